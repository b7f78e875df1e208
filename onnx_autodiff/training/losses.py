"""Losses appended to a forward model: the built-in ones, the model's own output, custom functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import OpsetTooOldError, TrainingError, UnknownValueError
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, OpBuilder, shapes
from onnx_autodiff.training.values import dim_value, fresh_value, shape_text

LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits")


@dataclasses.dataclass
class LossSpec:
    loss: str | Callable | onnx.FunctionProto | None
    output: str | None
    labels: object


class LossOpsetError(TrainingError, OpsetTooOldError):
    """A loss needs a newer default-domain opset than the model imports: an OpsetTooOldError too, so
    that generate_artifacts converts the model where its upgrade_opset allows, as it does for a rule."""


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
    if isinstance(spec.loss, str):
        if spec.loss not in LOSSES:
            raise TrainingError(f"unknown loss {spec.loss!r}: use one of {', '.join(LOSSES)}, None (the model's output is the loss) or a callable")
        label_name = spec.labels if isinstance(spec.labels, str) else "labels"
        if spec.loss == "cross_entropy":
            rank = shapes.rank(y)
            if rank is None or rank < 2:
                raise TrainingError(f"cross_entropy needs logits of shape [N, C, ...]; output '{y.name}' has shape {y.shape}")
            if op.opset < 13:
                raise LossOpsetError("cross_entropy uses SoftmaxCrossEntropyLoss, which needs opset >= 13; convert "
                                     "the model", 13)
            dims = [dim_value(d) for i, d in enumerate(y.shape) if i != 1]
            labels = [fresh_value(namer, label_name, ir.DataType.INT64, dims)]
            loss = op.SoftmaxCrossEntropyLoss(y, labels[0], reduction="mean", ignore_index=-100)
        else:
            labels = [fresh_value(namer, label_name, y.dtype, None if y.shape is None else [dim_value(d) for d in y.shape])]
            loss = _builtin_loss(op, spec.loss, y, labels[0])
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


def _builtin_loss(op: OpBuilder, name: str, y: ir.Value, t: ir.Value) -> ir.Value:
    if name == "mse":  # mean (y − t)²
        d = op.Sub(y, t)
        per_element = op.Mul(d, d)
    elif name == "l1":  # mean |y − t|
        per_element = op.Abs(op.Sub(y, t))
    else:  # bce_with_logits: mean max(x, 0) − x·t + log(1 + exp(−|x|)), stable for any x
        per_element = op.Add(op.Sub(op.Relu(y), op.Mul(y, t)), op.Log(op.Add(op.Exp(op.Neg(op.Abs(y))), 1.0)))
    return op.reduce("ReduceMean", per_element, None, keepdims=False)


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
