"""Products with frozen quantized weights: onnxruntime's ``com.microsoft.MatMulNBits``.

The quantized weight, its scales and zero points are frozen data (integers, or the quantizer's
statistics); the gradient flows to the activation and the bias. The forward keeps MatMulNBits
(the fast kernel); the backward multiplies by the weight dequantized in standard operators, the
operator's definition written out in a form onnxruntime computes at each step instead of
folding it into a float copy at load (see ``_times_weight``): B packs, per output column n and block b of ``block_size``
rows, ``bits``-bit unsigned integers q low bits first, and W[k, n] = (q - zero_point) · scale
with zero_point 2^(bits-1) when none is given.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

_NBITS_INPUTS = ("A", "B", "scales", "zero_points", "g_idx", "bias")
CHUNK = 1 << 22  # weights dequantized at once in the backward (16 MB of float32)


@rule("MatMulNBits", domain="com.microsoft", differentiable=("A", "bias"), inputs=_NBITS_INPUTS, broadcast=("bias",))
def matmul_nbits(op, node, dY):
    """Y = A @ W + bias, W [K, N] the dequantized B: dA = dY @ Wᵀ."""
    return {"A": _times_weight(op, node, dY), "bias": dY}


def _times_weight(op, node, dY):
    """dY [..., N] @ Wᵀ, the weight dequantized in standard operators.

    The bytes become floats through DequantizeLinear (scale 1) and split into their low and
    high halves in float arithmetic (exact on integers below 2^24): onnxruntime never
    constant-folds a DequantizeLinear, so the weight is unpacked each time the backward reads it
    and only the packed bytes stay in memory (BitShift on the constant bytes would be folded at
    load into a copy twice their size). A 4-bit weight is multiplied as its two halves, the
    columns of the low and of the high nibbles, and the two products interleaved; a large weight
    is dequantized :data:`CHUNK` weights at a time (a slice of its output columns, the products
    summed): no whole float copy of it is made."""
    inputs = list(node.inputs) + [None] * (len(_NBITS_INPUTS) - len(node.inputs))
    _, packed, scales, zero_points, g_idx, _ = inputs
    K, N = shapes.attr(node, "K", None), shapes.attr(node, "N", None)
    bits, block = shapes.attr(node, "bits", 4), shapes.attr(node, "block_size", None)
    if g_idx is not None:
        raise RuleError("MatMulNBits with g_idx (act-order quantization) has no gradient rule yet")
    if bits not in (4, 8) or K is None or N is None or block is None:
        raise RuleError(f"MatMulNBits with bits={bits} has no gradient rule (4 and 8 bits have)")
    blocks = -(-K // block)
    dtype = scales.dtype
    per_block = block * bits // 8
    scale = op.reshape(scales, [N, blocks, 1])
    if zero_points is None:
        zero = op.const(float(2 ** (bits - 1)), dtype=dtype)
    elif zero_points.dtype == dtype:
        zero = op.reshape(zero_points, [N, blocks, 1])
    else:  # packed like B, one value per block, padded to whole bytes per row
        per_row = -(-blocks * bits // 8)
        halves = _halves(op, _floats(op, op.reshape(zero_points, [N, per_row]), dtype), bits)
        zero = halves[0] if bits == 8 else op.reshape(
            op.Concat(*[op.reshape(half, [N, per_row, 1]) for half in halves], axis=-1), [N, per_row * 2])
        zero = op.reshape(op.slice(zero, [0], [blocks], axes=[1]), [N, blocks, 1])
    packed = op.reshape(packed, [N, blocks, per_block])
    if bits == 4:  # columns 2j and 2j + 1 of Wᵀ: the products of the two halves, interleaved
        rank = node.inputs[0].shape.rank() if node.inputs[0].shape is not None else None
        if rank is not None:
            shape = op.const([0] * (rank - 1) + [blocks * block])
        else:
            shape = op.Concat(op.slice(op.Shape(dY), [0], [-1]), op.const([blocks * block]), axis=0)
    dA = None
    rows = max(1, CHUNK // K)
    for start in range(0, N, rows):  # a slice of Wᵀ's rows at a time: one slice's floats live at once
        end = min(N, start + rows)
        part = (lambda v: v) if (start, end) == (0, N) else (lambda v: op.slice(v, [start], [end], axes=[0]))
        halves = _halves(op, _floats(op, part(packed), dtype), bits)
        offset = zero if zero_points is None else part(zero)  # a number, or one per row and block
        weights = [op.reshape(op.Mul(op.Sub(half, offset), part(scale)), [end - start, blocks * per_block])
                   for half in halves]
        rows_of_dY = dY if (start, end) == (0, N) else op.slice(dY, [start], [end], axes=[-1])
        partial = [op.MatMul(rows_of_dY, w) for w in weights]
        # Both halves' products are taken before the next slice's: the high nibbles, which the
        # low ones are computed from, then die with their slice.
        product = partial[0] if bits == 8 else op.Reshape(
            op.Concat(*[op.Unsqueeze(p, op.const([-1])) for p in partial], axis=-1), shape)
        dA = product if dA is None else op.Add(dA, product)
    return dA if blocks * block == K else op.slice(dA, [0], [K], axes=[-1])


def _floats(op, packed, dtype):
    """uint8 bytes as numbers of ``dtype``, through DequantizeLinear (never folded, see above)."""
    values = op.DequantizeLinear(packed, op.const(1.0, dtype=ir.DataType.FLOAT), op.const(0, dtype=ir.DataType.UINT8))
    return values if dtype == ir.DataType.FLOAT else op.Cast(values, to=int(dtype))


def _halves(op, values, bits):
    """The values a byte holds, low bits first: the byte itself (8 bits) or its low and high nibbles."""
    if bits == 8:
        return [values]
    high = op.Floor(op.Mul(values, op.const(1 / 16, like=values)))
    return [op.Sub(values, op.Mul(high, op.const(16.0, like=values))), high]
