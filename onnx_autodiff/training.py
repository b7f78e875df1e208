"""Training on plain onnxruntime: a forward model becomes train-step, eval and checkpoint artifacts.

onnxruntime-training is discontinued and the ``ai.onnx.preview.training`` optimisers do not run on
onnxruntime's inference build, so everything here is built from standard ONNX operators:

- :func:`generate_artifacts` differentiates ``loss(model(inputs), labels)`` with the autodiff pass
  and appends the optimiser update (SGD with momentum/nesterov/weight decay/dampening, Adam, AdamW,
  all matching ``torch.optim``), optionally after clipping the gradients by their global norm.
  The **train-step model** has the inputs ``[model inputs, labels, parameters, optimiser state,
  buffers, lr, step]`` and the outputs ``[loss, new parameters, new state, new buffers]``:
  ``lr`` is a float32 scalar, ``step`` the int64 1-based number of the step being taken (Adam's
  bias correction; SGD's first step with dampening). Buffers are BatchNormalization running
  statistics: the train model runs BatchNormalization with ``training_mode=1`` and returns the
  updated statistics; Dropout runs with ``training_mode=True`` there and ``False`` in the
  **eval model** (inputs ``[model inputs, labels, parameters, buffers]``, outputs
  ``[loss, model outputs...]``). The **checkpoint** holds the initial parameters, state and
  buffers. ``save(directory)`` writes them all with a JSON description of every name.
- Gradient accumulation (``gradient_accumulation=True``) adds two models: an *accumulate* model
  ``[batch, labels, parameters, accumulators, buffers] -> [loss, accumulators + gradients, new
  buffers]`` and an *apply* model ``[parameters, accumulators, state, lr, step, grad_scale] ->
  [new parameters, new state]`` that steps with ``grad_scale · accumulators`` (the Trainer passes
  1/k after k micro-batches, so k equal micro-batches of a mean loss step like one big batch).
- :class:`Trainer` runs these on onnxruntime, keeping parameters, state and buffers as
  ``OrtValue``\\ s on the device between steps (IO binding; outputs go to a second set of buffers
  that is swapped in only after a successful run, so a failed step changes nothing), and exports
  the trained inference model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from onnx_ir.passes.common import ShapeInferencePass

from onnx_autodiff.errors import AutodiffError, NotDifferentiableError, UnknownValueError
from onnx_autodiff.rules.builder import FLOAT_TYPES, Namer, OpBuilder

FORMAT_VERSION = 1
LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits")
OPTIMIZERS = ("sgd", "adam", "adamw")


class TrainingError(AutodiffError):
    """The training configuration cannot be built (unknown loss or optimiser, bad option, model)."""


class BatchError(AutodiffError):
    """A batch fed to a Trainer does not match the model (missing input, wrong shape or type)."""


# Optimisers: hyper-parameters are constants of the graph; lr and step are inputs of every step.


@dataclasses.dataclass(frozen=True)
class SGD:
    """torch.optim.SGD: g += wd·p; buf = momentum·buf + (1 − dampening)·g (buf = g on step 1);
    g = g + momentum·buf (nesterov) or buf; p −= lr·g."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    name = "sgd"

    def __post_init__(self):
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise TrainingError("SGD with nesterov=True needs momentum > 0 and dampening = 0")
        if self.momentum < 0 or self.weight_decay < 0:
            raise TrainingError("SGD momentum and weight_decay must be >= 0")

    def state_names(self) -> list[str]:
        return ["momentum_buffer"] if self.momentum else []


@dataclasses.dataclass(frozen=True)
class Adam:
    """torch.optim.Adam: g += wd·p; m = lerp(m, g, 1 − β1); v = β2·v + (1 − β2)·g²;
    p −= lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + eps) (√max(v) with amsgrad)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    name = "adam"
    decoupled = False

    def __post_init__(self):
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1) or self.eps < 0 or self.weight_decay < 0:
            raise TrainingError(f"{type(self).__name__} needs 0 <= betas < 1, eps >= 0 and weight_decay >= 0")

    def state_names(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW: p ·= 1 − lr·wd (decoupled weight decay), then Adam without wd."""

    weight_decay: float = 1e-2
    name = "adamw"
    decoupled = True


def make_optimizer(optimizer, **options):
    """An optimiser spec from a name ("sgd", "adam", "adamw") and torch-style options, or as given."""
    if isinstance(optimizer, (SGD, Adam)):
        return dataclasses.replace(optimizer, **options) if options else optimizer
    classes = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
    if not isinstance(optimizer, str) or optimizer.lower() not in classes:
        raise TrainingError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)} or an SGD/Adam/AdamW instance")
    cls = classes[optimizer.lower()]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TrainingError(f"{cls.__name__} has no option {unknown}; its options are {sorted(fields)}")
    if "betas" in options:
        options["betas"] = tuple(float(b) for b in options["betas"])
    return cls(**options)


def _optimizer_json(spec) -> dict:
    return {"name": spec.name, **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}}


def _optimizer_from_json(data: dict):
    data = dict(data)
    return make_optimizer(data.pop("name"), **data)


# The artifacts.


@dataclasses.dataclass
class TrainingArtifacts:
    """The models and initial state of one training setup; ``layout`` names every input and output."""

    train_model: onnx.ModelProto
    eval_model: onnx.ModelProto
    inference_model: onnx.ModelProto
    checkpoint: dict[str, np.ndarray]
    layout: dict
    accumulate_model: onnx.ModelProto | None = None
    apply_model: onnx.ModelProto | None = None

    FILES = {
        "train_model": "training_model.onnx",
        "eval_model": "eval_model.onnx",
        "inference_model": "inference_model.onnx",
        "accumulate_model": "accumulate_model.onnx",
        "apply_model": "apply_model.onnx",
    }

    @property
    def optimizer(self):
        return _optimizer_from_json(self.layout["optimizer"])

    @property
    def params(self) -> list[str]:
        return list(self.layout["params"])

    def save(self, directory: str | os.PathLike) -> dict[str, str]:
        """Writes the models, ``checkpoint.npz`` and ``artifacts.json`` (each file atomically)."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        written = {}
        for attribute, filename in self.FILES.items():
            proto = getattr(self, attribute)
            if proto is not None:
                path = os.path.join(directory, filename)
                _write_atomically(path, proto.SerializeToString(deterministic=True))
                written[attribute] = path
        path = os.path.join(directory, "checkpoint.npz")
        _write_atomically(path, _npz_bytes(self.checkpoint))
        written["checkpoint"] = path
        path = os.path.join(directory, "artifacts.json")
        _write_atomically(path, json.dumps(self.layout, indent=1, sort_keys=True).encode())
        written["layout"] = path
        return written

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TrainingArtifacts:
        directory = os.fspath(directory)
        path = os.path.join(directory, "artifacts.json")
        if not os.path.isfile(path):
            raise TrainingError(f"{directory} holds no training artifacts (no artifacts.json)")
        with open(path, encoding="utf-8") as stream:
            layout = json.load(stream)
        if layout.get("format") != FORMAT_VERSION:
            raise TrainingError(f"{path}: unsupported artifacts format {layout.get('format')!r}")
        models = {}
        for attribute, filename in cls.FILES.items():
            file = os.path.join(directory, filename)
            models[attribute] = onnx.load(file) if os.path.isfile(file) else None
        with np.load(os.path.join(directory, "checkpoint.npz")) as data:
            checkpoint = {k: data[k] for k in data.files}
        return cls(checkpoint=checkpoint, layout=layout, **models)


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _write_atomically(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".onnx-autodiff-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


# Building the graphs.


def _as_proto(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto
    if isinstance(model, ir.Model):
        return ir.to_proto(model)
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise TrainingError(f"no such model file: {os.fspath(model)}")
        return onnx.load(os.fspath(model))
    raise TrainingError(f"cannot use a {type(model).__name__} as a model: give an onnx.ModelProto, an onnx_ir.Model or a path")


def _default_opset(proto: onnx.ModelProto) -> int:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise TrainingError("the model imports no version of the default ONNX domain")


def _fresh_value(namer: Namer, hint: str, dtype: ir.DataType, shape) -> ir.Value:
    return ir.Value(name=namer.fresh(hint), type=ir.TensorType(dtype), shape=None if shape is None else ir.Shape(shape))


@dataclasses.dataclass
class _Roles:
    params: list[str]
    buffers: list[str]  # BatchNormalization running statistics updated in training mode
    opset: int


def _trainable_initializers(proto, opset: int, registry) -> set[str]:
    """Initializers read in a differentiable input position of some node (or by a subgraph):
    the default parameters, so Dropout ratios, Clip bounds and the like are not trained."""
    from onnx_autodiff.passes.autodiff import captured_values
    from onnx_autodiff.rules import default_registry

    registry = registry if registry is not None else default_registry()
    model = ir.from_proto(proto)
    inits = set(model.graph.initializers.values())
    found: set[str] = set()
    for node in model.graph:
        node_opset = model.opset_imports.get(node.domain or "", 1)
        rule = registry.lookup(node, node_opset)
        names = None
        if rule is not None:
            try:
                names = rule.input_names(node, node_opset)
            except AutodiffError:
                names = None
        for i, value in enumerate(node.inputs):
            if value in inits and (names is None or (i < len(names) and names[i] in rule.differentiable)):
                found.add(value.name)
        found.update(v.name for v in captured_values(node) if v in inits)
    return found


def _analyse(proto, requires_grad, frozen_params, freeze_batchnorm, registry=None) -> _Roles:
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = {v.name for v in graph.input}
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    opset = _default_opset(proto)
    stats: list[str] = []
    for node in graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            if opset < 14 and not freeze_batchnorm:
                raise TrainingError(
                    f"BatchNormalization node '{node.name}' is at opset {opset}: training mode with "
                    "running statistics needs opset >= 14 (convert the model with "
                    "onnx.version_converter.convert_version(model, 14)), or pass "
                    "freeze_batchnorm=True to keep its statistics fixed"
                )
            for name in node.input[3:5]:
                if name in inits and name not in stats:
                    stats.append(name)
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and 7 <= opset < 12:
            raise TrainingError(
                f"Dropout node '{node.name}' is at opset {opset}, which has no training mode: "
                "convert the model to opset >= 12 (onnx.version_converter)"
            )

    def check(names, role):
        names = [names] if isinstance(names, str) else list(names or [])
        for name in names:
            if name not in inits:
                where = "a graph input" if name in inputs else "no initializer of the model"
                raise UnknownValueError(f"{role} '{name}' is {where}; parameters must be initializers")
        return names

    frozen = set(check(frozen_params, "frozen parameter"))
    if requires_grad is None:
        used = _trainable_initializers(proto, opset, registry)
        params = [n for n, t in inits.items()
                  if t.data_type in float_types and n not in frozen and n not in stats and n in used]
    else:
        params = check(requires_grad, "parameter")
        for name in params:
            if inits[name].data_type not in float_types:
                dtype = onnx.TensorProto.DataType.Name(inits[name].data_type)
                raise NotDifferentiableError(f"parameter '{name}' is a {dtype} initializer; only floating-point initializers can be trained")
            if name in frozen:
                raise TrainingError(f"'{name}' is both a parameter to train and a frozen parameter")
            if name in stats:
                raise TrainingError(f"'{name}' is a BatchNormalization running statistic: it is updated by the forward pass, not trained")
        if len(set(params)) != len(params):
            raise TrainingError(f"requires_grad names a parameter twice: {params}")
    if not params:
        raise TrainingError("there is no parameter to train: the model has no floating-point initializer left after freezing")
    buffers = [] if freeze_batchnorm else [s for s in stats if s not in frozen]
    return _Roles(params=params, buffers=buffers, opset=opset)


def _prepare(proto, roles: _Roles, training: bool):
    """The forward model as onnx-ir with parameters and buffers as inputs and layers in the right mode.

    Returns (model, namer, buffer_updates {buffer name: new-statistic value}).
    """
    model = ir.from_proto(proto)
    graph = model.graph
    namer = Namer.for_graph(graph, prefix="train")
    updates: dict[str, ir.Value] = {}
    buffers = set(roles.buffers)
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "BatchNormalization" and roles.opset >= 14:
            stat_inputs = [v.name if v is not None else None for v in node.inputs[3:5]]
            if not any(name in buffers for name in stat_inputs):
                continue  # frozen statistics: inference mode in both models
            node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1 if training else 0)
            if training:
                if len(node.outputs) < 3:
                    node.resize_outputs(3)
                for name, out in zip(stat_inputs, node.outputs[1:3]):
                    if not out.name:
                        out.name = namer.fresh(f"{node.name or 'batchnorm'}_running")
                    if name in buffers:
                        if name in updates:
                            raise TrainingError(f"running statistic '{name}' is updated by two BatchNormalization nodes")
                        updates[name] = out
            elif len(node.outputs) > 1 and not any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
                node.resize_outputs(1)
        elif node.op_type == "Dropout" and roles.opset >= 12:
            if len(node.inputs) < 3:
                node.resize_inputs(3)
            if node.inputs[1] is None:
                node.replace_input_with(1, _constant(graph, namer, np.array(0.5, np.float32), "dropout_ratio"))
            previous = node.inputs[2]
            node.replace_input_with(2, _constant(graph, namer, np.array(training), "dropout_training"))
            if previous is not None and previous in graph.inputs and not previous.uses():
                graph.inputs.remove(previous)  # a training-mode flag input the artifacts now set
            if training and len(node.outputs) < 2:
                node.resize_outputs(2)
                node.outputs[1].name = namer.fresh(f"{node.name or 'dropout'}_mask")
    for name in [*roles.params, *roles.buffers]:
        value = graph.initializers.pop(name)
        value.const_value = None
        if value not in graph.inputs:
            graph.inputs.append(value)
    return model, namer, updates


def _constant(graph: ir.Graph, namer: Namer, array: np.ndarray, hint: str) -> ir.Value:
    value = ir.Value(name=namer.fresh(hint), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     shape=ir.Shape(array.shape), const_value=ir.Tensor(array))
    graph.register_initializer(value)
    return value


@dataclasses.dataclass
class _LossSpec:
    loss: str | Callable | onnx.FunctionProto | None
    output: str | None
    labels: object


def _attach_loss(model: ir.Model, namer: Namer, spec: _LossSpec):
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
            raise TrainingError(f"output '{name}' has shape {_shape_text([_dim(d) if _dim(d) is not None else d for d in shape])}: a loss must be a scalar")
        return loss, [], [v for v in outputs if v is not loss]
    y = outputs[names.index(spec.output)] if spec.output is not None else outputs[0]
    if y.dtype not in FLOAT_TYPES:
        raise TrainingError(f"output '{y.name}' is {y.dtype}, not a floating-point value a loss can apply to")
    op = OpBuilder(_default_opset_ir(model), namer, dict(model.opset_imports))
    if isinstance(spec.loss, str):
        if spec.loss not in LOSSES:
            raise TrainingError(f"unknown loss {spec.loss!r}: use one of {', '.join(LOSSES)}, None (the model's output is the loss) or a callable")
        label_name = spec.labels if isinstance(spec.labels, str) else "labels"
        if spec.loss == "cross_entropy":
            rank = len(y.shape) if y.shape is not None else None
            if rank is None or rank < 2:
                raise TrainingError(f"cross_entropy needs logits of shape [N, C, ...]; output '{y.name}' has shape {y.shape}")
            if op.opset < 13:
                raise TrainingError("cross_entropy uses SoftmaxCrossEntropyLoss, which needs opset >= 13; convert the model")
            dims = [_dim(d) for i, d in enumerate(y.shape) if i != 1]
            labels = [_fresh_value(namer, label_name, ir.DataType.INT64, dims)]
            loss = op.SoftmaxCrossEntropyLoss(y, labels[0], reduction="mean", ignore_index=-100)
        else:
            labels = [_fresh_value(namer, label_name, y.dtype, None if y.shape is None else [_dim(d) for d in y.shape])]
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


def _default_opset_ir(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def _dim(d):
    return d if isinstance(d, int) else (d.value if getattr(d, "value", None) is not None else None)


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
        shape = None if y.shape is None else [_dim(d) for d in y.shape]
        return [_fresh_value(namer, labels or "labels", y.dtype, shape)]
    values = []
    for entry in labels:
        try:
            name, dtype, shape = entry
            dtype = ir.DataType.from_numpy(np.dtype(dtype))
        except (TypeError, ValueError) as error:
            raise TrainingError(f"a label is given as (name, numpy dtype, shape), not {entry!r}") from error
        values.append(_fresh_value(namer, name, dtype, shape))
    return values


def _inline_function(op: OpBuilder, function: onnx.FunctionProto, args: list[ir.Value]) -> ir.Value:
    if function.attribute or function.attribute_proto:
        raise TrainingError(f"loss function '{function.name}' takes attributes; give it without attribute parameters")
    if len(function.input) != len(args):
        raise TrainingError(f"loss function '{function.name}' takes {len(function.input)} inputs; it is called with the output and {len(args) - 1} label(s)")
    fn = ir.serde.deserialize_function(function)
    outputs, _ = op.inline(fn.graph, args)
    return outputs[0]


def _emit_update(op: OpBuilder, spec, params, grads, lr: ir.Value, step: ir.Value, namer: Namer, max_grad_norm,
                 state_names=None):
    """Optimiser nodes: returns (state inputs per param, new params, new states per param)."""
    if max_grad_norm is not None:
        # torch.nn.utils.clip_grad_norm_: g ·= min(max_norm / (‖g‖₂ + 1e-6), 1) over all gradients
        squares = [op.Cast(op.ReduceSumSquare(g, keepdims=0), to=ir.DataType.FLOAT) for g in grads]
        total = op.Sqrt(op.Sum(*squares) if len(squares) > 1 else squares[0])
        coef = op.Min(op.Div(op.const(float(max_grad_norm), dtype=ir.DataType.FLOAT), op.Add(total, 1e-6)), 1.0)
        grads = [op.Mul(g, op.CastLike(coef, g)) for g in grads]
    double = ir.DataType.DOUBLE
    # scalar coefficients in float64, like torch's Python-float arithmetic, then cast per dtype
    lr_d = op.Cast(lr, to=double)
    t = op.Cast(step, to=double)
    coefficients: dict = {}

    def scalar(key, build, like):
        if (key, like.dtype) not in coefficients:
            coefficients[(key, like.dtype)] = op.Cast(build(), to=like.dtype)
        return coefficients[(key, like.dtype)]

    def d(x):
        return op.const(float(x), dtype=double)

    states, new_params, new_states = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        shape = [_dim(x) for x in p.shape]
        if state_names is None:
            inputs = [_fresh_value(namer, f"{p.name}.{s}", p.dtype, shape) for s in spec.state_names()]
        else:
            inputs = [ir.Value(name=n, type=ir.TensorType(p.dtype), shape=ir.Shape(shape)) for n in state_names[i]]
            namer.taken.update(state_names[i])
        states.append(inputs)
        outs = []
        if isinstance(spec, SGD):
            if spec.weight_decay:
                g = op.Add(g, op.Mul(p, op.const(spec.weight_decay, like=p)))
            if spec.momentum:
                buf = inputs[0]
                m = op.const(spec.momentum, like=p)
                if spec.dampening:
                    mixed = op.Add(op.Mul(buf, m), op.Mul(g, op.const(1 - spec.dampening, like=p)))
                    buf = op.Where(op.Equal(step, op.const(1, dtype=step.dtype)), g, mixed)
                else:
                    buf = op.Add(op.Mul(buf, m), g)  # buf = 0 before step 1: exactly g
                outs.append(buf)
                g = op.Add(g, op.Mul(buf, m)) if spec.nesterov else buf
            new_p = op.Sub(p, op.Mul(g, scalar("lr", lambda: lr_d, p)))
        else:
            b1, b2 = spec.betas
            m, v = inputs[0], inputs[1]
            if spec.weight_decay and not spec.decoupled:
                g = op.Add(g, op.Mul(p, op.const(spec.weight_decay, like=p)))
            if spec.weight_decay and spec.decoupled:
                p_decayed = op.Mul(p, scalar("decay", lambda: op.Sub(d(1), op.Mul(lr_d, d(spec.weight_decay))), p))
            else:
                p_decayed = p
            m = op.Add(m, op.Mul(op.Sub(g, m), op.const(1 - b1, like=p)))
            v = op.Add(op.Mul(v, op.const(b2, like=p)), op.Mul(op.Mul(g, g), op.const(1 - b2, like=p)))
            outs += [m, v]
            second = v
            if spec.amsgrad:
                second = op.Max(inputs[2], v)
                outs.append(second)
            # lr/bc1 · m / (√v/√bc2 + eps) = (lr·√bc2/bc1) · m / (√v + eps·√bc2): one pass fewer
            def bc2_sqrt():
                return op.Sqrt(op.Sub(d(1), op.Pow(d(b2), t)))

            eps = scalar("eps", lambda: op.Mul(bc2_sqrt(), d(spec.eps)), p)
            step_size = scalar("step_size", lambda: op.Div(op.Mul(lr_d, bc2_sqrt()), op.Sub(d(1), op.Pow(d(b1), t))), p)
            denom = op.Add(op.Sqrt(second), eps)
            new_p = op.Sub(p_decayed, op.Mul(op.Div(m, denom), step_size))
        new_params.append(new_p)
        new_states.append(outs)
    return states, new_params, new_states


def _publish(op: OpBuilder, namer: Namer, value: ir.Value, hint: str, taken: set, like: ir.Value | None = None) -> ir.Value:
    """``value`` as a graph output named after ``hint`` and typed like ``like`` (an Identity where it
    cannot be renamed)."""
    if value.producer() is None or value in taken or value.is_graph_output() or value.is_graph_input():
        value = op.Identity(value)
    taken.add(value)
    value.name = None
    value.name = namer.fresh(hint)
    if like is not None:
        value.type, value.shape = like.type, like.shape
    return value


def _finish(model: ir.Model, inputs: list[ir.Value], outputs: list[ir.Value], what: str) -> onnx.ModelProto:
    from onnx_autodiff.passes import cleanup_passes

    graph = model.graph
    graph.inputs.clear()
    graph.inputs.extend(inputs)
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    model = ir.passes.PassManager(cleanup_passes())(model).model
    if any(v.shape is None or v.type is None for v in graph.outputs):
        ShapeInferencePass(strict_mode=False)(model)
    untyped = [v.name for v in graph.outputs if v.shape is None or v.type is None]
    if untyped:
        raise TrainingError(f"the shapes of {untyped} are unknown: declare them in the model's outputs or value_info")
    proto = ir.to_proto(model)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as error:
        first = str(error).strip().splitlines()[0]
        raise TrainingError(f"the generated {what} fails the ONNX checker (a bug, please report): {first}") from error
    return proto


def generate_artifacts(
    model,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: str | Callable | onnx.FunctionProto | None = "cross_entropy",
    optimizer="adamw",
    *,
    optimizer_options: Mapping | None = None,
    output: str | None = None,
    labels=None,
    max_grad_norm: float | None = None,
    gradient_accumulation: bool = False,
    freeze_batchnorm: bool = False,
    registry=None,
) -> TrainingArtifacts:
    """The training artifacts of ``model`` (an onnx.ModelProto, onnx_ir.Model or path).

    requires_grad: initializers to train (default: every floating-point initializer that is
    neither in ``frozen_params`` nor a BatchNormalization running statistic).
    loss: "cross_entropy" (logits [N, C, ...], int64 class labels, mean, ignore_index −100),
    "mse", "l1", "bce_with_logits" (labels shaped like the output), None (the model's scalar
    output ``output`` is the loss), or a custom loss: a callable ``f(op, output, *labels)`` returning
    the scalar loss built with the :class:`~onnx_autodiff.rules.builder.OpBuilder` ``op``, or an
    onnx.FunctionProto with inputs ``[output, *labels]`` and the loss as first output.
    output: the model output the loss applies to (default: the first).
    labels: the label input's name (a str) or, for a custom loss, a list of (name, numpy dtype,
    shape) (default: one input "labels" shaped and typed like the output).
    optimizer: "sgd", "adam", "adamw" with ``optimizer_options`` (torch names: lr, momentum,
    dampening, nesterov, weight_decay, betas, eps, amsgrad), or an SGD/Adam/AdamW instance.
    max_grad_norm: clip the gradients by their global L2 norm (torch.nn.utils.clip_grad_norm_).
    gradient_accumulation: also build the accumulate and apply models.
    freeze_batchnorm: keep BatchNormalization in inference mode with fixed statistics.
    """
    spec = make_optimizer(optimizer, **dict(optimizer_options or {}))
    forward = _as_proto(model)
    proto = onnx.ModelProto()
    proto.CopyFrom(forward)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - shapes are a help, not a requirement
        pass
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise TrainingError(f"max_grad_norm must be > 0, not {max_grad_norm}")
    roles = _analyse(proto, requires_grad, frozen_params, freeze_batchnorm, registry)
    loss_spec = _LossSpec(loss, output, labels)
    batch_inputs = [v.name for v in proto.graph.input if v.name not in {t.name for t in proto.graph.initializer}]

    train = _build_train(proto, roles, loss_spec, spec, max_grad_norm, "train", registry)
    eval_model, eval_layout = _build_eval(proto, roles, loss_spec)
    layout = {
        "format": FORMAT_VERSION,
        "inputs": batch_inputs,
        "labels": train["labels"],
        "params": roles.params,
        "buffers": roles.buffers,
        "optimizer": _optimizer_json(spec),
        "max_grad_norm": max_grad_norm,
        "train": train["layout"],
        "eval": eval_layout,
    }
    checkpoint = {}
    inits = {t.name: t for t in proto.graph.initializer}
    for name in [*roles.params, *roles.buffers]:
        checkpoint[name] = numpy_helper.to_array(inits[name]).copy()
    for param, names in train["state"].items():
        for state in names:
            checkpoint[state] = np.zeros_like(checkpoint[param])
    artifacts = TrainingArtifacts(train["model"], eval_model, forward, checkpoint, layout)
    if gradient_accumulation:
        accumulate = _build_train(proto, roles, loss_spec, spec, max_grad_norm, "accumulate", registry)
        accumulators = [key for key, _, _ in accumulate["layout"]["carry"][: len(roles.params)]]
        apply_model, apply_layout = _build_apply(proto, roles, spec, max_grad_norm, train["state"], accumulators)
        artifacts.accumulate_model = accumulate["model"]
        artifacts.apply_model = apply_model
        layout["accumulate"] = accumulate["layout"]
        layout["apply"] = apply_layout
    return artifacts


def _build_train(proto, roles: _Roles, loss_spec, spec, max_grad_norm, kind: str, registry):
    from onnx_autodiff.passes import AutodiffPass

    model, namer, updates = _prepare(proto, roles, training=True)
    graph = model.graph
    batch = [v for v in graph.inputs if v.name not in set(roles.params) | set(roles.buffers)]
    loss, labels, _ = _attach_loss(model, namer, loss_spec)
    graph.outputs.clear()
    graph.outputs.append(loss)
    graph.inputs.extend(labels)
    autodiff = AutodiffPass(of=loss.name, wrt=roles.params, registry=registry, seed="ones", unreachable="raise")
    try:
        autodiff(model)
    except (ir.passes.PassError, AutodiffError) as error:
        cause = error
        while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, NotDifferentiableError) and "does not depend" in str(cause):
            raise TrainingError(f"{cause}: list it in frozen_params, or leave it out of requires_grad") from error
        raise cause from error
    grads = list(graph.outputs[1:])
    namer = Namer.for_graph(graph, prefix="opt")
    op = OpBuilder(_default_opset_ir(model), namer, dict(model.opset_imports))
    params = [next(v for v in graph.inputs if v.name == p) for p in roles.params]
    taken: set = set()
    loss_out = _publish(op, namer, loss, "loss", taken) if loss.is_graph_input() else loss
    taken.add(loss_out)
    carry, state_layout = [], {}
    extra_inputs: list[ir.Value] = []
    outputs = [loss_out]
    scalars = {}
    if kind == "train":
        lr = _fresh_value(namer, "lr", ir.DataType.FLOAT, [])
        step = _fresh_value(namer, "step", ir.DataType.INT64, [])
        states, new_params, new_states = _emit_update(op, spec, params, grads, lr, step, namer, max_grad_norm)
        for p, new_p in zip(params, new_params):
            outputs.append(_publish(op, namer, new_p, f"{p.name}.new", taken, like=p))
            carry.append([p.name, p.name, outputs[-1].name])
        for p, inputs, news in zip(params, states, new_states):
            state_layout[p.name] = [s.name for s in inputs]
            for s, new_s in zip(inputs, news):
                outputs.append(_publish(op, namer, new_s, f"{s.name}.new", taken, like=s))
                carry.append([s.name, s.name, outputs[-1].name])
                extra_inputs.append(s)
        scalars = {"lr": lr.name, "step": step.name}
        tail = [lr, step]
    else:  # accumulate: acc + grad
        tail = []
        for p, g in zip(params, grads):
            acc = _fresh_value(namer, f"{p.name}.grad_acc", g.dtype or p.dtype, [_dim(x) for x in p.shape])
            extra_inputs.append(acc)
            outputs.append(_publish(op, namer, op.Add(acc, g), f"{acc.name}.new", taken, like=acc))
            carry.append([acc.name, acc.name, outputs[-1].name])
    for name in roles.buffers:
        value = updates.get(name)
        if value is None:
            continue
        buffer = next(v for v in graph.inputs if v.name == name)
        outputs.append(_publish(op, namer, value, f"{name}.new", taken, like=buffer))
        carry.append([name, name, outputs[-1].name])
    graph.extend(op.nodes)
    for domain, version in op.opsets.items():
        model.opset_imports.setdefault(domain, version)
    buffer_inputs = [v for v in graph.inputs if v.name in set(roles.buffers)]
    inputs = [*batch, *labels, *params, *extra_inputs, *buffer_inputs, *tail]
    proto_out = _finish(model, inputs, outputs, f"{kind} model")
    layout = {
        "batch": [v.name for v in (*batch, *labels)],
        "carry": carry,
        "reads": [] if kind == "train" else [[p.name, p.name] for p in params],
        "scalars": scalars,
        "loss": loss_out.name,
    }
    return {"model": proto_out, "layout": layout, "labels": [v.name for v in labels], "state": state_layout}


def _build_eval(proto, roles: _Roles, loss_spec):
    model, namer, _ = _prepare(proto, roles, training=False)
    graph = model.graph
    batch = [v for v in graph.inputs if v.name not in set(roles.params) | set(roles.buffers)]
    reads = [v for v in graph.inputs if v.name in set(roles.params) | set(roles.buffers)]
    loss, labels, others = _attach_loss(model, namer, loss_spec)
    op = OpBuilder(_default_opset_ir(model), namer, dict(model.opset_imports))
    taken: set = set()
    loss_out = _publish(op, namer, loss, "loss", taken) if loss.is_graph_input() else loss
    taken.add(loss_out)
    outputs = [loss_out]
    for value in others:
        if value is not loss:
            if value.is_graph_input() or value in taken:
                name = value.name
                value = op.Identity(value)
                value.name = namer.fresh(name)
            taken.add(value)
            outputs.append(value)
    graph.extend(op.nodes)
    proto_out = _finish(model, [*batch, *labels, *reads], outputs, "eval model")
    layout = {
        "batch": [v.name for v in (*batch, *labels)],
        "reads": [[v.name, v.name] for v in reads],
        "loss": loss_out.name,
        "outputs": [v.name for v in outputs[1:]],
    }
    return proto_out, layout


def _build_apply(proto, roles: _Roles, spec, max_grad_norm, state: dict, accumulators: list[str]):
    inits = {t.name: t for t in proto.graph.initializer}
    reserved = [n for names in state.values() for n in names] + accumulators
    namer = Namer([v.name for v in proto.graph.input] + list(inits) + reserved, prefix="opt")
    opset = max(_default_opset(proto), 13)
    op = OpBuilder(opset, namer, {"": opset})
    params, accs = [], []
    for name, acc in zip(roles.params, accumulators):
        t = inits[name]
        dtype = ir.DataType(t.data_type)
        params.append(ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(t.dims))))
        accs.append(ir.Value(name=acc, type=ir.TensorType(dtype), shape=ir.Shape(list(t.dims))))
    lr = _fresh_value(namer, "lr", ir.DataType.FLOAT, [])
    step = _fresh_value(namer, "step", ir.DataType.INT64, [])
    scale = _fresh_value(namer, "grad_scale", ir.DataType.FLOAT, [])
    grads = [op.Mul(a, op.CastLike(scale, a)) for a in accs]
    states, new_params, new_states = _emit_update(op, spec, params, grads, lr, step, namer, max_grad_norm,
                                                  [state.get(p, []) for p in roles.params])
    taken: set = set()
    outputs, carry = [], []
    for p, new_p in zip(params, new_params):
        outputs.append(_publish(op, namer, new_p, f"{p.name}.new", taken, like=p))
        carry.append([p.name, p.name, outputs[-1].name])
    for inputs, news in zip(states, new_states):
        for s, new_s in zip(inputs, news):
            outputs.append(_publish(op, namer, new_s, f"{s.name}.new", taken, like=s))
            carry.append([s.name, s.name, outputs[-1].name])
    state_inputs = [s for inputs in states for s in inputs]
    graph = ir.Graph([*params, *accs, *state_inputs, lr, step, scale], outputs, nodes=op.nodes,
                     opset_imports={"": opset}, name="apply")
    model = ir.Model(graph, ir_version=max(proto.ir_version, 8), producer_name="onnx-autodiff")
    proto_out = _finish(model, list(graph.inputs), outputs, "apply model")
    layout = {
        "batch": [],
        "carry": carry,
        "reads": [[a.name, a.name] for a in accs],
        "scalars": {"lr": lr.name, "step": step.name, "grad_scale": scale.name},
        "loss": None,
    }
    return proto_out, layout


# Running the artifacts on onnxruntime.

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16,
}


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime has it, then CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class _Runner:
    """One model's session, its input metadata and its IO bindings (one per buffer parity)."""

    def __init__(self, trainer: Trainer, proto: onnx.ModelProto, layout: dict, kind: str) -> None:
        import onnxruntime as ort

        self.trainer, self.layout, self.kind = trainer, layout, kind
        self.session = ort.InferenceSession(
            proto.SerializeToString(), sess_options=trainer.session_options, providers=trainer.providers
        )
        meta = {i.name: i for i in self.session.get_inputs()}
        self.batch = [(name, _ORT_TYPES.get(meta[name].type), meta[name].shape) for name in layout["batch"]]
        self.carry = [tuple(entry) for entry in layout.get("carry", [])]
        self.reads = [tuple(entry) for entry in layout.get("reads", [])]
        self.scalars = {
            key: (name, _ORT_TYPES[meta[name].type], self._scalar(_ORT_TYPES[meta[name].type]))
            for key, name in layout.get("scalars", {}).items()
        }
        self.loss = layout.get("loss")
        self.loss_value = self._scalar(np.float32) if self.loss and kind != "eval" else None
        self.bindings: dict[tuple, object] = {}

    def _scalar(self, dtype):
        from onnxruntime import OrtValue

        return OrtValue.ortvalue_from_numpy(np.zeros((), dtype), self.trainer.device, 0)

    def feeds(self, batch) -> list[tuple[str, np.ndarray]]:
        """The batch as contiguous arrays of the model's dtypes, checked against the declared shapes."""
        names = [name for name, _, _ in self.batch]
        if isinstance(batch, Mapping):
            missing = [n for n in names if n not in batch]
            extra = sorted(set(batch) - set(names))
            if missing or extra:
                raise BatchError(
                    f"the {self.kind} model takes the batch inputs {names}"
                    + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "")
                )
            values = [batch[n] for n in names]
        else:
            values = list(batch) if isinstance(batch, (list, tuple)) else [batch]
            if len(values) != len(names):
                raise BatchError(f"the {self.kind} model takes {len(names)} batch inputs {names}, not {len(values)}")
        sizes: dict[str, tuple[int, str]] = {}
        feeds = []
        for (name, dtype, shape), value in zip(self.batch, values):
            array = np.asarray(value)
            if dtype is not None and array.dtype != dtype:
                if not np.can_cast(array.dtype, dtype, "same_kind"):
                    raise BatchError(f"batch input '{name}' is {array.dtype}; the model expects {np.dtype(dtype).name}")
                array = array.astype(dtype)
            if shape is not None:
                if array.ndim != len(shape):
                    raise BatchError(f"batch input '{name}' has shape {array.shape}; the model expects rank {len(shape)} {_shape_text(shape)}")
                for axis, (want, got) in enumerate(zip(shape, array.shape)):
                    if isinstance(want, int) and want != got:
                        raise BatchError(f"batch input '{name}' has shape {array.shape}; the model expects {_shape_text(shape)} (axis {axis} must be {want})")
                    if isinstance(want, str) and want:
                        seen = sizes.setdefault(want, (got, name))
                        if seen[0] != got:
                            raise BatchError(
                                f"batch input '{name}' has shape {array.shape}, but its axis {axis} ({want}) must match "
                                f"'{seen[1]}', where {want} = {seen[0]}"
                            )
            feeds.append((name, np.ascontiguousarray(array)))
        return feeds

    def binding(self):
        trainer = self.trainer
        keys = [key for key, _, _ in self.carry] + [key for key, _ in self.reads]
        signature = tuple(trainer._parity(key) for key in keys)
        binding = self.bindings.get(signature)
        if binding is None:
            binding = self.session.io_binding()
            for key, name, out in self.carry:
                binding.bind_ortvalue_input(name, trainer._value(key))
                binding.bind_ortvalue_output(out, trainer._value(key, spare=True))
            for key, name in self.reads:
                binding.bind_ortvalue_input(name, trainer._value(key))
            for name, _, value in self.scalars.values():
                binding.bind_ortvalue_input(name, value)
            if self.loss_value is not None:
                binding.bind_ortvalue_output(self.loss, self.loss_value)
            self.bindings[signature] = binding
        return binding

    def run(self, batch, scalars: Mapping[str, float]) -> float | None:
        from onnxruntime import OrtValue

        feeds = self.feeds(batch) if self.batch else []
        binding = self.binding()
        device = self.trainer.device
        alive = []
        for name, array in feeds:
            value = OrtValue.ortvalue_from_numpy(array, device, 0)
            alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for key, number in scalars.items():
            _, dtype, value = self.scalars[key]
            value.update_inplace(np.asarray(number, dtype))
        try:
            self.session.run_with_iobinding(binding)
        except Exception as error:  # noqa: BLE001 - onnxruntime raises its own types
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TrainingError(f"the {self.kind} step failed on onnxruntime; nothing was updated: {first}") from error
        for key, _, _ in self.carry:
            self.trainer._swap(key)
        return float(self.loss_value.numpy()) if self.loss_value is not None else None


def _shape_text(shape) -> str:
    return "[" + ", ".join("?" if d is None or (hasattr(d, "value") and d.value is None) else str(getattr(d, "value", d)) for d in shape) + "]"


class Trainer:
    """Runs training artifacts on onnxruntime; parameters, state and buffers stay on the device.

    ``step(batch)`` takes the batch as a dict or in the order of ``batch_names`` (model inputs, then
    labels) and returns the loss; ``accumulate(batch)`` / ``apply()`` do the same in micro-batches
    (artifacts built with ``gradient_accumulation=True``); ``evaluate(batch)`` runs the eval model;
    ``export()`` returns the inference model with the trained initializers.
    """

    def __init__(self, artifacts: TrainingArtifacts | str | os.PathLike, lr: float | None = None,
                 providers: Sequence | None = None, session_options=None, checkpoint: Mapping | None = None) -> None:
        import onnxruntime as ort

        if not isinstance(artifacts, TrainingArtifacts):
            artifacts = TrainingArtifacts.load(artifacts)
        self.artifacts = artifacts
        self.layout = artifacts.layout
        self.optimizer = artifacts.optimizer
        self.lr = float(self.optimizer.lr if lr is None else lr)
        self.providers = list(providers) if providers is not None else default_providers()
        if session_options is None:
            session_options = ort.SessionOptions()
            session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session_options = session_options
        self._values: dict[str, list] = {}
        self._current: dict[str, int] = {}
        self._runners: dict[str, _Runner] = {}
        self.step_count = 0
        self._micro_batches = 0
        first = self.providers[0] if self.providers else "CPUExecutionProvider"
        first = first[0] if isinstance(first, tuple) else first
        self.device = "cuda" if first == "CUDAExecutionProvider" else "cpu"
        self._runner("train")
        self.load_state_dict(checkpoint if checkpoint is not None else artifacts.checkpoint)

    # state storage: two OrtValues per key, the current one and a spare the next step writes

    def _value(self, key: str, spare: bool = False):
        pair = self._values[key]
        index = self._current[key] ^ int(spare)
        if pair[index] is None:
            from onnxruntime import OrtValue

            current = pair[self._current[key]]
            pair[index] = OrtValue.ortvalue_from_shape_and_type(
                current.shape(), _ORT_TYPES[current.data_type()], self.device, 0
            )
        return pair[index]

    def _parity(self, key: str) -> int:
        if key not in self._values:
            raise TrainingError(f"the checkpoint has no value for '{key}'")
        return self._current[key]

    def _swap(self, key: str) -> None:
        self._current[key] ^= 1

    def _set(self, key: str, array: np.ndarray) -> None:
        from onnxruntime import OrtValue

        array = np.ascontiguousarray(array)
        pair = self._values.get(key)
        if pair is not None:
            current = pair[self._current[key]]
            if tuple(current.shape()) == array.shape and _ORT_TYPES[current.data_type()] == array.dtype:
                current.update_inplace(array)
                return
        self._values[key] = [OrtValue.ortvalue_from_numpy(array.copy(), self.device, 0), None]
        self._current[key] = 0
        for runner in self._runners.values():
            runner.bindings.clear()

    def _runner(self, kind: str) -> _Runner:
        if kind not in self._runners:
            proto = {"train": self.artifacts.train_model, "eval": self.artifacts.eval_model,
                     "accumulate": self.artifacts.accumulate_model, "apply": self.artifacts.apply_model}[kind]
            if proto is None:
                raise TrainingError(f"these artifacts have no {kind} model: generate them with gradient_accumulation=True")
            self._runners[kind] = _Runner(self, proto, self.layout[kind], kind)
        return self._runners[kind]

    @property
    def batch_names(self) -> list[str]:
        return list(self.layout["train"]["batch"])

    # training

    def step(self, batch, lr: float | None = None) -> float:
        """One optimiser step on ``batch``; returns the loss (before the update)."""
        if self._micro_batches:
            raise TrainingError("accumulated gradients are pending: call apply() before step()")
        loss = self._runner("train").run(batch, {"lr": self.lr if lr is None else lr, "step": self.step_count + 1})
        self.step_count += 1
        return loss

    def accumulate(self, batch) -> float:
        """Adds the gradients of ``batch`` to the accumulators; returns its loss."""
        runner = self._runner("accumulate")
        if self._micro_batches == 0:  # the accumulators come first in carry, one per parameter read
            for (acc, _, _), (param, _) in zip(runner.carry, runner.reads):
                value = self._value(param)
                self._set(acc, np.zeros(value.shape(), _ORT_TYPES[value.data_type()]))
        loss = runner.run(batch, {})
        self._micro_batches += 1
        return loss

    def apply(self, lr: float | None = None) -> None:
        """One optimiser step with the mean of the accumulated gradients."""
        if self._micro_batches == 0:
            raise TrainingError("apply() needs accumulate() first: no gradient has been accumulated")
        scalars = {"lr": self.lr if lr is None else lr, "step": self.step_count + 1,
                   "grad_scale": 1.0 / self._micro_batches}
        self._runner("apply").run(None, scalars)
        self.step_count += 1
        self._micro_batches = 0

    def evaluate(self, batch) -> dict[str, np.ndarray]:
        """The eval model on ``batch`` (inputs and labels): {"loss": ..., model outputs...}."""
        from onnxruntime import OrtValue

        runner = self._runner("eval")
        binding = runner.session.io_binding()
        alive = []
        for name, array in runner.feeds(batch):
            value = OrtValue.ortvalue_from_numpy(array, self.device, 0)
            alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for key, name in runner.reads:
            binding.bind_ortvalue_input(name, self._value(key))
        names = [runner.loss, *self.layout["eval"]["outputs"]]
        for name in names:
            binding.bind_output(name, self.device)
        try:
            runner.session.run_with_iobinding(binding)
        except Exception as error:  # noqa: BLE001
            raise TrainingError(f"the eval model failed on onnxruntime: {str(error).strip().splitlines()[0]}") from error
        results = dict(zip(names, binding.copy_outputs_to_cpu()))
        results["loss"] = results.pop(runner.loss)
        return results

    # state

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: self._value(name).numpy() for name in self.layout["params"]}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, optimiser state and buffers as numpy arrays, with ``__step__``."""
        state = {key: self._value(key).numpy() for key in self.artifacts.checkpoint}
        state["__step__"] = np.array(self.step_count, np.int64)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        missing = sorted(set(self.artifacts.checkpoint) - set(state))
        if missing:
            raise TrainingError(f"the checkpoint lacks {missing}")
        for key in self.artifacts.checkpoint:
            want = self.artifacts.checkpoint[key]
            array = np.asarray(state[key])
            if array.shape != want.shape:
                raise TrainingError(f"checkpoint value '{key}' has shape {array.shape}, not {want.shape}")
            self._set(key, array.astype(want.dtype, copy=False))
        self.step_count = int(state.get("__step__", 0))
        self._micro_batches = 0

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        _write_atomically(os.fspath(path), _npz_bytes(self.state_dict()))

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        with np.load(os.fspath(path)) as data:
            self.load_state_dict({k: data[k] for k in data.files})

    def export(self, path: str | os.PathLike | None = None) -> onnx.ModelProto:
        """The inference (forward) model with the trained parameters and buffers as initializers."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self.artifacts.inference_model)
        trained = {key: self._value(key).numpy() for key in [*self.layout["params"], *self.layout["buffers"]]}
        for i, tensor in enumerate(proto.graph.initializer):
            if tensor.name in trained:
                proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(trained[tensor.name], tensor.name))
        if path is not None:
            _write_atomically(os.fspath(path), proto.SerializeToString(deterministic=True))
        return proto


# Command line (``onnx-autodiff artifacts``) and demo.


def add_arguments(parser) -> None:
    """Arguments of ``onnx-autodiff artifacts MODEL -o DIR``."""
    parser.add_argument("model", help="forward .onnx model")
    parser.add_argument("-o", "--output", required=True, help="directory to write the artifacts to")
    parser.add_argument("--loss", default="cross_entropy", choices=[*LOSSES, "none"],
                        help="loss on the model's output; 'none': the model's output is the loss (default cross_entropy)")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="default adamw")
    parser.add_argument("--requires-grad", nargs="+", metavar="NAME", help="initializers to train (default: every float initializer)")
    parser.add_argument("--frozen", nargs="+", metavar="NAME", help="initializers to keep fixed")
    parser.add_argument("--output-name", metavar="NAME", help="the model output the loss applies to (default: the first)")
    parser.add_argument("--lr", type=float, help="default learning rate recorded in the artifacts")
    parser.add_argument("--momentum", type=float, help="SGD momentum")
    parser.add_argument("--nesterov", action="store_true", help="SGD Nesterov momentum")
    parser.add_argument("--weight-decay", type=float, help="weight decay (AdamW: decoupled)")
    parser.add_argument("--max-grad-norm", type=float, help="clip gradients by their global L2 norm")
    parser.add_argument("--gradient-accumulation", action="store_true", help="also write the accumulate and apply models")


def run(args) -> int:
    """``onnx-autodiff artifacts``: writes the artifacts; exit 0, or raises an AutodiffError."""
    options = {k: v for k, v in (("lr", args.lr), ("momentum", args.momentum), ("weight_decay", args.weight_decay)) if v is not None}
    if args.nesterov:
        options["nesterov"] = True
    if args.optimizer != "sgd" and ("momentum" in options or args.nesterov):
        raise TrainingError("--momentum and --nesterov apply to --optimizer sgd only")
    if not os.path.isfile(args.model):
        raise TrainingError(f"no such model file: {args.model}")
    start = time.perf_counter()
    artifacts = generate_artifacts(
        args.model, requires_grad=args.requires_grad, frozen_params=args.frozen,
        loss=None if args.loss == "none" else args.loss, optimizer=args.optimizer, optimizer_options=options,
        output=args.output_name, max_grad_norm=args.max_grad_norm, gradient_accumulation=args.gradient_accumulation,
    )
    written = artifacts.save(args.output)
    seconds = time.perf_counter() - start
    print(
        f"wrote {len(written)} files to {args.output} in {seconds:.2f} s: {len(artifacts.params)} parameters "
        f"({', '.join(artifacts.params[:6])}{', ...' if len(artifacts.params) > 6 else ''}), "
        f"{args.optimizer}, train model {len(artifacts.train_model.graph.node)} nodes"
    )
    return 0


def run_training_demo(steps: int = 150, out=print) -> int:
    """Builds artifacts for an MLP with BatchNormalization and Dropout, trains it with AdamW on
    onnxruntime, exports it and checks the exported model's accuracy; 0 on success."""
    import onnxruntime as ort

    from onnx_autodiff.demo import CLASSES, FEATURES, blobs

    hidden = 32
    rng = np.random.default_rng(0)

    def init(name, *shape, scale=None, fill=None):
        array = np.full(shape, fill, np.float32) if fill is not None else (rng.standard_normal(shape) * scale).astype(np.float32)
        return numpy_helper.from_array(array, name)

    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["hn"]),
        helper.make_node("Relu", ["hn"], ["a"]),
        helper.make_node("Dropout", ["a", "ratio"], ["d"]),
        helper.make_node("Gemm", ["d", "W2", "b2"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", CLASSES])],
        [init("W1", hidden, FEATURES, scale=(2 / FEATURES) ** 0.5), init("b1", hidden, fill=0),
         init("gamma", hidden, fill=1), init("beta", hidden, fill=0), init("mean", hidden, fill=0),
         init("var", hidden, fill=1), numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
         init("W2", CLASSES, hidden, scale=(1 / hidden) ** 0.5), init("b2", CLASSES, fill=0)],
    )
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    start = time.perf_counter()
    artifacts = generate_artifacts(forward, loss="cross_entropy", optimizer="adamw", optimizer_options={"lr": 1e-2})
    build = time.perf_counter() - start
    X, labels = blobs(seed=1, samples=512)
    Xt, lt = blobs(seed=1, samples=768)
    Xt, lt = Xt[512:], lt[512:]
    trainer = Trainer(artifacts)
    before = trainer.evaluate({"X": Xt, "labels": lt})
    start = time.perf_counter()
    for i in range(steps):
        rows = slice((i * 64) % 512, (i * 64) % 512 + 64)
        loss = trainer.step({"X": X[rows], "labels": labels[rows]})
    seconds = time.perf_counter() - start
    after = trainer.evaluate({"X": Xt, "labels": lt})
    exported = trainer.export()
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"X": Xt})[0]
    accuracy = float(np.mean(logits.argmax(1) == lt))
    same = np.allclose(logits, after["logits"], atol=1e-5)
    out("onnx-autodiff training demo: MLP 16-32-4 with BatchNormalization and Dropout, AdamW, plain onnxruntime")
    out(f"  artifacts      train {len(artifacts.train_model.graph.node)} nodes, eval {len(artifacts.eval_model.graph.node)} nodes, built in {build:.2f} s")
    out(f"  training       {steps} steps of 64 in {seconds:.2f} s ({seconds / steps * 1e3:.2f} ms/step), last loss {loss:.4f}")
    out(f"  held-out loss  {float(before['loss']):.4f} -> {float(after['loss']):.4f}")
    out(f"  exported model accuracy {accuracy:.1%} (matches eval model: {same})")
    ok = float(after["loss"]) < float(before["loss"]) and accuracy > 0.8 and same
    out("  result         " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1
