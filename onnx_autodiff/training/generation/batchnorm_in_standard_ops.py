"""BatchNormalization in training mode as standard ops, for the targets whose kernel lacks the mode
(``Target.batchnorm_in_standard_ops``: onnxruntime-web's WebGPU BatchNormalization, "trainingMode
is not supported yet")."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import Namer, OpBuilder, shapes


@dataclasses.dataclass
class StatisticsInStandardOps(ir.passes.PassResult):
    """The new running statistics by buffer name (the given ones, replaced where lowered)."""

    updates: dict[str, ir.Value]


class BatchNormInStandardOpsPass(ir.passes.InPlacePass):
    """Each BatchNormalization in training mode as standard ops.

    With μ and σ² the batch's mean and biased variance over every axis but 1 (the statistics of
    onnxruntime's CPU kernel): Y = (X − μ)/√(σ² + ε)·scale + B, running mean = mean·momentum +
    μ·(1 − momentum), running variance = var·momentum + σ²·(1 − momentum). The gradient rules then
    differentiate these ops (ReduceMean, Sub, Mul, Sqrt, Div) instead of BatchNormalization.
    ``updates``: the new statistics :class:`~.training_mode.TrainingModePass` found.
    """

    def __init__(self, namer: Namer, updates: dict[str, ir.Value]) -> None:
        super().__init__()
        self.namer = namer
        self.updates = updates

    def call(self, model: ir.Model) -> StatisticsInStandardOps:
        graph, namer = model.graph, self.namer
        replaced: dict[ir.Value, ir.Value] = {}
        for node in list(graph):
            if (node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx")
                    or shapes.attr(node, "training_mode", 0) != 1):
                continue
            x, scale, bias, mean, var = node.inputs[:5]
            r = shapes.rank(x)
            if r is None:
                raise TrainingError(f"BatchNormalization '{node.name}': the rank of its input is unknown (declare its shape)")
            epsilon, momentum = shapes.attr(node, "epsilon", 1e-5), shapes.attr(node, "momentum", 0.9)
            op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
            axes, per_channel = [0, *range(2, r)], [-1, *[1] * (r - 2)]
            batch_mean = op.reduce("ReduceMean", x, axes, keepdims=True)
            centred = op.Sub(x, batch_mean)
            batch_var = op.reduce("ReduceMean", op.Mul(centred, centred), axes, keepdims=True)
            normalised = op.Div(centred, op.Sqrt(op.Add(batch_var, float(epsilon))))
            channels = (lambda v: op.reshape(v, per_channel)) if r > 2 else (lambda v: v)
            y = op.Add(op.Mul(normalised, channels(scale)), channels(bias))
            new_mean = op.Add(op.Mul(mean, float(momentum)), op.Mul(op.reshape(batch_mean, [-1]), float(1 - momentum)))
            new_var = op.Add(op.Mul(var, float(momentum)), op.Mul(op.reshape(batch_var, [-1]), float(1 - momentum)))
            graph.insert_before(node, op.nodes)
            replaced.update(replace_node(graph, node, (y, new_mean, new_var)))
        updates = {name: replaced.get(value, value) for name, value in self.updates.items()}
        return StatisticsInStandardOps(model, bool(replaced), updates)


def replace_node(graph: ir.Graph, node: ir.Node, values) -> dict[ir.Value, ir.Value]:
    """Removes ``node``, its outputs replaced by ``values`` (already in the graph), under their
    names; returns {old output: its replacement}."""
    replaced = {}
    for old, new in zip(node.outputs, values):
        if old.is_graph_output():
            graph.outputs[:] = [new if out is old else out for out in graph.outputs]
        old.replace_all_uses_with(new)
        if old.name:  # the names of the node's outputs kept
            name, old.name = old.name, None
            new.name = name
        replaced[old] = new
    graph.remove(node, safe=True)
    return replaced
