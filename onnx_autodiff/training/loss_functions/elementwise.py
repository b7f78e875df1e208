"""Losses of each element of the output against a label of its shape: mse, l1, bce_with_logits."""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.training.loss_functions.base import Attachment, activation, logits_under, mean, register_loss
from onnx_autodiff.training.values import dim_value


def _like_output(att: Attachment, y: ir.Value) -> ir.Value:
    return att.label(att.label_name, y.dtype, None if y.shape is None else [dim_value(d) for d in y.shape])


@register_loss("mse")
def mse(att: Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean (y − t)²."""
    labels = [_like_output(att, y)]
    d = att.op.Sub(y, labels[0])
    return mean(att.op, att.op.Mul(d, d)), labels


@register_loss("l1")
def l1(att: Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean |y − t|."""
    labels = [_like_output(att, y)]
    return mean(att.op, att.op.Abs(att.op.Sub(y, labels[0]))), labels


@register_loss("bce_with_logits")
def bce_with_logits(att: Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean max(x, 0) − x·t + log(1 + exp(−|x|)), stable for any x; x under a final Sigmoid."""
    labels = [_like_output(att, y)]
    x = logits_under(att, y, "bce_with_logits", activation(y, ("Sigmoid",)), None)
    op = att.op
    per_element = op.Add(op.Sub(op.Relu(x), op.Mul(x, labels[0])), op.Log(op.Add(op.Exp(op.Neg(op.Abs(x))), 1.0)))
    return mean(op, per_element), labels
