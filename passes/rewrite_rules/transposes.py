"""Transposes: of the identity permutation (gone), of a Transpose (composed into one, or gone
when they cancel), of an explicit Einsum (its output letters permuted), of a MatMul of a
Transpose (moved onto the product's inputs), Transposes read only by Einsums (folded into their
equations), and a Concat of Transposes (one Transpose of a Concat).

onnxscript's ``transpose_transpose_rule`` composes a pair whatever else reads the inner
Transpose (which then stays: no node saved, and a swap of the last two axes that runtimes fuse
into a MatMul becomes a copy), and its ``no_op_transpose_rule`` needs an explicit ``perm``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter import MatchResult

from onnx_autodiff.passes.metadata import mark, provenance
from onnx_autodiff.passes.rewrite_rules.analysis import concat_axis, only_use, opset, perm, produced_by, verdict
from onnx_autodiff.toolkit.shapes import attr, dims, rank


def _identity_perm(context, node: ir.Node) -> MatchResult:
    p = perm(node, rank(node.inputs[0]))
    return verdict(p is not None and p == list(range(len(p))), "the axes move")


def _transpose(op, x):
    return op.Transpose(x, _check=_identity_perm)


def _itself(op, x, **_):
    return op.Identity(x)


def einsum_terms(node: ir.Node | None) -> tuple[list[str], str] | None:
    """An Einsum's input terms and output term when its equation is explicit, without ellipsis."""
    if node is None or node.op_type != "Einsum" or node.domain != "":
        return None
    equation = str(attr(node, "equation", "")).replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    inputs = lhs.split(",")
    if not arrow or "." in equation or len(inputs) != len(node.inputs):
        return None
    return inputs, out


def _equation(inputs: list[str], out: str) -> str:
    return ",".join(inputs) + "->" + out


def _transpose_of_einsum(op, a):
    return op.Transpose(op.Einsum(a, _allow_other_inputs=True, _outputs=["product"]), _outputs=["out"])


def _einsum_output_permutes(context, a, product, out) -> MatchResult:
    terms = einsum_terms(product.producer())
    p = perm(context.root, rank(product))
    return verdict(terms is not None and p is not None and len(terms[1]) == len(p) and only_use(product),
                   "an implicit equation, or the Einsum is read elsewhere")


def _permuted_einsum(op, a, product, out):
    """Transpose(Einsum(..)->o) is the Einsum writing its output letters permuted."""
    einsum = product.producer()
    inputs, term = einsum_terms(einsum)
    p = perm(out.producer(), len(term))
    return op.Einsum(*einsum.inputs, equation=_equation(inputs, "".join(term[i] for i in p)))


def _transpose_of_matmul(op, a, b):
    return op.Transpose(op.MatMul(a, b, _outputs=["product"]), _outputs=["out"])


def _swap(r: int) -> list[int]:
    return [*range(r - 2), r - 1, r - 2]


def _moves_onto_inputs(context, a, b, product, out) -> MatchResult:
    """Transpose(MatMul(a, b)) swapping the last two axes is MatMul(bᵀ, aᵀ): worth it when a or b
    is itself the only use of a Transpose the new one composes with (no more nodes, and the
    transposes are on the inputs, where runtimes fuse them into the product)."""
    p = perm(context.root, rank(product))
    r = None if p is None else len(p)
    if r is None or r < 2 or p != _swap(r) or not only_use(product):
        return verdict(False, "not a swap of the last two axes of a product read only here")
    if rank(a) != r or rank(b) != r:
        return verdict(False, "a 1-D or broadcast operand")  # a Transpose would feed a product with a vector

    def absorbs(value: ir.Value) -> bool:
        return produced_by(value, "Transpose") is not None and only_use(value)

    return verdict(absorbs(a) or absorbs(b), "no transposed operand to compose with")


def _product_of_transposes(op, a, b, product, out):
    swap = _swap(rank(a))
    result = op.MatMul(op.Transpose(b, perm=swap), op.Transpose(a, perm=swap))
    origin = provenance(product.producer())
    if origin is not None:  # still the product's gradient
        for value in (result, *result.producer().inputs):
            mark(value.producer(), origin, overwrite=True)
    return result


def _transpose_of_transpose(op, x):
    return op.Transpose(op.Transpose(x, _outputs=["inner"]), _outputs=["out"])


def _composed(node: ir.Node) -> list[int] | None:
    """The one permutation of Transpose(Transpose(x))."""
    inner = node.inputs[0].producer()
    outer = perm(node, rank(node.inputs[0]))
    if outer is None:
        return None
    first = perm(inner, rank(inner.inputs[0]) if rank(inner.inputs[0]) is not None else len(outer))
    if first is None or len(first) != len(outer):
        return None
    return [first[p] for p in outer]


def _composes(context, x, inner, out) -> MatchResult:
    composed = _composed(context.root)
    if composed is None:
        return verdict(False, "unknown permutations")
    # The inner Transpose read elsewhere stays: composing saves no node, and would turn a swap
    # of the last two axes, which runtimes fuse into a MatMul, into a copy.
    return verdict(composed == list(range(len(composed))) or only_use(inner), "the inner Transpose is read elsewhere")


def _one_transpose(op, x, inner, out):
    composed = _composed(out.producer())
    if composed == list(range(len(composed))):
        return op.Identity(x)
    return op.Transpose(x, perm=composed)


def _einsum_transposed_input(value: ir.Value | None, term: str) -> tuple[ir.Value, str] | None:
    """(x, x's term) when ``value`` = Transpose(x) and every reader of it is an explicit Einsum,
    which can then all read x with the letters permuted (the Transpose then has no reader left)."""
    node = produced_by(value, "Transpose")
    if node is None or value.is_graph_output():
        return None
    p = perm(node, len(term))
    if p is None or len(p) != len(term) or not value.uses():
        return None
    if any(einsum_terms(use.node) is None for use in value.uses()):
        return None
    letters = [""] * len(term)
    for i, axis in enumerate(p):
        letters[axis] = term[i]  # axis i of the Transpose is axis p[i] of x
    return node.inputs[0], "".join(letters)


def _without_transposes(node: ir.Node) -> tuple[list[ir.Value], str] | None:
    """The inputs and equation of an Einsum that reads x where it read Transpose(x)."""
    terms = einsum_terms(node)
    if terms is None:
        return None
    inputs, out = terms
    values, changed = list(node.inputs), False
    for i, value in enumerate(values):
        found = _einsum_transposed_input(value, inputs[i])
        if found is not None:
            values[i], inputs[i] = found
            changed = True
    return (values, _equation(inputs, out)) if changed else None


def _reads_transposes(context, node: ir.Node) -> MatchResult:
    return verdict(_without_transposes(node) is not None, "no Transpose read by Einsums only")


def _einsum_of_transposes(op, a):
    return op.Einsum(a, _allow_other_inputs=True, _check=_reads_transposes, _outputs=["out"])


def _einsum_of_sources(op, a, out):
    values, equation = _without_transposes(out.producer())
    return op.Einsum(*values, equation=equation)


def _concat_plan(node: ir.Node, axis: int) -> tuple[list[ir.Value], list[list[int]], list[int]] | None:
    """Concat(Transpose(x_i, p_i)) = Transpose(Concat(Transpose(x_i, r_i)), p) for the most common
    perm p, r_i = p_i after p⁻¹ (no node where that is the identity): (x_i, r_i, p) when that
    leaves fewer Transposes (the backward of attention heads split from one projection)."""
    r = len(dims(node.outputs[0]))
    perms, sources = [], []
    for value in node.inputs:
        producer = produced_by(value, "Transpose")
        if producer is None or not only_use(value):
            return None
        perms.append(perm(producer, r))
        sources.append(producer.inputs[0])
    if any(p is None or len(p) != r for p in perms):
        return None
    common = max(perms, key=lambda p: (perms.count(p), -perms.index(p)))
    inverse = [common.index(k) for k in range(r)]
    residues = [[p[inverse[k]] for k in range(r)] for p in perms]
    if sum(residue != list(range(r)) for residue in residues) + 1 >= len(perms):
        return None
    return sources, residues, common


def _concat_of_transposes(op, a):
    return op.Concat(a, _allow_other_inputs=True, _check=_joins_transposes, _outputs=["out"])


def _joins_transposes(context, node: ir.Node) -> MatchResult:
    axis = concat_axis(node, opset(context.model))
    holds = axis is not None and axis != len(dims(node.outputs[0])) - 1 and _concat_plan(node, axis) is not None
    return verdict(holds, "not Transposes that one Transpose after the Concat would reduce")


def _transpose_of_concat(op, a, out):
    node = out.producer()
    axis = attr(node, "axis") % len(dims(out))
    sources, residues, common = _concat_plan(node, axis)
    inputs = [x if residue == list(range(len(residue))) else op.Transpose(x, perm=residue)
              for x, residue in zip(sources, residues)]
    return op.Transpose(op.Concat(*inputs, axis=common[axis]), perm=common)


def rules() -> list[RewriteRule]:
    return [
        RewriteRule(_transpose, _itself, name="no_op_transpose", remove_nodes=False),
        RewriteRule(_transpose_of_einsum, _permuted_einsum, _einsum_output_permutes,
                    name="transpose_of_einsum", remove_nodes=False),
        RewriteRule(_transpose_of_matmul, _product_of_transposes, _moves_onto_inputs,
                    name="transpose_of_matmul", remove_nodes=False),
        RewriteRule(_transpose_of_transpose, _one_transpose, _composes, name="transpose_of_transpose",
                    remove_nodes=False),
        RewriteRule(_einsum_of_transposes, _einsum_of_sources, name="einsum_of_transposes", remove_nodes=False),
        RewriteRule(_concat_of_transposes, _transpose_of_concat, name="concat_of_transposes", remove_nodes=False),
    ]
