"""The loss attached to the forward model's output (:mod:`~onnx_autodiff.training.losses` builds it)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.toolkit import Namer
from onnx_autodiff.training.losses import LossSpec, attach_loss


@dataclasses.dataclass
class LossAttached(ir.passes.PassResult):
    """The scalar loss, the label inputs it reads (not yet graph inputs) and the model's outputs
    other than the loss."""

    loss: ir.Value
    labels: list[ir.Value]
    others: list[ir.Value]


class AttachLossPass(ir.passes.InPlacePass):
    """Appends the loss of ``spec`` to the model's nodes; the graph's inputs and outputs stay as
    they are (each model the build makes chooses its own)."""

    def __init__(self, spec: LossSpec, namer: Namer) -> None:
        super().__init__()
        self.spec = spec
        self.namer = namer

    def call(self, model: ir.Model) -> LossAttached:
        loss, labels, others = attach_loss(model, self.namer, self.spec)
        return LossAttached(model, True, loss, list(labels), list(others))
