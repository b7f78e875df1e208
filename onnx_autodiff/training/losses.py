"""Losses appended to a forward model: the built-in ones, the model's own output, custom functions.

A built-in loss is one function registered with :func:`_builtin`: given the attachment (builder,
namer, the spec) and the model output, it returns the scalar loss and the label inputs it made.

Class losses fit the model's output (docs/training.md, "Losses"):

- an output made by Softmax (or LogSoftmax) along the class axis is probabilities: cross_entropy,
  causal_lm and ctc read the activation's input, the logits, instead (and bce_with_logits a
  Sigmoid's input), saying so in one note; the model's outputs stay as they are;
- the class axis of cross_entropy's logits is 1 ([N, C, d1, ...], labels [N, d1, ...], as ONNX's
  SoftmaxCrossEntropyLoss and PyTorch take it) or the last one ([batch, sequence, classes],
  labels [batch, sequence], as transformers write logits): see :func:`class_axis`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError, TrainingOpsetError, UnknownValueError
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, OpBuilder, shapes
from onnx_autodiff.training.values import dim_value, fresh_value, shape_text

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the class label of no class, as PyTorch and transformers write it


@dataclasses.dataclass
class LossSpec:
    loss: str | Callable | onnx.FunctionProto | None
    output: str | None
    labels: object
    # what attaching the loss found, the same for each model it is attached to:
    notes: list[str] = dataclasses.field(default_factory=list)  # each logged once
    class_axis: int | None = 1  # the scored output's axis that integer labels index (None: no accuracy)


@dataclasses.dataclass
class _Attachment:
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


_BUILTINS: dict[str, Callable[[_Attachment, ir.Value], tuple[ir.Value, list[ir.Value]]]] = {}


def _builtin(name: str):
    """Registers a built-in loss: ``build(attachment, output) -> (loss, label inputs)``."""

    def register(build):
        _BUILTINS[name] = build
        return build

    return register


@dataclasses.dataclass(frozen=True)
class BuiltinLoss:
    """A built-in loss with options, e.g. ``BuiltinLoss("ctc", blank=27, zero_infinity=True)``;
    ``loss="ctc"`` is ``BuiltinLoss("ctc")``."""

    name: str
    options: dict = dataclasses.field(default_factory=dict)

    def __init__(self, name: str, **options) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "options", options)


def attach_loss(model: ir.Model, namer: Namer, spec: LossSpec):
    """Appends the loss; returns (loss value, label inputs, model outputs other than the loss)."""
    graph = model.graph
    outputs = list(graph.outputs)
    names = [v.name for v in outputs]
    if spec.output is not None and spec.output not in names:
        raise UnknownValueError(f"output '{spec.output}' is not an output of the model; its outputs are {names}")
    if spec.loss is None:
        if spec.output is not None:
            name = spec.output
        elif len(names) == 1:
            name = names[0]
        elif "loss" in names:
            name = "loss"
        else:
            raise TrainingError(f"with loss=None the model's output is the loss: name it with output=... (outputs {names})")
        loss = outputs[names.index(name)]
        shape = loss.shape
        if shape is not None and (len(shape) > 1 or (len(shape) == 1 and shape[0] != 1)):
            raise TrainingError(f"output '{name}' has shape {shape_text([dim_value(d) if dim_value(d) is not None else d for d in shape])}: a loss must be a scalar")
        return loss, [], [v for v in outputs if v is not loss]
    y = outputs[names.index(spec.output)] if spec.output is not None else outputs[0]
    if y.dtype not in FLOAT_TYPES:
        raise TrainingError(f"output '{y.name}' is {y.dtype}, not a floating-point value a loss can apply to")
    op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
    if isinstance(spec.loss, (str, BuiltinLoss)):
        builtin = spec.loss if isinstance(spec.loss, BuiltinLoss) else BuiltinLoss(spec.loss)
        build = _BUILTINS.get(builtin.name)
        if build is None:
            raise TrainingError(f"unknown loss {builtin.name!r}: use one of {', '.join(LOSSES)}, None (the model's output is the loss) or a callable")
        try:
            inspect.signature(build).bind(None, None, **builtin.options)
        except TypeError as error:
            raise TrainingError(f"loss {builtin.name!r} does not take the options {builtin.options}: {error}") from error
        loss, labels = build(_Attachment(model, op, namer, spec), y, **builtin.options)
    else:
        labels = _label_values(namer, spec.labels, y)
        if isinstance(spec.loss, onnx.FunctionProto):
            loss = _inline_function(op, spec.loss, [y, *labels])
        elif callable(spec.loss):
            loss = spec.loss(op, y, *labels)
        else:
            raise TrainingError(f"loss must be one of {LOSSES}, None, a callable or an onnx.FunctionProto, not {type(spec.loss).__name__}")
        if not isinstance(loss, ir.Value):
            raise TrainingError("a custom loss must return the onnx_ir.Value of the loss (built with the op builder it is given)")
    graph.extend(op.nodes)
    loss.name = None
    loss.name = namer.fresh("loss")
    loss.type, loss.shape = ir.TensorType(y.dtype), ir.Shape([])
    return loss, labels, outputs


# The output's activation, and the logits under it


def _activation(y: ir.Value, op_types: tuple[str, ...]) -> tuple[ir.Node, int | None] | None:
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


def _logits(att: _Attachment, y: ir.Value, loss: str, found, axis: int | None) -> ir.Value:
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


# Class axis


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


def _softmax_cross_entropy(op: OpBuilder, logits: ir.Value, labels: ir.Value, axis: int, rank: int) -> ir.Value:
    """Mean cross-entropy over the labels that are not IGNORE_INDEX, classes along ``axis``."""
    if axis != 1:  # classes last: rows of classes, and the labels flat alike (views: no copy)
        logits, labels = op.Flatten(logits, axis=rank - 1), op.Reshape(labels, [-1])
    return op.SoftmaxCrossEntropyLoss(logits, labels, reduction="mean", ignore_index=IGNORE_INDEX)


# The built-in losses


@_builtin("cross_entropy")
def _cross_entropy(att: _Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean −log softmax(logits)[label] over the labels other than −100."""
    rank = shapes.rank(y)
    if rank is None or rank < 2:
        raise TrainingError(f"cross_entropy needs logits of shape [N, C, ...]; output '{y.name}' has shape {y.shape}")
    att.need_opset("cross_entropy", 13, "SoftmaxCrossEntropyLoss")
    dims = [dim_value(d) for d in y.shape]
    found = _activation(y, ("Softmax", "LogSoftmax"))
    axis, guess = class_axis(dims, att.label_shape, found and found[1])
    att.spec.class_axis = axis
    label_dims = _label_dims(dims, axis)
    if guess is not None:
        other = 1 if axis != 1 else rank - 1
        att.note(f"cross_entropy takes axis {axis} of output '{y.name}' {shape_text(dims)} as the classes, labels "
                 f"{shape_text(label_dims)} ({guess}); labels {shape_text(_label_dims(dims, other))} would take axis {other}")
    labels = [att.label(att.label_name, ir.DataType.INT64, label_dims)]
    logits = _logits(att, y, "cross_entropy", found, axis)
    return _softmax_cross_entropy(att.op, logits, labels[0], axis, rank), labels


@_builtin("mse")
def _mse(att: _Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean (y − t)²."""
    labels = [_like_output(att, y)]
    d = att.op.Sub(y, labels[0])
    return _mean(att.op, att.op.Mul(d, d)), labels


@_builtin("l1")
def _l1(att: _Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean |y − t|."""
    labels = [_like_output(att, y)]
    return _mean(att.op, att.op.Abs(att.op.Sub(y, labels[0]))), labels


@_builtin("bce_with_logits")
def _bce_with_logits(att: _Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
    """Mean max(x, 0) − x·t + log(1 + exp(−|x|)), stable for any x; x under a final Sigmoid."""
    labels = [_like_output(att, y)]
    x = _logits(att, y, "bce_with_logits", _activation(y, ("Sigmoid",)), None)
    op = att.op
    per_element = op.Add(op.Sub(op.Relu(x), op.Mul(x, labels[0])), op.Log(op.Add(op.Exp(op.Neg(op.Abs(x))), 1.0)))
    return _mean(op, per_element), labels


@_builtin("causal_lm")
def _causal_lm(att: _Attachment, y: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
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
    logits = _logits(att, y, "causal_lm", _activation(y, ("Softmax", "LogSoftmax")), 2)
    op = att.op
    # labels[:, 1:] padded with −100, as transformers shifts them: the last position counts for nothing,
    # and the logits are read whole (no slice of the largest tensor)
    following = op.Slice(labels[0], [1], [np.iinfo(np.int64).max], [1])
    shifted = op.Pad(following, [0, 0, 0, 1], np.array(IGNORE_INDEX, np.int64))
    return _softmax_cross_entropy(op, logits, shifted, 2, 3), labels


@_builtin("ctc")
def _ctc(att: _Attachment, y: ir.Value, blank: int = 0, zero_infinity: bool = False) -> tuple[ir.Value, list[ir.Value]]:
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
    logits = _logits(att, y, "ctc", _activation(y, ("Softmax", "LogSoftmax")), 2)
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
    return _mean(op, op.Div(nll, lengths)), [targets, input_lengths, target_lengths]


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


def _like_output(att: _Attachment, y: ir.Value) -> ir.Value:
    return att.label(att.label_name, y.dtype, None if y.shape is None else [dim_value(d) for d in y.shape])


def _mean(op: OpBuilder, x: ir.Value) -> ir.Value:
    return op.reduce("ReduceMean", x, None, keepdims=False)


LOSSES = tuple(_BUILTINS)


def _label_values(namer: Namer, labels, y: ir.Value) -> list[ir.Value]:
    """Label inputs of a custom loss: default one shaped and typed like the output."""
    if labels is None or isinstance(labels, str):
        shape = None if y.shape is None else [dim_value(d) for d in y.shape]
        return [fresh_value(namer, labels or "labels", y.dtype, shape)]
    values = []
    for entry in labels:
        try:
            name, dtype, shape = entry
            dtype = ir.DataType.from_numpy(np.dtype(dtype))
        except (TypeError, ValueError) as error:
            raise TrainingError(f"a label is given as (name, numpy dtype, shape), not {entry!r}") from error
        values.append(fresh_value(namer, name, dtype, shape))
    return values


def _inline_function(op: OpBuilder, function: onnx.FunctionProto, args: list[ir.Value]) -> ir.Value:
    if function.attribute or function.attribute_proto:
        raise TrainingError(f"loss function '{function.name}' takes attributes; give it without attribute parameters")
    if len(function.input) != len(args):
        raise TrainingError(f"loss function '{function.name}' takes {len(function.input)} inputs; it is called with the output and {len(args) - 1} label(s)")
    fn = ir.serde.deserialize_function(function)
    outputs, _ = op.inline(fn.graph, args)
    return outputs[0]
