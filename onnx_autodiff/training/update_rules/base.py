"""What an optimiser is: a class of its hyper-parameters that builds its update, registered by name
in :data:`OPTIMIZER_CLASSES`, the table that ``make_optimizer``, the manifest's JSON and its JSON
Schema and the command line's ``--optimizer`` read."""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir

from onnx_autodiff.toolkit import OpBuilder
from onnx_autodiff.toolkit.shapes import cast_like
from onnx_autodiff.training.registry import Registry


class Optimizer:
    """An optimiser: subclass it as a frozen dataclass whose fields are its hyper-parameters (the
    keys of its JSON in ``artifacts.json``, as torch.optim names them; ``lr`` among them, the
    trainers' default learning rate), with its ``name`` and its update, and register the class
    (:func:`register_optimizer`).

    Its update is elementwise, one parameter (or a group of them joined, of one dtype) at a time;
    the clipping, the finite check, the gate of a failed step and the grouping are the caller's
    (:func:`~onnx_autodiff.training.optimizers.emit_update`). Its hyper-parameters are constants
    of the graph; lr, the step and the coefficients are inputs of every step."""

    name: ClassVar[str]

    @classmethod
    def from_options(cls, **options) -> Optimizer:
        """An instance from options as JSON or the command line give them (checked by name already)."""
        return cls(**options)

    def state_names(self) -> list[str]:
        """The names of the state it keeps per parameter (each shaped like it; zeros at first)."""
        return []

    def coefficient_formulas(self) -> dict[str, list]:
        """The per-step scalars its update reads besides lr and step, by key, as the expressions
        the runner computes them by (:func:`~onnx_autodiff.training.optimizers.compile_coefficient`)."""
        return {}

    def update(self, op: OpBuilder, p: ir.Value, g: ir.Value, states: list[ir.Value],
               scalars: StepScalars) -> list[ir.Value]:
        """The new value of ``p`` and of each of its ``states`` (in :meth:`state_names`' order), from
        its gradient ``g`` (clipped already)."""
        raise NotImplementedError(f"{type(self).__name__} defines no update")


class StepScalars:
    """The scalars an update reads, each made once per dtype (a model may update float16 and
    float32 parameters): the inputs ``lr`` and the coefficients by key, the constants of the
    hyper-parameters; ``step`` is the 1-based step (int64)."""

    def __init__(self, op: OpBuilder, lr: ir.Value, step: ir.Value, coefficients) -> None:
        self.op = op
        self.lr = lr
        self.step = step
        self.coefficients = coefficients
        self._made: dict = {}

    def input(self, key: str, like: ir.Value) -> ir.Value:
        """"lr" or the coefficient of ``key`` in ``like``'s dtype (no Cast where it has it)."""
        value = self.lr if key == "lr" else self.coefficients[key]
        return self._once(key, like, lambda: cast_like(self.op, value, like))

    def literal(self, key: str, value: float, like: ir.Value) -> ir.Value:
        """A constant ``value`` in ``like``'s dtype, known by ``key``."""
        return self._once(key, like, lambda: self.op.const(value, like=like))

    def _once(self, key: str, like: ir.Value, make) -> ir.Value:
        if (key, like.dtype) not in self._made:
            self._made[(key, like.dtype)] = make()
        return self._made[(key, like.dtype)]


OPTIMIZER_CLASSES: Registry[type[Optimizer]] = Registry("optimizer")


def register_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """Registers ``cls`` under its ``name`` (a class decorator)."""
    return OPTIMIZER_CLASSES.register(cls.name, cls)
