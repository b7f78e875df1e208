"""The cleanup of the backward graph, as ``grad``'s: the optimiser's nodes added after it are
emitted clean (a second cleanup of the whole train model found nothing to do and took 28% of the
build)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.passes.cleanup import cleanup_passes
from onnx_autodiff.training.targets import Target


@dataclasses.dataclass
class CleanBackward(ir.passes.PassResult):
    """The loss and the gradients after the cleanup (which may replace the values of the graph's
    outputs), and the buffers' new statistics, kept through it."""

    loss: ir.Value
    grads: list[ir.Value]
    updates: dict[str, ir.Value]


class CleanBackwardPass(ir.passes.InPlacePass):
    """The cleanup, lowered for ``target``, of a model whose outputs are the loss and the gradients.

    ``updates``: the buffers' new statistics, by buffer name. Where the target computes them in
    standard ops no node reads them yet: they are graph outputs meanwhile, so that the cleanup
    keeps them (and may replace them, as it may the loss and the gradients).
    """

    def __init__(self, target: Target, updates: dict[str, ir.Value]) -> None:
        super().__init__()
        self.target = target
        self.updates = updates

    def call(self, model: ir.Model) -> CleanBackward:
        graph, updates = model.graph, self.updates
        unread = self.target.batchnorm_in_standard_ops and bool(updates)
        if unread:
            count = len(graph.outputs)
            graph.outputs.extend(updates.values())
        ir.passes.PassManager(cleanup_passes(target=self.target.lowering))(model)
        if unread:
            updates = dict(zip(updates, graph.outputs[count:]))
            del graph.outputs[count:]
        return CleanBackward(model, True, graph.outputs[0], list(graph.outputs[1:]), updates)
