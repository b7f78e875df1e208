"""Dropout in training mode as a hash of the step and the micro-batch, for the targets whose kernels
lack the mode (``Target.hashed_dropout``): every runtime then draws the same masks, the Python
Trainer's on onnxruntime's CPU the browser's."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.passes.rewrite_rules.webgpu import dropout_key, dropout_tables, hashed_dropout
from onnx_autodiff.toolkit import Namer, OpBuilder, shapes
from onnx_autodiff.training.generation.batchnorm_in_standard_ops import replace_node
from onnx_autodiff.training.values import fresh_initializer, fresh_value

# The scalar inputs of the hashed Dropout, by their key in the signatures' scalars, and how the
# trainer computes them from the step it takes and the micro-batch it accumulates (0 for a train step)
DROPOUT_SEEDS = {"dropout_step": "step", "dropout_micro_batch": "micro_batch"}


@dataclasses.dataclass
class HashedDropout(ir.passes.PassResult):
    """The uint32 scalar inputs the masks read, by key (:data:`DROPOUT_SEEDS`), already graph
    inputs; none without a Dropout in training mode."""

    seeds: dict[str, ir.Value]


class HashedDropoutPass(ir.passes.InPlacePass):
    """Each Dropout in training mode as :func:`~onnx_autodiff.passes.rewrite_rules.webgpu.hashed_dropout`."""

    def __init__(self, namer: Namer) -> None:
        super().__init__()
        self.namer = namer

    def call(self, model: ir.Model) -> HashedDropout:
        graph, namer = model.graph, self.namer
        dropouts = [node for node in graph if node.op_type == "Dropout" and node.domain in ("", "ai.onnx")
                    and len(node.inputs) > 2 and _constant_true(node.inputs[2])]
        if not dropouts:
            return HashedDropout(model, False, {})
        for node in dropouts:
            if node.inputs[0].dtype is None:
                raise TrainingError(f"Dropout '{node.name}': the type of its input is unknown (declare it in the model)")
        seeds = {key: fresh_value(namer, key, ir.DataType.UINT32, []) for key in DROPOUT_SEEDS}
        graph.inputs.extend(seeds.values())
        tables = [fresh_initializer(graph, namer, table, "dropout_table") for table in dropout_tables()]
        op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
        key = dropout_key(op, seeds["dropout_step"], seeds["dropout_micro_batch"], tables)
        graph.insert_before(dropouts[0], op.nodes)
        for salt, node in enumerate(dropouts):
            op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
            y, mask = hashed_dropout(op, node.inputs[0], node.inputs[1], key, salt, tables)
            graph.insert_before(node, op.nodes)
            replace_node(graph, node, (y, mask))
        return HashedDropout(model, True, seeds)


def _constant_true(value: ir.Value | None) -> bool:
    fixed = shapes.constant(value) if value is not None else None
    return fixed is not None and bool(fixed.item())
