"""Linear algebra: Einsum and Det.

Einsum: the gradient of operand i is an Einsum of dY with the other operands whose output
subscripts are operand i's. Three things need more than that one Einsum:
- a letter repeated inside operand i (a diagonal, "ii->i") cannot be an output subscript twice:
  each repeat gets a fresh letter tied to the first by an identity-matrix operand;
- a letter (or the ellipsis) of operand i that only operand i carries (summed away, "ij->i") is
  supplied by an extra operand of ones shaped like operand i;
- size-1 dimensions broadcast against other operands (ellipsis dims, and explicit letters, which
  onnxruntime broadcasts too) are summed back, statically when the shapes decide it.

Det: dX = dY·adj(X)ᵀ, the cofactor matrix, computed as the determinants of all n² minors in one
batched Det (two Gathers and a Transpose). It is exact at singular matrices too (no inverse is
formed), and needs a static n; its cost grows as n⁵, so it suits small matrices.
"""

from __future__ import annotations

import string

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import may_be_float, shapes

ELLIPSIS = "."  # one token standing for "..."


def _terms(text: str) -> list[str]:
    """A subscript string as tokens: letters, and ELLIPSIS for "..."."""
    tokens = list(text.replace("...", ELLIPSIS))
    if tokens.count(ELLIPSIS) > 1 or any(t != ELLIPSIS and t not in string.ascii_letters for t in tokens):
        raise RuleError(f"malformed Einsum term '{text}'")
    return tokens


def parse_equation(equation: str, count: int) -> tuple[list[list[str]], list[str]]:
    """Input terms and the output term (implicit mode: once-seen letters in ASCII order)."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = [_terms(t) for t in lhs.split(",")]
    if len(inputs) != count:
        raise RuleError(f"Einsum equation '{equation}' has {len(inputs)} terms for {count} inputs")
    if arrow:
        output = _terms(rhs)
    else:
        letters = [t for term in inputs for t in term if t != ELLIPSIS]
        once = sorted(t for t in set(letters) if letters.count(t) == 1)
        output = ([ELLIPSIS] if any(ELLIPSIS in t for t in inputs) else []) + once
    if len(set(output)) != len(output):
        raise RuleError(f"Einsum output '{rhs}' repeats a subscript")
    return inputs, output


def _text(tokens) -> str:
    return "".join("..." if t == ELLIPSIS else t for t in tokens)


def _split_dims(term: list[str], value: ir.Value):
    """An operand's static dims as ({letter: dim of its first occurrence}, ellipsis dims); None
    for what the metadata does not give."""
    d = shapes.dims(value)
    letters = [t for t in term if t != ELLIPSIS]
    if d is None or len(d) < len(letters):
        return {t: None for t in letters}, None
    if ELLIPSIS not in term:
        at, e = len(term), 0
    else:
        at, e = term.index(ELLIPSIS), len(d) - len(letters)
    aligned = list(d[:at]) + [None] * (ELLIPSIS in term) + list(d[at + e :])
    by_letter = {}
    for t, x in zip(term, aligned):
        if t != ELLIPSIS:
            by_letter.setdefault(t, x)
    return by_letter, tuple(d[at : at + e])


def _broadcast_dim(candidates):
    """The extent broadcasting gives these dims, or None when the metadata does not decide it."""
    candidates = set(candidates)
    ints = {c for c in candidates if isinstance(c, int) and c != 1}
    if ints:
        return ints.pop() if len(ints) == 1 else None
    rest = candidates - {1}
    if not rest:
        return 1
    return rest.pop() if len(rest) == 1 and None not in rest else None


def _broadcast_shape(shapes_):
    """Right-aligned broadcast of several ellipsis shapes (None if one is unknown)."""
    if any(s is None for s in shapes_):
        return None
    width = max((len(s) for s in shapes_), default=0)
    padded = [(1,) * (width - len(s)) + tuple(s) for s in shapes_]
    return [_broadcast_dim([s[k] for s in padded]) for k in range(width)]


def _letter_dim(op, X, term, letter):
    """Operand X's extent for ``letter`` (first occurrence): an int or a 1-element int64 value."""
    pos = term.index(letter)
    if ELLIPSIS in term and pos > term.index(ELLIPSIS):
        pos = pos - len(term)  # counted from the end: the ellipsis length may be unknown
    d = shapes.dims(X)
    if d is not None and isinstance(d[pos], int):
        return d[pos]
    return op.Slice(op.Shape(X), [pos], [pos + 1 if pos != -1 else 2**62])


def _eye(op, X, n):
    if isinstance(n, int):
        return op.const(np.eye(n), dtype=X.dtype)
    zeros = op.ConstantOfShape(op.Concat(n, n, axis=0), value=ir.Tensor(np.zeros(1, X.dtype.numpy())))
    return op.EyeLike(zeros)


@rule("Einsum", differentiable=("Inputs",), since=12)
def einsum(op, node, dY):
    """Y = Einsum(X_1, ..., X_n); dX_i = Einsum(dY, X_j (j ≠ i) -> term_i), plus diagonals and sums."""
    inputs = list(node.inputs)
    terms, out = parse_equation(shapes.attr(node, "equation"), len(inputs))
    taken = {t for term in terms for t in term} | set(out)
    fresh = iter(c for c in string.ascii_letters if c not in taken)
    split = [_split_dims(t, x) for t, x in zip(terms, inputs)]
    letters = {t for term in terms for t in term if t != ELLIPSIS}
    full = {t: _broadcast_dim([s[0][t] for s in split if t in s[0]]) for t in letters}
    full_ellipsis = _broadcast_shape([s[1] for s, term in zip(split, terms) if ELLIPSIS in term])
    grads = []
    for i, (X, term) in enumerate(zip(inputs, terms)):
        if not may_be_float(X):
            grads.append(None)
            continue
        others = [(terms[j], inputs[j]) for j in range(len(inputs)) if j != i]
        target, eyes = [], []
        for t in term:
            if t != ELLIPSIS and t in target:
                f = next(fresh)
                eyes.append(([t, f], _eye(op, X, _letter_dim(op, X, term, t))))
                t = f
            target.append(t)
        own, ellipsis_dims = split[i]
        extent = {**full, **{f: d for f, d in zip(target, _aligned(X, term)) if f not in full}}
        if ELLIPSIS in target and ellipsis_dims == ():
            target.remove(ELLIPSIS)
        operands = [(out, dY), *others, *eyes]
        if not _covered(term, target, out, own, [split[j][0] for j in range(len(inputs)) if j != i], full):
            operands.append((target, shapes.ones_like(op, X)))
        result = list(target)
        if ELLIPSIS not in result and any(ELLIPSIS in t for t, _ in operands):
            result.insert(0, ELLIPSIS)  # onnxruntime wants it kept; summed below
        equation = ",".join(_text(t) for t, _ in operands) + "->" + _text(result)
        g = op.Einsum(*(v for _, v in operands), equation=equation)
        # g's dims are the broadcast of every operand's; a shapeless `like` sums at run time.
        like = _like_shape(X, result, extent, full_ellipsis)
        grads.append(shapes.unbroadcast(op, g, X, like if like is not None else g))
    return {"Inputs": grads}


def _covered(term, target, out, own, others, full) -> bool:
    """Whether dY and the other operands supply every dimension of operand i at full extent."""
    if ELLIPSIS in target and ELLIPSIS not in out:
        return False
    for t in set(term) - {ELLIPSIS}:
        sources = ([full[t]] if t in out else []) + [o[t] for o in others if t in o]
        if not sources:
            return False
        if own[t] == 1:
            continue
        # X's extent is 1 or the broadcast one, so an int > 1 among the sources settles it.
        extent = _broadcast_dim(sources)
        if extent is None or not (extent == own[t] or isinstance(extent, int) and extent != 1):
            return False
    return True


def _like_shape(X, result, extent, full_ellipsis):
    """A shape-only value with g's static dims (None when the metadata does not give them)."""
    if shapes.dims(X) is None or (ELLIPSIS in result and full_ellipsis is None):
        return None
    like = []
    for t in result:
        like.extend(full_ellipsis if t == ELLIPSIS else [extent[t]])
    return ir.Value(name=None, shape=ir.Shape(like))


def _aligned(X, term):
    """X's dims, one per token of its term (None for the ellipsis and where unknown)."""
    d = shapes.dims(X)
    if d is None:
        return [None] * len(term)
    if ELLIPSIS not in term:
        return list(d)
    at = term.index(ELLIPSIS)
    e = len(d) - (len(term) - 1)
    return list(d[:at]) + [None] + list(d[at + e :])


@rule("Det", differentiable=("X",), since=11)
def det(op, node, dY):
    """Y = det(X) over the last two axes; dX = dY·cof(X), the matrix of signed minors."""
    X = node.inputs[0]
    r = shapes.known_rank(X)
    n = shapes.dims(X)[-1]
    dY = op.unsqueeze(dY, [-2, -1])
    if n == 1:
        return {"X": dY}
    if isinstance(n, int):
        keep = np.array([[k for k in range(n) if k != i] for i in range(n)], np.int64)
        sign = op.const((-1.0) ** np.add.outer(np.arange(n), np.arange(n)), dtype=X.dtype)
    else:  # the same tables at run time (a 1×1 matrix's minor is 0×0, whose Det is 1)
        shapes.require_opset(op, 10, f"the Det gradient of '{X.name}', whose matrix size is only known at run time,")
        size = op.Gather(op.Shape(X), r - 1)
        rows, cols = op.Range(0, size, 1), op.Range(0, op.Sub(size, 1), 1)
        column, row = op.unsqueeze(rows, [1]), op.unsqueeze(cols, [0])
        keep = op.Add(row, op.Cast(op.Not(op.Less(row, column)), to=int(ir.DataType.INT64)))  # k + (k >= i)
        parity = op.Mod(op.Add(column, op.unsqueeze(rows, [0])), 2)
        sign = shapes.cast_like(op, op.Sub(1, op.Mul(parity, 2)), X)
    cols = op.Gather(X, keep, axis=r - 1)  # [..., row, j, col]
    minors = op.Gather(cols, keep, axis=r - 2)  # [..., i, row, j, col]
    b = r - 2
    minors = op.Transpose(minors, perm=[*range(b), b, b + 2, b + 1, b + 3])
    cofactor = op.Mul(op.Det(minors), sign)
    return {"X": op.Mul(dY, cofactor)}
