"""The gradients of the loss with respect to the parameters: the autodiff pass on the model whose
one output is the loss."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.errors import AutodiffError, NotDifferentiableError, TrainingError
from onnx_autodiff.passes.autodiff import AutodiffPass
from onnx_autodiff.toolkit.inference import fully_shaped


@dataclasses.dataclass
class Differentiated(ir.passes.PassResult):
    """The graph's outputs: the loss, then the gradient of each parameter in the order given."""

    loss: ir.Value
    grads: list[ir.Value]


class DifferentiatePass(ir.passes.InPlacePass):
    """Makes ``loss`` the graph's one output and ``labels`` inputs of it, and appends the gradients
    of ``loss`` with respect to ``params`` (graph inputs by name) as outputs.

    A parameter that the loss does not depend on is an error that says what to do; any other error
    of the autodiff pass is raised as the pass raised it, not wrapped in the PassErrors of the pass
    managers it runs.
    """

    def __init__(self, loss: ir.Value, labels: list[ir.Value], params: list[str], registry=None) -> None:
        super().__init__()
        self.loss = loss
        self.labels = labels
        self.params = params
        self.registry = registry

    def call(self, model: ir.Model) -> Differentiated:
        graph = model.graph
        graph.outputs.clear()
        graph.outputs.append(self.loss)
        graph.inputs.extend(self.labels)
        # upgrade_opset=False: build_proto_upgrading converts the forward model where a rule asks.
        # The forward model's shapes are onnx's inference of it (onnx_inferred): where the preparation
        # and the loss added no value, the pass's own inference would only find them again (0.55 s of
        # a 20,001-node chain's build), so it runs only where some value lacks a shape.
        autodiff = AutodiffPass(of=self.loss.name, wrt=self.params, registry=self.registry, seed="ones",
                                unreachable="raise", upgrade_opset=False, infer_shapes=not fully_shaped(graph))
        try:
            autodiff(model)
        except (ir.passes.PassError, AutodiffError) as error:
            raise _training_error(error) from error
        return Differentiated(model, True, graph.outputs[0], list(graph.outputs[1:]))


def _training_error(error: Exception) -> Exception:
    """The error behind ``error`` (an autodiff error wrapped in PassErrors), said for training."""
    cause = error
    while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, NotDifferentiableError) and "does not depend" in str(cause):
        return TrainingError(f"{cause}: list it in frozen_params, or leave it out of requires_grad")
    return cause
