"""Frozen base weights in the shipped formats: quantized at build time (QLoRA), read back and
quantized again after merging.

A weight is the matrix W [K, N] that a MatMul or Gemm multiplies by (K the reduction axis); a
model may store it as Wᵀ [N, K] (torch's ``nn.Linear``), and its stored form keeps that layout.

- ``int8``: one scale per output column (per channel); symmetric int8 (scale = max|w| / 127),
  or asymmetric uint8 with a zero point.
- ``int4``: one scale per block of ``block_size`` rows of K; symmetric int4 (max|w| / 7) or
  asymmetric uint4.
- ``float16``: float16 storage.

Read through ``DequantizeLinear`` (int4 needs opset 21) or ``Cast`` in standard operators, or,
with ``format="matmulnbits"``, by onnxruntime's ``com.microsoft.MatMulNBits`` kernel in place of
the MatMul (its packing: per output column and block, the unsigned values low bits first, zero
point 2^(bits-1) when symmetric). Rounding is numpy's (half to even); every scale is float32 or
the weight's float type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.toolkit import Namer, shapes

KINDS = ("int4", "int8", "float16")
FORMATS = ("dequantizelinear", "matmulnbits")
BLOCK_SIZES = (16, 32, 64, 128, 256)
INT4_OPSET = 21  # DequantizeLinear of int4/uint4 with block_size
COLUMNS_AT_ONCE = 1 << 22  # weights quantized at once


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How to store frozen base weights: ``kind`` in :data:`KINDS`, ``format`` in :data:`FORMATS`."""

    kind: str
    format: str = "dequantizelinear"
    block_size: int = 32
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TrainingError(f"quantize_base must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.format not in FORMATS:
            raise TrainingError(f"quantize_format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if self.block_size not in BLOCK_SIZES:
            raise TrainingError(f"quantize_block must be one of {', '.join(map(str, BLOCK_SIZES))}, not {self.block_size!r}")
        if self.kind == "float16" and self.format == "matmulnbits":
            raise TrainingError("quantize_format 'matmulnbits' stores 4 or 8 bits: use quantize_base int4 or int8")

    @property
    def bits(self) -> int:
        return {"int4": 4, "int8": 8}.get(self.kind, 16)


def column_slices(K: int, N: int):
    """The slices of W [K, N]'s columns quantized at once: :data:`COLUMNS_AT_ONCE` weights each."""
    step = max(1, COLUMNS_AT_ONCE // max(K, 1))
    return [slice(start, min(N, start + step)) for start in range(0, N, step)]


def quantized(w: np.ndarray, bits: int, block: int, symmetric: bool, signed: bool = False, after_slice=None):
    """W [K, N] as (q [K, N] integers, scale [blocks, N], zero [blocks, N] or None), blocks of
    ``block`` rows (the last one may be shorter); ``w ≈ (q - zero) · scale`` row-block-wise.
    Symmetric: signed q, no zero point; else unsigned q (``signed``: signed) and a zero point.
    q is int8, or uint8 when unsigned; the columns are quantized :data:`COLUMNS_AT_ONCE` weights at
    a time in float64 (a weight's float64 copy would be twice its float32 size), ``after_slice()``
    called after each (a mapped weight's reader drops the pages read)."""
    K, N = w.shape
    blocks = -(-K // block)
    first = -(2 ** (bits - 1)) if symmetric or signed else 0
    q = np.empty((K, N), np.int8 if first < 0 else np.uint8)
    scale = np.empty((blocks, N), np.float64)
    zero = None if symmetric else np.empty((blocks, N), np.float64)
    for columns in column_slices(K, N):
        padded = np.zeros((blocks * block, columns.stop - columns.start), np.float64)
        padded[:K] = w[:, columns]
        tiles = padded.reshape(blocks, block, -1)
        if symmetric:
            top = 2 ** (bits - 1) - 1
            part = np.abs(tiles).max(axis=1) / top
            part[part == 0] = 1.0
            values = np.clip(np.rint(tiles / part[:, None]), -top - 1, top)
        else:
            last = first + 2 ** bits - 1
            low, high = np.minimum(tiles.min(axis=1), 0), np.maximum(tiles.max(axis=1), 0)
            part = (high - low) / (last - first)
            part[part == 0] = 1.0
            zero[:, columns] = np.clip(np.rint(first - low / part), first, last)
            values = np.clip(np.rint(tiles / part[:, None]) + zero[:, None, columns], first, last)
        scale[:, columns] = part
        q[:, columns] = values.reshape(blocks * block, -1)[:K]
        if after_slice is not None:
            after_slice()
    return q, scale, zero


def dequantized(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, block: int) -> np.ndarray:
    """The float64 W [K, N] of :func:`quantized`'s parts."""
    K = q.shape[0]
    rows = np.repeat(np.arange(scale.shape[0]), block)[:K]
    return (q - (0 if zero is None else zero[rows])) * scale[rows].astype(np.float64)


class QuantizedBase:
    """Writes one float weight's stored form into a graph and reads such forms back."""

    def __init__(self, graph: ir.Graph, namer: Namer, spec: Quantization, opsets: dict) -> None:
        self.graph, self.namer, self.spec, self.opsets = graph, namer, spec, opsets

    def store(self, weight: ir.Value, nodes: list[ir.Node], transposed: bool) -> ir.Value:
        """Replaces the float initializer ``weight``, which ``nodes`` multiply by (through its
        transpose when ``transposed``), with its quantized form; returns the stored initializer
        (named and marked as ``weight`` was)."""
        tensor = weight.const_value
        array = tensor.numpy()
        mapped = tensor.raw if isinstance(tensor, ir.ExternalTensor) else None
        drop = getattr(mmap, "MADV_DONTNEED", None)
        # a mapped weight's pages read so far leave the process after each slice (unmodified file
        # pages: read again from the page cache if needed), so no whole weight is resident at once
        after_slice = (lambda: mapped.madvise(drop)) if isinstance(mapped, mmap.mmap) and drop is not None else None
        stored = self._stored(weight, array, nodes, transposed, after_slice)
        del array
        if isinstance(tensor, ir.ExternalTensor):  # a float weight read from its file: its pages leave
            with contextlib.suppress(BufferError):  # this process once read (a whole model's would add
                tensor.release()                    # up), unless a view of them is still held elsewhere
        return stored

    def _stored(self, weight: ir.Value, array: np.ndarray, nodes: list[ir.Node], transposed: bool,
                after_slice=None) -> ir.Value:
        spec = self.spec
        w = array.T if transposed else array  # [K, N]
        if spec.format == "matmulnbits":
            return self._nbits(weight, w, nodes, after_slice)
        name, dtype = weight.name, weight.dtype
        if spec.kind == "float16":
            stored = self._initializer(name, array.astype(np.float16), weight)
            read = ir.Node("", "Cast", [stored], attributes=[ir.AttrInt64("to", int(dtype))], name=f"{name}.cast")
        else:
            block = w.shape[0] if spec.kind == "int8" else spec.block_size
            q, scale, zero = quantized(w, spec.bits, block, spec.symmetric, after_slice=after_slice)
            kind = {(4, True): ir.DataType.INT4, (4, False): ir.DataType.UINT4,
                    (8, True): ir.DataType.INT8, (8, False): ir.DataType.UINT8}[spec.bits, spec.symmetric]
            stored_layout = (lambda a: a.T) if transposed else (lambda a: a)
            if spec.kind == "int8":  # per channel: one scale per output column
                scale, zero = scale[0], None if zero is None else zero[0]
            q_tensor = ir.Tensor(stored_layout(q).astype(kind.numpy()), dtype=kind)
            stored = self._initializer(name, q_tensor, weight)
            inputs = [stored, self._initializer(f"{name}.scale", stored_layout(scale).astype(dtype.numpy()))]
            if zero is not None:
                inputs.append(self._initializer(f"{name}.zero_point",
                                                ir.Tensor(stored_layout(zero).astype(kind.numpy()), dtype=kind)))
            axis = (0 if transposed else 1) if spec.kind == "int8" else (1 if transposed else 0)
            attributes = [ir.AttrInt64("axis", axis)]
            if spec.kind == "int4":
                attributes.append(ir.AttrInt64("block_size", spec.block_size))
            read = ir.Node("", "DequantizeLinear", inputs, attributes=attributes, name=f"{name}.dequantize")
        out = read.outputs[0]
        out.name, out.dtype, out.shape = self.namer.fresh(f"{name}.dequantized"), dtype, ir.Shape(array.shape)
        ir.convenience.replace_all_uses_with(weight, out)
        self.graph.insert_before(self._first(nodes), read)
        return stored

    def _nbits(self, weight: ir.Value, w: np.ndarray, nodes: list[ir.Node], after_slice=None) -> ir.Value:
        spec, name, dtype = self.spec, weight.name, weight.dtype
        if any(node.op_type != "MatMul" for node in nodes):
            kinds = sorted({node.op_type for node in nodes} - {"MatMul"})
            raise TrainingError(f"quantize_format 'matmulnbits' replaces MatMul nodes; '{name}' is also read by "
                                f"{', '.join(kinds)}: use quantize_format 'dequantizelinear'")
        K, N = w.shape
        bits, block = spec.bits, spec.block_size
        packed, scale, zero = nbits_parts(w, bits, block, spec.symmetric, after_slice)
        stored = self._initializer(name, packed, weight)
        inputs = [None, stored, self._initializer(f"{name}.scales", scale.astype(dtype.numpy()))]
        if zero is not None:
            inputs.append(self._initializer(f"{name}.zero_points", zero))
        self.opsets.setdefault("com.microsoft", 1)
        for node in nodes:
            read = node
            x = read.inputs[0]
            attributes = [ir.AttrInt64("K", K), ir.AttrInt64("N", N), ir.AttrInt64("bits", bits),
                          ir.AttrInt64("block_size", block)]
            kernel = ir.Node("com.microsoft", "MatMulNBits", [x, *inputs[1:]], attributes=attributes,
                             name=self.namer.fresh(f"{node.name or name}.nbits"))
            old, new = read.outputs[0], kernel.outputs[0]
            new.dtype = old.dtype or dtype
            new.shape = old.shape or (ir.Shape([*x.shape[:-1], N]) if x.shape is not None else None)
            self.graph.insert_before(read, kernel)
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            self.graph.remove(read, safe=True)
            old.name, new.name = None, old.name
        _drop_unused(self.graph, weight)
        return stored

    def _initializer(self, hint: str, data, like: ir.Value | None = None) -> ir.Value:
        tensor = data if isinstance(data, ir.Tensor) else ir.Tensor(np.ascontiguousarray(data))
        if like is not None:  # the stored form takes the float weight's place, name and marks
            self.graph.initializers.pop(like.name)
            metadata = dict(like.metadata_props)
            value = ir.Value(name=like.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape),
                             const_value=tensor)
            like.name = self.namer.fresh(f"{hint}.float")
            value.metadata_props.update(metadata)
        else:
            value = ir.Value(name=self.namer.fresh(hint), type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape),
                             const_value=tensor)
        self.graph.register_initializer(value)
        return value

    def _first(self, nodes: list[ir.Node]) -> ir.Node:
        """The first node of the graph that reads a value of ``nodes``' weight (a Transpose before them)."""
        wanted = set(nodes)
        for node in self.graph:
            if node in wanted or any(u in wanted for out in node.outputs for u, _ in out.uses()):
                return node
        raise TrainingError("a LoRA target's reads are not in the graph (a bug, please report)")


def _drop_unused(graph: ir.Graph, weight: ir.Value) -> None:
    """Removes the Transposes left reading nothing but dead ends from the replaced float weight."""
    for user, _ in list(weight.uses()):
        if user.op_type == "Transpose" and not user.outputs[0].uses():
            graph.remove(user, safe=True)


def _packed(values: np.ndarray, bits: int, pad: bool = False) -> np.ndarray:
    """Unsigned ``bits``-bit integers [..., m] as uint8 bytes, low bits first ([..., m · bits / 8];
    ``pad``: an odd last axis is padded to whole bytes)."""
    values = values.astype(np.uint8)
    if bits == 8:
        return values
    if values.shape[-1] % 2:
        if not pad:
            raise TrainingError("a 4-bit block must hold an even number of values (a bug, please report)")
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


# (domain, op type) of the nodes that read a weight in a stored form -> the input holding it
STORED_INPUT = {("com.microsoft", "MatMulNBits"): 1, ("", "DequantizeLinear"): 0, ("", "Cast"): 0}
_HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def frozen_bases(graph: ir.Graph) -> dict[str, ir.Node]:
    """The initializers of ``graph`` that hold a weight in a stored form, each with the first node
    reading that form (its op type names the form): a MatMulNBits' packed weight, the data of a
    DequantizeLinear, a float16/bfloat16 weight read through Cast."""
    found = {}
    for node in graph:
        position = STORED_INPUT.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
        stored = node.inputs[position] if position is not None and len(node.inputs) > position else None
        if stored is None or not stored.is_initializer() or stored.const_value is None:
            continue
        if node.op_type == "Cast" and stored.dtype not in _HALF_TYPES:
            continue
        found.setdefault(stored.name, node)
    return found


def stored_weight(model: ir.Model, stored: str, base: str) -> np.ndarray:
    """The float64 matrix a frozen base ``stored`` holds: in its stored layout for a
    DequantizeLinear or Cast base, W [K, N] for a MatMulNBits one."""
    value = model.graph.initializers[stored]
    node = next(user for user, _ in value.uses())
    if base == "Cast":
        return value.const_value.numpy().astype(np.float64)
    if base == "DequantizeLinear":
        q = value.const_value.numpy().astype(np.int64)
        scale = node.inputs[1].const_value.numpy().astype(np.float64)
        zero = (node.inputs[2].const_value.numpy().astype(np.int64)
                if len(node.inputs) > 2 and node.inputs[2] is not None else 0)
        axis, block = shapes.attr(node, "axis", 1) % q.ndim, shapes.attr(node, "block_size", 0)
        if block:
            scale = np.repeat(scale, block, axis=axis).take(range(q.shape[axis]), axis=axis)
            zero = zero if np.isscalar(zero) else np.repeat(zero, block, axis=axis).take(range(q.shape[axis]), axis=axis)
        elif scale.ndim == 1:
            shape = [1] * q.ndim
            shape[axis] = -1
            scale = scale.reshape(shape)
            zero = zero if np.isscalar(zero) else zero.reshape(shape)
        return (q - zero) * scale
    K, N = shapes.attr(node, "K", None), shapes.attr(node, "N", None)
    bits, block = shapes.attr(node, "bits", 4), shapes.attr(node, "block_size", None)
    blocks = -(-K // block)
    q = _unpacked(value.const_value.numpy().reshape(N, -1), bits)[:, : blocks * block]  # [N, K']
    scale = node.inputs[2].const_value.numpy().astype(np.float64).reshape(N, blocks)
    zero_points = node.inputs[3] if len(node.inputs) > 3 else None
    if zero_points is None:
        zero = np.full((N, blocks), 2 ** (bits - 1))
    elif zero_points.dtype == node.inputs[2].dtype:
        zero = zero_points.const_value.numpy().astype(np.float64).reshape(N, blocks)
    else:
        zero = _unpacked(zero_points.const_value.numpy().reshape(N, -1), bits)[:, :blocks]
    w = (q.reshape(N, blocks, block) - zero[..., None]) * scale[..., None]
    return w.reshape(N, blocks * block)[:, :K].T


def requantized(model: ir.Model, stored: str, base: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """The tensors of the frozen base ``stored`` (its data, scales and zero points, by name) that
    store ``w`` (laid out as :func:`stored_weight` gives it) in the same scheme: the same types,
    axis, block size, and symmetric when the base has no zero point."""
    value = model.graph.initializers[stored]
    node = next(user for user, _ in value.uses())
    if base == "Cast":
        return {stored: w.astype(value.dtype.numpy())}
    if base == "DequantizeLinear":
        axis, block = shapes.attr(node, "axis", 1) % 2, shapes.attr(node, "block_size", 0)
        kind = value.dtype
        bits = 4 if kind in (ir.DataType.INT4, ir.DataType.UINT4) else 8
        has_zero = len(node.inputs) > 2 and node.inputs[2] is not None
        signed = kind in (ir.DataType.INT4, ir.DataType.INT8)
        if not has_zero and not signed:
            raise TrainingError(f"re-quantizing '{stored}': an unsigned base without zero points is not supported; "
                                "export(merge=False) keeps the adapters apart")
        # quantized() groups down the rows: a per-axis scale runs along axis, a block across it
        columns = w if (axis == 0) == bool(block) else w.T
        q, scale, zero = quantized(columns, bits, block or columns.shape[0], not has_zero, signed)
        back = (lambda a: a) if (axis == 0) == bool(block) else (lambda a: a.T)
        scale_value = node.inputs[1]
        if not block:
            scale, zero = scale[0], None if zero is None else zero[0]
        parts = {stored: back(q).astype(kind.numpy()),
                 scale_value.name: back(scale).astype(scale_value.dtype.numpy()).reshape(scale_value.const_value.shape)}
        if has_zero:
            zero_value = node.inputs[2]
            zero = np.zeros_like(scale) if zero is None else zero
            parts[zero_value.name] = back(zero).astype(zero_value.dtype.numpy()).reshape(zero_value.const_value.shape)
        return parts
    K, N = shapes.attr(node, "K", None), shapes.attr(node, "N", None)
    bits, block = shapes.attr(node, "bits", 4), shapes.attr(node, "block_size", None)
    zero_points = node.inputs[3] if len(node.inputs) > 3 else None
    if zero_points is not None and zero_points.dtype != ir.DataType.UINT8:
        raise TrainingError(f"re-quantizing '{stored}': float zero points are not supported; export(merge=False) "
                            "keeps the adapters apart")
    packed, scale, zero = nbits_parts(w, bits, block, zero_points is None)
    scales = node.inputs[2]
    parts = {stored: packed.reshape(value.const_value.shape),
             scales.name: scale.reshape(scales.const_value.shape).astype(scales.dtype.numpy())}
    if zero is not None:
        parts[zero_points.name] = zero.reshape(zero_points.const_value.shape)
    return parts


def nbits_parts(w: np.ndarray, bits: int, block: int, symmetric: bool, after_slice=None):
    """W [K, N] as MatMulNBits stores it: (packed B [N, blocks, block · bits / 8] uint8, scales
    [N · blocks] float64, packed zero points or None when ``symmetric``); a slice of columns at a
    time (B's rows), as :func:`quantized`."""
    K, N = w.shape
    blocks = -(-K // block)
    packed = np.empty((N, blocks, block * bits // 8), np.uint8)
    scales = np.empty((N, blocks), np.float64)
    zero_points = None if symmetric else np.empty((N, -(-blocks * bits // 8)), np.uint8)
    for columns in column_slices(K, N):
        q, scale, zero = quantized(w[:, columns], bits, block, symmetric)
        packed[columns], packed_zero = nbits_packed(q, zero, bits, block)
        if zero is not None:
            zero_points[columns] = packed_zero
        scales[columns] = scale.T
        if after_slice is not None:
            after_slice()
    return packed, scales.reshape(-1), zero_points


def nbits_packed(q: np.ndarray, zero: np.ndarray | None, bits: int, block: int):
    """Integers q [K, N] in blocks of ``block`` rows as MatMulNBits stores them: (packed B [N,
    blocks, block · bits / 8] uint8, packed zero points [N, ·] or None). Without ``zero`` q is
    signed, the kernel's default zero point 2^(bits−1) added; with ``zero`` [blocks, N] both are
    unsigned. The padding rows of a short last block dequantize to 0."""
    K, N = q.shape
    blocks = -(-K // block)
    offset = 2 ** (bits - 1) if zero is None else 0  # symmetric: the kernel's default zero point
    padded = np.full((blocks * block, N), offset, np.int16)
    padded[:K] = q
    padded[:K] += offset
    zero_points = None
    if zero is not None:
        padded[K:] = np.repeat(zero, block, axis=0)[K:]
        zero_points = _packed(zero.T.astype(np.int64), bits, pad=True)
    return _packed(padded.T.reshape(-1, blocks, block), bits), zero_points


def _unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes [..., m] -> their unsigned ``bits``-bit values [..., m · 8 / bits], low bits first."""
    packed = packed.astype(np.int64)
    if bits == 8:
        return packed
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def nbits_read_as_dequantizelinear(graph: ir.Graph) -> tuple[list[str], dict[str, str]]:
    """Each ``com.microsoft.MatMulNBits`` node of ``graph`` becomes its definition in standard
    operators, reading the same bytes: ``MatMul(A, Transpose(DequantizeLinear(B, scales,
    zero_points, axis=1, block_size)))`` (plus its bias), B seen as the [N, K] unsigned 4- or
    8-bit tensor it packs (ONNX packs 4-bit values as MatMulNBits does: two a byte, low bits
    first), the zero points those given or 2^(bits-1). Needs opset 21 (DequantizeLinear with
    block_size).

    onnxruntime then holds the weights once: its MatMulNBits kernel keeps a pre-packed copy of
    them beside the bytes that a backward reads, which a DequantizeLinear read does not, for a
    dequantization at each read. Returns the names of the initializers the DequantizeLinear nodes
    read, and {node name: why it stays} for the nodes left as they are (act-order g_idx, float
    zero points, K not a whole number of blocks, stored parts that are not initializers)."""
    nodes = [n for n in graph if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    whys = {node: _why_kept(node) for node in nodes}
    kept = {node.name or node.inputs[1].name: why for node, why in whys.items() if why is not None}
    converted = {node for node, why in whys.items() if why is None}
    done = {}
    namer = Namer.for_graph(graph, prefix="nbits") if converted else None
    for node in nodes:
        if node not in converted:
            continue
        A, B, scales, zero_points, _, bias = (list(node.inputs) + [None] * 6)[:6]
        K, N = shapes.attr(node, "K", None), shapes.attr(node, "N", None)
        bits, block = shapes.attr(node, "bits", 4), shapes.attr(node, "block_size", None)
        key = (B, scales, zero_points, bits, block)
        if key not in done:
            done[key] = _as_dequantizelinear_inputs(graph, namer, converted, B, scales, zero_points, N, K, bits, block)
        floats = ir.node("DequantizeLinear", done[key], attributes={"axis": 1, "block_size": block})
        transposed = ir.node("Transpose", floats.outputs, attributes={"perm": [1, 0]})
        product = ir.node("MatMul", [A, transposed.outputs[0]])
        added = [product] if bias is None else [product, ir.node("Add", [product.outputs[0], bias])]
        new_nodes = [floats, transposed, *added]
        for made, hint in zip(new_nodes, ("dequantized", "transposed", "product", "biased")):
            made.outputs[0].name = namer.fresh(f"{B.name}.{hint}")
        floats.outputs[0].dtype, floats.outputs[0].shape = scales.dtype, ir.Shape([N, K])
        transposed.outputs[0].dtype, transposed.outputs[0].shape = scales.dtype, ir.Shape([K, N])
        old, new = node.outputs[0], added[-1].outputs[0]
        new.type, new.shape = old.type, old.shape
        graph.insert_before(node, new_nodes)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        old.name, new.name = None, old.name
        if bias is not None:
            product.outputs[0].dtype = old.dtype
    return [v.name for inputs in done.values() for v in inputs], kept


def _why_kept(node: ir.Node) -> str | None:
    """Why standard operators cannot read the MatMulNBits ``node``'s weights as stored (None: they can)."""
    _, B, scales, zero_points, g_idx, _ = (list(node.inputs) + [None] * 6)[:6]
    K, N = shapes.attr(node, "K", None), shapes.attr(node, "N", None)
    bits, block = shapes.attr(node, "bits", 4), shapes.attr(node, "block_size", None)
    if g_idx is not None:
        return "act-order g_idx"
    if bits not in (4, 8) or K is None or N is None or not block:
        return f"{bits}-bit weights"
    if K % block:
        return f"K={K} is not a whole number of blocks of {block}"
    if zero_points is not None and zero_points.dtype != ir.DataType.UINT8:
        return "float zero points"
    if not all(v.is_initializer() and v.const_value is not None for v in (B, scales, zero_points) if v is not None):
        return "its weights are not initializers"
    return None


def _as_dequantizelinear_inputs(graph: ir.Graph, namer: Namer, converted: set[ir.Node], B: ir.Value, scales: ir.Value,
                                zero_points: ir.Value | None, N: int, K: int, bits: int, block: int) -> list[ir.Value]:
    """MatMulNBits' B, scales and zero points as DequantizeLinear's [N, K], [N, blocks] and
    [N, blocks]: B's and the scales' bytes as they are (a tensor stored in a file stays there),
    the zero points unpacked from their padded rows, or 2^(bits-1)."""
    kind = ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8
    blocks = K // block
    data = _retyped(graph, namer, converted, B, kind, [N, K])
    values = [data, _retyped(graph, namer, converted, scales, scales.dtype, [N, blocks])]
    if zero_points is None:
        zero = np.full((N, blocks), 2 ** (bits - 1), np.uint8)
        name = namer.fresh(f"{data.name}.zero_point")
        return [*values, _initializer_named(graph, name, ir.Tensor(zero.astype(kind.numpy()), dtype=kind))]
    zero = _unpacked(zero_points.const_value.numpy().reshape(N, -1), bits)[:, :blocks]
    return [*values, _taking_over(graph, namer, converted, zero_points, ir.Tensor(zero.astype(kind.numpy()), dtype=kind))]


def _initializer_named(graph: ir.Graph, name: str, tensor) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape), const_value=tensor)
    graph.register_initializer(value)
    return value


def _taking_over(graph: ir.Graph, namer: Namer, converted: set[ir.Node], value: ir.Value, tensor) -> ir.Value:
    """A new initializer of ``tensor`` that takes the initializer ``value``'s name and marks where
    the ``converted`` MatMulNBits nodes alone read ``value`` (the tensors of the model's own form
    keep their names: a merge's re-quantized tensors find them), one named after it otherwise."""
    only_converted = all(user in converted for user, _ in value.uses())
    name = value.name if only_converted else namer.fresh(f"{value.name}.{tensor.dtype.name.lower()}")
    if only_converted:  # (value keeps its name: renaming it would rename the tensor it wraps, the caller's)
        graph.initializers.pop(value.name)
    new = _initializer_named(graph, name, tensor)
    if only_converted:
        new.metadata_props.update(value.metadata_props)
    return new


def _retyped(graph: ir.Graph, namer: Namer, converted: set[ir.Node], value: ir.Value, dtype: ir.DataType,
             shape: list[int]) -> ir.Value:
    """The initializer ``value``'s bytes as a tensor of ``dtype`` and ``shape`` (see :func:`_taking_over`)."""
    tensor = value.const_value
    if isinstance(tensor, ir.ExternalTensor):
        retyped = ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, dtype, shape=ir.Shape(shape),
                                    name=tensor.name, base_dir=tensor.base_dir)
    elif dtype in (ir.DataType.UINT4, ir.DataType.INT4):
        retyped = ir.PackedTensor(np.frombuffer(tensor.tobytes(), np.uint8), dtype, shape=shape)
    else:
        retyped = ir.Tensor(tensor.numpy().reshape(shape))
    return _taking_over(graph, namer, converted, value, retyped)


def as_read(tensor: onnx.TensorProto, part: np.ndarray) -> onnx.TensorProto:
    """A MatMulNBits part (B, scales or zero points, as :func:`requantized` gives them) as the
    tensor ``tensor`` of the same name that :func:`nbits_read_as_dequantizelinear` made of it
    reads it: its type and shape, 4-bit values unpacked from the rows they pad and packed again."""
    dims = list(tensor.dims)
    if tensor.data_type in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4):
        rows = _unpacked(part.reshape(dims[0], -1), 4)[:, : dims[1]]
        packed = _packed(rows.reshape(-1), 4, pad=True)
        return onnx.helper.make_tensor(tensor.name, tensor.data_type, dims, packed.tobytes(), raw=True)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return onnx.numpy_helper.from_array(part.reshape(dims).astype(dtype), tensor.name)
