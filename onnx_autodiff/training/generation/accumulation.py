"""Gradient accumulation: the accumulate model's step, each gradient added to its accumulator
(the apply model then steps by the sums: :mod:`.apply`)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.optimizers import joined, split_back, step_kept, update_groups, when_kept
from onnx_autodiff.training.targets import Target
from onnx_autodiff.training.values import dim_value, fresh_value


@dataclasses.dataclass
class Accumulation(ir.passes.PassResult):
    """The accumulators (one input per parameter, carried to the next micro-batch; no graph input
    yet) and ``kept``, True where the micro-batch counts (its loss and gradients finite)."""

    accumulators: list[ir.Value]
    kept: ir.Value


class AccumulationStepPass(ir.passes.InPlacePass):
    """Appends ``accumulator + gradient`` for each of ``params`` to the model's nodes, emitted with
    ``outputs``' builder (grouped where ``target`` runs grouped updates; the sums unchanged where
    the micro-batch does not count: ``loss`` or a gradient not finite), and publishes the sums as
    carried outputs."""

    def __init__(self, outputs: Outputs, params: list[ir.Value], grads: list[ir.Value], loss: ir.Value,
                 target: Target) -> None:
        super().__init__()
        self.outputs = outputs
        self.params = params
        self.grads = grads
        self.loss = loss
        self.target = target

    def call(self, model: ir.Model) -> Accumulation:
        outputs, params, grads = self.outputs, self.params, self.grads
        op, namer = outputs.op, outputs.namer
        groups = update_groups(params, self.target.group_limit)
        grad_groups = joined(op, groups, grads)  # read by the finite check and by the sums
        kept, _ = step_kept(op, grad_groups, self.loss)
        accs = [fresh_value(namer, f"{p.name}.grad_acc", g.dtype or p.dtype, [dim_value(x) for x in p.shape])
                for p, g in zip(params, grads)]
        acc_groups = joined(op, groups, accs)  # read by the sums, and what a failed step returns
        sums = split_back(op, groups, when_kept(op, kept, lambda op: [op.Add(a, g) for a, g in zip(acc_groups, grad_groups)],
                                                acc_groups), accs)
        for acc, new_acc in zip(accs, sums):
            outputs.add_carried(acc, new_acc)
        outputs.add_nodes_to(model.graph)
        return Accumulation(model, True, accs, kept)
