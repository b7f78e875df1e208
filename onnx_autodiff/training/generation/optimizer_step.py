"""The optimiser step of a train or apply model: the update of each parameter and its state from
its gradient, as outputs that replace their inputs at the next step."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.optimizers import Optimizer, coefficient_formulas, emit_update
from onnx_autodiff.training.targets import Target
from onnx_autodiff.training.values import fresh_value


@dataclasses.dataclass
class OptimizerStep(ir.passes.PassResult):
    """What the optimiser's nodes read besides the parameters and gradients: their state, and the
    scalars the trainer feeds (lr, the 1-based step, the coefficients by key); and ``kept``, True
    where the step counts (the loss and the gradients finite). None of them is a graph input yet:
    each model the build makes sets its inputs."""

    lr: ir.Value
    step: ir.Value
    states: list[list[ir.Value]]  # per parameter, in the spec's order of state names
    coefficients: dict[str, ir.Value]
    kept: ir.Value

    @property
    def state_inputs(self) -> list[ir.Value]:
        return [s for inputs in self.states for s in inputs]

    def scalars(self) -> dict[str, str]:
        """The scalar inputs by their key in the step's signature."""
        return {"lr": self.lr.name, "step": self.step.name, **{key: value.name for key, value in self.coefficients.items()}}


class OptimizerStepPass(ir.passes.InPlacePass):
    """Appends the update of ``params`` by ``grads`` (``spec``'s, grouped where ``target`` runs
    grouped updates, clipped by ``max_grad_norm``) to the model's nodes, emitted with ``outputs``'
    builder, and publishes the new parameters, then the new states, as carried outputs.

    ``lr``, ``step``: their inputs where the caller made them (else made here); ``state_names``:
    the state inputs' names per parameter (an apply model's, those of the train model); ``loss``:
    checked finite with the gradients.
    """

    def __init__(self, outputs: Outputs, spec: Optimizer, params: list[ir.Value], grads: list[ir.Value],
                 max_grad_norm: float | None, target: Target, lr: ir.Value | None = None, step: ir.Value | None = None,
                 state_names: list[list[str]] | None = None, loss: ir.Value | None = None) -> None:
        super().__init__()
        self.outputs = outputs
        self.spec = spec
        self.params = params
        self.grads = grads
        self.max_grad_norm = max_grad_norm
        self.target = target
        self.lr = lr
        self.step = step
        self.state_names = state_names
        self.loss = loss

    def call(self, model: ir.Model) -> OptimizerStep:
        outputs, params = self.outputs, self.params
        op, namer = outputs.op, outputs.namer
        lr = self.lr or fresh_value(namer, "lr", ir.DataType.FLOAT, [])
        step = self.step or fresh_value(namer, "step", ir.DataType.INT64, [])
        coefficients: dict[str, ir.Value] = {}
        states, new_params, new_states, kept = emit_update(op, self.spec, params, self.grads, lr, step, namer,
                                                           self.max_grad_norm, self.state_names, loss=self.loss,
                                                           coefficients=coefficients, group_limit=self.target.group_limit)
        for p, new_p in zip(params, new_params):
            outputs.add_carried(p, new_p)
        for inputs, news in zip(states, new_states):
            for s, new_s in zip(inputs, news):
                outputs.add_carried(s, new_s)
        outputs.add_nodes_to(model.graph)
        return OptimizerStep(model, True, lr, step, states, coefficients, kept)


def coefficient_signature(spec: Optimizer, keys) -> dict:
    """How the runner computes the coefficients of ``keys`` (:func:`~.optimizers.coefficient_formulas`)."""
    formulas = coefficient_formulas(spec)
    return {key: formulas[key] for key in keys}
