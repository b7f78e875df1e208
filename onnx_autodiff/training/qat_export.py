"""The quantized model of a quantization-aware training run: its fake quantization frozen into the
QDQ form onnxruntime's quantizer writes (integer weights, constant scales and zero points), which
onnxruntime runs with its quantized kernels."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_autodiff.weights.quantized import nbits_packed


def frozen_quantization(proto: onnx.ModelProto, quantize_format: str = "dequantizelinear") -> onnx.ModelProto:
    """``proto`` (a fake-quantized model in evaluation form, its weights and observers' ranges
    set) with every value computed from initializers alone, except by DequantizeLinear, computed
    once and stored: the weights' QuantizeLinear become integer initializers read by their
    DequantizeLinear, the ranges' scales and zero points constants. Computed by onnx's reference
    implementation, whose arithmetic (float32, round half to even) is the runtime's.
    ``quantize_format`` "matmulnbits": MatMuls by a 4-bit weight in blocks become MatMulNBits."""
    graph = proto.graph
    constant = {t.name for t in graph.initializer}
    folded, kept = [], []
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type != "DequantizeLinear" and node.domain in ("", "ai.onnx") and all(i in constant for i in inputs) \
                and not any(attribute.type == onnx.AttributeProto.GRAPH for attribute in node.attribute):
            folded.append(node)
            constant.update(node.output)
        else:
            kept.append(node)
    read = {name for node in kept for name in node.input} | {v.name for v in graph.output}
    computed = [name for node in folded for name in node.output if name in read]
    if not computed:
        return proto
    sources = {name for node in folded for name in node.input}
    subgraph = onnx.helper.make_graph(folded, "constants", [], [onnx.helper.make_empty_tensor_value_info(n) for n in computed],
                                      [t for t in graph.initializer if t.name in sources])
    evaluator = ReferenceEvaluator(onnx.helper.make_model(subgraph, opset_imports=proto.opset_import,
                                                          ir_version=proto.ir_version))
    values = dict(zip(computed, evaluator.run(None, {})))
    frozen = onnx.ModelProto()
    frozen.CopyFrom(proto)
    del frozen.graph.node[:]
    frozen.graph.node.extend(kept)
    initializers = [t for t in graph.initializer if t.name in read]
    del frozen.graph.initializer[:]
    frozen.graph.initializer.extend(initializers)
    frozen.graph.initializer.extend(numpy_helper.from_array(values[name], name) for name in computed)
    stale = set(constant) - read
    _forget_types(frozen.graph, stale)
    inputs = [v for v in frozen.graph.input if v.name not in stale]  # (IR 3 lists initializers as inputs)
    del frozen.graph.input[:]
    frozen.graph.input.extend(inputs)
    _transposes_stored(frozen.graph)
    _blocked_gemms_as_matmuls(frozen.graph)
    if quantize_format == "matmulnbits":
        _as_matmulnbits(frozen)
    return frozen


def _as_matmulnbits(proto: onnx.ModelProto) -> None:
    """Each MatMul by a DequantizeLinear of a 2-D int4/uint4 initializer in blocks along axis 0
    (which nothing else reads) becomes onnxruntime's MatMulNBits of the same integers."""
    graph = proto.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers = _readers(graph)
    inits = {t.name: t for t in graph.initializer}
    nodes, dropped, reads, added = [], set(), set(), []
    for node in graph.node:
        read = producers.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        parts = [name for name in read.input if name] if read is not None and read.op_type == "DequantizeLinear" else []
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in read.attribute} if parts else {}
        stored = inits.get(parts[0]) if parts else None
        if stored is None or stored.data_type not in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) \
                or len(stored.dims) != 2 or attrs.get("axis") != 0 or not attrs.get("block_size") \
                or readers[node.input[1]] != 1 or any(p not in inits or readers[p] != 1 for p in parts):
            nodes.append(node)
            continue
        q = numpy_helper.to_array(stored).astype(np.int64)
        scale = numpy_helper.to_array(inits[parts[1]])
        zero = numpy_helper.to_array(inits[parts[2]]).astype(np.int64) if len(parts) > 2 else None
        signed = stored.data_type == onnx.TensorProto.INT4
        if zero is not None and signed:  # MatMulNBits' integers are unsigned: both shifted alike
            q, zero = q + 8, zero + 8
        elif zero is None and not signed:
            zero = np.zeros_like(scale, np.int64)
        K, N = q.shape
        block = attrs["block_size"]
        packed, zero_points = nbits_packed(q, zero, 4, block)
        name = stored.name
        inputs = [node.input[0], name, f"{name}.scales"]
        added += [numpy_helper.from_array(packed, name),
                  numpy_helper.from_array(np.ascontiguousarray(scale.T).reshape(-1), f"{name}.scales")]
        if zero_points is not None:
            inputs.append(f"{name}.zero_points")
            added.append(numpy_helper.from_array(zero_points.reshape(-1), f"{name}.zero_points"))
        dropped.update(parts)
        reads.add(read.output[0])
        nodes.append(onnx.helper.make_node("MatMulNBits", inputs, list(node.output), name=node.name or name,
                                           domain="com.microsoft", K=K, N=N, bits=4, block_size=block))
    if not dropped:
        return
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.node[:]
    graph.node.extend(n for n in nodes if not set(n.output) & reads)
    del graph.initializer[:]
    graph.initializer.extend([*kept, *added])
    _forget_types(graph, reads)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


def _readers(graph: onnx.GraphProto) -> dict[str, int]:
    """How many node inputs and graph outputs read each value."""
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for value in graph.output:
        readers[value.name] = readers.get(value.name, 0) + 1
    return readers


def _forget_types(graph: onnx.GraphProto, names: set[str]) -> None:
    """Drops the value_info of ``names`` (values gone, or whose stored shapes changed)."""
    info = [v for v in graph.value_info if v.name not in names]
    del graph.value_info[:]
    graph.value_info.extend(info)


def _store_transposed(read: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> None:
    """The 2-D initializers a DequantizeLinear ``read`` of a 2-D weight reads (integers, scales, zero
    points; a per-axis scale is 1-D and stays) stored transposed, its axis swapped: it gives the
    weight's transpose."""
    for name in read.input:
        if name:
            array = numpy_helper.to_array(inits[name])
            if array.ndim == 2:
                inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array.T), name))
    for attribute in read.attribute:
        if attribute.name == "axis":
            attribute.i = 1 - (attribute.i % 2)


def _transposes_stored(graph: onnx.GraphProto) -> None:
    """Each 2-D Transpose of a DequantizeLinear of initializers that nothing else reads is stored
    transposed instead (the integers, scales and zero points; the axis swapped): the weight read as
    the product reads it, which onnxruntime's kernels fuse."""
    producers = {out: node for node in graph.node for out in node.output}
    readers = _readers(graph)
    inits = {t.name: t for t in graph.initializer}
    dropped, renamed = set(), set()
    for node in graph.node:
        read = producers.get(node.input[0]) if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
        if read is None or read.op_type != "DequantizeLinear" or perm not in ([], [[1, 0]]) or readers[node.input[0]] != 1:
            continue
        stored = [name for name in read.input if name]
        if any(name not in inits or readers[name] != 1 for name in stored) or len(inits[stored[0]].dims) != 2:
            continue
        _store_transposed(read, inits)
        renamed.add(read.output[0])
        read.output[0] = node.output[0]
        dropped.add(id(node))
    if not dropped:
        return
    kept = [node for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    _forget_types(graph, renamed)


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or with a number appended where a node has it already; then taken."""
    fresh, number = name, 1
    while fresh in taken:
        fresh, number = f"{name}_{number}", number + 1
    taken.add(fresh)
    return fresh


def _blocked_gemms_as_matmuls(graph: onnx.GraphProto) -> None:
    """Each Gemm (transB=1, transA=0, alpha = beta = 1) whose weight a DequantizeLinear reads in
    blocks along its reduction axis becomes a MatMul by the transposed weight (blocks along axis 0)
    and an Add of its bias: the form onnxruntime fuses into MatMulNBits."""
    producers = {out: node for node in graph.node for out in node.output}
    readers = _readers(graph)
    inits = {t.name: t for t in graph.initializer}
    taken = {node.name for node in graph.node}
    nodes, transposed = [], set()
    for node in graph.node:
        read = producers.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) > 1 else None
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if read is None or read.op_type != "DequantizeLinear" or readers[node.input[1]] != 1 or attrs.get("transB") != 1 \
                or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            nodes.append(node)
            continue
        read_attrs = {a.name: onnx.helper.get_attribute_value(a) for a in read.attribute}
        stored = [name for name in read.input if name]
        if not read_attrs.get("block_size") or read_attrs.get("axis") != 1 or \
                any(name not in inits or readers[name] != 1 for name in stored):
            nodes.append(node)
            continue
        _store_transposed(read, inits)
        transposed.add(read.output[0])
        if len(node.input) > 2 and node.input[2]:
            product = f"{node.output[0]}_product"
            name = _fresh(f"{node.name or node.output[0]}_matmul", taken)
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], node.input[1]], [product], name=name))
            nodes.append(onnx.helper.make_node("Add", [product, node.input[2]], list(node.output), name=node.name))
        else:
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], node.input[1]], list(node.output), name=node.name))
    del graph.node[:]
    graph.node.extend(nodes)
    _forget_types(graph, transposed)  # (their shapes are the stored ones')
