"""Neural-network layers: matrix products, convolutions and pooling.

Convolution gradients are convolutions again: dX is the transposed convolution of dY with the same
kernel, and dW is a convolution of X (batch moved to the channel axis) with dY as the kernel,
strides and dilations swapped.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes


def _spatial_perm(first: list[int], ns: int) -> list[int]:
    return [*first, *range(2, ns + 2)]


# Matrix products


@rule("Gemm", differentiable=("A", "B", "C"), since=7)
def gemm(op, node, dY):
    """Y = alpha * A' @ B' + beta * C, A' = A or Aᵀ (transA), B' likewise; C broadcasts to Y."""
    A, B = node.inputs[:2]
    C = node.inputs[2] if len(node.inputs) > 2 else None
    alpha, beta = shapes.attr(node, "alpha", 1.0), shapes.attr(node, "beta", 1.0)
    ta, tb = shapes.attr(node, "transA", 0), shapes.attr(node, "transB", 0)
    no_c = None if op.opset >= 11 else 0.0  # C is required before opset 11

    def mm(a, b, trans_a, trans_b):
        return op.Gemm(a, b, no_c, alpha=float(alpha), transA=int(trans_a), transB=int(trans_b))

    # dA' = alpha dY B'ᵀ and dB' = alpha A'ᵀ dY, transposed back when the input was.
    dA = mm(B, dY, tb, 1) if ta else mm(dY, B, 0, not tb)
    dB = mm(dY, A, 1, ta) if tb else mm(A, dY, not ta, 0)
    grads = {"A": dA, "B": dB}
    if C is not None:
        dC = dY if beta == 1.0 else op.Mul(dY, float(beta))
        grads["C"] = shapes.unbroadcast(op, dC, C, node.outputs[0])
    return grads


# Einsum letters for batch axes; m, k, n name the matrix axes.
_BATCH_LETTERS = "abcdefghijlopqrstuvwxyz"
_EINSUM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16})


@rule("MatMul", differentiable=("A", "B"))
def matmul(op, node, dY):
    """Y = A @ B (numpy matmul: 1-D operands promoted, batch dims broadcast)."""
    A, B = node.inputs
    ra, rb = shapes.rank(A), shapes.rank(B)
    if ra is None or rb is None:
        return _matmul_any_rank(op, A, B, dY, ra, rb)
    if ra == 1 and rb == 1:
        return {"A": op.Mul(dY, B), "B": op.Mul(dY, A)}
    floats = A.dtype in _EINSUM_TYPES and B.dtype in _EINSUM_TYPES
    if ra == rb == 2 and floats and op.opset >= 11:
        # Gemm is the standard op for a product of matrices, one of them transposed (one node
        # where MatMul needs a Transpose beside it: a quarter fewer backward nodes to build and
        # clean up on a chain of linear layers).
        return {"A": op.Gemm(dY, B, transB=1), "B": op.Gemm(A, dY, transA=1)}
    if min(ra, rb) <= 2 and max(ra, rb) - 2 <= len(_BATCH_LETTERS) and floats and op.opset >= 12:
        return _matmul_one_batched(op, A, B, dY, ra, rb)
    if max(ra, rb) - 2 <= len(_BATCH_LETTERS) and floats and op.opset >= 12 and _same_batch(A, B, ra, rb):
        return _matmul_batched(op, A, B, dY, ra, rb)
    return _matmul_broadcast(op, node, dY, ra, rb)


def _matmul_one_batched(op, A, B, dY, ra, rb):
    """At most one operand has batch axes, so every Einsum letter has one extent (no broadcast).

    A gradient that keeps the batch axes is MatMul with the other operand's last two axes swapped.
    A linear layer's weight gradient (batch axes on A only, B a 2-D weight of known shape) is one
    matrix product over the flattened batch, Gemm(Aᵀ, dY) with the batch and row axes as one; otherwise
    Einsum sums the batch axes inside the product: no [batch, K, N] intermediate, no ReduceSum.
    """
    b = _BATCH_LETTERS[: max(ra, rb) - 2]
    ta = "k" if ra == 1 else b[: ra - 2] + "mk"
    tb = "k" if rb == 1 else b[: rb - 2] + "kn"
    ty = b + ("m" if ra > 1 else "") + ("n" if rb > 1 else "")
    if ra > 2 and rb == 2:
        dA = op.MatMul(dY, shapes.swap_last2(op, B, rb))
    else:
        dA = op.Einsum(dY, B, equation=f"{ty},{tb}->{ta}")
    k_n = shapes.static_shape(B) if rb == 2 else None
    if ra == 2 and rb > 2:
        dB = op.MatMul(shapes.swap_last2(op, A, ra), dY)
    elif ra > 2 and k_n is not None and op.opset >= 11:
        dB = op.Gemm(op.reshape(A, [-1, k_n[0]]), op.reshape(dY, [-1, k_n[1]]), transA=1)
    else:
        dB = op.Einsum(A, dY, equation=f"{ta},{ty}->{tb}")
    return {"A": dA, "B": dB}


def _same_batch(A, B, ra, rb) -> bool:
    """Whether the batch axes the operands share are known to have equal extents (no size-1
    axis broadcasts against a longer one, which Einsum's explicit letters do not allow)."""
    da, db = shapes.dims(A), shapes.dims(B)
    n = min(ra, rb) - 2
    if da is None or db is None or n <= 0:
        return False
    return all(x is not None and x == y for x, y in zip(da[ra - 2 - n : ra - 2], db[rb - 2 - n : rb - 2]))


def _matmul_batched(op, A, B, dY, ra, rb):
    """Batch axes on both sides with equal extents (attention's Q·Kᵀ and P·V).

    Equal ranks: MatMul with the other operand's last two axes swapped (the gradient keeps every
    batch axis). Otherwise Einsum, which sums the batch axes only one operand has inside the
    product.
    """
    if ra == rb:
        return {"A": op.MatMul(dY, shapes.swap_last2(op, B, rb)),
                "B": op.MatMul(shapes.swap_last2(op, A, ra), dY)}
    b = _BATCH_LETTERS[: max(ra, rb) - 2]
    ta, tb, ty = b[len(b) - ra + 2 :] + "mk", b[len(b) - rb + 2 :] + "kn", b + "mn"
    return {"A": op.Einsum(dY, B, equation=f"{ty},{tb}->{ta}"),
            "B": op.Einsum(A, dY, equation=f"{ta},{ty}->{tb}")}


def _sum_to_batch(op, grad, x, out_batch):
    """Sum a matmul operand's gradient (batch dims ``out_batch``) down to x's batch dims."""
    x_dims = shapes.dims(x)
    if out_batch is not None and x_dims is not None:
        grad.shape = ir.Shape([*out_batch, *x_dims[-2:]])
    return shapes.unbroadcast(op, grad, x, grad)


def _matmul_broadcast(op, node, dY, ra, rb):
    """Batch axes on both sides (broadcast against each other), or no Einsum/Gemm form."""
    A, B = node.inputs
    if ra == 1:  # A is a row (1, K); Y lost that axis
        dY2 = op.unsqueeze(dY, [rb - 2])
        dA = op.MatMul(dY2, shapes.swap_last2(op, B, rb))
        return {"A": op.reduce_sum(dA, list(range(rb - 1)), keepdims=False),
                "B": op.MatMul(op.unsqueeze(A, [1]), dY2)}
    if rb == 1:  # B is a column (K, 1)
        dY2 = op.unsqueeze(dY, [ra - 1])
        dB = op.MatMul(shapes.swap_last2(op, A, ra), dY2)
        return {"A": op.MatMul(dY2, op.unsqueeze(B, [0])),
                "B": op.reduce_sum(dB, [*range(ra - 2), ra - 1], keepdims=False)}
    y_dims = shapes.dims(node.outputs[0])
    batch = None if y_dims is None else y_dims[:-2]
    dA = op.MatMul(dY, shapes.swap_last2(op, B, rb))
    dB = op.MatMul(shapes.swap_last2(op, A, ra), dY)
    return {"A": _sum_to_batch(op, dA, A, batch), "B": _sum_to_batch(op, dB, B, batch)}


def _matmul_any_rank(op, A, B, dY, ra, rb):
    """An operand whose rank is unknown until run time (a bare node list, a value a backward
    made inside a subgraph): by run-time shapes, each operand is viewed as matmul reads it (a 1-D
    A as a row, a 1-D B as a column, ones prepended to the longer batch's rank) and dY with the
    axes it lost restored. Einsum's ellipsis carries the batch axes (it takes equal ranks only),
    and the run-time reduction sums the broadcast ones back to each operand's own."""
    if any(x.dtype is not None and x.dtype not in _EINSUM_TYPES for x in (A, B)):
        unknown = A if ra is None else B
        raise RuleError(f"the gradient of MatMul with an operand of unknown rank ('{unknown.name}') is an "
                        f"Einsum, which takes float, double and float16 only (the operands are {A.dtype}, "
                        f"{B.dtype}): run shape inference so that the rank is known")
    shapes.require_opset(op, 13, f"MatMul's gradient for operands of unknown rank ('{A.name}', '{B.name}')")
    a_shape, b_shape = _matrix_shape(op, A, row=True), _matrix_shape(op, B, row=False)
    r = op.Max(op.Shape(a_shape), op.Shape(b_shape))
    a2, b2 = (op.Reshape(x, _padded(op, shape, r)) for x, shape in ((A, a_shape), (B, b_shape)))
    rows, cols = op.Slice(a_shape, [-2], [-1]), op.Slice(b_shape, [-1], [_INT64_MAX])
    batch = op.Slice(op.Shape(dY), [0], op.Sub(r, [2]))
    dY2 = op.Reshape(dY, op.Concat(batch, rows, cols, axis=0))
    dA = shapes.unbroadcast(op, op.Einsum(dY2, b2, equation="...mn,...kn->...mk"), a2, dY2)
    dB = shapes.unbroadcast(op, op.Einsum(a2, dY2, equation="...mk,...mn->...kn"), b2, dY2)
    return {"A": op.Reshape(dA, op.Shape(A)), "B": op.Reshape(dB, op.Shape(B))}


_INT64_MAX = np.iinfo(np.int64).max


def _matrix_shape(op, x, row: bool):
    """x's shape as matmul reads it: itself with two axes or more, a 1-D x's as a row (A) or a
    column (B), at run time."""
    x_shape = op.Shape(x)
    at_least_2 = op.Max(op.Shape(x_shape), [2])
    if row:
        return op.Slice(op.Concat([1], x_shape, axis=0), op.Neg(at_least_2), [_INT64_MAX])
    return op.Slice(op.Concat(x_shape, [1], axis=0), [0], at_least_2)


def _padded(op, shape, r):
    """``shape`` with ones prepended to ``r`` entries (run-time values)."""
    ones = op.ConstantOfShape(op.Sub(r, op.Shape(shape)), value=ir.Tensor(np.array([1], np.int64)))
    return op.Concat(ones, shape, axis=0)


# Convolutions


class _Geometry:
    """A convolution's spatial attributes, with auto_pad turned into explicit pads (ints, or
    :class:`_RunTimePads` where only the sizes at run time decide them). ``kernel`` is None where
    only W's shape at run time tells the kernel's size (no kernel_shape, W's spatial extents
    symbolic): the forward takes that, so the gradients compute it (:meth:`kernel_size`)."""

    def __init__(self, node: ir.Node, X: ir.Value, W: ir.Value | None):
        w_dims = None if W is None else shapes.dims(W)
        kernel = shapes.attr(node, "kernel_shape")
        r = shapes.rank(X) or (len(w_dims) if w_dims is not None else None)
        r = r or (len(kernel) + 2 if kernel is not None else None)
        if r is None:
            kernel_name = "" if W is None else f" and of the kernel '{W.name}'"
            raise RuleError(f"the ranks of the input '{X.name}'{kernel_name} are unknown; run shape "
                            "inference or give kernel_shape")
        ns = self.ns = r - 2
        if kernel is None and w_dims is not None and all(isinstance(d, int) for d in w_dims[2:]):
            kernel = list(w_dims[2:])
        if kernel is None and W is None:
            raise RuleError("the node has no kernel_shape")
        self.kernel = None if kernel is None else list(kernel)
        self.W = W
        self.group = shapes.attr(node, "group", 1)
        self.strides = shapes.attr(node, "strides", [1] * ns)
        self.dilations = shapes.attr(node, "dilations", [1] * ns)
        x_dims = shapes.dims(X)
        spatial = None if x_dims is None else list(x_dims[2:])
        static = spatial is not None and all(isinstance(d, int) for d in spatial)
        self.spatial = spatial if static else None
        auto_pad = shapes.attr(node, "auto_pad", "NOTSET")
        self.auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if self.auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
            raise RuleError(f"auto_pad={self.auto_pad} is not supported")
        self.pads = shapes.attr(node, "pads", [0] * (2 * ns))
        if self.auto_pad == "VALID":
            self.pads = [0] * (2 * ns)

    def resolve_same(self, op, X: ir.Value) -> None:
        """auto_pad=SAME_*: pad so that the output has ceil(S / stride) elements. The pads are ints
        when the sizes, or unit strides (a total of the window's reach less one), decide them, else
        :class:`_RunTimePads` computed from Shape(X)."""
        if not self.auto_pad.startswith("SAME"):
            return
        if self.kernel is None or (self.spatial is None and any(st != 1 for st in self.strides)):
            self.pads = self._same_pads_at_run_time(op, X)
            return
        spatial = self.spatial or [1] * self.ns
        self.same_pads([
            max(0, (-(-s // st) - 1) * st + d * (k - 1) + 1 - s)
            for s, st, d, k in zip(spatial, self.strides, self.dilations, self.kernel)
        ])

    def _same_pads_at_run_time(self, op, X: ir.Value) -> _RunTimePads:
        # total = (ceil(S/st) - 1)·st + reach - S = reach - 1 - (S - 1) mod st, at least 0
        why = f"auto_pad={self.auto_pad} on spatial sizes of '{X.name}' known only at run time"
        shapes.require_opset(op, 11, why)
        span = self.span(op)
        size = shapes.shape_between(op, X, 2, self.ns + 2)
        offset = op.Mod(op.Sub(size, [1]), np.array(self.strides, np.int64))
        total = op.Sub(span, offset)
        # (negative where a stride passes the window)
        if any(st > r for st, r in zip(self.strides, self.least_reach())):
            total = _at_least_zero(op, total)
        return _RunTimePads.split(op, total, self.auto_pad)

    def extent(self, windows: list[int]) -> list[int]:
        """How far ``windows`` windows per axis reach, from the first tap to the last (the kernel's
        size known)."""
        return [(n - 1) * st + d * (k - 1) + 1
                for n, st, d, k in zip(windows, self.strides, self.dilations, self.kernel)]

    def kernel_size(self, op):
        """The kernel's spatial extents: ints, or an int64 vector read from Shape(W) at run time."""
        if self.kernel is not None:
            return self.kernel
        shapes.require_opset(op, 10, f"a convolution's gradient with the kernel '{self.W.name}' of a "
                                     "size known only at run time (Slice)")
        return shapes.shape_between(op, self.W, 2, self.ns + 2)

    def span(self, op):
        """d·(k − 1) per axis, from a window's first tap to its last (its reach less one): ints, or
        an int64 vector computed from the kernel's size at run time."""
        if self.kernel is not None:
            return [d * (k - 1) for d, k in zip(self.dilations, self.kernel)]
        return op.Mul(op.Sub(self.kernel_size(op), [1]), np.array(self.dilations, np.int64))

    def least_reach(self) -> list[int]:
        """One window's reach per axis, or where only the run knows the kernel, its least (one tap)."""
        return self.extent([1] * self.ns) if self.kernel is not None else [1] * self.ns

    def same_pads(self, totals: list[int]) -> None:
        """Split total paddings the auto_pad way: SAME_UPPER puts the odd one at the end."""
        small = [t // 2 for t in totals]
        big = [t - t // 2 for t in totals]
        self.pads = small + big if self.auto_pad == "SAME_UPPER" else big + small


def _at_least_zero(op, total: ir.Value) -> ir.Value:
    """max(total, 0) for an int64 value (int64 Max from opset 12; Where before, rather than
    converting the model)."""
    return op.Max(total, [0]) if op.opset >= 12 else op.Where(op.Less(total, [0]), [0], total)


class _RunTimePads(NamedTuple):
    """Pads that Shape(X) decides at run time: int64 vectors with one entry per spatial axis."""

    begin: ir.Value
    end: ir.Value

    @classmethod
    def split(cls, op, total: ir.Value, auto_pad: str) -> _RunTimePads:
        """As :meth:`_Geometry.same_pads`: SAME_UPPER puts the odd one at the end."""
        half = op.Div(total, [2])
        rest = op.Sub(total, half)
        return cls(half, rest) if auto_pad == "SAME_UPPER" else cls(rest, half)

    def of_tensor(self, op):
        """The Pad input for a tensor with batch and channel axes before the spatial ones."""
        return op.Concat([0, 0], self.begin, [0, 0], self.end, axis=0)


def _batch_as_channels(op, x, group: int, ns: int):
    """(N, C, *S) -> (C/g, g·N, *S): channel c' = i·N + n holds x[n, i·C/g + c] for group i."""
    if group == 1:
        return op.Transpose(x, perm=_spatial_perm([1, 0], ns))
    # Spatial axes go first so that Reshape can copy them with 0 whatever their size.
    t = op.Transpose(x, perm=[*range(2, ns + 2), 0, 1])  # (*S, N, C)
    t = op.reshape(t, [0] * (ns + 1) + [group, -1])  # (*S, N, g, C/g)
    t = op.Transpose(t, perm=[*range(ns), ns + 2, ns + 1, ns])  # (*S, C/g, g, N)
    t = op.reshape(t, [0] * (ns + 1) + [-1])  # (*S, C/g, g·N)
    return op.Transpose(t, perm=[ns, ns + 1, *range(ns)])


def _kernel_grad(op, x, dy, g: _Geometry, x_like: ir.Value, dy_like: ir.Value):
    """dW[m, c, k] = Σ_n,o dy[n, m, o]·xpad[n, group(m)·C/g + c, o·stride + k·dilation].

    A Conv of x (batch as channels) with dy (batch as input channels) as the kernel; ``x_like``
    and ``dy_like`` are forward values of their shapes (gradients carry none).
    """
    ns = g.ns
    xin = _batch_as_channels(op, x, g.group, ns)
    pads = g.pads
    if isinstance(pads, _RunTimePads):
        xin, pads = op.Pad(xin, pads.of_tensor(op)), None
    kern = op.Transpose(dy, perm=_spatial_perm([1, 0], ns))
    dw = op.Conv(xin, kern, strides=g.dilations, dilations=g.strides, pads=pads, group=g.group)
    dw = op.Transpose(dw, perm=_spatial_perm([1, 0], ns))
    taps = _kernel_grad_taps(g, x_like, dy_like)
    if taps is not None and taps == g.kernel:
        return dw
    # The Conv may produce extra taps past the kernel's end (they touch no output).
    return op.slice(dw, [0] * ns, g.kernel_size(op), range(2, ns + 2))


def _kernel_grad_taps(g: _Geometry, x_like, dy_like) -> list[int] | None:
    """The size of _kernel_grad's Conv output per axis, when the shapes and pads are static."""
    x_dims, dy_dims = shapes.dims(x_like), shapes.dims(dy_like)
    if x_dims is None or dy_dims is None or isinstance(g.pads, _RunTimePads):
        return None
    spatial = list(zip(x_dims[2:], dy_dims[2:]))
    if not all(isinstance(s, int) and isinstance(o, int) for s, o in spatial):
        return None
    # dy is the kernel, its taps a stride apart; the Conv steps by the dilation.
    return [(s + b + e - st * (o - 1) - 1) // d + 1 for (s, o), b, e, st, d in
            zip(spatial, g.pads, g.pads[g.ns:], g.strides, g.dilations)]


def _cut_to(op, transpose, g: _Geometry, like):
    """The adjoint of a strided window op over ``like`` whose spatial sizes S are known only at run
    time: ``transpose(pads, output_padding)``, a ConvTranspose over the windows, made to reach at
    least S past the begin pad, then cut to S from there.

    The windows may stop short of begin + S, by at most stride − 1 − the end pad (NOTSET) or
    stride − the window's reach (SAME_*): output_padding adds that much (less than the stride, as
    ConvTranspose requires); ceil_mode windows only reach further."""
    shapes.require_opset(op, 10, f"the gradient of a strided window op on the spatial sizes of "
                                 f"'{like.name}', known only at run time (Slice)")
    ns = g.ns
    size = shapes.shape_between(op, like, 2, ns + 2)
    if isinstance(g.pads, _RunTimePads):
        begin, starts, ends = [0] * ns, g.pads.begin, op.Add(g.pads.begin, size)
        # (with the kernel's size known only at run time, what the least reach needs: the cut
        # drops any extra)
        tail = [max(0, st - r) for st, r in zip(g.strides, g.least_reach())]
    else:
        begin, starts, ends = g.pads[:ns], [0] * ns, size
        tail = [max(0, st - 1 - e) for st, e in zip(g.strides, g.pads[ns:])]
    full = transpose(pads=begin + [0] * ns, output_padding=tail if any(tail) else None)
    return op.Slice(full, starts, ends, list(range(2, ns + 2)))


@rule("Conv", differentiable=("X", "W", "B"))
def conv(op, node, dY):
    """Y = Σ_c,k W[m, c, k]·Xpad[n, group(m)·C/g + c, o·stride + k·dilation] + B[m]."""
    X, W = node.inputs[:2]
    B = node.inputs[2] if len(node.inputs) > 2 else None
    g = _Geometry(node, X, W)
    g.resolve_same(op, X)
    common = dict(strides=g.strides, dilations=g.dilations, group=g.group)
    if g.spatial is not None and g.kernel is not None:
        # Windows that do not reach X's end leave a tail that output_padding restores.
        out_pad = [
            (s + b + e - d * (k - 1) - 1) % st
            for s, b, e, d, k, st in zip(
                g.spatial, g.pads[: g.ns], g.pads[g.ns:], g.dilations, g.kernel, g.strides
            )
        ]
        dX = op.ConvTranspose(dY, W, pads=g.pads, output_padding=out_pad, **common)
    else:
        dX = _cut_to(op, lambda **geometry: op.ConvTranspose(dY, W, **geometry, **common), g, X)
    dW = _kernel_grad_by_columns(op, X, dY, g, node.outputs[0])
    grads = {"X": dX, "W": dW if dW is not None else _kernel_grad(op, X, dY, g, X, node.outputs[0])}
    if B is not None:
        grads["B"] = op.reduce_sum(dY, [0, *range(2, g.ns + 2)], keepdims=False)
    return grads


# Elements of the column tensor _kernel_grad_by_columns may make (float32: 32 MB), and of its
# one-hot kernel.
COLUMNS_LIMIT = 1 << 23
ONE_HOT_LIMIT = 1 << 18


def _kernel_grad_by_columns(op, x, dy, g: _Geometry, y):
    """dW[m, c, t] = Σ_n,o dy[n, m, o]·cols[n, c·T + t, o], cols = xpad at o·stride + t·dilation.

    The columns come from a depthwise Conv with a one-hot kernel per tap, the sum from one batched
    MatMul, where _kernel_grad's Conv has a kernel as large as dy and an output as small as W
    (which runtimes may run as one thin product per channel: benchmarks/README.md). Only without
    groups, with static shapes, and while the columns (taps times x's size) and the one-hot kernel
    stay under their limits; else None.
    """
    x_dims, y_dims = shapes.static_shape(x), shapes.static_shape(y)
    if (g.group != 1 or g.kernel is None or x_dims is None or y_dims is None or op.opset < 11
            or x.dtype not in _EINSUM_TYPES):
        return None
    (n, c, *_), (_, m, *out) = x_dims, y_dims
    taps, positions = int(np.prod(g.kernel)), int(np.prod(out))
    if n * c * taps * positions > COLUMNS_LIMIT or c * taps * taps > ONE_HOT_LIMIT:
        return None
    one_hot = np.tile(np.eye(taps).reshape(1, taps, 1, *g.kernel), (c, 1, 1, *[1] * g.ns))
    cols = op.Conv(x, op.const(one_hot.reshape(c * taps, 1, *g.kernel), like=x), group=c,
                   strides=g.strides, dilations=g.dilations, pads=g.pads)
    cols = op.reshape(cols, [n, c * taps, positions])
    per_sample = op.MatMul(op.reshape(dy, [n, m, positions]), op.Transpose(cols, perm=[0, 2, 1]))
    return op.reshape(op.reduce_sum(per_sample, [0], keepdims=False), [m, c, *g.kernel])


@rule("ConvTranspose", differentiable=("X", "W", "B"))
def conv_transpose(op, node, dY):
    """Y[n, group(c)·M/g + m, x·stride + k·dilation - pad] += X[n, c, x]·W[c, m, k], + B[m]."""
    X, W = node.inputs[:2]
    B = node.inputs[2] if len(node.inputs) > 2 else None
    g = _Geometry(node, X, W)
    ns = g.ns
    output_shape = shapes.attr(node, "output_shape")
    sized = output_shape is not None or g.auto_pad.startswith("SAME")  # pads that sizes decide
    if sized and (g.kernel is None or (output_shape is not None and g.spatial is None)):
        out = None if output_shape is None else output_shape[-ns:]
        out_pad = shapes.attr(node, "output_padding", [0] * ns)
        dX = _conv_transpose_dx_at_run_time(op, dY, W, g, X, out, out_pad)
    else:
        if g.auto_pad.startswith("SAME") or output_shape is not None:
            # Without output_shape the total does not depend on X's sizes: any will do.
            spatial = g.spatial or [1] * ns
            out_pad = shapes.attr(node, "output_padding", [0] * ns)
            full = g.extent(spatial)
            out = output_shape[-ns:] if output_shape else [s * st for s, st in zip(spatial, g.strides)]
            g.same_pads([f + p - o for f, p, o in zip(full, out_pad, out)])
            # Only the begin pads matter; Y's end is cut or zero-extended from the full transpose.
            end = [f - b - o for f, b, o in zip(full, g.pads, out)]
        else:
            end = [e - p for e, p in zip(g.pads[ns:], shapes.attr(node, "output_padding", [0] * ns))]
        if min(g.pads[:ns]) < 0:
            raise RuleError(f"negative pads {g.pads[:ns]} are not supported")
        # The Conv adjoint reads dY with the same begin pads; its end pads bring it back to X's size.
        g.pads = g.pads[:ns] + [max(0, e) for e in end]
        dX = op.Conv(dY, W, strides=g.strides, dilations=g.dilations, pads=g.pads, group=g.group)
        if min(end) < 0:
            ends = g.spatial if g.spatial is not None else op.Slice(op.Shape(X), [2], [ns + 2])
            dX = op.slice(dX, [0] * ns, ends, range(2, ns + 2))
    grads = {"X": dX, "W": _kernel_grad(op, dY, X, g, node.outputs[0], X)}
    if B is not None:
        grads["B"] = op.reduce_sum(dY, [0, *range(2, ns + 2)], keepdims=False)
    return grads


def _conv_transpose_dx_at_run_time(op, dY, W, g: _Geometry, X, out: list[int] | None, out_pad: list[int]):
    """ConvTranspose's dX where output_shape or auto_pad=SAME_* fixes Y's sizes O and the pads
    follow from sizes known only at run time (X's S, with output_shape; the kernel's, either way):
    the total padding (S − 1)·stride + reach + output_padding − O, O = output_shape or S·stride
    (SAME_*, where S cancels), split the auto_pad way (NOTSET as SAME_LOWER), becomes g's run-time
    pads, around dY; the Conv adjoint then yields S + ⌊output_padding / stride⌋ positions. Where
    the total may be negative (Y asks for more than the transpose makes: zeros, as onnxruntime
    takes the total at least 0), it is 0 and the extra positions are cut."""
    shapes.require_opset(op, 11, f"ConvTranspose's gradient with pads decided by the spatial sizes of "
                                 f"'{X.name}' or '{W.name}', known only at run time (Pad)")
    ns = g.ns
    strides = np.array(g.strides, np.int64)
    span = g.span(op)
    known = np.array(out_pad, np.int64) + 1 - strides  # the terms known before run time, and the others
    at_run_time = []
    if isinstance(span, list):
        known += span
    else:
        at_run_time.append(span)
    size = None
    if out is not None:
        known -= np.array(out, np.int64)
        size = shapes.shape_between(op, X, 2, ns + 2)
        at_run_time.append(op.Mul(size, strides))
    total = known
    for term in at_run_time:
        total = op.Add(term, total)
    # (without output_shape the total is reach + output_padding − stride, which the least reach bounds)
    short = out is not None or any(st > r + p for st, r, p in zip(g.strides, g.least_reach(), out_pad))
    if short:
        total = _at_least_zero(op, total)
    g.pads = _RunTimePads.split(op, total, g.auto_pad)
    dX = op.Conv(op.Pad(dY, g.pads.of_tensor(op)), W, strides=g.strides, dilations=g.dilations,
                 group=g.group)
    if short or any(p >= st for p, st in zip(out_pad, g.strides)):
        size = size if size is not None else shapes.shape_between(op, X, 2, ns + 2)
        dX = op.Slice(dX, [0] * ns, size, list(range(2, ns + 2)))
    return dX


# Pooling


def _pooled_size(g: _Geometry, spatial, ceil_mode) -> list[int]:
    """Output sizes; with ceil_mode a last window that would start in the end padding is dropped
    (onnxruntime and the reference evaluator do so; onnx shape inference does not)."""
    out = []
    for s, b, e, st, d, k in zip(spatial, g.pads, g.pads[g.ns:], g.strides, g.dilations, g.kernel):
        span = s + b + e - d * (k - 1) - 1
        n = (-(-span // st) if ceil_mode else span // st) + 1
        out.append(n - 1 if ceil_mode and (n - 1) * st >= s + b else n)
    return out


@rule("AveragePool", differentiable=("X",))
def average_pool(op, node, dY):
    """Y[o] = Σ_window(o) X / divisor(o); dX = the window-sum adjoint of dY / divisor."""
    X = node.inputs[0]
    shapes.require_opset(op, 7, "AveragePool's gradient")
    g = _Geometry(node, X, None)
    g.resolve_same(op, X)
    if g.spatial is None:
        return {"X": _average_pool_at_run_time(op, node, dY, g)}
    ns, spatial = g.ns, g.spatial
    out = _pooled_size(g, spatial, shapes.attr(node, "ceil_mode", 0))
    # As in Conv's dX: the windows' full extent is cut, or zero-extended, back to X's size.
    end = [f - b - s for f, b, s in zip(g.extent(out), g.pads, spatial)]
    pads = g.pads[:ns] + [max(0, e) for e in end]
    geometry = dict(strides=g.strides, dilations=g.dilations, pads=pads)
    window = op.const(np.ones([1, 1, *g.kernel]), like=dY)
    ones = op.const(np.ones([1, 1, *spatial]), like=dY)
    # 1/divisor = AveragePool(ones) / in-bounds taps: the runtime's own divisor convention.
    attrs = {k: shapes.attr(node, k) for k in node.attributes}
    taps = op.Conv(ones, window, **geometry)
    scale = op.Div(op.AveragePool(ones, **attrs), taps)
    flat = op.reshape(op.Mul(dY, scale), [-1, 1] + [0] * ns)
    dX = op.ConvTranspose(flat, window, output_padding=[max(0, -e) for e in end], **geometry)
    return {"X": op.Reshape(dX, op.Shape(X))}


def _average_pool_at_run_time(op, node, dY, g: _Geometry):
    """AveragePool's dX where X's spatial sizes are known only at run time: the divisors as in the
    static form, from ones of X's sizes (one plane) made at run time."""
    X, ns = node.inputs[0], g.ns
    window = _pool_window(op, g, X, dY)
    ones = shapes.fill_like(op, dY, 1.0, op.Concat([1, 1], shapes.shape_between(op, X, 2, ns + 2), axis=0))
    pooled = op.AveragePool(ones, **{k: shapes.attr(node, k) for k in node.attributes})
    # In-bounds taps: with ceil_mode the end pads grow by a stride less one, enough for the last
    # window, and the windows the pool drops (starting in the end pad) are cut.
    ceil_mode, pads = shapes.attr(node, "ceil_mode", 0), g.pads
    if isinstance(pads, _RunTimePads):
        ones, pads = op.Pad(ones, pads.of_tensor(op)), None
    elif ceil_mode:
        pads = pads[:ns] + [e + st - 1 for e, st in zip(pads[ns:], g.strides)]
    taps = op.Conv(ones, window, strides=g.strides, dilations=g.dilations, pads=pads)
    if ceil_mode:
        taps = op.Slice(taps, [0] * (ns + 2), op.Shape(pooled))
    return _pool_adjoint_at_run_time(op, op.Mul(dY, op.Div(pooled, taps)), window, g, X)


def _pool_window(op, g: _Geometry, X, dY):
    """The pooling window as a Conv kernel of ones (after a check that the sizes known only at run
    time can be read and cut: opset 10)."""
    shapes.require_opset(op, 10, f"the gradient of a pool over the spatial sizes of '{X.name}', "
                                 "known only at run time (Slice)")
    return op.const(np.ones([1, 1, *g.kernel]), like=dY)


def _pool_adjoint_at_run_time(op, t, window, g: _Geometry, X):
    """Σ of t over the windows that hold each element of X, for X's sizes known only at run time."""
    flat = op.reshape(t, [-1, 1] + [0] * g.ns)
    geometry = dict(strides=g.strides, dilations=g.dilations)
    back = _cut_to(op, lambda **given: op.ConvTranspose(flat, window, **given, **geometry), g, X)
    return op.Reshape(back, op.Shape(X))


@rule("GlobalAveragePool", differentiable=("X",))
def global_average_pool(op, node, dY):
    """Y[n, c] = mean of X[n, c] over the spatial axes."""
    X = node.inputs[0]
    shapes.require_opset(op, 8, "GlobalAveragePool's gradient (Expand)")
    spatial = shapes.static_shape(X)
    if spatial is not None:
        size = op.const(float(np.prod(spatial[2:])), like=dY)
    else:
        size = op.CastLike(op.Div(op.Size(X), op.Size(dY)), dY)
    return {"X": op.Expand(op.Div(dY, size), op.Shape(X))}


def _row_major(node: ir.Node) -> bool:
    return shapes.attr(node, "storage_order", 0) == 0


# The forward node is given its Indices output (row-major) rather than running MaxPool again.
@rule("MaxPool", differentiable=("X",), since=8, saves=("Indices",), when=_row_major)
@rule("MaxPool", differentiable=("X",))
def max_pool(op, node, dY, dIndices=None):
    """Y[o] = max over the window; dX gets dY[o] at the window's first maximum (Indices)."""
    X = node.inputs[0]
    shapes.require_opset(op, 8, "MaxPool's gradient (the Indices output)")
    attrs = {k: shapes.attr(node, k) for k in node.attributes if k != "storage_order"}
    if len(node.outputs) > 1 and node.outputs[1].name and _row_major(node):
        indices = node.outputs[1]
    else:
        indices = op.MaxPool(X, _outputs=2, **attrs)[1]
    g = _Geometry(node, X, None)
    # Two windows share an element when they overlap along any one axis.
    overlapping = any(st < d * (k - 1) + 1 for st, d, k in zip(g.strides, g.dilations, g.kernel))
    overhang = None if overlapping else _unpool_overhang(op, g, X, shapes.attr(node, "ceil_mode", 0))
    if overhang is not None and op.opset >= 9 and X.dtype in _UNPOOL_TYPES:
        # Every index is hit at most once: MaxUnpool puts dY there in one node (faster than the
        # scatter below). Indices are absolute; its end pads only keep the size it infers from
        # the windows within X's, which onnxruntime checks against output_shape.
        return {"X": op.MaxUnpool(dY, indices, op.Shape(X), kernel_shape=g.kernel,
                                  strides=g.strides, pads=[0] * g.ns + overhang)}
    why = "MaxPool's gradient (ScatterElements, with reduction='add' when windows overlap)"
    shapes.require_opset(op, 16 if overlapping else 11, why)
    # Indices are offsets into X flattened whole (batch and channel included).
    zeros = shapes.zeros(op, op.Reshape(X, [-1]))
    flat = op.ScatterElements(zeros, op.Reshape(indices, [-1]), op.Reshape(dY, [-1]), axis=0,
                              reduction="add" if op.opset >= 16 else None)
    return {"X": op.Reshape(flat, op.Shape(X))}


# onnxruntime has MaxUnpool kernels for these only.
_UNPOOL_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})


def _unpool_overhang(op, g: _Geometry, X, ceil_mode) -> list[int] | None:
    """How far the undilated windows reach past X's end, per axis (None: unknown, or a kernel
    or more, which MaxUnpool's pads cannot take)."""
    if g.spatial is None:
        return None
    g.resolve_same(op, X)
    out = _pooled_size(g, g.spatial, ceil_mode)
    over = [max(0, (o - 1) * st + k - s) for o, st, k, s in zip(out, g.strides, g.kernel, g.spatial)]
    return over if all(v < k for v, k in zip(over, g.kernel)) else None


@rule("GlobalMaxPool", differentiable=("X",))
def global_max_pool(op, node, dY):
    """Y[n, c] = max of X[n, c] over the spatial axes; dX gets dY at the first maximum."""
    X = node.inputs[0]
    shapes.require_opset(op, 11, "GlobalMaxPool's gradient (ScatterElements)")
    rows = op.reshape(X, [0, 0, -1])
    first = op.ArgMax(rows, axis=2, keepdims=1)
    dX = op.ScatterElements(shapes.zeros(op, rows), first, op.reshape(dY, [0, 0, 1]), axis=2)
    return {"X": op.Reshape(dX, op.Shape(X))}


# Dropout, local response normalisation, Lp pooling, Col2Im, deformable convolution


def _may_train(node: ir.Node) -> bool:
    """Whether a Dropout (opset 12+) can run in training mode: its mode input is not a constant false."""
    mode = node.inputs[2] if len(node.inputs) > 2 else None
    if mode is None:
        return False
    fixed = shapes.number(mode)
    return fixed is None or bool(fixed)


# In training mode the random mask cannot be recomputed: the forward node is given its mask output.
@rule("Dropout", differentiable=("data",), since=12, saves=("mask",), when=_may_train)
@rule("Dropout", differentiable=("data",))
def dropout(op, node, dY, dMask=None):
    """Identity in inference mode; training: Y = X·mask/(1 − ratio), dX = dY·mask/(1 − ratio)."""
    X = node.inputs[0]
    if op.opset >= 12:
        ratio = node.inputs[1] if len(node.inputs) > 1 else None
        mode = node.inputs[2] if len(node.inputs) > 2 else None
        fixed_mode = shapes.number(mode)
        fixed_ratio = 0.5 if ratio is None else shapes.number(ratio)
        if mode is None or (fixed_mode is not None and not fixed_mode):
            return {"data": dY}
    else:
        # Opsets 7-11 have no mode: inference runtimes (all that run them) copy X.
        training = op.opset < 7 and not shapes.attr(node, "is_test", 0)
        if not training:
            return {"data": dY}
        mode = fixed_mode = None
        fixed_ratio = shapes.attr(node, "ratio", 0.5)
    if fixed_ratio is not None and float(fixed_ratio) == 0.0:
        return {"data": dY}
    mask = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1].name else None
    if mask is None:
        raise RuleError(
            "Dropout in training mode needs its mask output to be differentiated (the random mask "
            "cannot be recomputed); add the 'mask' output to the node in the model"
        )
    if fixed_ratio is not None:
        scale = op.const(1.0 / (1.0 - float(fixed_ratio)), like=X)
    else:
        scale = op.Reciprocal(op.Sub(1.0, shapes.cast_like(op, ratio, X)))
    if mode is not None and fixed_mode is None:
        scale = op.Where(mode, scale, op.const(1.0, like=X))
    kept = op.Mul(dY, shapes.cast_like(op, mask, X))
    return {"data": op.Mul(kept, scale, broadcast=1 if op.opset < 7 else None)}


def _channel_window_sum(op, x, rank_: int, before: int, after: int):
    """Σ x[n, c + j] for j in [−before, after] (zero outside): a Conv over (N, 1, C, *S)."""
    window = op.const(np.ones([1, 1, before + after + 1] + [1] * (rank_ - 2)), like=x)
    zeros = [0] * (rank_ - 2)
    summed = op.Conv(op.unsqueeze(x, [1]), window, pads=[before, *zeros, after, *zeros])
    return op.squeeze(summed, [1])


@rule("LRN", differentiable=("X",))
def lrn(op, node, dY):
    """Y = X·S^−β, S = bias + α/size·Σ X² over channels c − ⌊(size−1)/2⌋ … c + ⌈(size−1)/2⌉;
    dX = dY·S^−β − 2αβ/size·X·window_sumᵀ(dY·Y/S)."""
    X, Y = node.inputs[0], node.outputs[0]
    shapes.require_opset(op, 7, "LRN's gradient (numpy broadcasting)")
    size = shapes.attr(node, "size")
    alpha, beta = shapes.attr(node, "alpha", 1e-4), shapes.attr(node, "beta", 0.75)
    bias = shapes.attr(node, "bias", 1.0)
    r = shapes.known_rank(X, "LRN's input X")
    lo, hi = (size - 1) // 2, size // 2
    S = op.Add(op.Mul(_channel_window_sum(op, op.Mul(X, X), r, lo, hi), alpha / size), bias)
    back = _channel_window_sum(op, op.Div(op.Mul(dY, Y), S), r, hi, lo)  # the adjoint window
    direct = op.Mul(dY, op.Pow(S, -float(beta)))
    return {"X": op.Sub(direct, op.Mul(op.Mul(X, back), 2.0 * alpha * beta / size))}


def _lp_weight(op, X, p):
    """∂|x|^p/∂x / p = sign(x)·|x|^(p−1)."""
    shapes.require_opset(op, 7, "the gradient of Lp pooling (numpy broadcasting)")
    if p == 2:
        return X
    if op.opset < 9:  # no Sign yet: x·|x|^(p−2), undefined at x = 0 when p < 2
        return op.Mul(X, op.Pow(op.Abs(X), float(p - 2)))
    if p == 1:
        return op.Sign(X)
    return op.Mul(op.Sign(X), op.Pow(op.Abs(X), float(p - 1)))


@rule("LpPool", differentiable=("X",))
def lp_pool(op, node, dY):
    """Y[o] = (Σ_window(o) |X|^p)^(1/p); dX = sign(X)|X|^(p−1)·window_sumᵀ(dY·Y^(1−p))."""
    X, Y = node.inputs[0], node.outputs[0]
    p = shapes.attr(node, "p", 2)
    weight = _lp_weight(op, X, p)
    g = _Geometry(node, X, None)
    g.resolve_same(op, X)
    ns, spatial = g.ns, g.spatial
    t = dY if p == 1 else op.Div(dY, Y) if p == 2 else op.Mul(dY, op.Pow(Y, float(1 - p)))
    if spatial is None:
        return {"X": op.Mul(weight, _pool_adjoint_at_run_time(op, t, _pool_window(op, g, X, dY), g, X))}
    out = _pooled_size(g, spatial, shapes.attr(node, "ceil_mode", 0))
    # The window-sum adjoint, as in AveragePool: the windows' full extent cut or extended to X.
    end = [f - b - s for f, b, s in zip(g.extent(out), g.pads, spatial)]
    window = op.const(np.ones([1, 1, *g.kernel]), like=dY)
    flat = op.reshape(t, [-1, 1] + [0] * ns)
    back = op.ConvTranspose(flat, window, strides=g.strides, dilations=g.dilations,
                            pads=g.pads[:ns] + [max(0, e) for e in end],
                            output_padding=[max(0, -e) for e in end])
    return {"X": op.Mul(weight, op.Reshape(back, op.Shape(X)))}


@rule("GlobalLpPool", differentiable=("X",))
def global_lp_pool(op, node, dY):
    """Y[n, c] = (Σ_spatial |X|^p)^(1/p); dX = sign(X)|X|^(p−1)·Y^(1−p)·dY."""
    X, Y = node.inputs[0], node.outputs[0]
    p = shapes.attr(node, "p", 2)
    weight = _lp_weight(op, X, p)
    t = dY if p == 1 else op.Div(dY, Y) if p == 2 else op.Mul(dY, op.Pow(Y, float(1 - p)))
    return {"X": op.Mul(weight, t)}


@rule("Col2Im", differentiable=("input",))
def col2im(op, node, dY):
    """Y = Σ of the column blocks at their image positions; dinput = Im2Col(dY): a Conv of each
    channel of dY with a one-hot kernel per block position."""
    block = shapes.constant(node.inputs[2])
    if block is None:
        raise RuleError(f"Col2Im's gradient needs a constant block_shape ('{node.inputs[2].name}' is "
                        "computed at run time)")
    block = [int(b) for b in block]
    ns, k = len(block), int(np.prod(block))
    onehot = op.const(np.eye(k).reshape([k, 1, *block]), like=dY)
    planes = op.reshape(dY, [-1, 1] + [0] * ns)  # (N·C, 1, *image)
    cols = op.Conv(planes, onehot, strides=shapes.attr(node, "strides", [1] * ns),
                   dilations=shapes.attr(node, "dilations", [1] * ns),
                   pads=shapes.attr(node, "pads", [0] * (2 * ns)))
    return {"input": op.Reshape(cols, op.Shape(node.inputs[0]))}


@rule("DeformConv", differentiable=("X", "W", "offset", "B", "mask"))
def deform_conv(op, node, dY):
    """Y[n, m, o] = Σ_c,k W[m, c, k]·mask[n, g, k, o]·bilinear(X[n, c], p(o, k) + off[n, g, k, o])
    + B[m], g the offset group of c, zeros read outside X. The sampled columns are rebuilt from
    the four corners (GatherElements); dX scatters back with the bilinear weights, doffset is the
    slope of the bilinear surface, dmask the unmasked columns."""
    X, W, offset = node.inputs[:3]
    B = node.inputs[3] if len(node.inputs) > 3 else None
    mask = node.inputs[4] if len(node.inputs) > 4 else None
    if shapes.rank(X) != 4:
        raise RuleError(f"DeformConv's gradient supports 2-D images only (the input '{X.name}' has shape "
                        f"{shapes.dims(X)})")
    g = _Geometry(node, X, W)
    group, G = g.group, shapes.attr(node, "offset_group", 1)
    # Sizes are ints where static, else 1-element int64 values read at run time.
    H, Wd = shapes.extent(op, X, 2), shapes.extent(op, X, 3)
    kh, kw = g.kernel or (shapes.extent(op, W, 2), shapes.extent(op, W, 3))
    if all(isinstance(v, int) for v in (H, Wd, kh, kw)):
        oh, ow = [(s + b + e - d * (k - 1) - 1) // st + 1 for s, b, e, d, k, st in
                  zip((H, Wd), g.pads[:2], g.pads[2:], g.dilations, (kh, kw), g.strides)]
    else:  # (the offsets have the output's sizes)
        oh, ow = shapes.extent(op, offset, 2), shapes.extent(op, offset, 3)
    K, L = _product(op, kh, kw), _product(op, oh, ow)
    KL = _product(op, K, L)
    base_y, base_x = _deform_base_positions(op, g, kh, kw, oh, ow, X)
    off_y, off_x = op.split(op.reshape(offset, shapes.shape_from(op, 0, G, K, 2, L)), [1, 1], axis=3)
    py, px = (op.Add(op.reshape(off, shapes.shape_from(op, 0, G, 1, KL)),
                     base if isinstance(base, ir.Value) else op.const(base, like=X))
              for off, base in ((off_y, base_y), (off_x, base_x)))
    y0, x0 = op.Floor(py), op.Floor(px)
    ly, lx = op.Sub(py, y0), op.Sub(px, x0)
    hy, hx = op.Sub(1.0, ly), op.Sub(1.0, lx)
    y1, x1 = op.Add(y0, 1.0), op.Add(x0, 1.0)
    C = shapes.extent(op, X, 1)
    if isinstance(C, int):
        per_group = op.const([1, 1, C // G, 1])
    else:
        per_group = op.Concat([1, 1], op.Div(C, [G]), [1], axis=0)
    planes = op.reshape(X, shapes.shape_from(op, 0, G, -1, _product(op, H, Wd)))  # (N, G, C/G, H·W)
    y_last, x_last = _last_index(op, H, X), _last_index(op, Wd, X)
    width = float(Wd) if isinstance(Wd, int) else op.CastLike(Wd, X)

    def corner(yc, xc):
        inside = op.And(op.And(op.GreaterOrEqual(yc, 0.0), op.LessOrEqual(yc, y_last)),
                        op.And(op.GreaterOrEqual(xc, 0.0), op.LessOrEqual(xc, x_last)))
        flat = op.Add(op.Mul(op.Clip(yc, 0.0, y_last), width), op.Clip(xc, 0.0, x_last))
        index = op.Expand(op.Cast(flat, to=int(ir.DataType.INT64)), per_group)
        valid = op.CastLike(inside, X)
        return index, valid, op.Mul(op.GatherElements(planes, index, axis=3), valid)

    (i00, m00, v00), (i01, m01, v01) = corner(y0, x0), corner(y0, x1)
    (i10, m10, v10), (i11, m11, v11) = corner(y1, x0), corner(y1, x1)
    weights = [op.Mul(hy, hx), op.Mul(hy, lx), op.Mul(ly, hx), op.Mul(ly, lx)]
    sampled = op.Sum(*(op.Mul(w, v) for w, v in zip(weights, (v00, v01, v10, v11))))
    m = None if mask is None else op.reshape(mask, shapes.shape_from(op, 0, G, 1, KL))
    columns = sampled if m is None else op.Mul(sampled, m)
    # The convolution proper is a batched matmul per group: (C/group·K) columns, L positions.
    col_r = op.reshape(columns, shapes.shape_from(op, 0, group, -1, L))
    dy_r = op.reshape(dY, shapes.shape_from(op, 0, group, -1, L))
    w_r = op.reshape(W, shapes.shape_from(op, group, -1, _product(op, shapes.extent(op, W, 1), K)))
    d_cols = op.MatMul(op.Transpose(w_r, perm=[0, 2, 1]), dy_r)
    d_cols = op.reshape(d_cols, shapes.shape_from(op, 0, G, -1, KL))
    dW = op.reduce_sum(op.MatMul(dy_r, op.Transpose(col_r, perm=[0, 1, 3, 2])), [0], False)
    w_dims = shapes.static_shape(W)
    grads = {"W": op.reshape(dW, w_dims) if w_dims is not None else op.Reshape(dW, op.Shape(W))}
    if B is not None:
        grads["B"] = op.reduce_sum(dY, [0, 2, 3], keepdims=False)
    if m is not None:
        d_mask = op.reduce_sum(op.Mul(d_cols, sampled), [2], keepdims=True)
        grads["mask"] = op.Reshape(d_mask, op.Shape(mask))
        d_cols = op.Mul(d_cols, m)
    updates = [op.Mul(d_cols, op.Mul(w, v)) for w, v in zip(weights, (m00, m01, m10, m11))]
    dX = op.ScatterElements(shapes.zeros(op, planes), op.Concat(i00, i01, i10, i11, axis=3),
                            op.Concat(*updates, axis=3), axis=3, reduction="add")
    grads["X"] = op.Reshape(dX, op.Shape(X))
    slope_y = op.Add(op.Mul(hx, op.Sub(v10, v00)), op.Mul(lx, op.Sub(v11, v01)))
    slope_x = op.Add(op.Mul(hy, op.Sub(v01, v00)), op.Mul(ly, op.Sub(v11, v10)))
    d_py, d_px = (op.reshape(op.reduce_sum(op.Mul(d_cols, s), [2]), shapes.shape_from(op, 0, G, K, 1, L))
                  for s in (slope_y, slope_x))
    grads["offset"] = op.Reshape(op.Concat(d_py, d_px, axis=3), op.Shape(offset))
    return grads


def _product(op, *sizes):
    """The product of sizes given as ints or 1-element int64 values: an int when all are ints."""
    known = int(np.prod([s for s in sizes if isinstance(s, int)]))
    values = [s for s in sizes if not isinstance(s, int)]
    if not values:
        return known
    product = functools.reduce(op.Mul, values)
    return product if known == 1 else op.Mul(product, [known])


def _last_index(op, size, like: ir.Value):
    """size − 1 as Clip's bound: a float, or a scalar of like's dtype computed at run time."""
    if isinstance(size, int):
        return float(size - 1)
    return op.CastLike(op.squeeze(op.Sub(size, [1]), [0]), like)


def _deform_base_positions(op, g: _Geometry, kh, kw, oh, ow, like: ir.Value):
    """Where DeformConv's taps sample without offsets, y and x, each (1, 1, 1, K·L): tap k = (i, j)
    of output position l = (r, c) at (r·stride − pad + i·dilation, c·stride − pad + j·dilation).
    numpy arrays where the sizes are ints; else values of like's dtype computed at run time, the
    indices from CumSum over ones of the sizes (no Range: it takes scalars)."""
    (sy, sx), (di, dj), (py, px) = g.strides, g.dilations, g.pads[:2]
    if all(isinstance(v, int) for v in (kh, kw, oh, ow)):
        rows, cols = np.arange(oh) * sy - py, np.arange(ow) * sx - px
        base_y = np.add.outer(np.repeat(np.arange(kh) * di, kw), np.repeat(rows, ow))
        base_x = np.add.outer(np.tile(np.arange(kw) * dj, kh), np.tile(cols, oh))
        return base_y.reshape(1, 1, 1, -1), base_x.reshape(1, 1, 1, -1)
    ones = op.ConstantOfShape(shapes.shape_from(op, kh, kw, oh, ow),
                              value=ir.Tensor(np.array([1], np.int64)))
    i, j, r, c = (op.CumSum(ones, axis, exclusive=1) for axis in range(4))
    base_y = op.Add(op.Mul(i, [di]), op.Sub(op.Mul(r, [sy]), [py]))
    base_x = op.Add(op.Mul(j, [dj]), op.Sub(op.Mul(c, [sx]), [px]))
    return tuple(op.CastLike(op.Reshape(base, [1, 1, 1, -1]), like) for base in (base_y, base_x))
