"""Products with frozen quantized weights: onnxruntime's ``com.microsoft.MatMulNBits``.

The quantized weight, its scales and zero points are frozen data (integers, or the quantizer's
statistics); the gradient flows to the activation and the bias. The forward keeps MatMulNBits
(the fast kernel); the backward multiplies by the weight dequantized in standard operators, the
operator's definition written out: B packs, per output column n and block b of ``block_size``
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


@rule("MatMulNBits", domain="com.microsoft", differentiable=("A", "bias"), inputs=_NBITS_INPUTS, broadcast=("bias",))
def matmul_nbits(op, node, dY):
    """Y = A @ W + bias, W [K, N] the dequantized B."""
    return {"A": op.MatMul(dY, dequantized_nbits(op, node)), "bias": dY}


def dequantized_nbits(op, node):
    """The weight of a MatMulNBits node as a float [N, K] tensor (Wᵀ), in standard operators."""
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
    q = op.reshape(_unpacked(op, op.reshape(packed, [N, blocks, per_block]), [N, blocks, per_block], bits),
                   [N, blocks, block])
    if zero_points is None:
        zero = op.const(np.array(2 ** (bits - 1)), dtype=dtype)
    elif zero_points.dtype == dtype:
        zero = op.reshape(zero_points, [N, blocks, 1])
    else:  # packed like B, one value per block, padded to whole bytes per row
        per_row = -(-blocks * bits // 8)
        zero = op.Cast(_unpacked(op, op.reshape(zero_points, [N, per_row]), [N, per_row], bits), to=int(dtype))
        zero = op.reshape(op.slice(zero, [0], [blocks], axes=[1]), [N, blocks, 1])
    weight = op.Mul(op.Sub(op.Cast(q, to=int(dtype)), zero), op.reshape(scales, [N, blocks, 1]))
    weight = op.reshape(weight, [N, blocks * block])
    return weight if blocks * block == K else op.slice(weight, [0], [K], axes=[1])


def _unpacked(op, packed, dims, bits):
    """uint8 ``dims`` [..., m] holding 8/bits values a byte, low bits first -> uint8 [..., m · 8/bits]."""
    if bits == 8:
        return packed
    four = op.const(4, dtype=ir.DataType.UINT8)
    high = op.BitShift(packed, four, direction="RIGHT")
    low = op.Sub(packed, op.BitShift(high, four, direction="LEFT"))
    pairs = op.Concat(op.reshape(low, [*dims, 1]), op.reshape(high, [*dims, 1]), axis=-1)
    return op.reshape(pairs, [*dims[:-1], dims[-1] * 2])
