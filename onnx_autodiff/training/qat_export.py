"""The quantized model of a quantization-aware training run: its fake quantization frozen into the
QDQ form onnxruntime's quantizer writes (integer weights, constant scales and zero points), which
onnxruntime runs with its quantized kernels."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator


def frozen_quantization(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` (a fake-quantized model in evaluation form, its weights and observers' ranges
    set) with every value computed from initializers alone, except by DequantizeLinear, computed
    once and stored: the weights' QuantizeLinear become integer initializers read by their
    DequantizeLinear, the ranges' scales and zero points constants. Computed by onnx's reference
    implementation, whose arithmetic (float32, round half to even) is the runtime's."""
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
    kept_info = [v for v in frozen.graph.value_info if v.name not in stale]
    del frozen.graph.value_info[:]
    frozen.graph.value_info.extend(kept_info)
    _blocked_gemms_as_matmuls(frozen.graph)
    return frozen


def _blocked_gemms_as_matmuls(graph: onnx.GraphProto) -> None:
    """Each Gemm (transB=1, transA=0, alpha = beta = 1) whose weight a DequantizeLinear reads in
    blocks along its reduction axis becomes a MatMul by the transposed weight (blocks along axis 0)
    and an Add of its bias: the form onnxruntime fuses into MatMulNBits."""
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    inits = {t.name: t for t in graph.initializer}
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
        for name in stored:
            inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(inits[name]).T), name))
        for attribute in read.attribute:
            if attribute.name == "axis":
                attribute.i = 0
        transposed.add(read.output[0])
        if len(node.input) > 2 and node.input[2]:
            product = f"{node.output[0]}_product"
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], node.input[1]], [product], name=f"{node.name}_matmul"))
            nodes.append(onnx.helper.make_node("Add", [product, node.input[2]], list(node.output), name=node.name))
        else:
            nodes.append(onnx.helper.make_node("MatMul", [node.input[0], node.input[1]], list(node.output), name=node.name))
    del graph.node[:]
    graph.node.extend(nodes)
    info = [v for v in graph.value_info if v.name not in transposed]  # (their shapes are the stored ones')
    del graph.value_info[:]
    graph.value_info.extend(info)
