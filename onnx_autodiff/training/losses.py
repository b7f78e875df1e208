"""Losses appended to a forward model: the built-in ones, the model's own output, custom functions.

A built-in loss is one function registered by name (:func:`register_loss`) in its family's module
of :mod:`~onnx_autodiff.training.loss_functions`: given the attachment (builder, namer, the spec)
and the model output, it returns the scalar loss and the label inputs it made. :data:`LOSSES`
names those registered.

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

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError, UnknownValueError
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, OpBuilder
from onnx_autodiff.training import loss_functions  # noqa: F401  (registers the built-in losses)
from onnx_autodiff.training.loss_functions.base import BUILTIN_LOSSES, Attachment, LossSpec, register_loss
from onnx_autodiff.training.loss_functions.classes import IGNORE_INDEX, class_axis
from onnx_autodiff.training.values import dim_value, fresh_value, shape_text

__all__ = ["BUILTIN_LOSSES", "IGNORE_INDEX", "LOSSES", "BuiltinLoss", "LossSpec", "attach_loss", "class_axis",
           "register_loss"]

# The built-in losses' names, as registered (the command line's --loss choices).
LOSSES = BUILTIN_LOSSES.names


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
        build = BUILTIN_LOSSES.get(builtin.name)
        if build is None:
            raise TrainingError(f"unknown loss {builtin.name!r}: use one of {', '.join(LOSSES)}, None (the model's output is the loss) or a callable")
        try:
            inspect.signature(build).bind(None, None, **builtin.options)
        except TypeError as error:
            raise TrainingError(f"loss {builtin.name!r} does not take the options {builtin.options}: {error}") from error
        loss, labels = build(Attachment(model, op, namer, spec), y, **builtin.options)
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
