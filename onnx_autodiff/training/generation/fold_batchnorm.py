"""BatchNormalization folded into the convolution before it, with its running statistics: the
deployed form, whose weight fake quantization then quantizes what inference multiplies by."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.toolkit import Namer, shapes
from onnx_autodiff.training.values import fresh_initializer


class FoldBatchNormPass(ir.passes.InPlacePass):
    """Folds each BatchNormalization that alone reads a Conv's output (or a ConvTranspose's of one
    group), where the statistics, scale, bias and the convolution's weight and bias are
    initializers: W' = W·γ/√(σ² + ε) along the output channels, b' = (b − μ)·γ/√(σ² + ε) + β. The
    weight keeps its name (a new one where another node reads it too); ``folded`` lists the
    BatchNormalization nodes' names."""

    def __init__(self) -> None:
        super().__init__()
        self.folded: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        namer = Namer.for_graph(graph, prefix="folded")
        for norm in list(graph):
            conv = _foldable(norm, graph)
            if conv is None:
                continue
            scale, bias, mean, var = (v.const_value.numpy().astype(np.float64) for v in norm.inputs[1:5])
            factor = scale / np.sqrt(var + shapes.attr(norm, "epsilon", 1e-5))
            weight = conv.inputs[1]
            w = weight.const_value.numpy()
            axis = 0 if conv.op_type == "Conv" else 1
            spread = [1] * w.ndim
            spread[axis] = -1
            folded_w = (w * factor.reshape(spread)).astype(w.dtype)
            old_bias = conv.inputs[2] if len(conv.inputs) > 2 else None
            b = old_bias.const_value.numpy().astype(np.float64) if old_bias is not None else np.zeros_like(mean)
            folded_b = ((b - mean) * factor + bias).astype(w.dtype)
            _set(graph, namer, conv, 1, folded_w, weight.name)
            if len(conv.inputs) < 3:
                conv.resize_inputs(3)
            _set(graph, namer, conv, 2, folded_b, old_bias.name if old_bias is not None else f"{conv.name or 'conv'}.bias")
            y, out = norm.outputs[0], conv.outputs[0]
            name = y.name
            y.replace_all_uses_with(out, replace_graph_outputs=True)
            statistics = list(norm.inputs[1:])
            graph.remove(norm, safe=True)
            out.name = name  # the model's value names stay (the folded convolution's output is the norm's)
            for value in statistics:
                if value is not None and value.is_initializer() and not value.uses():
                    graph.initializers.pop(value.name)
                    if value.is_graph_input():  # (an initializer listed as an input, as IR 3 models do)
                        graph.inputs.remove(value)
            self.folded.append(norm.name or "")
        return ir.passes.PassResult(model, modified=bool(self.folded))


def _foldable(norm: ir.Node, graph: ir.Graph) -> ir.Node | None:
    """The convolution ``norm`` folds into, or None."""
    if norm.op_type != "BatchNormalization" or norm.domain not in ("", "ai.onnx") or len(norm.inputs) < 5:
        return None
    if any(out.uses() or out.is_graph_output() for out in norm.outputs[1:]):
        return None
    x = norm.inputs[0]
    conv = x.producer() if x is not None else None
    if conv is None or conv.op_type not in ("Conv", "ConvTranspose") or conv.domain not in ("", "ai.onnx"):
        return None
    if conv.op_type == "ConvTranspose" and shapes.attr(conv, "group", 1) != 1:
        return None
    if len(x.uses()) != 1 or x.is_graph_output():
        return None
    constants = [*norm.inputs[1:5], *conv.inputs[1:3]]
    if any(v is not None and (not v.is_initializer() or v.const_value is None) for v in constants) or conv.inputs[1] is None:
        return None
    return conv


def _set(graph: ir.Graph, namer: Namer, node: ir.Node, index: int, array: np.ndarray, name: str) -> None:
    """``node``'s input ``index`` holds ``array``: the initializer it reads, where only it reads
    that one; else a new initializer."""
    value = node.inputs[index]
    if value is not None and value.is_initializer() and len(value.uses()) == 1:
        value.const_value = ir.Tensor(np.ascontiguousarray(array), name=value.name)
        value.shape = ir.Shape(array.shape)
        return
    node.replace_input_with(index, fresh_initializer(graph, namer, array, name))
