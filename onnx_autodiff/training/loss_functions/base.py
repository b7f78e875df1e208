"""What a built-in loss is: a function registered by name in :data:`BUILTIN_LOSSES` (the table that
``loss="name"``, ``LOSSES`` and the command line's ``--loss`` read), given the :class:`Attachment`
it builds with and the model's output; and the readers of the output that several losses share."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import onnx
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError, TrainingOpsetError
from onnx_autodiff.toolkit import Namer, OpBuilder, shapes
from onnx_autodiff.training.registry import Registry
from onnx_autodiff.training.values import fresh_value

# (the notes' logger keeps the name of the module users know, where the losses are attached)
logger = logging.getLogger("onnx_autodiff.training.losses")


@dataclasses.dataclass
class LossSpec:
    loss: str | Callable | onnx.FunctionProto | None
    output: str | None
    labels: object
    # what attaching the loss found, the same for each model it is attached to:
    notes: list[str] = dataclasses.field(default_factory=list)  # each logged once
    class_axis: int | None = 1  # the scored output's axis that integer labels index (None: no accuracy)


@dataclasses.dataclass
class Attachment:
    """What a built-in loss builds with: the model, its builder and namer, the loss's spec."""

    model: ir.Model
    op: OpBuilder
    namer: Namer
    spec: LossSpec

    @property
    def label_name(self) -> str:
        labels = self.spec.labels
        if isinstance(labels, str):
            return labels
        return labels[0][0] if labels else "labels"

    @property
    def label_shape(self) -> list | None:
        """The labels' shape as the caller gave it ((name, dtype, shape) entries), or None."""
        labels = self.spec.labels
        if labels is None or isinstance(labels, str) or not labels:
            return None
        try:
            return None if labels[0][2] is None else list(labels[0][2])
        except (TypeError, IndexError) as error:
            raise TrainingError(f"a label is given as (name, numpy dtype, shape), not {labels[0]!r}") from error

    def label(self, hint: str, dtype: ir.DataType, dims) -> ir.Value:
        return fresh_value(self.namer, hint, dtype, dims)

    def note(self, text: str) -> None:
        """One note per build, though the loss is attached to each model (train, eval, ...)."""
        if text not in self.spec.notes:
            self.spec.notes.append(text)
            logger.warning("%s", text)

    def need_opset(self, loss: str, opset: int, why: str) -> None:
        if self.op.opset < opset:
            raise TrainingOpsetError(f"{loss} uses {why}, which needs opset >= {opset}; convert the model", opset)


# build(attachment, output, **options) -> (the scalar loss, the label inputs it made)
BuiltLoss = Callable[..., tuple[ir.Value, list[ir.Value]]]
BUILTIN_LOSSES: Registry[BuiltLoss] = Registry("loss")


def register_loss(name: str):
    """Registers a built-in loss (a decorator): ``build(attachment, output, **options) -> (loss,
    label inputs)``; its keyword options are those ``BuiltinLoss(name, ...)`` passes."""

    def register(build: BuiltLoss) -> BuiltLoss:
        return BUILTIN_LOSSES.register(name, build)

    return register


# The output's activation, and the logits under it


def activation(y: ir.Value, op_types: tuple[str, ...]) -> tuple[ir.Node, int | None] | None:
    """(node, the axis it normalises; None for Sigmoid) when one of ``op_types`` makes ``y``
    (through Identity). The losses that read a Softmax need opset 13, where it normalises one axis:
    a model of an older opset is converted first, and onnx's converter writes an older Softmax's
    2-D coercion out (Flatten, Softmax, Reshape) where it spans several axes."""
    node = y.producer()
    while node is not None and node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
        node = node.inputs[0].producer()
    if node is None or node.op_type not in op_types or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Sigmoid":
        return node, None
    r = shapes.rank(y)
    return None if r is None else (node, shapes.normalize_axis(shapes.attr(node, "axis", -1), r))


def logits_under(att: Attachment, y: ir.Value, loss: str, found, axis: int | None) -> ir.Value:
    """What the loss reads: the input of the activation ``found`` that makes ``y`` when it
    normalises the loss's class ``axis`` (the model's output is probabilities), else ``y``."""
    if found is None or found[1] != axis:
        return y
    node = found[0]
    x = node.inputs[0]
    what = "" if node.op_type == "LogSoftmax" else ", not to its probabilities"
    att.note(f"{loss} is applied to '{x.name}', the logits that the {node.op_type} making output '{y.name}' "
             f"normalises{what}; the model keeps its output")
    return x


def mean(op: OpBuilder, x: ir.Value) -> ir.Value:
    return op.reduce("ReduceMean", x, None, keepdims=False)
