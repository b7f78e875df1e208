"""causal_lm: transformers' next-token loss of a causal language model."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.toolkit import shapes
from onnx_autodiff.training.loss_functions.base import Attachment, activation, logits_under, register_loss
from onnx_autodiff.training.loss_functions.classes import IGNORE_INDEX, softmax_cross_entropy
from onnx_autodiff.training.values import dim_value, shape_text


@register_loss("causal_lm")
def causal_lm(att: Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """transformers' causal language-model loss: the logits [batch, sequence, vocabulary] at
    position t scored against the label at t + 1 (labels [batch, sequence], the input ids or
    −100 where not counted), mean over the counted ones."""
    if shapes.rank(y) != 3:
        raise TrainingError(f"causal_lm needs logits [batch, sequence, vocabulary]; output '{y.name}' has shape "
                            f"{y.shape if y.shape is None else shape_text([dim_value(d) for d in y.shape])}")
    att.need_opset("causal_lm", 13, "SoftmaxCrossEntropyLoss")
    att.spec.class_axis = None  # (each position's label is the next position's token)
    dims = [dim_value(d) for d in y.shape]
    labels = [att.label(att.label_name, ir.DataType.INT64, dims[:2])]
    logits = logits_under(att, y, "causal_lm", activation(y, ("Softmax", "LogSoftmax")), 2)
    op = att.op
    # labels[:, 1:] padded with −100, as transformers shifts them: the last position counts for nothing,
    # and the logits are read whole (no slice of the largest tensor)
    following = op.Slice(labels[0], [1], [np.iinfo(np.int64).max], [1])
    shifted = op.Pad(following, [0, 0, 0, 1], np.array(IGNORE_INDEX, np.int64))
    return softmax_cross_entropy(op, logits, shifted, 2, 3), labels
