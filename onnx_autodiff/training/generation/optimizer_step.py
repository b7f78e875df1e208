"""The optimiser step of a train or apply model: the update of each parameter and its state from
its gradient, as outputs that replace their inputs at the next step."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.optimizers import coefficient_formulas, emit_update
from onnx_autodiff.training.targets import Target
from onnx_autodiff.training.values import fresh_value


@dataclasses.dataclass
class OptimizerStep:
    """What the optimiser's nodes read besides the parameters and gradients: their state, and the
    scalars the trainer feeds (lr, the 1-based step, the coefficients by key); and ``kept``, True
    where the step counts (the loss and the gradients finite)."""

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


def optimizer_step(outputs: Outputs, spec, params: list[ir.Value], grads: list[ir.Value], max_grad_norm,
                   target: Target, lr: ir.Value | None = None, step: ir.Value | None = None,
                   state_names: list[list[str]] | None = None, loss: ir.Value | None = None) -> OptimizerStep:
    """Emits the update of ``params`` by ``grads`` with ``outputs``' builder and publishes the new
    parameters, then the new states, as carried outputs. ``lr``, ``step``: their inputs where the
    caller made them (else made here); ``state_names``: the state inputs' names per parameter (an
    apply model's, those of the train model); ``loss``: checked finite with the gradients."""
    op, namer = outputs.op, outputs.namer
    lr = lr or fresh_value(namer, "lr", ir.DataType.FLOAT, [])
    step = step or fresh_value(namer, "step", ir.DataType.INT64, [])
    coefficients: dict[str, ir.Value] = {}
    states, new_params, new_states, kept = emit_update(op, spec, params, grads, lr, step, namer, max_grad_norm,
                                                       state_names, loss=loss, coefficients=coefficients,
                                                       group_limit=target.group_limit)
    for p, new_p in zip(params, new_params):
        outputs.add_carried(p, new_p)
    for inputs, news in zip(states, new_states):
        for s, new_s in zip(inputs, news):
            outputs.add_carried(s, new_s)
    return OptimizerStep(lr, step, states, coefficients, kept)


def coefficient_signature(spec, keys) -> dict:
    """How the runner computes the coefficients of ``keys`` (:func:`~.optimizers.coefficient_formulas`)."""
    formulas = coefficient_formulas(spec)
    return {key: formulas[key] for key in keys}
