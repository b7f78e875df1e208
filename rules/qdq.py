"""Fake quantization: a QuantizeLinear whose integers only a DequantizeLinear reads (the QDQ pair
onnxruntime's quantizer writes and quantization-aware training inserts), differentiated as one
unit with the straight-through estimator, and its scales with LSQ (Esser et al. 2020).

Forward, as ONNX defines it: q = clip(round(x / s) + z, qmin, qmax) (round half to even; qmin,
qmax the range of q's integer type: int8, uint8, int16, uint16, int4, uint4, int2, uint2), then
y = (q − z')·s' with the DequantizeLinear's scale s' and zero point z'. Each node's scale and
zero point are per tensor (one element), per axis (1-D, along ``axis``) or blocked (opset 21's
``block_size``: one scale per ``block_size`` consecutive elements along ``axis``, the last block
possibly shorter); each is spread over x's shape by its own node's ``axis`` and ``block_size``.

With u = round(x/s) + z before the clip, and x inside the range where qmin ≤ u ≤ qmax:

- dx = dY·s'/s inside, 0 where the value was clipped (round's derivative taken as 1); with the
  DequantizeLinear reading the same scale (or an equal constant), dx = dY inside: torch's
  ``fake_quantize_per_tensor_affine`` / ``_per_channel_affine``.
- ds (the QuantizeLinear's scale) = Σ dY·(−s'/s)·(x/s) inside, 0 outside; ds' (the
  DequantizeLinear's) = Σ dY·(q − z'), its exact derivative; the sums run over the elements that
  share each scale (all of them, the other axes, or the block). Where both nodes read one scale
  value (as onnxruntime's quantizer writes them) its gradient is their sum, LSQ as torch's
  ``_fake_quantize_learnable_per_tensor_affine`` / ``_per_channel_affine`` compute it (grad_factor
  1): dY·(round(x/s) − x/s) inside, dY·(q − z) where clipped. A scale gets a gradient only when it
  is a float value the gradient is asked for (a constant scale's computation is left unused).
- The zero points are integers in ONNX: no gradient here. A training pass that learns a float
  zero point feeds its rounded value to these nodes and differentiates the rounding its own way.

The pattern matches every QuantizeLinear → DequantizeLinear pair (default domain, or both in
onnxruntime's com.microsoft domain) where nothing but the DequantizeLinear reads q (not a graph
output either); the two nodes' scales and zero points may be separate values (a requantization:
the same formulas). The mask is recomputed in float32 from x (a half-precision model's may
differ from its kernel's at an exact rounding tie only). Refused with a RuleError: q of a float
type (float8, float4: no integer range), a scale of unknown rank, a per-axis or blocked scale
over an x of unknown rank, or a scale layout ONNX does not define. Below opset 11 (no Round) the
passes upgrade the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

FLOAT = ir.DataType.FLOAT

RANGES = {
    ir.DataType.INT8: (-128, 127), ir.DataType.UINT8: (0, 255),
    ir.DataType.INT16: (-32768, 32767), ir.DataType.UINT16: (0, 65535),
    ir.DataType.INT4: (-8, 7), ir.DataType.UINT4: (0, 15),
    ir.DataType.INT2: (-2, 1), ir.DataType.UINT2: (0, 3),
}
"""The integer types a QuantizeLinear saturates to, with their ranges [qmin, qmax]."""


def fake_quantize(op, x, scale, dq_scale):
    q = op.QuantizeLinear(x, scale, _allow_other_inputs=True, _outputs=["q"])
    return op.DequantizeLinear(q, dq_scale, _allow_other_inputs=True)


def fake_quantize_contrib(op, x, scale, dq_scale):
    """The same pair in onnxruntime's com.microsoft domain (its quantizer's 16- and 4-bit QDQ
    below opset 21, or with UseQDQContribOps)."""
    q = op.QuantizeLinear(x, scale, _domain="com.microsoft", _allow_other_inputs=True, _outputs=["q"])
    return op.DequantizeLinear(q, dq_scale, _domain="com.microsoft", _allow_other_inputs=True)


@dataclass(frozen=True)
class _Layout:
    """How a node's scale (and zero point) spreads over x: per tensor, per axis, or in blocks."""

    kind: str  # "tensor", "axis" or "block"
    axis: int = 0
    block: int = 0
    rank: int = 0


def _where(node: ir.Node) -> str:
    kind = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
    return f"{kind} '{node.name or node.outputs[0].name}'"


def _layout(node: ir.Node, scale: ir.Value, x: ir.Value) -> _Layout:
    dims = shapes.dims(scale)
    if dims is None:
        raise RuleError(f"the rank of the scale '{scale.name}' of {_where(node)} is unknown; run shape inference first")
    if not dims or (all(isinstance(d, int) for d in dims) and int(np.prod(dims)) == 1):
        return _Layout("tensor")  # (a one-element scale is per tensor, as onnx's reference reads it)
    rank = shapes.known_rank(x, f"input of {_where(node)}")
    axis = shapes.attr(node, "axis", 1)
    if not -rank <= axis < rank:
        raise RuleError(f"{_where(node)} has axis {axis}, outside the rank {rank} of '{x.name}'")
    axis = shapes.normalize_axis(axis, rank)
    block = shapes.attr(node, "block_size", 0) or 0
    if block > 0:
        if len(dims) != rank:
            raise RuleError(f"{_where(node)} has block_size {block} and a scale '{scale.name}' of rank {len(dims)}, "
                            f"not the rank {rank} of '{x.name}'")
        return _Layout("block", axis, block, rank)
    if len(dims) != 1:
        raise RuleError(f"{_where(node)} has a scale '{scale.name}' of rank {len(dims)} without block_size: "
                        "ONNX defines scalar (per tensor) and 1-D (per axis) scales there")
    return _Layout("axis", axis, 0, rank)


def _spread(op, value: ir.Value, layout: _Layout, x: ir.Value) -> ir.Value:
    """``value`` (a scale or zero point, already float) broadcastable against x."""
    if layout.kind == "tensor":
        return value if shapes.rank(value) == 0 else op.reshape(value, [])
    axis, rank = layout.axis, layout.rank
    if layout.kind == "axis":
        return op.reshape(value, [1] * axis + [-1] + [1] * (rank - axis - 1))
    block = layout.block
    repeated = op.Expand(op.unsqueeze(value, [axis + 1]), [1] * (axis + 1) + [block] + [1] * (rank - axis - 1))
    known = shapes.static_shape(value)
    if known is not None:
        merged = list(known)
        merged[axis] *= block
    else:
        merged = shapes.shape_from(op, *_outer(op, value, axis, rank, [-1]))
    spread = op.reshape(repeated, merged)
    length, blocks = shapes.extent(op, x, axis), shapes.extent(op, value, axis)
    if isinstance(length, int) and isinstance(blocks, int) and length == blocks * block:
        return spread
    return op.slice(spread, [0], [length] if isinstance(length, int) else length, axes=[axis])


def _outer(op, like: ir.Value, axis: int, rank: int, middle: list) -> list:
    """Shape parts: ``like``'s extents before ``axis``, ``middle``, its extents after ``axis``."""
    before = [shapes.shape_between(op, like, 0, axis)] if axis > 0 else []
    after = [shapes.shape_between(op, like, axis + 1, rank)] if axis + 1 < rank else []
    return before + middle + after


def _gather(op, grad: ir.Value, layout: _Layout, value: ir.Value, x: ir.Value) -> ir.Value:
    """``grad`` (in x's shape) summed over the elements sharing each entry of ``value``: in
    ``value``'s shape."""
    if layout.kind == "tensor":
        total = op.reduce_sum(grad, None, keepdims=False)
        rank = shapes.rank(value)
        if not rank:
            return total
        known = shapes.static_shape(value)
        return op.reshape(total, list(known) if known is not None else op.Shape(value))
    axis, rank = layout.axis, layout.rank
    if layout.kind == "axis":
        others = [i for i in range(rank) if i != axis]
        summed = op.reduce_sum(grad, others, keepdims=False) if others else grad
        if not isinstance((shapes.dims(value) or (None,))[0], int):
            # a scale whose length only the run knows: one element (per tensor) or x's extent
            summed = shapes.unbroadcast(op, summed, value, summed)
        return summed
    block = layout.block
    length, blocks = shapes.extent(op, x, axis), shapes.extent(op, value, axis)
    if isinstance(length, int) and isinstance(blocks, int):
        short = blocks * block - length
    else:
        as_value = lambda n: op.const(np.array([n], np.int64)) if isinstance(n, int) else n  # noqa: E731
        short = op.Sub(op.Mul(as_value(blocks), as_value(block)), as_value(length))
    if not (isinstance(short, int) and short == 0):  # the last block's missing elements, as zeros
        grad = op.Pad(grad, shapes.shape_from(op, 0, short), None, [axis])
    known = shapes.static_shape(x)
    if known is not None:
        split = [*known[:axis], -1, block, *known[axis + 1:]]
    else:
        split = shapes.shape_from(op, *_outer(op, x, axis, rank, [-1, block]))
    return op.reduce_sum(op.reshape(grad, split), [axis + 1], keepdims=False)


def _quantized_type(node: ir.Node, q: ir.Value) -> ir.DataType | None:
    """q's type: its zero point's, else ``output_dtype``, else uint8 (ONNX's default)."""
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if zero is not None and zero.dtype is not None:
        return zero.dtype
    if shapes.attr(node, "output_dtype", 0):
        return ir.DataType(shapes.attr(node, "output_dtype"))
    return q.dtype if zero is not None else ir.DataType.UINT8


def _as_float(op, value: ir.Value) -> ir.Value:
    return value if value.dtype == FLOAT else op.Cast(value, to=int(FLOAT))


def _zero_point(op, node: ir.Node, layout: _Layout, x: ir.Value) -> ir.Value | None:
    """The node's zero point in float32, spread over x; None where it is absent or all zeros."""
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if zero is None:
        return None
    known = shapes.constant(zero)
    if known is not None:
        known = np.asarray(known).astype(np.float32)
        if not known.any():
            return None
        return _spread(op, op.const(known, dtype=FLOAT), layout, x)
    return _spread(op, op.Cast(zero, to=int(FLOAT)), layout, x)


def _same_scale(first: ir.Value, second: ir.Value) -> bool:
    """One value, or constants of equal shapes and values (for the STE's factor s'/s = 1)."""
    if first is second:
        return True
    a, b = shapes.constant(first), shapes.constant(second)
    return a is not None and b is not None and a.shape == b.shape and np.array_equal(a, b)


def _back(op, grad: ir.Value, like: ir.Value) -> ir.Value:
    """``grad`` (float32) in the dtype of ``like``."""
    if like.dtype is None or like.dtype == FLOAT:
        return grad
    return op.Cast(grad, to=int(like.dtype))


@rule(pattern=fake_quantize_contrib, differentiable=("x", "scale", "dq_scale"))
@rule(pattern=fake_quantize, differentiable=("x", "scale", "dq_scale"))
def _fake_quantize(op, match, dY):
    q = match["q"]
    quantize, dequantize = q.producer(), match.outputs[0].producer()
    x, scale, dq_scale = match["x"], match["scale"], match["dq_scale"]
    kind = _quantized_type(quantize, q)
    if kind not in RANGES:
        name = kind.name if kind is not None else "an unknown type"
        raise RuleError(
            f"{_where(quantize)} → {_where(dequantize)} quantizes to {name}: the straight-through "
            f"gradient covers the integer types ({', '.join(t.name.lower() for t in RANGES)}); register a "
            "pattern rule named 'fake_quantize' with register_gradient(pattern=...) to replace it")
    pair = f"{_where(quantize)} → {_where(dequantize)}"
    shapes.require_opset(op, 11, f"the straight-through gradient of {pair} (Round)")
    qmin, qmax = RANGES[kind]
    layout = _layout(quantize, scale, x)
    s = _spread(op, _as_float(op, scale), layout, x)
    v = op.Div(_as_float(op, x), s)  # x/s
    u = op.Round(v)
    zero = _zero_point(op, quantize, layout, x)
    if zero is not None:
        u = op.Add(u, zero)  # round(x/s) + z, before the clip
    clipped = op.clip(u, float(qmin), float(qmax))
    inside = op.Equal(clipped, u)
    nothing = op.const(0.0, dtype=FLOAT)
    step = _as_float(op, dY)

    dq_layout = _layout(dequantize, dq_scale, x)
    if _same_scale(scale, dq_scale) and dq_layout == layout:
        ratio = None
    else:
        ratio = op.Div(_spread(op, _as_float(op, dq_scale), dq_layout, x), s)  # s'/s
    gradients = {"x": _back(op, op.Where(inside, step if ratio is None else op.Mul(step, ratio), nothing), x)}

    # The scales (left unused unless asked for): q − z', and the inside part −(s'/s)·(x/s).
    same_zero = len(dequantize.inputs) > 2 and len(quantize.inputs) > 2 and dequantize.inputs[2] is quantize.inputs[2]
    dq_zero = zero if same_zero and dq_layout == layout else _zero_point(op, dequantize, dq_layout, x)
    level = clipped if dq_zero is None else op.Sub(clipped, dq_zero)  # q − z'
    rounding = op.Where(inside, v if ratio is None else op.Mul(v, ratio), nothing)
    if dq_scale is scale and ratio is None:  # LSQ: (q − z) − x/s inside, i.e. round(x/s) − x/s where z' = z
        gradients["scale"] = _back(op, _gather(op, op.Mul(step, op.Sub(level, rounding)), layout, scale, x), scale)
        return gradients
    gradients["scale"] = _back(op, _gather(op, op.Neg(op.Mul(step, rounding)), layout, scale, x), scale)
    gradients["dq_scale"] = _back(op, _gather(op, op.Mul(step, level), dq_layout, dq_scale, x), dq_scale)
    return gradients
