"""The forward model in training or evaluation mode, its parameters and buffers graph inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.toolkit import Namer
from onnx_autodiff.training.generation.roles import Roles
from onnx_autodiff.training.values import fresh_initializer


@dataclasses.dataclass
class TrainingMode(ir.passes.PassResult):
    """The namer of the values the build adds to the model, and the new running statistics of
    BatchNormalization in training mode, by the name of the buffer each replaces."""

    namer: Namer
    updates: dict[str, ir.Value]


class TrainingModePass(ir.passes.InPlacePass):
    """Sets each layer's mode: BatchNormalization whose statistics are buffers in training mode (its
    new statistics as outputs) or in inference mode, Dropout's training flag a constant; the
    parameters and buffers of ``roles`` become graph inputs (the trainer feeds them)."""

    def __init__(self, roles: Roles, training: bool) -> None:
        super().__init__()
        self.roles = roles
        self.training = training

    def call(self, model: ir.Model) -> TrainingMode:
        roles, training = self.roles, self.training
        graph = model.graph
        namer = Namer.for_graph(graph, prefix="train")
        updates: dict[str, ir.Value] = {}
        buffers = set(roles.buffers)
        for node in list(graph):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "BatchNormalization" and roles.opset >= 14:
                stat_inputs = [v.name if v is not None else None for v in node.inputs[3:5]]
                if not any(name in buffers for name in stat_inputs):
                    continue  # frozen statistics: inference mode in both models
                node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1 if training else 0)
                if training:
                    if len(node.outputs) < 3:
                        node.resize_outputs(3)
                    for name, out in zip(stat_inputs, node.outputs[1:3]):
                        if not out.name:
                            out.name = namer.fresh(f"{node.name or 'batchnorm'}_running")
                        if name in buffers:
                            if name in updates:
                                raise TrainingError(f"running statistic '{name}' is updated by two BatchNormalization nodes")
                            updates[name] = out
                elif len(node.outputs) > 1 and not any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
                    node.resize_outputs(1)
            elif node.op_type == "Dropout" and roles.opset >= 12:
                if len(node.inputs) < 3:
                    node.resize_inputs(3)
                if node.inputs[1] is None:
                    node.replace_input_with(1, fresh_initializer(graph, namer, np.array(0.5, np.float32), "dropout_ratio"))
                previous = node.inputs[2]
                node.replace_input_with(2, fresh_initializer(graph, namer, np.array(training), "dropout_training"))
                if previous is not None and previous in graph.inputs and not previous.uses():
                    graph.inputs.remove(previous)  # a training-mode flag input the artifacts now set
                if training and len(node.outputs) < 2:
                    node.resize_outputs(2)
                    node.outputs[1].name = namer.fresh(f"{node.name or 'dropout'}_mask")
        inputs = set(graph.inputs)  # (a set: a model may have thousands of parameters)
        for name in [*roles.params, *roles.buffers]:
            value = graph.initializers.pop(name)
            value.const_value = None
            if value not in inputs:
                graph.inputs.append(value)
                inputs.add(value)
        return TrainingMode(model, True, namer, updates)
