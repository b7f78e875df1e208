"""ctc: connectionist temporal classification, as torch.nn.functional.ctc_loss, by the forward
algorithm over the time steps in a Scan."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.toolkit import Namer, OpBuilder, shapes
from onnx_autodiff.training.loss_functions.base import Attachment, activation, logits_under, mean, register_loss
from onnx_autodiff.training.values import dim_value, fresh_value, shape_text


@register_loss("ctc")
def ctc(att: Attachment, y: ir.Value, blank: int = 0, zero_infinity: bool = False) -> tuple[ir.Value, list[ir.Value]]:
    """Connectionist temporal classification, as torch.nn.functional.ctc_loss(reduction="mean"):
    −log Σ over the alignments of the targets of their probability, per sequence divided by its
    target length, mean over the batch; the forward algorithm's recursion over the extended
    targets (blank, l1, blank, l2, ..., blank) in log space, one Scan step per time step.

    The output is [batch, time, classes] or [time, batch, classes] (the axis matching the inputs'
    batch axis is the batch; batch first when neither or both do), read through log-softmax over the
    classes: logits and log-probabilities alike. Labels: ``labels`` [batch, S] int64 (padded: the
    entries after each target length are not read), ``input_lengths`` and ``target_lengths``
    [batch] int64. Impossible alignments (targets too long for the input) give an infinite loss,
    or with ``zero_infinity`` zero and no gradient.
    """
    if shapes.rank(y) != 3:
        raise TrainingError(f"ctc needs scores [batch, time, classes] or [time, batch, classes]; output '{y.name}' "
                            f"has shape {y.shape if y.shape is None else shape_text([dim_value(d) for d in y.shape])}")
    att.need_opset("ctc", 13, "Scan, GatherElements and Range")
    op, dtype = att.op, y.dtype
    att.spec.class_axis = None
    dims = [dim_value(d) for d in y.shape]
    batch_axis, why = _ctc_batch_axis(att.model, dims)
    time_axis = 1 - batch_axis
    layout = "[batch, time, classes]" if batch_axis == 0 else "[time, batch, classes]"
    infinite = "" if zero_infinity else "; targets too long for their input give an infinite loss (0 with zero_infinity, --ctc-zero-infinity)"
    att.note(f"ctc reads output '{y.name}' {shape_text(dims)} as {layout} ({why}); blank is class {blank}{infinite}")
    logits = logits_under(att, y, "ctc", activation(y, ("Softmax", "LogSoftmax")), 2)
    log_probs = op.LogSoftmax(logits, axis=2)
    n = dims[batch_axis]
    label_shape = att.label_shape
    targets = att.label(att.label_name, ir.DataType.INT64, [n, label_shape[1] if label_shape and len(label_shape) == 2 else None])
    input_lengths = att.label("input_lengths", ir.DataType.INT64, [n])
    target_lengths = att.label("target_lengths", ir.DataType.INT64, [n])

    def floating(value):  # a scalar of the scores' dtype
        return op.const(value, dtype=dtype)

    def extent(axis: int):
        return dims[axis] if isinstance(dims[axis], int) else op.Slice(op.Shape(log_probs), [axis], [axis + 1])

    neg = float(np.finfo(dtype.numpy()).min) / 4  # log 0, finite: sums of it stay finite, and so do gradients
    extended, skip = _ctc_extended(op, targets, target_lengths, blank, floating(0.0), floating(neg))
    # emissions [T, N, L]: log p_t(l'[k])
    spread = [1, 1, 1]
    spread[time_axis] = extent(time_axis)
    index = op.Expand(op.unsqueeze(extended, [time_axis]), shapes.shape_from(op, *spread))
    emissions = op.GatherElements(log_probs, index, axis=2)
    if batch_axis == 0:
        emissions = op.Transpose(emissions, perm=[1, 0, 2])
    active = op.Less(op.unsqueeze(_positions(op, emissions, 0), [1, 2]), op.unsqueeze(input_lengths, [0, 2]))  # [T, N, 1]
    # α before the first step: [0, −∞, ...], from which the first step reaches l'[0] (staying) and
    # l'[1] (advancing), and no state after them (l'[2] is a blank: no skip to it)
    first = op.Equal(_positions(op, extended, 1), np.array(0, np.int64))
    start = op.Expand(op.Where(first, floating(0.0), floating(neg)), op.Shape(extended))
    final = op.Scan(start, emissions, active, body=_ctc_step(op, att.namer, dtype, skip, neg), num_scan_inputs=2)
    # log-likelihood: α at the last label or the blank after it (the blank alone for empty targets)
    end = op.unsqueeze(op.Mul(target_lengths, np.array(2, np.int64)), [1])
    at_end = op.GatherElements(final, end, axis=1)
    before_end = op.GatherElements(final, op.Max(op.Sub(end, np.array(1, np.int64)), np.array(0, np.int64)), axis=1)
    before_end = op.Add(before_end, op.Where(op.Greater(end, np.array(0, np.int64)), floating(0.0), floating(neg)))
    likelihood = _log_sum_exp(op, at_end, before_end)
    impossible = op.Less(likelihood, floating(neg / 2))
    nll = op.Where(impossible, floating(0.0 if zero_infinity else np.inf), op.Neg(likelihood))
    lengths = op.Cast(op.Max(op.unsqueeze(target_lengths, [1]), np.array(1, np.int64)), to=int(dtype))
    return mean(op, op.Div(nll, lengths)), [targets, input_lengths, target_lengths]


def _ctc_extended(op: OpBuilder, targets: ir.Value, target_lengths: ir.Value, blank: int, zero: ir.Value,
                  floor: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The extended targets l' [N, L = 2S + 1] (blank, l1, blank, ..., lS, blank; entries after a
    target's length read as blanks) and the log-weight of a step that skips the blank before l'[k]
    (0 where l'[k] is a label other than l'[k − 2], ``floor`` elsewhere)."""
    blank64 = np.array(blank, np.int64)
    counted = op.Less(op.unsqueeze(_positions(op, targets, 1), [0]), op.unsqueeze(target_lengths, [1]))
    kept = op.unsqueeze(op.Where(counted, targets, blank64), [2])
    pairs = op.Concat(op.Expand(blank64, op.Shape(kept)), kept, axis=2)
    extended = op.Pad(op.Reshape(pairs, [0, -1]), [0, 0, 0, 1], blank64)
    before = op.Pad(op.Slice(extended, [0], [-2], [1]), [0, 2, 0, 0], blank64)
    skips = op.And(op.Not(op.Equal(extended, blank64)), op.Not(op.Equal(extended, before)))
    return extended, op.Where(skips, zero, floor)


def _ctc_step(op: OpBuilder, namer: Namer, dtype: ir.DataType, skip: ir.Value, neg: float) -> ir.Graph:
    """The Scan body of one time step: α'[k] = log(e^α[k] + e^α[k−1] + e^(α[k−2] + skip[k])) + emission[k]
    where the sequence is active (t < its input length), α where it has ended."""
    body = op.child()
    alpha = fresh_value(namer, "alpha", dtype, [None, None])
    emitted = fresh_value(namer, "emission", dtype, [None, None])
    live = fresh_value(namer, "active", ir.DataType.BOOL, [None, 1])
    floor = body.const(neg, dtype=dtype)
    from_previous = body.Pad(body.Slice(alpha, [0], [-1], [1]), [0, 1, 0, 0], floor)
    from_skip = body.Add(body.Pad(body.Slice(alpha, [0], [-2], [1]), [0, 2, 0, 0], floor), skip)
    stepped = body.Add(_log_sum_exp(body, alpha, from_previous, from_skip), emitted)
    return body.graph([alpha, emitted, live], [body.Where(live, stepped, alpha)], name="ctc_step")


def _log_sum_exp(op: OpBuilder, *terms: ir.Value) -> ir.Value:
    """log Σ exp(terms), elementwise, shifted by their maximum."""
    top = op.Max(*terms)
    total = op.Exp(op.Sub(terms[0], top))
    for term in terms[1:]:
        total = op.Add(total, op.Exp(op.Sub(term, top)))
    return op.Add(op.Log(total), top)


def _positions(op: OpBuilder, x: ir.Value, axis: int) -> ir.Value:
    """0, 1, ..., n − 1 for x's extent n along ``axis`` (int64)."""
    n = op.Squeeze(op.Slice(op.Shape(x), [axis], [axis + 1]), [0])
    return op.Range(np.array(0, np.int64), n, np.array(1, np.int64))


def _ctc_batch_axis(model: ir.Model, dims: list) -> tuple[int, str]:
    """0 or 1, whichever of the output's first two axes is the inputs' batch axis, and why."""
    initializers = model.graph.initializers
    batch = {dim_value(v.shape[0]) for v in model.graph.inputs
             if v.name not in initializers and v.shape is not None and len(v.shape) > 0}
    batch.discard(None)
    matches = [axis for axis in (0, 1) if dims[axis] is not None and dims[axis] in batch]
    if matches == [1]:
        return 1, "its axis 1 is the inputs' batch axis"
    if matches == [0]:
        return 0, "its axis 0 is the inputs' batch axis"
    return 0, "batch first, as OCR models write it: the inputs' batch axis does not tell"
