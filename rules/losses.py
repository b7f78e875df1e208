"""Softmax family and classification losses: forward meaning in the docstring, backward below it.

Softmax and LogSoftmax reuse their forward output Y. The losses are written as a negative
log-likelihood over log-probabilities: a one-hot selection of the labels (zero where a label equals
ignore_index) gives the gradient for the log-probabilities and for the class weights; the softmax
of SoftmaxCrossEntropyLoss is then undone like LogSoftmax's, so its optional log_prob output is
used when present but never required. Without log_prob's gradient and class weights, the
cross-entropy's gradient is a · (softmax − one-hot) with the one-hot as a ScatterElements at the
labels: one tensor of the scores' size besides the softmax (a large vocabulary's logits).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes


def _sum_over_softmax_axes(op, node, t, legacy: bool):
    """Σ t over the axes the op normalises, kept broadcastable to t.

    From opset 13 that is the one axis ``axis`` (default -1); before, the input is coerced to 2-D
    at ``axis`` (default 1), so every axis from ``axis`` on.
    """
    axis = shapes.attr(node, "axis", 1 if legacy else -1)
    if not legacy:
        return op.reduce_sum(t, [axis])
    r = shapes.rank(node.inputs[0])
    if r is not None:
        return op.reduce_sum(t, range(shapes.normalize_axis(axis, r), r))
    # Unknown rank: sum the 2-D view, then spread the row sums back over the original shape.
    flat = op.Flatten(t, axis=axis)
    return op.Reshape(op.Expand(op.reduce_sum(flat, [1]), op.Shape(flat)), op.Shape(t))


def _finite(op, node, Y):
    """Y with NaN read as 0: a row of -inf logits (a fully masked attention row) gives NaN, and
    0·NaN would turn the zero gradient that masking sends there into NaN.

    Not when a Where makes the logits (the mask applied to the scores, as exporters write it):
    a row can then be all -inf only where the mask covers it, and Where's gradient selects zero
    for those positions whatever the NaN, so the guard would only cost two full-size passes.
    """
    producer = node.inputs[0].producer()
    masked = producer is not None and producer.op_type == "Where" and producer.domain in ("", "ai.onnx")
    if op.opset < 9 or masked:
        return Y
    return op.Where(op.IsNaN(Y), op.const(0.0, like=Y), Y)


def _softmax(op, node, dY, legacy):
    Y = _finite(op, node, node.outputs[0])
    dYY = op.Mul(dY, Y)
    return {"input": op.Sub(dYY, op.Mul(Y, _sum_over_softmax_axes(op, node, dYY, legacy)))}


def _log_softmax(op, node, dY, legacy):
    probabilities = _finite(op, node, op.Exp(node.outputs[0]))
    return {"input": op.Sub(dY, op.Mul(probabilities, _sum_over_softmax_axes(op, node, dY, legacy)))}


@rule("Softmax", differentiable=("input",), since=13)
def softmax(op, node, dY):
    """Y = exp(X) / Σ_axis exp(X); dX = Y * (dY - Σ_axis dY*Y)"""
    return _softmax(op, node, dY, legacy=False)


@rule("Softmax", differentiable=("input",), until=12)
def softmax_2d(op, node, dY):
    """Softmax over every axis from ``axis`` on (the input seen as 2-D); same derivative."""
    return _softmax(op, node, dY, legacy=True)


@rule("LogSoftmax", differentiable=("input",), since=13)
def log_softmax(op, node, dY):
    """Y = X - log Σ_axis exp(X); dX = dY - exp(Y) * Σ_axis dY"""
    return _log_softmax(op, node, dY, legacy=False)


@rule("LogSoftmax", differentiable=("input",), until=12)
def log_softmax_2d(op, node, dY):
    """LogSoftmax over every axis from ``axis`` on (the input seen as 2-D); same derivative."""
    return _log_softmax(op, node, dY, legacy=True)


@rule("Hardmax", differentiable=("input",))
def hardmax(op, node, dY):
    """Y = one-hot of the argmax along axis: piecewise constant, so dX = 0.

    A rule returning zeros (not a non-differentiable declaration), so a gradient requested through
    Hardmax is zeros of the input's shape and never an "unreachable" error.
    """
    return {"input": shapes.zeros(op, node.inputs[0])}


def _class_ids(op, scores, r: int):
    """0..C-1 as int64 of shape (C, 1, ..., 1), aligned with the class axis 1 of the scores."""
    trailing = [1] * (r - 2)
    C = (shapes.dims(scores) or (None, None))[1]
    if isinstance(C, int):
        return op.const(np.arange(C, dtype=np.int64).reshape([C, *trailing]))
    count = op.Gather(op.Shape(scores), op.const(np.int64(1)))
    ids = op.Range(op.const(np.int64(0)), count, op.const(np.int64(1)))
    return op.Reshape(ids, [-1, *trailing]) if trailing else ids


def _scores_rank(scores, labels) -> int:
    """The rank of scores (N, C, d...), else one more than that of labels (N, d...)."""
    r = shapes.rank(scores)
    if r is None and shapes.rank(labels) is not None:
        r = shapes.rank(labels) + 1
    if r is None or r < 2:
        raise RuleError(f"needs the rank of scores/input or of the labels (scores' at least 2), got {r}")
    return r


def _coefficient(op, reduction: str, dL, total):
    """dloss/dl for each label's term l (broadcastable to the class axis 1): dL per label
    (none), dL (sum), dL / total() (mean, ``total`` the weight of the labels counted)."""
    if reduction == "none":
        return op.unsqueeze(dL, [1])
    if reduction == "sum":
        return dL
    if reduction == "mean":
        return op.Div(dL, total())
    raise RuleError(f"unknown reduction '{reduction}' (expected none, sum or mean)")


def _nll_backward(op, node, logp, dL):
    """Gradients of loss = reduce(-w[t] * logp[n, t, ...]) for logp (N, C, d...) and weights w.

    mean divides by W = Σ of the selected weights (the count of labels not ignored without
    weights), so dw[c] = dL/W * Σ_{t=c} (-logp - loss) there, and dL * Σ_{t=c} -logp otherwise.
    """
    scores, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    r = _scores_rank(scores, labels)
    reduction = shapes.attr(node, "reduction", "mean")
    ignore_index = shapes.attr(node, "ignore_index")
    if labels.dtype != ir.DataType.INT64:
        labels = op.Cast(labels, to=ir.DataType.INT64)
    labels = op.unsqueeze(labels, [1])
    chosen = op.Equal(labels, _class_ids(op, scores, r))
    if ignore_index is not None:
        chosen = op.And(chosen, op.Not(op.Equal(labels, op.const(np.int64(ignore_index)))))
    pick = shapes.cast_like(op, chosen, scores)  # (N, C, d...): one-hot of the label, zero rows where ignored
    trailing = [1] * (r - 2)
    class_weights = None
    if weights is not None:
        class_weights = op.Reshape(weights, [-1, *trailing]) if trailing else weights
    weighted = pick if weights is None else op.Mul(pick, class_weights)
    coef = _coefficient(op, reduction, dL, lambda: op.reduce_sum(weighted, None, keepdims=False))
    d_logp = op.Neg(op.Mul(weighted, coef))
    if weights is None:
        return d_logp, None
    nll = op.Neg(op.reduce_sum(op.Mul(pick, logp), [1]))  # (N, 1, d...), zero where ignored
    if reduction == "mean":
        nll = op.Sub(nll, node.outputs[0])
    per_label = op.Mul(pick, op.Mul(nll, coef))
    return d_logp, op.reduce_sum(per_label, [0, *range(2, r)], keepdims=False)


def _log_softmax_axis1(op, scores, labels):
    """LogSoftmax over the class axis 1 alone (opset 12's LogSoftmax flattens from its axis on)."""
    if op.opset >= 13:
        return op.LogSoftmax(scores, axis=1)
    r = _scores_rank(scores, labels)
    if r == 2:
        return op.LogSoftmax(scores, axis=1)
    perm = [0, *range(2, r), 1]
    moved = op.LogSoftmax(op.Transpose(scores, perm=perm), axis=r - 1)
    return op.Transpose(moved, perm=shapes.inverse_perm(perm))


def _labels_index_scores(node) -> bool:
    """Whether every label, ignore_index included, indexes the class axis of the scores (from −C;
    the labels a loss accepts are classes or its ignore_index)."""
    ignore_index = shapes.attr(node, "ignore_index")
    C = (shapes.dims(node.inputs[0]) or (None, None))[1]
    return ignore_index is None or isinstance(C, int) and -C <= ignore_index < C


def _label_count(op, scores):
    """N·d1·... of scores (N, C, d...) in their type, read from their shape (the labels are read
    by the loss and its one-hot alone, see :mod:`~onnx_autodiff.passes.rewrite_rules.webgpu`)."""
    shape = shapes.dims(scores)
    if shape is not None and all(isinstance(d, int) for d in shape):
        return op.const(float(np.prod(shape) // shape[1]), like=scores)
    size = shapes.cast_like(op, op.Size(scores), scores)
    return op.Div(size, shapes.cast_like(op, op.Gather(op.Shape(scores), op.const(np.int64(1))), scores))


def _minus_one_hot(op, node, probabilities, dL):
    """dscores = a · (probabilities − one-hot(t)), a the loss's weight of each label (zero where
    ignored): the product, then a taken off at each label (a ScatterElements of its classes),
    without a one-hot of the scores' size."""
    scores, labels = node.inputs[0], node.inputs[1]
    reduction = shapes.attr(node, "reduction", "mean")
    ignore_index = shapes.attr(node, "ignore_index")
    if labels.dtype != ir.DataType.INT64:
        labels = op.Cast(labels, to=ir.DataType.INT64)
    labels = op.unsqueeze(labels, [1])  # (N, 1, d...), indices of the class axis
    counted = None if ignore_index is None else shapes.cast_like(
        op, op.Not(op.Equal(labels, op.const(np.int64(ignore_index)))), scores)
    a = _coefficient(op, reduction, dL, lambda: op.reduce_sum(counted, None, keepdims=False) if counted is not None
                     else _label_count(op, scores))
    if counted is not None:
        a = op.Mul(counted, a)
    scaled = op.Mul(probabilities, a)
    at_labels = op.Sub(op.GatherElements(scaled, labels, axis=1), a)
    return op.ScatterElements(scaled, labels, at_labels, axis=1)


@rule("SoftmaxCrossEntropyLoss", differentiable=("scores", "weights"), since=12)
def softmax_cross_entropy_loss(op, node, dL, dLogProb=None):
    """loss = NLL(LogSoftmax(scores, axis=1), labels, weights); log_prob = LogSoftmax(scores, 1)

    dscores = G - softmax * Σ_c G with G = dlog_prob + ∂loss/∂log_prob; without dlog_prob and
    weights, a · (softmax − one-hot(t)) with a the weight of each label in the loss.
    """
    scores = node.inputs[0]
    has_log_prob = len(node.outputs) > 1 and node.outputs[1].name
    weighted = len(node.inputs) > 2 and node.inputs[2] is not None
    if has_log_prob or weighted or op.opset < 13:
        logp = node.outputs[1] if has_log_prob else _log_softmax_axis1(op, scores, node.inputs[1])
        probabilities = op.Exp(logp)
    else:  # the log-probabilities themselves are not needed
        logp, probabilities = None, op.Softmax(scores, axis=1)
    if dL is not None and dLogProb is None and not weighted and _labels_index_scores(node):
        return {"scores": _minus_one_hot(op, node, probabilities, dL)}
    d_logp, d_weights = (dLogProb, None) if dL is None else _nll_backward(op, node, logp, dL)
    if dL is not None and dLogProb is not None:
        d_logp = op.Add(d_logp, dLogProb)
    d_scores = op.Sub(d_logp, op.Mul(probabilities, op.reduce_sum(d_logp, [1])))
    return {"scores": d_scores, "weights": d_weights}


@rule("NegativeLogLikelihoodLoss", differentiable=("input", "weight"), since=12)
def negative_log_likelihood_loss(op, node, dL):
    """loss = reduce(-weight[t] * input[n, t, d...]) over labels t not equal to ignore_index"""
    d_input, d_weight = _nll_backward(op, node, node.inputs[0], dL)
    return {"input": d_input, "weight": d_weight}
