"""The quantized model of a quantization-aware training run: its fake quantization frozen into the
QDQ form onnxruntime's quantizer writes (integer weights, constant scales and zero points), which
onnxruntime runs with its quantized kernels."""

from __future__ import annotations

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
    return frozen
