"""cross_entropy: integer class labels scored against logits, their class axis found from the shapes."""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.toolkit import OpBuilder, shapes
from onnx_autodiff.training.loss_functions.base import Attachment, activation, logits_under, register_loss
from onnx_autodiff.training.values import dim_value, shape_text

IGNORE_INDEX = -100  # the class label of no class, as PyTorch and transformers write it


def class_axis(logits: list, labels: list | None = None, normalised: int | None = None) -> tuple[int, str | None]:
    """The axis of ``logits`` (its dims: ints, symbols, None) that holds the classes, with the
    reason when the logits' shape alone suggested it (the caller's note), else None.

    Rank 2: axis 1. Otherwise, in this order: the labels' shape when given (rank one less) and
    only one of axis 1 ([N, C, d1, ...], labels [N, d1, ...]) and the last axis ([N, d1, ..., C],
    labels [N, d1, ...]) fits it; the axis a final Softmax normalises when it is one of the two;
    for rank 3, the shape: a fixed last axis beside a symbolic axis 1 (a vocabulary beside a
    sequence), the larger of two fixed ones, the last when neither is fixed (transformers'
    layout), axis 1 when only it is fixed; rank 4 and more: axis 1 (images, [N, C, H, W]).
    """
    r = len(logits)
    last = r - 1
    if r == 2:
        return 1, None
    if labels is not None and len(labels) == r - 1:
        def fits(axis: int) -> bool:
            rest = [d for i, d in enumerate(logits) if i != axis]
            return all(not (isinstance(a, int) and isinstance(b, int)) or a == b for a, b in zip(rest, labels))
        fitting = [axis for axis in (1, last) if fits(axis)]
        if len(fitting) == 1:
            return fitting[0], None
    if normalised in (1, last):
        return normalised, None
    if r > 3:
        return 1, None
    first, final = logits[1], logits[2]
    if isinstance(final, int) and not isinstance(first, int):
        return last, "its last axis is fixed and axis 1 is not, as a vocabulary beside a sequence"
    if isinstance(first, int) and not isinstance(final, int):
        return 1, "axis 1 is fixed and the last is not"
    if isinstance(first, int):
        if first > final:
            return 1, "axis 1 is the larger"
        return last, "the last axis is the larger"
    return last, "neither is fixed: transformers' layout"


def _label_dims(dims: list, axis: int) -> list:
    return [d for i, d in enumerate(dims) if i != axis]


def softmax_cross_entropy(op: OpBuilder, logits: ir.Value, labels: ir.Value, axis: int, rank: int) -> ir.Value:
    """Mean cross-entropy over the labels that are not IGNORE_INDEX, classes along ``axis``."""
    if axis != 1:  # classes last: rows of classes, and the labels flat alike (views: no copy)
        logits, labels = op.Flatten(logits, axis=rank - 1), op.Reshape(labels, [-1])
    return op.SoftmaxCrossEntropyLoss(logits, labels, reduction="mean", ignore_index=IGNORE_INDEX)


@register_loss("cross_entropy")
def cross_entropy(att: Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean −log softmax(logits)[label] over the labels other than −100."""
    rank = shapes.rank(y)
    if rank is None or rank < 2:
        raise TrainingError(f"cross_entropy needs logits of shape [N, C, ...]; output '{y.name}' has shape {y.shape}")
    att.need_opset("cross_entropy", 13, "SoftmaxCrossEntropyLoss")
    dims = [dim_value(d) for d in y.shape]
    found = activation(y, ("Softmax", "LogSoftmax"))
    axis, guess = class_axis(dims, att.label_shape, found and found[1])
    att.spec.class_axis = axis
    label_dims = _label_dims(dims, axis)
    if guess is not None:
        other = 1 if axis != 1 else rank - 1
        att.note(f"cross_entropy takes axis {axis} of output '{y.name}' {shape_text(dims)} as the classes, labels "
                 f"{shape_text(label_dims)} ({guess}); labels {shape_text(_label_dims(dims, other))} would take axis {other}")
    labels = [att.label(att.label_name, ir.DataType.INT64, label_dims)]
    logits = logits_under(att, y, "cross_entropy", found, axis)
    return softmax_cross_entropy(att.op, logits, labels[0], axis, rank), labels
