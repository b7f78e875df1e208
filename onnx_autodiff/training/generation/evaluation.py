"""The eval model: [batch, labels, parameters, buffers] -> [loss, model outputs]. It is the forward
model and loss of the train model under the same names, cut out of the finished train model where it
can be (building it anew costs as much as converting, cleaning and checking the whole forward model
again), else built from the forward model in evaluation mode."""

from __future__ import annotations

import dataclasses

import onnx
import onnx_ir as ir

from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.passes.unused import optional_outputs
from onnx_autodiff.toolkit import OpBuilder, captured_values, proto_graphs
from onnx_autodiff.training.generation.finish import checked, finish
from onnx_autodiff.training.generation.loss import AttachLossPass
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.generation.roles import Roles, proto_default_opset
from onnx_autodiff.training.generation.training_mode import TrainingModePass
from onnx_autodiff.training.losses import LossSpec
from onnx_autodiff.training.manifest import Evaluation, Read
from onnx_autodiff.training.targets import Target


def prepared_alike(model: ir.Model, batchnorm_training: bool, target: Target) -> bool:
    """Whether the train model's forward ``model`` is the eval model's: no layer in training mode
    (BatchNormalization updating its statistics: ``batchnorm_training``; Dropout) and no target
    lowering the forward or the whole train model."""
    if batchnorm_training or target.lowers_training_forward:
        return False
    return not any(node.op_type == "Dropout" and node.domain in ("", "ai.onnx") for node in model.graph)


@dataclasses.dataclass
class EvalCut:
    """Where the eval model lies in a finished train model: the positions of the nodes that compute
    its outputs from its inputs, in the graph's order; the initializers they read; its inputs; its
    outputs as value_info."""

    positions: list[int]
    initializers: list[str]
    inputs: list[str]
    outputs: list[onnx.ValueInfoProto]

    @classmethod
    def find(cls, model: ir.Model, inputs: list[str], outputs: list[str]) -> EvalCut | None:
        """The cut of ``outputs`` from ``inputs`` in ``model``, or None where there is none: an output
        the cleanup replaced (its name gone) or a value read that is neither one of ``inputs`` nor an
        initializer."""
        graph = model.graph
        produced = {v.name: v for node in graph for v in node.outputs if v.name}
        values = [produced.get(name) for name in outputs]
        if any(v is None or v.type is None or v.shape is None for v in values):
            return None
        allowed = set(inputs)
        needed: set[ir.Node] = set()
        initializers: dict[str, None] = {}
        pending = [v.producer() for v in values]
        while pending:
            node = pending.pop()
            if node in needed:
                continue
            needed.add(node)
            for value in (*node.inputs, *captured_values(node)):
                if value is None:
                    continue
                producer = value.producer()
                if producer is not None:
                    pending.append(producer)
                elif value.is_initializer() and not value.is_graph_input():
                    initializers[value.name] = None
                elif value.name not in allowed:
                    return None
        positions = [i for i, node in enumerate(graph) if node in needed]
        return cls(positions, list(initializers), inputs, [ir.serde.serialize_value(v) for v in values])

    def model(self, proto: onnx.ModelProto, check_output: bool = False) -> onnx.ModelProto:
        """The eval model: the nodes of ``proto`` (the train model, written) at :attr:`positions`,
        with these inputs (``proto``'s of those names) and outputs, checked."""
        graph = proto.graph
        part = onnx.ModelProto(ir_version=proto.ir_version, producer_name=proto.producer_name,
                               producer_version=proto.producer_version, domain=proto.domain,
                               model_version=proto.model_version, doc_string=proto.doc_string)
        part.opset_import.extend(proto.opset_import)
        part.functions.extend(proto.functions)
        part.graph.name = graph.name
        nodes = graph.node
        part.graph.node.extend(nodes[i] for i in self.positions)
        by_name = {v.name: v for v in graph.input}
        part.graph.input.extend(by_name[name] for name in self.inputs)
        wanted = set(self.initializers)
        part.graph.initializer.extend(t for t in graph.initializer if t.name in wanted)
        part.graph.output.extend(self.outputs)
        _drop_unread_outputs(part.graph, proto_default_opset(part))
        return checked(part, "eval model", check_output)


def _drop_unread_outputs(graph: onnx.GraphProto, opset: int) -> None:
    """The optional outputs that only the backward read (LayerNormalization's statistics) left out
    of the nodes of ``graph``, as the cleanup of a model of its own leaves them out (Attention
    keeps its own, see the cleanup's removal)."""
    read = {v.name for v in graph.output}
    read.update(name for g in proto_graphs(graph) for node in g.node for name in node.input)
    for node in graph.node:
        if len(node.output) < 2 or node.domain not in ("", "ai.onnx") or node.op_type == "Attention":
            continue
        options = optional_outputs(node.op_type, opset)
        if options is None or len(options) < len(node.output):
            continue
        outputs = [name if name in read or not optional else "" for name, optional in zip(node.output, options)]
        while outputs and not outputs[-1]:
            outputs.pop()
        if outputs != list(node.output):
            del node.output[:]
            node.output.extend(outputs)


def eval_model(model: ir.Model, roles: Roles, loss_spec: LossSpec, target: Target,
               check_output: bool = False) -> tuple[onnx.ModelProto, Evaluation]:
    """The eval model built from the forward model ``model`` (changed in place), and its signature."""
    mode = TrainingModePass(roles, training=False)(model)
    graph = model.graph
    batch = [v for v in graph.inputs if v.name not in roles.state]
    reads = [v for v in graph.inputs if v.name in roles.state]
    attached = AttachLossPass(loss_spec, mode.namer)(model)
    loss = attached.loss
    outputs = Outputs(OpBuilder(default_opset(model), mode.namer, dict(model.opset_imports)), mode.namer)
    outputs.add_loss(loss)
    for value in attached.others:
        if value is not loss:
            outputs.add_as_is(value)
    graph.extend(outputs.op.nodes)
    # the names before the cleanup, which keeps the graph outputs' names but may replace their
    # values (a lowered loss node: the old value loses its name)
    output_names = [v.name for v in outputs.values]
    proto_out = finish(model, [*batch, *attached.labels, *reads], outputs.values, "eval model", target=target,
                       check_output=check_output)
    return proto_out, Evaluation(batch=tuple(v.name for v in (*batch, *attached.labels)),
                                 reads=tuple(Read(v.name, v.name) for v in reads), loss=output_names[0],
                                 outputs=tuple(output_names[1:]))

