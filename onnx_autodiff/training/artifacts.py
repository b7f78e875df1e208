"""Training artifacts: the train-step, eval, accumulate and apply models built from a forward model."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from onnx_autodiff.files import json_text, write_atomically
from onnx_autodiff.errors import (
    AutodiffError,
    NotDifferentiableError,
    TrainingError,
    TrainingOpsetError,
    UnknownValueError,
    names_summary,
)
from onnx_autodiff.modelfile import (
    base_dir_of,
    check_model,
    external_files,
    from_proto,
    full_output_check,
    reading_written,
    over_limit,
    save_model,
    tensor_array,
    to_proto,
    uses_external_data,
    with_small_tensors_inline,
)
from onnx_autodiff.toolkit.inference import fully_shaped, onnx_inferred, take_inferred_types
from onnx_autodiff.training.lora import LoraConfig, LoraPass, adapt, quantize_bases
from onnx_autodiff.weights.quantized import INT4_OPSET, STORED_INPUT
from onnx_autodiff.passes.opsets import OpsetError, build_proto_upgrading, convert_in_place, default_opset
from onnx_autodiff.passes.unused import optional_outputs
from onnx_autodiff.passes.parameters import default_parameters
from onnx_autodiff.passes.lift import LiftedWeight, LiftWeightConstantsPass
from onnx_autodiff.weights.recovery import RecoverParametersPass, is_torch_export
from onnx_autodiff.passes.rewrite_rules import lowering_rules
from onnx_autodiff.rules.quantized import CHUNK
from onnx_autodiff.passes.rewrite_rules.webgpu import dropout_key, dropout_tables, hashed_dropout
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, OpBuilder, captured_values, proto_graphs, shapes
from onnx_autodiff.training.losses import LossSpec, attach_loss
from onnx_autodiff.training.manifest import (
    FORMAT_VERSION,
    SEEDED_FORMAT,
    Carried,
    Evaluation,
    ExternalData,
    LoraRecord,
    Manifest,
    ModuleParameter,
    Read,
    Step,
)
from onnx_autodiff.training.optimizers import (
    GROUP_LIMIT,
    coefficient_formulas,
    emit_update,
    joined,
    make_optimizer,
    split_back,
    step_kept,
    update_groups,
    when_kept,
)
from onnx_autodiff.training.values import (
    dim_value,
    arrays_writer,
    fresh_value,
    load_arrays,
)

CHECKPOINT_FILES = {"npz": "checkpoint.npz", "safetensors": "checkpoint.safetensors"}




@dataclasses.dataclass
class TrainingArtifacts:
    """The models and initial state of one training setup; ``manifest`` names every input and
    output (what ``artifacts.json`` holds, see :mod:`~onnx_autodiff.training.manifest`)."""

    train_model: onnx.ModelProto
    eval_model: onnx.ModelProto
    inference_model: onnx.ModelProto
    checkpoint: dict[str, np.ndarray]
    manifest: Manifest
    accumulate_model: onnx.ModelProto | None = None
    apply_model: onnx.ModelProto | None = None
    left_out: list[str] = dataclasses.field(default_factory=list)  # constants the default did not train
    base_dir: str | None = None  # where the models' external tensors are read from (None: none)
    directory: str | None = None  # where load() read the artifacts from (None: made in memory)

    FILES = {
        "train_model": "training_model.onnx",
        "eval_model": "eval_model.onnx",
        "inference_model": "inference_model.onnx",
        "accumulate_model": "accumulate_model.onnx",
        "apply_model": "apply_model.onnx",
    }
    # read from its file when first used: the trainer needs it only to export (and its initial
    # weights would otherwise stay in memory beside the trained ones)
    LAZY = ("inference_model",)

    def __post_init__(self) -> None:
        if isinstance(self.manifest, Mapping):  # a layout: artifacts.json's JSON, as this field once held
            self.manifest = Manifest.from_json(self.manifest)

    @property
    def layout(self) -> dict:
        """The manifest as ``artifacts.json`` holds it (a new dict at each call)."""
        return self.manifest.to_json()

    @property
    def optimizer(self):
        return self.manifest.optimizer

    @property
    def params(self) -> list[str]:
        return list(self.manifest.params)

    def save(self, directory: str | os.PathLike, external_data: bool | None = None,
             checkpoint_format: str = "npz") -> dict[str, str]:
        """Writes the models, the checkpoint and ``artifacts.json`` (each file atomically).

        Models read from a model with external data keep reading those tensors (the frozen
        weights, the initial values) from its data file, where it is: no copy is written (tensors
        under 1 KB are read into the models), the models name the file as that model does and
        ``artifacts.json`` its folder
        (``"external_data"``: relative to the directory and absolute, with each file's size),
        where :meth:`load` and the trainer find it; the file must stay there, unchanged, while
        the artifacts are used. ``external_data=True`` makes the directory self-contained instead:
        each model gets its tensors in a data file beside it (``training_model.onnx.data``, copied
        a tensor at a time), as a model over protobuf's 2 GB does; ``external_data=False`` puts
        every tensor into the model files. Tensors the build made (a base quantized anew) go
        into the train model's data file, which the other models read where they hold the same
        tensors (one copy of the quantized base on disk).
        ``checkpoint_format``: "npz" (``checkpoint.npz``) or "safetensors"
        (``checkpoint.safetensors``, which the JavaScript trainer reads); ``load`` reads either."""
        if checkpoint_format not in CHECKPOINT_FILES:
            raise TrainingError(f"checkpoint_format must be one of {', '.join(CHECKPOINT_FILES)}, not {checkpoint_format!r}")
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        written = {}
        models = {attribute: getattr(self, attribute) for attribute in self.FILES}
        found: dict[int, tuple[onnx.ModelProto, bool]] = {}

        def external(proto: onnx.ModelProto) -> bool:
            """uses_external_data, once per model (each call walks every node's attributes)."""
            if id(proto) not in found:
                found[id(proto)] = proto, uses_external_data(proto)  # (held: the id stays its)
            return found[id(proto)][1]

        models, referenced = self._referencing(directory, models, external_data, external)
        first = None  # the first model written here with a data file: the others read its tensors
        for attribute, filename in self.FILES.items():
            proto = models[attribute]
            if proto is not None:
                path = os.path.join(directory, filename)
                sharing = first and external_data is None and reading_written(proto, first, self.base_dir, directory)
                if sharing:
                    write_atomically(path, sharing.SerializeToString(deterministic=True))
                    with contextlib.suppress(FileNotFoundError):  # an earlier save's own data file
                        os.remove(path + ".data")
                elif referenced is None and (external_data or external_data is None and (
                        external(proto) or _holds_large_tensors(proto))):
                    if save_model(from_proto(proto, self.base_dir), path, True) and first is None:
                        first = onnx.load(path, load_external_data=False)
                else:
                    write_atomically(path, proto.SerializeToString(deterministic=True))
                written[attribute] = path
            if referenced is not None:  # a data file an earlier save wrote beside it would be stale
                stale = os.path.join(directory, filename + ".data")
                if os.path.isfile(stale) and not any(os.path.isfile(os.path.join(referenced.path, f))
                                                     and os.path.samefile(stale, os.path.join(referenced.path, f))
                                                     for f in referenced.files):
                    os.remove(stale)
        path = os.path.join(directory, CHECKPOINT_FILES[checkpoint_format])
        write_atomically(path, arrays_writer(path, self.checkpoint))
        written["checkpoint"] = path
        for other in CHECKPOINT_FILES.values():  # one checkpoint per directory: load must not pick a stale one
            if other != CHECKPOINT_FILES[checkpoint_format] and os.path.exists(os.path.join(directory, other)):
                os.remove(os.path.join(directory, other))
        path = os.path.join(directory, "artifacts.json")
        manifest = dataclasses.replace(self.manifest, external_data=referenced)
        write_atomically(path, json_text(manifest.to_json()).encode())
        written["layout"] = path
        return written

    def _referencing(self, directory: str, models: dict, external_data: bool | None,
                     external=uses_external_data) -> tuple[dict, ExternalData | None]:
        """The models to write and what ``artifacts.json`` records of the data files they read from
        where they are (see :meth:`save`; their tensors under 1 KB read into them), or the models
        as they are and None where they are written with their tensors."""
        protos = [p for p in models.values() if p is not None]
        if external_data is not None or not self.base_dir or not any(external(p) for p in protos):
            return models, None
        if any(over_limit(p.ByteSize()) for p in protos):  # the tensors held in the models need a data file too
            return models, None
        if any(_holds_large_tensors(p) for p in protos):
            # large tensors the build made (a base quantized anew): in data files of their own, which
            # the runtimes map, rather than held in every model's proto (one folder for all of them)
            return models, None
        folder = os.path.abspath(self.base_dir)
        files = list(dict.fromkeys(f for p in protos for f in external_files(p)))
        ours = {os.path.join(os.path.abspath(directory), f)
                for f in (*self.FILES.values(), *CHECKPOINT_FILES.values(), "artifacts.json")}
        if any(os.path.normpath(os.path.join(folder, f)) in ours for f in files):  # named like a file written here
            return models, None
        models = {a: with_small_tensors_inline(p, folder) if p is not None and external(p) else p
                  for a, p in models.items()}
        files = list(dict.fromkeys(f for p in models.values() if p is not None for f in external_files(p)))
        if not files:
            return models, None
        try:
            relative = os.path.relpath(folder, os.path.abspath(directory))
        except ValueError:  # another drive
            relative = None
        return models, ExternalData(folder=relative, path=folder,
                                    files={f: os.path.getsize(os.path.join(folder, f)) for f in files})

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TrainingArtifacts:
        directory = os.fspath(directory)
        path = os.path.join(directory, "artifacts.json")
        if not os.path.isfile(path):
            raise TrainingError(f"{directory} holds no training artifacts (no artifacts.json)")
        with open(path, encoding="utf-8") as stream:
            try:
                document = json.load(stream)
            except ValueError as error:
                raise TrainingError(f"{path} is not JSON ({error}): generate the artifacts again") from error
        manifest = Manifest.from_json(document, path)
        models = {}
        for attribute, filename in cls.FILES.items():
            file = os.path.join(directory, filename)
            # external tensors stay in their files, read from there when used
            if attribute in cls.LAZY:
                models[attribute] = None
            else:
                models[attribute] = onnx.load(file, load_external_data=False) if os.path.isfile(file) else None
        files = [os.path.join(directory, f) for f in CHECKPOINT_FILES.values()
                 if os.path.isfile(os.path.join(directory, f))]
        if not files:
            raise TrainingError(f"{directory} holds no checkpoint ({' or '.join(CHECKPOINT_FILES.values())})")
        checkpoint = load_arrays(files[0])  # mapped, read when used
        base_dir = _data_folder(directory, manifest.external_data, path) if manifest.external_data else directory
        artifacts = cls(checkpoint=checkpoint, manifest=manifest, base_dir=base_dir, directory=directory, **models)
        for attribute in cls.LAZY:
            del artifacts.__dict__[attribute]  # __getattr__ reads it when first used
        return artifacts

    def __getattr__(self, name: str):
        # only called for a model that load() left in its file
        directory = self.__dict__.get("directory") or self.__dict__.get("base_dir")
        if name not in type(self).LAZY or directory is None:
            raise AttributeError(name)
        file = os.path.join(directory, self.FILES[name])
        model = onnx.load(file, load_external_data=False) if os.path.isfile(file) else None
        setattr(self, name, model)
        return model




def _data_folder(directory: str, record: ExternalData, path: str) -> str:
    """The folder of the data files ``artifacts.json`` (at ``path``) records: relative to the
    artifacts' directory, else where it was; each file must be there with its recorded size."""
    files = record.files
    candidates = [os.path.join(directory, record.folder)] if record.folder is not None else []
    candidates += [record.path] if record.path else []
    for folder in candidates:
        if all(os.path.isfile(os.path.join(folder, f)) and os.path.getsize(os.path.join(folder, f)) == size
               for f, size in files.items()):
            return folder
    where = candidates[0] if candidates else directory
    missing = [f for f in files if not os.path.isfile(os.path.join(where, f))]
    problem = (f"{names_summary(missing)} {'is' if len(missing) == 1 else 'are'} not there" if missing else
               f"{names_summary(list(files))} changed size since then")
    raise TrainingError(f"{path}: the models read their tensors from {names_summary(list(files))} in {where} (the data "
                        f"file of the model the artifacts were generated from), but {problem}: put it back, or generate "
                        "the artifacts again (--external-data writes a copy of the tensors beside them)")


def _as_proto(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto
    if isinstance(model, ir.Model):
        return to_proto(model)
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise TrainingError(f"no such model file: {os.fspath(model)}")
        return onnx.load(os.fspath(model), load_external_data=False)  # read from there when used
    raise TrainingError(f"cannot use a {type(model).__name__} as a model: give an onnx.ModelProto, an onnx_ir.Model or a path")


def _holds_float_constants(proto: onnx.ModelProto) -> bool:
    """Whether a float Constant node is anywhere in ``proto``'s graphs (weights a producer may have
    stored so: :class:`~onnx_autodiff.passes.lift.LiftWeightConstantsPass`)."""
    return any(node.op_type == "Constant" and node.attribute and (
        node.attribute[0].name in ("value_float", "value_floats")
        or (node.attribute[0].name == "value" and ir.DataType(node.attribute[0].t.data_type) in FLOAT_TYPES))
        for graph in proto_graphs(proto.graph) for node in graph.node)


def _source_dir(model) -> str | None:
    """Where the external tensors of ``model`` (as :func:`_as_proto` takes it) are read from."""
    if isinstance(model, ir.Model):
        return base_dir_of(model)
    if isinstance(model, (str, os.PathLike)):
        return os.path.dirname(os.path.abspath(os.fspath(model)))
    return None


def _default_opset(proto: onnx.ModelProto) -> int:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise TrainingError("the model imports no version of the default ONNX domain")


@dataclasses.dataclass
class _Roles:
    params: list[str]
    buffers: list[str]  # BatchNormalization running statistics updated in training mode
    opset: int
    left_out: list[str]  # float initializers the default parameters left out (constants)
    base_dir: str | None = None  # where external tensors are read from

    @functools.cached_property
    def state(self) -> frozenset[str]:
        """The parameters and buffers: the initializers the trainer carries from step to step."""
        return frozenset(self.params) | frozenset(self.buffers)


def _analyse(proto, requires_grad, frozen_params, freeze_batchnorm, registry=None, base_dir=None,
             model: ir.Model | None = None) -> _Roles:
    """The parameters, buffers and opset of ``proto`` (``model``: it as onnx-ir, when the caller
    has it, which this leaves as it is)."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = {v.name for v in graph.input}
    opset = _default_opset(proto)
    stats: list[str] = []
    for node in graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            if opset < 14 and not freeze_batchnorm:
                raise TrainingOpsetError(
                    f"BatchNormalization node '{node.name}' is at opset {opset}: training mode with "
                    "running statistics needs opset >= 14 (convert the model with "
                    "onnx.version_converter.convert_version(model, 14)), or pass "
                    "freeze_batchnorm=True to keep its statistics fixed", 14)
            for name in node.input[3:5]:
                if name in inits and name not in stats:
                    stats.append(name)
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and 7 <= opset < 12:
            raise TrainingOpsetError(
                f"Dropout node '{node.name}' is at opset {opset}, which has no training mode: "
                "convert the model to opset >= 12 (onnx.version_converter)", 12)

    def check(names, role):
        names = [names] if isinstance(names, str) else list(names or [])
        for name in names:
            if name not in inits:
                where = "a graph input" if name in inputs else "no initializer of the model"
                raise UnknownValueError(f"{role} '{name}' is {where}; parameters must be initializers")
        return names

    frozen = set(check(frozen_params, "frozen parameter"))
    left_out: list[str] = []
    if requires_grad is None:
        default = default_parameters(model if model is not None else from_proto(proto, base_dir), registry)
        left_out = [n for n in default.left_out if n not in stats and n not in frozen]
        params = [v.name for v in default.parameters if v.name not in frozen and v.name not in stats]
    else:
        params = check(requires_grad, "parameter")
        for name in params:
            if inits[name].data_type not in FLOAT_TYPES:
                dtype = onnx.TensorProto.DataType.Name(inits[name].data_type)
                raise NotDifferentiableError(f"parameter '{name}' is a {dtype} initializer; only floating-point initializers can be trained")
            if name in frozen:
                raise TrainingError(f"'{name}' is both a parameter to train and a frozen parameter")
            if name in stats:
                raise TrainingError(f"'{name}' is a BatchNormalization running statistic: it is updated by the forward pass, not trained")
        if len(set(params)) != len(params):
            raise TrainingError(f"requires_grad names a parameter twice: {params}")
    if not params:
        constants = f"; the default left out {names_summary(left_out)}: name them in requires_grad" if left_out else ""
        raise TrainingError(f"there is no parameter to train: the model has no floating-point initializer left after freezing{constants}")
    buffers = [] if freeze_batchnorm else [s for s in stats if s not in frozen]
    left_out += [n for n in quantized_weight_names(proto) if n not in left_out]
    return _Roles(params=params, buffers=buffers, opset=opset, left_out=left_out, base_dir=base_dir)


def _holds_large_tensors(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` holds a frozen base the build stored anew (quantized or half precision,
    :data:`FROZEN_IN_PLACE` bytes or more) itself: such tensors go to a data file, which runtimes
    map instead of parsing. Smaller constants the build made stay in the model file."""
    # (ByteSize bounds the data's size without copying it: the nodes are walked only where some
    # initializer is that large, not for every model saved)
    large = [t for t in proto.graph.initializer
             if t.data_location != onnx.TensorProto.EXTERNAL and t.ByteSize() >= FROZEN_IN_PLACE]
    if not large:
        return False
    stored = set(_stored_inputs(proto))
    return any(t.name in stored and len(t.raw_data) >= FROZEN_IN_PLACE for t in large)


def quantized_weight_names(proto: onnx.ModelProto) -> list[str]:
    """The integer initializers that hold a quantized weight (passes.parameters.quantized_weights,
    read off a proto)."""
    integers = {t.name for t in proto.graph.initializer if ir.DataType(t.data_type) not in FLOAT_TYPES}
    return [name for name in _stored_inputs(proto) if name in integers]


def _stored_inputs(proto: onnx.ModelProto) -> list[str]:
    """The inputs of ``proto``'s nodes that hold a weight in a stored form (quantize.STORED_INPUT),
    each once, in node order."""
    found = []
    for node in proto.graph.node:
        position = STORED_INPUT.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
        if position is not None and len(node.input) > position and node.input[position]:
            found.append(node.input[position])
    return list(dict.fromkeys(found))


def _prepare(proto, roles: _Roles, training: bool, model: ir.Model | None = None):
    """The forward model as onnx-ir with parameters and buffers as inputs and layers in the right mode
    (``model``: ``proto`` as onnx-ir already, changed in place).

    Returns (model, namer, buffer_updates {buffer name: new-statistic value}).
    """
    model = model if model is not None else from_proto(proto, roles.base_dir)
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
    inputs = set(graph.inputs)  # (a set: a model may have thousands of parameters)
    for name in [*roles.params, *roles.buffers]:
        value = graph.initializers.pop(name)
        value.const_value = None
        if value not in inputs:
            graph.inputs.append(value)
            inputs.add(value)
    return model, namer, updates


def _training_batchnorm_in_standard_ops(model: ir.Model, namer: Namer, updates: dict) -> dict:
    """Each BatchNormalization in training mode as standard ops, for the targets whose kernel
    lacks the mode (:data:`FORWARD_LOWERED`); returns ``updates`` with the new running statistics.

    With μ and σ² the batch's mean and biased variance over every axis but 1 (the statistics of
    onnxruntime's CPU kernel): Y = (X − μ)/√(σ² + ε)·scale + B, running mean = mean·momentum +
    μ·(1 − momentum), running variance = var·momentum + σ²·(1 − momentum). The gradient rules then
    differentiate these ops (ReduceMean, Sub, Mul, Sqrt, Div) instead of BatchNormalization.
    """
    graph = model.graph
    replaced: dict[ir.Value, ir.Value] = {}
    for node in list(graph):
        if (node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx")
                or shapes.attr(node, "training_mode", 0) != 1):
            continue
        x, scale, bias, mean, var = node.inputs[:5]
        r = shapes.rank(x)
        if r is None:
            raise TrainingError(f"BatchNormalization '{node.name}': the rank of its input is unknown (declare its shape)")
        epsilon, momentum = shapes.attr(node, "epsilon", 1e-5), shapes.attr(node, "momentum", 0.9)
        op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
        axes, per_channel = [0, *range(2, r)], [-1, *[1] * (r - 2)]
        batch_mean = op.reduce("ReduceMean", x, axes, keepdims=True)
        centred = op.Sub(x, batch_mean)
        batch_var = op.reduce("ReduceMean", op.Mul(centred, centred), axes, keepdims=True)
        normalised = op.Div(centred, op.Sqrt(op.Add(batch_var, float(epsilon))))
        channels = (lambda v: op.reshape(v, per_channel)) if r > 2 else (lambda v: v)
        y = op.Add(op.Mul(normalised, channels(scale)), channels(bias))
        new_mean = op.Add(op.Mul(mean, float(momentum)), op.Mul(op.reshape(batch_mean, [-1]), float(1 - momentum)))
        new_var = op.Add(op.Mul(var, float(momentum)), op.Mul(op.reshape(batch_var, [-1]), float(1 - momentum)))
        graph.insert_before(node, op.nodes)
        replaced.update(_replace_node(graph, node, (y, new_mean, new_var)))
    return {name: replaced.get(value, value) for name, value in updates.items()}


def _replace_node(graph: ir.Graph, node: ir.Node, values) -> dict[ir.Value, ir.Value]:
    """Removes ``node``, its outputs replaced by ``values`` (already in the graph), under their
    names; returns {old output: its replacement}."""
    replaced = {}
    for old, new in zip(node.outputs, values):
        if old.is_graph_output():
            graph.outputs[:] = [new if out is old else out for out in graph.outputs]
        old.replace_all_uses_with(new)
        if old.name:  # the names of the node's outputs kept
            name, old.name = old.name, None
            new.name = name
        replaced[old] = new
    graph.remove(node, safe=True)
    return replaced


# The scalar inputs of the hashed Dropout, by their key in the signatures' scalars, and how the
# trainer computes them from the step it takes and the micro-batch it accumulates (0 for a train step)
DROPOUT_SEEDS = {"dropout_step": "step", "dropout_micro_batch": "micro_batch"}


def _training_dropout_by_hash(model: ir.Model, namer: Namer) -> dict[str, ir.Value]:
    """Each Dropout in training mode as :func:`.webgpu.hashed_dropout`, for the targets whose
    kernels lack the mode (:data:`FORWARD_LOWERED`); returns the uint32 scalar inputs its masks
    read, by key (:data:`DROPOUT_SEEDS`), already graph inputs; none without such a Dropout.
    Every runtime then draws the same masks: the Python Trainer's on onnxruntime's CPU are the
    browser's."""
    graph = model.graph
    dropouts = [node for node in graph if node.op_type == "Dropout" and node.domain in ("", "ai.onnx")
                and len(node.inputs) > 2 and _constant_true(node.inputs[2])]
    if not dropouts:
        return {}
    for node in dropouts:
        if node.inputs[0].dtype is None:
            raise TrainingError(f"Dropout '{node.name}': the type of its input is unknown (declare it in the model)")
    seeds = {key: fresh_value(namer, key, ir.DataType.UINT32, []) for key in DROPOUT_SEEDS}
    graph.inputs.extend(seeds.values())
    tables = [_constant(graph, namer, table, "dropout_table") for table in dropout_tables()]
    op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
    key = dropout_key(op, seeds["dropout_step"], seeds["dropout_micro_batch"], tables)
    graph.insert_before(dropouts[0], op.nodes)
    for salt, node in enumerate(dropouts):
        op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
        y, mask = hashed_dropout(op, node.inputs[0], node.inputs[1], key, salt, tables)
        graph.insert_before(node, op.nodes)
        _replace_node(graph, node, (y, mask))
    return seeds


def _constant_true(value: ir.Value | None) -> bool:
    fixed = shapes.constant(value) if value is not None else None
    return fixed is not None and bool(fixed.item())


def _constant(graph: ir.Graph, namer: Namer, array: np.ndarray, hint: str) -> ir.Value:
    value = ir.Value(name=namer.fresh(hint), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     shape=ir.Shape(array.shape), const_value=ir.Tensor(array))
    graph.register_initializer(value)
    return value


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


def _finish(model: ir.Model, inputs: list[ir.Value], outputs: list[ir.Value], what: str,
            cleaned: list[ir.Node] | None = None, target: str | None = "onnxruntime", check_output: bool = False,
            forward: tuple[list[str], list[str]] | None = None):
    """The model with these inputs and outputs, cleaned up and lowered for ``target`` unless
    ``cleaned`` lists the nodes added since its cleanup (then only what those nodes and the
    outputs it had leave unused is removed, and the added nodes lowered where the target needs
    it), checked (onnx.checker's structural check;
    its full check where :func:`~onnx_autodiff.modelfile.full_output_check` says), as a proto.

    ``forward``: (input names, output names) of a part of the model to cut out as a model of its
    own (the eval model of a train model); then (the proto, that part's proto or None where it
    cannot be cut out, see :func:`_forward_part`)."""
    from onnx_autodiff.passes import cleanup_passes
    from onnx_autodiff.passes.lowering import LoweringPass
    from onnx_autodiff.passes.unused import RemoveUnusedPass, remove_unused_after

    graph = model.graph
    previous = list(graph.outputs)
    graph.inputs.clear()
    graph.inputs.extend(inputs)
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    if cleaned is None:
        model = ir.passes.PassManager(cleanup_passes(target=target))(model).model
    elif target in OPTIMIZER_LOWERED:
        model = ir.passes.PassManager([RemoveUnusedPass(), LoweringPass(target)])(model).model
    else:
        remove_unused_after(graph, cleaned, [v for v in previous if not v.is_graph_output()])
    _frozen_read_in_place(model)
    if target is not None and _holds_stored_weights(graph):
        _frozen_bases_read_in_pieces(model)
        _frozen_bases_read_at_use(model)
    if any(v.shape is None or v.type is None for v in graph.outputs):
        ShapeInferencePass(strict_mode=False)(model)
    untyped = [v.name for v in graph.outputs if v.shape is None or v.type is None]
    if untyped:
        raise TrainingError(f"the shapes of {untyped} are unknown: declare them in the model's outputs or value_info")
    part = _forward_part(model, *forward) if forward is not None else None
    _forget_intermediate_types(model.graph)
    proto = _checked(to_proto(model), what, check_output)  # external tensors stay references to their files
    if forward is None:
        return proto
    return proto, part and _checked(_model_of_part(proto, *part), "eval model", check_output)


def _checked(proto: onnx.ModelProto, what: str, check_output: bool) -> onnx.ModelProto:
    """``proto`` after onnx.checker's structural check (its full check where
    :func:`~onnx_autodiff.modelfile.full_output_check` says)."""
    try:
        check_model(proto, full=full_output_check(check_output))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        first = str(error).strip().splitlines()[0]
        raise TrainingError(f"the generated {what} fails the ONNX checker (a bug, please report): {first}") from error
    return proto


def _forward_part(model: ir.Model, inputs: list[str], outputs: list[str]):
    """Where the eval model can be cut out of the finished train model ``model``: (the positions of
    the nodes that compute ``outputs`` from ``inputs``, in the graph's order; the initializers they
    read; ``outputs`` as value_info), or None where it cannot: an output the cleanup replaced (its
    name gone) or a value read that is neither one of ``inputs`` nor an initializer."""
    graph = model.graph
    produced = {v.name: v for node in graph for v in node.outputs if v.name}
    values = [produced.get(name) for name in outputs]
    if any(v is None or v.type is None or v.shape is None for v in values):
        return None
    allowed = set(inputs)
    needed: set[ir.Node] = set()
    initializers: dict[str, None] = {}
    pending = [v.producer() for v in values]
    while pending:
        node = pending.pop()
        if node in needed:
            continue
        needed.add(node)
        for value in (*node.inputs, *captured_values(node)):
            if value is None:
                continue
            producer = value.producer()
            if producer is not None:
                pending.append(producer)
            elif value.is_initializer() and not value.is_graph_input():
                initializers[value.name] = None
            elif value.name not in allowed:
                return None
    positions = [i for i, node in enumerate(graph) if node in needed]
    return positions, list(initializers), inputs, [ir.serde.serialize_value(v) for v in values]


def _model_of_part(proto: onnx.ModelProto, positions: list[int], initializers: list[str], inputs: list[str],
                   outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    """The model of the nodes of ``proto`` at ``positions`` (:func:`_forward_part`), with these
    inputs (``proto``'s of those names) and outputs."""
    graph = proto.graph
    part = onnx.ModelProto(ir_version=proto.ir_version, producer_name=proto.producer_name,
                           producer_version=proto.producer_version, domain=proto.domain,
                           model_version=proto.model_version, doc_string=proto.doc_string)
    part.opset_import.extend(proto.opset_import)
    part.functions.extend(proto.functions)
    part.graph.name = graph.name
    nodes = graph.node
    part.graph.node.extend(nodes[i] for i in positions)
    by_name = {v.name: v for v in graph.input}
    part.graph.input.extend(by_name[name] for name in inputs)
    wanted = set(initializers)
    part.graph.initializer.extend(t for t in graph.initializer if t.name in wanted)
    part.graph.output.extend(outputs)
    _drop_unread_outputs(part.graph, _default_opset(part))
    return part


def _drop_unread_outputs(graph: onnx.GraphProto, opset: int) -> None:
    """The optional outputs that only the backward read (LayerNormalization's statistics) left out
    of the nodes of ``graph``, as the cleanup of a model of its own leaves them out (Attention
    keeps its own, see the cleanup's removal)."""
    read = {v.name for v in graph.output}
    read.update(name for g in proto_graphs(graph) for node in g.node for name in node.input)
    for node in graph.node:
        if len(node.output) < 2 or node.domain not in ("", "ai.onnx") or node.op_type == "Attention":
            continue
        options = optional_outputs(node.op_type, opset)
        if options is None or len(options) < len(node.output):
            continue
        outputs = [name if name in read or not optional else "" for name, optional in zip(node.output, options)]
        while outputs and not outputs[-1]:
            outputs.pop()
        if outputs != list(node.output):
            del node.output[:]
            node.output.extend(outputs)


def _forget_intermediate_types(graph: ir.Graph) -> None:
    """Drops the types and shapes of the values the main graph's nodes compute, except its
    outputs', so that they are not written as value_info: runtimes and onnx's checker infer them
    again from the inputs', and writing them was a third of converting a train model of 60,000
    nodes to protobuf (and of its file). Called on a model about to be converted and dropped."""
    outputs = frozenset(graph.outputs)
    for node in graph:
        for value in node.outputs:
            if value not in outputs:
                value.type = None
                value.shape = None


# Targets whose lowering also applies to the optimiser's nodes, added after the backward graph's
# cleanup: they are emitted in forms that onnxruntime runs as they are, but the WebGPU provider
# lacks some (the Sum of the step's finite check).
OPTIMIZER_LOWERED = frozenset({"webgpu"})
# Targets whose optimiser updates parameters one by one, not in groups (optimizers.GROUP_LIMIT):
# the grouped form's Concat of thousands of inputs is not known to run on the WebGPU provider.
UNGROUPED = frozenset({"webgpu"})


def _group_limit(target: str | None) -> int | None:
    return None if target in UNGROUPED else GROUP_LIMIT


# Targets whose kernels lack a forward op's training mode: the train models compute it in standard
# ops (onnxruntime-web's WebGPU BatchNormalization: "trainingMode is not supported yet").
FORWARD_LOWERED = frozenset({"webgpu"})
# Targets whose train models keep a model's own MatMulNBits in the kernel unless told otherwise:
# onnxruntime-web runs that kernel on WebGPU; elsewhere the default reads those weights through
# DequantizeLinear, which holds them once (the kernel keeps a pre-packed copy beside them).
NBITS_KERNEL = frozenset({"webgpu"})
FROZEN_IN_PLACE = 1 << 18  # bytes: a frozen weight this large is read where it is stored, never copied transposed
_GEMM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


def _frozen_read_in_place(model: ir.Model) -> None:
    """``MatMul(x, Transpose(W))`` of a large frozen weight ``W`` (an initializer of at least
    :data:`FROZEN_IN_PLACE` bytes; torch exports ``nn.Linear`` so) as a Gemm that reads W
    transposed in place, x of rank > 2 flattened to a matrix and back (the same products):
    onnxruntime would fold the Transpose of the constant into a second, transposed copy of W when
    it creates the session, and keep both where the backward reads W too."""
    graph = model.graph
    if default_opset(model) < 11:  # Gemm's C input is optional from opset 11
        return
    namer = None
    for node in list(graph):
        weight = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        tensor = weight.const_value if weight is not None and weight.is_initializer() else None
        if (tensor is None or weight.is_graph_input() or tensor.dtype not in _GEMM_TYPES or len(tensor.shape) != 2
                or tensor.nbytes < FROZEN_IN_PLACE or list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]):
            continue
        transposed = node.outputs[0]
        for user, index in list(transposed.uses()):
            x = user.inputs[0]
            if (user.op_type != "MatMul" or user.domain not in ("", "ai.onnx") or index != 1 or x is None
                    or x.shape is None or len(x.shape) < 2 or user.outputs[0].is_graph_output()):
                continue
            namer = namer or Namer.for_graph(graph, prefix="frozen")
            out, (n, k), lead = user.outputs[0], tensor.shape.dims, list(x.shape.dims[:-1])
            nodes, rows = [], x
            if len(x.shape) > 2:
                nodes.append(ir.node("Reshape", [x, _constant(graph, namer, np.array([-1, k], np.int64), "rows")]))
                rows = nodes[-1].outputs[0]
                rows.name, rows.dtype, rows.shape = namer.fresh(f"{x.name}.rows"), x.dtype, ir.Shape([None, k])
            nodes.append(ir.node("Gemm", [rows, weight], attributes={"transB": 1}))
            product = nodes[-1].outputs[0]
            product.name, product.dtype = namer.fresh(f"{out.name}.rows"), out.dtype
            if len(x.shape) > 2:
                if all(isinstance(d, int) for d in lead):
                    shape = _constant(graph, namer, np.array([*lead, n], np.int64), "shape")
                else:  # the leading dims of x, then N
                    start, end = (_constant(graph, namer, np.array([i], np.int64), "axis") for i in (0, -1))
                    nodes.append(ir.node("Shape", [x]))
                    nodes.append(ir.node("Slice", [nodes[-1].outputs[0], start, end]))
                    last = _constant(graph, namer, np.array([n], np.int64), "columns")
                    nodes.append(ir.node("Concat", [nodes[-1].outputs[0], last], attributes={"axis": 0}))
                    shape = nodes[-1].outputs[0]
                    for value in (nodes[-3].outputs[0], nodes[-2].outputs[0], shape):
                        value.name = namer.fresh(f"{out.name}.shape")
                nodes.append(ir.node("Reshape", [product, shape]))
            result = nodes[-1].outputs[0]
            result.type, result.shape = out.type, out.shape
            ir.convenience.replace_nodes_and_values(graph, user, [user], nodes, [out], [result])
        if not transposed.uses() and not transposed.is_graph_output():
            graph.remove(node, safe=True)


_HALF_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_STORED_TYPES = _HALF_TYPES | {ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.INT8, ir.DataType.UINT8}


def _holds_stored_weights(graph: ir.Graph) -> bool:
    """Whether ``graph`` holds weights stored in another type than they are computed in (half
    precision, 4 or 8 bits): the reads that the lowerings below place have nothing to do
    otherwise (a walk of a 20,001-node chain's train model spared)."""
    return any(value.dtype in _STORED_TYPES for value in graph.initializers.values())


def _frozen_base_reads(graph: ir.Graph):
    """The nodes that read a frozen base weight stored in another type as floats: a Cast from
    float16/bfloat16 or a DequantizeLinear of initializers, at least :data:`FROZEN_IN_PLACE` bytes
    of floats, each with the stored weight."""
    for node in list(graph):
        stored = node.inputs[0] if node.inputs and node.domain in ("", "ai.onnx") else None
        tensor = stored.const_value if stored is not None and stored.is_initializer() else None
        floats = node.outputs[0].dtype
        if (tensor is None or floats is None or tensor.size * floats.itemsize < FROZEN_IN_PLACE
                or not all(v is None or v.is_initializer() for v in node.inputs)):
            continue
        if node.op_type == "DequantizeLinear" or node.op_type == "Cast" and tensor.dtype in _HALF_TYPES:
            yield node, stored


_SAMPLING = frozenset({"Bernoulli", "Multinomial", "Dropout"})  # nodes whose values are drawn: kept in place
_PIECES_BITS = 4  # bits of a stored weight, at most, that _frozen_bases_read_in_pieces stores in pieces


def _frozen_bases_read_in_pieces(model: ir.Model) -> None:
    """A frozen base weight W [R, C] stored in at most :data:`_PIECES_BITS` bits whose floats are
    more than :data:`~onnx_autodiff.rules.quantized.CHUNK` (a language model's head: 32,000 x 768,
    98 MB of floats) is read in pieces along its shorter axis by the products that multiply by it,
    each piece stored and read as floats by itself, never the whole weight's floats at once (as in
    MatMulNBits' backward, rules/quantized.py):

    - a product contracting that axis (the head's forward, ``x @ Wᵀ``: the logits) sums the
      pieces' products through Gemm's C, which onnxruntime's order computes first: the sum so
      far, the next product and one piece's floats are alive (2 x 33 + 16 MB, where the whole
      read held 33 + 98: a 155 M Llama's 4-bit steps, 619 -> 560 MB at their peak);
    - a product contracting the other axis (the head's backward, ``dY @ W``: 768 numbers per
      token) takes the pieces' products side by side.

    The pieces replace W in the train and eval models; stored in 4 bits, they cost an eighth of
    the floats they spare (a float16 head's pieces cost a step more than they spared). A weight
    the model stores in a file (a shipped MatMulNBits file read through DequantizeLinear) is cut
    the same way: pieces of its rows are the bytes of that file where they are, pieces of its
    columns copies, which the saved artifacts write into a data file of their own (reading the
    whole weight in the forward instead kept that 155 M Llama's steps at 693 MB, not 559)."""
    graph = model.graph
    opset = default_opset(model)  # (21 or later: DequantizeLinear of 4 bits)
    namer = None
    for read, stored in list(_frozen_base_reads(graph)):
        shape = stored.const_value.shape
        if len(shape) != 2 or shape[0] * shape[1] <= CHUNK or stored.const_value.dtype.bitwidth > _PIECES_BITS:
            continue
        along, side_by_side = int(shape[1] < shape[0]), True
        products = [(product, axis) for axis in (0, 1) if axis == along or side_by_side
                    for product in _products_contracting(read.outputs[0], axis)]
        if not products:
            continue
        namer = namer or Namer.for_graph(graph, prefix="frozen")
        length = _piece_length(read, along, CHUNK // shape[1 - along])
        cuts = [(start, min(shape[along], start + length)) for start in range(0, shape[along], length)]
        pieces = [_stored_piece(graph, namer, read, along, start, end) for start, end in cuts]
        for product, axis in products:
            op = OpBuilder(opset, namer)
            x, out = product.inputs[0], product.outputs[0]
            if axis == along:
                total = _summed_through_gemm(op, read, x, out, along, cuts, pieces)
            else:
                floats = (_read_piece(op, read, stored_inputs) for stored_inputs in pieces)
                total = op.Concat(*[op.MatMul(x, op.Transpose(piece, perm=[1, 0]) if along == 0 else piece)
                                    for piece in floats], axis=-1)
            total.type, total.shape = out.type, out.shape
            ir.convenience.replace_nodes_and_values(graph, product, [product], op.nodes, [out], [total])
        for user in list(dict.fromkeys(user for user, _ in read.outputs[0].uses())):
            if user.op_type == "Transpose" and not user.outputs[0].uses():
                graph.remove(user, safe=True)
        if not read.outputs[0].uses():
            stored_inputs = [value for value in read.inputs if value is not None]
            graph.remove(read, safe=True)  # (which detaches its inputs)
            for value in stored_inputs:
                if not value.uses() and not value.is_graph_input():
                    graph.initializers.pop(value.name)


def _summed_through_gemm(op: OpBuilder, read: ir.Node, x: ir.Value, out: ir.Value, along: int, cuts, pieces) -> ir.Value:
    """x @ W (``along`` 0) or x @ Wᵀ (``along`` 1) of W's pieces along the contracted axis: the
    pieces' products summed, each through the C of the next one's Gemm, over x's rows (x
    flattened to a matrix and back)."""
    rank = x.shape.rank() if x.shape is not None else None
    rows = x if rank == 2 else op.reshape(x, [-1, x.shape[-1]])
    total = None
    for (start, end), stored_inputs in zip(cuts, pieces):
        piece = _read_piece(op, read, stored_inputs)
        columns = op.slice(rows, [start], [end], axes=[1])
        total = op.Gemm(columns, piece, *([total] if total is not None else []), transB=along)
    if rank == 2:
        return total
    lead = list(x.shape.dims[:-1])
    if all(isinstance(d, int) for d in lead):
        return op.reshape(total, [*lead, out.shape[-1]])
    # the leading dims of x, then the output's columns
    return op.reshape(total, op.Concat(op.slice(op.Shape(x), [0], [-1]), op.const([out.shape[-1]]), axis=0))


def _products_contracting(floats: ir.Value, axis: int) -> list[ir.Node]:
    """The MatMuls that multiply by ``floats`` (a weight W [R, C]) contracting its ``axis``: ``x @ W``
    contracts axis 0, ``x @ Transpose(W)`` axis 1."""
    found = []
    for user, index in floats.uses():
        if user.op_type == "MatMul" and user.domain in ("", "ai.onnx") and index == 1 and axis == 0:
            found.append(user)
        elif (user.op_type == "Transpose" and user.domain in ("", "ai.onnx") and axis == 1
              and list(user.attributes.get_ints("perm", [1, 0])) == [1, 0]):
            found.extend(product for product, position in user.outputs[0].uses()
                         if product.op_type == "MatMul" and product.domain in ("", "ai.onnx") and position == 1)
    return [product for product in found if not product.outputs[0].is_graph_output()]


def _piece_length(read: ir.Node, axis: int, length: int) -> int:
    """``length`` as a whole number of the read's quantization blocks where they run along ``axis``."""
    block = read.attributes.get_int("block_size", 0) if read.op_type == "DequantizeLinear" else 0
    if block and read.attributes.get_int("axis", 1) % 2 == axis:
        return max(block, length // block * block)
    return max(1, length)


def _stored_piece(graph: ir.Graph, namer: Namer, read: ir.Node, axis: int, start: int, end: int) -> list:
    """The inputs of ``read`` (a Cast or DequantizeLinear of a stored weight [R, C]) for the piece
    ``start:end`` along ``axis``, as initializers: the weight's piece, and its scale's and zero
    point's where they vary along ``axis`` (per row or column, or in blocks). Rows of a tensor
    stored in a file are the bytes of that file where they are (a model's own weights: nothing is
    copied), other pieces copies."""
    quantized_axis = read.attributes.get_int("axis", 1) % 2
    block = read.attributes.get_int("block_size", 0)
    inputs = []
    for position, value in enumerate(read.inputs):
        array = value.const_value.numpy() if value is not None else None
        if position == 0 or array is not None and array.ndim == 2:
            cut = slice(start // block, -(-end // block)) if position and block and quantized_axis == axis else slice(start, end)
            part = array[cut] if axis == 0 else array[:, cut]
        elif array is not None and array.ndim == 1 and quantized_axis == axis:
            part = array[start:end]
        else:  # one scale (zero point) for the whole piece, or none
            inputs.append(value)
            continue
        name = namer.fresh(f"{value.name}.{'rows' if axis == 0 else 'columns'}{start}")
        stored = _stored_rows(value.const_value, cut, name) if axis == 0 else None
        piece = ir.Value(name=name, type=value.type, shape=ir.Shape(part.shape),
                         const_value=stored or ir.tensor(np.ascontiguousarray(part), dtype=value.dtype, name=name))
        graph.register_initializer(piece)
        inputs.append(piece)
    return inputs


def _stored_rows(tensor, rows: slice, name: str) -> ir.ExternalTensor | None:
    """Rows ``rows`` of ``tensor`` as the bytes of its file that hold them, where it is stored in a
    file and they start and end on whole bytes; else None."""
    if not isinstance(tensor, ir.ExternalTensor) or tensor.offset is None:
        return None
    dims = list(tensor.shape.dims)
    bits = int(np.prod(dims[1:], dtype=np.int64)) * tensor.dtype.bitwidth
    if bits % 8:
        return None
    start, stop, _ = rows.indices(dims[0])
    return ir.ExternalTensor(tensor.location, tensor.offset + start * bits // 8, (stop - start) * bits // 8, tensor.dtype,
                             shape=ir.Shape([stop - start, *dims[1:]]), name=name, base_dir=tensor.base_dir)


def _read_piece(op: OpBuilder, read: ir.Node, inputs: list) -> ir.Value:
    """``read`` (Cast, DequantizeLinear) again, of a piece's stored inputs."""
    floats = op.emit(read.op_type, *inputs, **{name: attribute.value for name, attribute in read.attributes.items()})
    floats.dtype, floats.shape = read.outputs[0].dtype, inputs[0].shape
    return floats


def _frozen_bases_read_at_use(model: ir.Model) -> None:
    """Frozen base weights stored in another type (read through a Cast from float16/bfloat16 or a
    DequantizeLinear, at least :data:`FROZEN_IN_PLACE` bytes as floats) become floats where each node
    uses them, one reader's floats at a time, never a whole model's at once. Left as written,
    onnxruntime folds a Cast of a constant into a float copy of the weight when it creates the
    session (a float16 Llama's train step then peaks above its float32 base's), and runs reads
    that depend on no other node before the first layer, holding their floats until used.

    - A Cast's weight becomes an overridable graph input (its initializer the default), which
      onnxruntime does not fold; each node reading the Cast gets a Cast of its own, the second and
      later ones through a Reshape of a shape of their own, so that the common-subexpression
      elimination at session creation cannot merge them back into one copy alive from the forward
      to the backward (onnxruntime gives each reader of a DequantizeLinear a copy itself).
    - Every node computed from stored weights alone comes first in the graph (these reads, a
      MatMulNBits backward's unpacking): onnxruntime's order visits a node's later inputs first,
      so what comes first runs just before the node that uses it. Where such a node comes after
      the activation it meets, the backward's reads all run before the loss's gradient and
      stay alive until their layer's turn (a 155 M Llama's MatMulNBits step: 20 MB more at
      its peak)."""
    graph = model.graph
    inputs = set(graph.inputs)
    namer = None
    for node, stored in _frozen_base_reads(graph):
        tensor = stored.const_value
        if node.op_type == "Cast":
            namer = namer or Namer.for_graph(graph, prefix="frozen")
            if stored not in inputs:
                graph.inputs.append(stored)
                inputs.add(stored)
            out = node.outputs[0]
            readers = list(dict.fromkeys(user for user, _ in out.uses()))
            dims = _constant(graph, namer, np.array(tensor.shape.dims, np.int64), "dims") if len(readers) > 1 else None
            for rank, reader in enumerate(readers[1:], start=1):
                flat = _constant(graph, namer, np.array([1] * (rank - 1) + [-1], np.int64), "flat")
                copy = [ir.node("Reshape", [stored, flat])]
                copy.append(ir.node("Cast", [copy[0].outputs[0]], attributes={"to": node.attributes["to"].value}))
                copy.append(ir.node("Reshape", [copy[1].outputs[0], dims]))
                for value in (c.outputs[0] for c in copy):
                    value.name = namer.fresh(f"{stored.name}.read")
                copy[-1].outputs[0].type, copy[-1].outputs[0].shape = out.type, out.shape
                for index, value in enumerate(reader.inputs):
                    if value is out:
                        reader.replace_input_with(index, copy[-1].outputs[0])
                graph.insert_before(reader, copy)
    _stored_alone_first(graph)


def _stored_alone_first(graph: ir.Graph) -> None:
    """Moves the nodes that compute from initializers alone (no graph input other than an
    overridable initializer, no subgraph, nothing random) to the front, in their order."""
    computed = {v for v in graph.inputs if not v.is_initializer()}
    first = []
    for node in graph:
        if (node.op_type.startswith("Random") or node.op_type in _SAMPLING
                or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
                or any(v in computed for v in node.inputs if v is not None)):
            computed.update(node.outputs)
        else:
            first.append(node)
    if first and len(first) < len(graph):
        graph.remove(first)
        graph.insert_before(graph.node(0), first)


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
    upgrade_opset: bool = True,
    lora=None,
    target: str | None = "onnxruntime",
    check_output: bool = False,
) -> TrainingArtifacts:
    """The training artifacts of ``model`` (an onnx.ModelProto, onnx_ir.Model or path).

    Tensors stored beside a model file (external data) stay there: they are read when used, the
    checkpoint maps the parameters' initial values from their file, and ``save`` writes the
    models that hold such tensors with a data file of their own.

    requires_grad: initializers to train (default: the model's parameters, as
    :func:`onnx_autodiff.passes.parameters.default_parameters` chooses them, that are neither in
    ``frozen_params`` nor BatchNormalization running statistics; ``left_out`` of the result
    lists the constants it did not train).
    loss: "cross_entropy" (logits [N, C, ...] or [batch, sequence, classes], int64 class labels,
    mean, ignore_index −100), "causal_lm" (transformers' next-token loss of logits [batch,
    sequence, vocabulary]), "ctc" (torch's ctc_loss; labels, input_lengths, target_lengths),
    "mse", "l1", "bce_with_logits" (labels shaped like the output), a
    :class:`~onnx_autodiff.training.losses.BuiltinLoss` (one of those with options, e.g.
    ``BuiltinLoss("ctc", blank=27)``), None (the model's scalar
    output ``output`` is the loss), or a custom loss: a callable ``f(op, output, *labels)`` returning
    the scalar loss built with the :class:`~onnx_autodiff.toolkit.builder.OpBuilder` ``op``, or an
    onnx.FunctionProto with inputs ``[output, *labels]`` and the loss as first output.
    output: the model output the loss applies to (default: the first).
    labels: the label input's name (a str) or, for a custom loss, a list of (name, numpy dtype,
    shape) (default: one input "labels" shaped and typed like the output); for a built-in loss
    the first entry's shape, where given, decides the class axis (see docs/training.md, "Losses").
    A class loss on an output made by Softmax, LogSoftmax (cross_entropy, causal_lm, ctc) or
    Sigmoid (bce_with_logits) applies to the logits under it, logging a warning that says so.
    optimizer: "sgd", "adam", "adamw" with ``optimizer_options`` (torch names: lr, momentum,
    dampening, nesterov, weight_decay, betas, eps, amsgrad), or an SGD/Adam/AdamW instance.
    max_grad_norm: clip the gradients by their global L2 norm (torch.nn.utils.clip_grad_norm_).
    gradient_accumulation: also build the accumulate and apply models.
    freeze_batchnorm: keep BatchNormalization in inference mode with fixed statistics.
    upgrade_opset: when a gradient rule needs a newer opset than the model imports, convert the
    model with onnx.version_converter (one warning line); False refuses.
    lora: a :class:`~onnx_autodiff.training.lora.LoraConfig`: adds adapters to the weights of
    MatMul and Gemm and trains them alone, with what the config adds (biases, norms) and the extra
    initializers ``requires_grad`` names (e.g. a classifier head); the base weights stay constants.
    ``Trainer.export()`` merges the adapters into them (``merge=False`` keeps them apart).
    target: the runtime the train, eval, accumulate and apply models are lowered for (the
    cleanup's ``target``): "onnxruntime" (default), "webgpu" (onnxruntime-web's WebGPU provider runs
    every compute node, see :mod:`onnx_autodiff.passes.rewrite_rules.webgpu`) or None (canonical
    standard forms). The inference model is the input model's, whatever the target.
    check_output: check each generated model with onnx.checker's full check (strict shape inference
    of the whole graph) instead of the structural one (see
    :func:`~onnx_autodiff.modelfile.full_output_check`).

    Python's cyclic collector rescans the ever larger graphs while they are built (the optimiser's
    nodes of 10,000 parameters: 7.6 s with it, 1.8 s without): a large build runs faster inside
    :func:`onnx_autodiff.collector_paused`, as the command line runs it.
    """
    return _generate_artifacts(model, requires_grad, frozen_params, loss, optimizer, optimizer_options, output,
                               labels, max_grad_norm, gradient_accumulation, freeze_batchnorm, registry,
                               upgrade_opset, lora, target, check_output)


def _generate_artifacts(model, requires_grad, frozen_params, loss, optimizer, optimizer_options, output, labels,
                        max_grad_norm, gradient_accumulation, freeze_batchnorm, registry, upgrade_opset, lora,
                        target, check_output) -> TrainingArtifacts:
    if target is not None:
        lowering_rules(target)  # an unknown target fails here, naming the known ones, before the work
    spec = make_optimizer(optimizer, **dict(optimizer_options or {}))
    forward, base_dir = _as_proto(model), _source_dir(model)
    proto = onnx.ModelProto()
    proto.CopyFrom(forward)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    source = _Source(proto, forward, base_dir)
    frozen_params = source.selection(frozen_params, "frozen parameter")
    named = set([requires_grad] if isinstance(requires_grad, str) else requires_grad or ())
    requires_grad = source.selection(requires_grad, "parameter")
    if requires_grad is not None and frozen_params:  # what a pattern selects, frozen_params may take back
        requires_grad = [n for n in requires_grad if n in named or n not in set(frozen_params)]
    if lora is not None:
        extra = [requires_grad] if isinstance(requires_grad, str) else list(requires_grad or [])
        injected = source.adapt(lora, extra, upgrade_opset, target)
        frozen = {frozen_params} if isinstance(frozen_params, str) else set(frozen_params or [])
        adapters = [name for a in injected.adapters for name in (a.A, a.B)]
        requires_grad = list(dict.fromkeys([*adapters, *(n for n in injected.extra if n not in frozen), *extra]))
    proto, forward, modules = source.protos()
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise TrainingError(f"max_grad_norm must be > 0, not {max_grad_norm}")
    loss_spec = LossSpec(loss, output, labels)

    def build_train(candidate: onnx.ModelProto):
        # converted once, as given, then typed by onnx's inference; the analysis of the default
        # parameters leaves it as it is, and it is the model prepared for training
        inferred = onnx_inferred(candidate)
        model = from_proto(candidate, base_dir)
        if inferred is not None:
            take_inferred_types(model, inferred)
            candidate = inferred
        roles = _analyse(candidate, requires_grad, frozen_params, freeze_batchnorm, registry, base_dir, model)
        return candidate, roles, _build_train(candidate, roles, loss_spec, spec, max_grad_norm, "train", registry,
                                              target, check_output, model)

    # The train model's build finds the opset its rules need (converting the forward model where a
    # rule asks for a newer one), and every other model is built from that forward model.
    proto, roles, train = build_proto_upgrading(proto, build_train, upgrade_opset)
    batch_inputs = [v.name for v in proto.graph.input if v.name not in {t.name for t in proto.graph.initializer}]
    eval_model, evaluation = train["eval"] or _build_eval(proto, roles, loss_spec, target, check_output)
    manifest = Manifest(
        format=FORMAT_VERSION,
        inputs=tuple(batch_inputs),
        labels=tuple(train["labels"]),
        params=tuple(roles.params),
        buffers=tuple(roles.buffers),
        optimizer=spec,
        max_grad_norm=max_grad_norm,
        train=train["signature"],
        eval=evaluation,
        target=target,
        class_axis=loss_spec.class_axis,
        modules=modules,
        constants=source.constants,
        lora=None if lora is None else LoraRecord(injected.config, injected.config.scale, tuple(injected.adapters)),
    )
    checkpoint = {}
    inits = {t.name: t for t in proto.graph.initializer}
    for name in [*roles.params, *roles.buffers]:  # external ones mapped from their file, not read yet
        checkpoint[name] = tensor_array(inits[name], base_dir)
    for param, names in train["state"].items():
        for state in names:
            checkpoint[state] = np.zeros_like(checkpoint[param])
    accumulate_model = apply_model = None
    if gradient_accumulation:
        accumulate = _build_train(proto, roles, loss_spec, spec, max_grad_norm, "accumulate", registry, target,
                                  check_output)
        accumulators = [key for key, _, _ in accumulate["signature"].carry[: len(roles.params)]]
        apply_model, apply_signature = _build_apply(proto, roles, spec, max_grad_norm, train["state"], accumulators,
                                                    target, check_output)
        accumulate_model = accumulate["model"]
        manifest = dataclasses.replace(manifest, accumulate=accumulate["signature"], apply=apply_signature)
    if set(DROPOUT_SEEDS) & set(manifest.train.coefficients):  # (the accumulate model's are the same)
        manifest = dataclasses.replace(manifest, format=SEEDED_FORMAT)
    return TrainingArtifacts(train["model"], eval_model, forward, checkpoint, manifest, accumulate_model, apply_model,
                             left_out=roles.left_out, base_dir=base_dir)


class _Source:
    """The model to train and the inference model, where they differ from the file's: for a model
    exported from PyTorch, its parameters recovered (:mod:`~onnx_autodiff.weights.recovery`); with
    LoRA, the adapters added. Both stages work on onnx-ir: the model is converted once on the way in
    and once on the way out (:meth:`protos`); any other model stays the proto it came as."""

    def __init__(self, proto: onnx.ModelProto, forward: onnx.ModelProto, base_dir: str | None) -> None:
        self.proto, self.forward, self.base_dir = proto, forward, base_dir
        self.model: ir.Model | None = None  # the model to train, once converted
        self.inference: ir.Model | None = None  # the inference model, where it is no longer ``forward``
        self.modules: tuple[ModuleParameter, ...] | None = None
        self.constants: tuple[LiftedWeight, ...] | None = None  # the weights lifted from Constant nodes, for export
        if _holds_float_constants(proto):  # (read off the proto, as the check below)
            self._lift()
        if is_torch_export(proto):  # (read off the proto: most models are not, and need no conversion)
            self._recover()

    def _lift(self) -> None:
        """Weights stored as Constant nodes become initializers of the model to train; the
        inference model keeps them as nodes, which ``Trainer.export`` sets (the manifest's "constants")."""
        model = from_proto(self.proto, self.base_dir)
        lift = LiftWeightConstantsPass()
        if lift(model).modified:
            self.model = model
            self.constants = tuple(lift.lifted)

    def _recover(self) -> None:
        """Each module parameter one initializer in the model to train (tied copies read through
        it), the inference model in the file's own layout (what ``Trainer.export`` fills in), and
        the parameters by module name as the manifest records them (each with the copies that
        export sets from it)."""
        if self.model is None:
            self.model = from_proto(self.proto, self.base_dir)
        kept = RecoverParametersPass(tie=False)
        self.inference = kept(from_proto(self.proto, self.base_dir)).model
        tied = RecoverParametersPass(tie=True)
        tied(self.model)
        lifted = {weight.initializer for weight in self.constants or ()}  # (Constant nodes in the inference model)
        if [p.initializer for p in tied.recovered if p.initializer not in lifted] != [p.initializer for p in kept.recovered]:
            raise TrainingError("parameter recovery named the parameters differently in the train and the exported "
                                "model (a bug, please report)")
        self.modules = tuple(
            ModuleParameter(name=p.name, initializer=p.initializer, transposed=p.transposed, shape=p.shape,
                            found_by=p.found_by, aliases=p.aliases,
                            copies=tuple((name, bool(transposed != p.transposed)) for name, transposed in p.copies))
            for p in kept.recovered  # (from the stored tensor)
            if p.module)  # (not a weight trained as stored, a fused Conv: no module tensor to give back)

    def _initializers(self) -> list[str]:
        if self.model is not None:
            return list(self.model.graph.initializers)
        return [t.name for t in self.proto.graph.initializer]

    def selection(self, names, role: str):
        """``names`` with module names and patterns (``*q_proj*``) replaced by the initializers that
        hold them; initializer names stay as they are."""
        if names is None or self.modules is None:
            return names
        names = [names] if isinstance(names, str) else list(names)
        inits = self._initializers()
        known = set(inits)
        held: dict[str, list[str]] = {}
        for module in self.modules:
            held.setdefault(module.initializer, []).extend([module.name, *module.aliases])
        chosen = []
        for name in names:
            if name in known:
                found = [name]
            else:
                found = [i for i in inits if fnmatch.fnmatchcase(i, name) or any(fnmatch.fnmatchcase(n, name) for n in held.get(i, ()))]
                if not found:
                    raise UnknownValueError(f"{role} '{name}' is no initializer and matches no module parameter "
                                            f"(the module's parameters are {names_summary([m.name for m in self.modules])})")
            chosen.extend(f for f in found if f not in chosen)
        return chosen

    def adapt(self, lora, trained: list[str], upgrade: bool, target: str | None) -> LoraPass:
        """Adds the adapters of ``lora`` to the model to train; where their base is stored anew,
        the inference model stores it as the train model does."""
        if self.model is None:
            self.model = from_proto(self.proto, self.base_dir)
        lora = self._nbits_read_by_default(lora, upgrade, target)
        inference_reason = self._upgrade_for(lora, upgrade)
        injected = adapt(self.model, lora, trained=trained)
        if injected.quantized:
            if self.inference is None:
                self.inference = from_proto(self.forward, self.base_dir)
            if inference_reason is not None:
                self._convert(self.inference, inference_reason)
            quantize_bases(self.inference, lora.quantization, injected.quantized)
        return injected

    def _nbits_read_by_default(self, lora, upgrade: bool, target: str | None):
        """``lora`` with the kernel chosen for the model's own MatMulNBits where its quantize_format
        is left to the default and DequantizeLinear is not the default's form: on a target of
        :data:`NBITS_KERNEL`, or where reading so needs a newer opset and ``upgrade`` is off
        (the model as it is)."""
        if not isinstance(lora, LoraConfig) or lora.quantize_format is not None or lora.quantize_base is not None:
            return lora
        if target in NBITS_KERNEL or (not upgrade and _default_opset(self.proto) < INT4_OPSET):
            return dataclasses.replace(lora, quantize_format="matmulnbits")
        return lora

    def _upgrade_for(self, lora, upgrade: bool) -> str | None:
        """Converts the model to train to the opset that ``lora``'s quantized base needs (int4 read
        through DequantizeLinear: 21; also where the model's MatMulNBits are read so); the reason,
        where the inference model, which keeps its MatMulNBits, needs it too (else None)."""
        opset = _default_opset(self.proto)  # (the model's until converted here)
        if not isinstance(lora, LoraConfig) or opset >= INT4_OPSET:
            return None
        spec = lora.quantization
        quantized = spec is not None and spec.kind == "int4" and spec.format == "dequantizelinear"
        nbits = lora.reads_nbits_as_dequantizelinear and any(
            node.op_type == "MatMulNBits" and node.domain == "com.microsoft" for node in self.model.graph)
        if not (quantized or nbits):
            return None
        reason = f"{'an int4 base' if quantized else 'MatMulNBits'} read through DequantizeLinear needs opset {INT4_OPSET}"
        if not upgrade:
            raise OpsetError(f"{reason}; the model imports opset {opset} (upgrade_opset=False)")
        self._convert(self.model, reason)
        return reason if quantized else None

    def _convert(self, model: ir.Model, reason: str) -> None:
        convert_in_place(model, INT4_OPSET, reason)
        if self.base_dir:  # the converted tensors are read from the file's folder, as before
            ir.external_data.set_base_dir(model.graph, self.base_dir)

    def protos(self) -> tuple[onnx.ModelProto, onnx.ModelProto, tuple[ModuleParameter, ...] | None]:
        """The model to train, the inference model, and the recovered module parameters (None
        where the model is no PyTorch export)."""
        proto = self.proto if self.model is None else to_proto(self.model)
        forward = self.forward if self.inference is None else to_proto(self.inference)
        return proto, forward, self.modules


def _build_train(proto, roles: _Roles, loss_spec, spec, max_grad_norm, kind: str, registry, target="onnxruntime",
                 check_output: bool = False, model: ir.Model | None = None):
    from onnx_autodiff.passes import AutodiffPass, cleanup_passes

    model, namer, updates = _prepare(proto, roles, training=True, model=model)
    seeds: dict[str, ir.Value] = {}
    if target in FORWARD_LOWERED:
        updates = _training_batchnorm_in_standard_ops(model, namer, updates)
        seeds = _training_dropout_by_hash(model, namer)
    graph = model.graph
    batch = [v for v in graph.inputs if v.name not in roles.state and v not in seeds.values()]
    reads = [v for v in graph.inputs if v.name in roles.state]
    same_as_eval = kind == "train" and _prepared_alike(model, updates, target)
    loss, labels, others = attach_loss(model, namer, loss_spec)
    # The eval model is this forward model and loss with the same names (as _build_eval makes it),
    # cut out of the finished train model where it can be: building it anew costs as much as
    # converting, cleaning and checking the whole forward model again.
    eval_part = None
    if same_as_eval and not any(v.is_graph_input() for v in (loss, *others)) and len({loss, *others}) == 1 + len(others):
        eval_part = [v.name for v in (*batch, *labels, *reads)], [v.name for v in (loss, *others)]
    graph.outputs.clear()
    graph.outputs.append(loss)
    graph.inputs.extend(labels)
    # upgrade_opset=False: build_proto_upgrading converts the forward model where a rule asks.
    # The forward model's shapes are onnx's inference of it (onnx_inferred): where the preparation
    # and the loss added no value, the pass's own inference would only find them again (0.55 s of
    # a 20,001-node chain's build), so it runs only where some value lacks a shape.
    autodiff = AutodiffPass(of=loss.name, wrt=roles.params, registry=registry, seed="ones", unreachable="raise",
                            upgrade_opset=False, infer_shapes=not fully_shaped(graph))
    try:
        autodiff(model)
    except (ir.passes.PassError, AutodiffError) as error:
        cause = error
        while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, NotDifferentiableError) and "does not depend" in str(cause):
            raise TrainingError(f"{cause}: list it in frozen_params, or leave it out of requires_grad") from error
        raise cause from error
    # the backward cleaned up as grad's is; the optimiser's nodes added next are emitted clean
    # (a second cleanup of the whole train model found nothing to do and took 28% of the build)
    lowered_statistics = target in FORWARD_LOWERED and bool(updates)
    if lowered_statistics:  # no node reads them yet: graph outputs meanwhile, so the cleanup keeps them
        count = len(graph.outputs)
        graph.outputs.extend(updates.values())
    ir.passes.PassManager(cleanup_passes(target=target))(model)
    if lowered_statistics:
        updates = dict(zip(updates, graph.outputs[count:]))
        del graph.outputs[count:]
    loss, grads = graph.outputs[0], list(graph.outputs[1:])
    namer = Namer.for_graph(graph, prefix="opt")
    op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
    inputs_by_name = {v.name: v for v in graph.inputs}
    params = [inputs_by_name[p] for p in roles.params]
    taken: set = set()
    loss_out = _publish(op, namer, loss, "loss", taken) if loss.is_graph_input() else loss
    taken.add(loss_out)
    carry, state_names = [], {}
    extra_inputs: list[ir.Value] = []
    outputs = [loss_out]
    scalars, coefficients = {}, {}
    if kind == "train":
        lr = fresh_value(namer, "lr", ir.DataType.FLOAT, [])
        step = fresh_value(namer, "step", ir.DataType.INT64, [])
        states, new_params, new_states, kept = emit_update(op, spec, params, grads, lr, step, namer, max_grad_norm,
                                                           loss=loss, coefficients=coefficients,
                                                           group_limit=_group_limit(target))
        for p, new_p in zip(params, new_params):
            outputs.append(_publish(op, namer, new_p, f"{p.name}.new", taken, like=p))
            carry.append(Carried(p.name, p.name, outputs[-1].name))
        for p, inputs, news in zip(params, states, new_states):
            state_names[p.name] = [s.name for s in inputs]
            for s, new_s in zip(inputs, news):
                outputs.append(_publish(op, namer, new_s, f"{s.name}.new", taken, like=s))
                carry.append(Carried(s.name, s.name, outputs[-1].name))
                extra_inputs.append(s)
        scalars = {"lr": lr.name, "step": step.name, **{key: value.name for key, value in coefficients.items()}}
        tail = [lr, step, *coefficients.values()]
    else:  # accumulate: acc + grad
        tail = []
        groups = update_groups(params, _group_limit(target))
        grad_groups = joined(op, groups, grads)  # read by the finite check and by the sums
        kept, _ = step_kept(op, grad_groups, loss)
        accs = [fresh_value(namer, f"{p.name}.grad_acc", g.dtype or p.dtype, [dim_value(x) for x in p.shape])
                for p, g in zip(params, grads)]
        extra_inputs.extend(accs)
        acc_groups = joined(op, groups, accs)  # read by the sums, and what a failed step returns
        sums = split_back(op, groups, when_kept(op, kept, lambda op: [op.Add(a, g) for a, g in zip(acc_groups, grad_groups)],
                                                acc_groups), accs)
        for acc, new_acc in zip(accs, sums):
            outputs.append(_publish(op, namer, new_acc, f"{acc.name}.new", taken, like=acc))
            carry.append(Carried(acc.name, acc.name, outputs[-1].name))
    for name in roles.buffers:
        value = updates.get(name)
        if value is None:
            continue
        buffer = inputs_by_name[name]
        # not returned by the If on kept: onnxruntime's BatchNormalization writes the statistics it
        # returns into the buffers of its inputs unless they are graph outputs (the trainer gives
        # them spare buffers, kept only when the step is)
        outputs.append(_publish(op, namer, value, f"{name}.new", taken, like=buffer))
        carry.append(Carried(name, name, outputs[-1].name))
    outputs.append(_publish(op, namer, kept, "kept", taken))
    added = list(op.nodes)
    graph.extend(added)
    for domain, version in op.opsets.items():
        model.opset_imports.setdefault(domain, version)
    buffers = set(roles.buffers)
    buffer_inputs = [v for v in graph.inputs if v.name in buffers]
    scalars.update({key: value.name for key, value in seeds.items()})
    inputs = [*batch, *labels, *params, *extra_inputs, *buffer_inputs, *tail, *seeds.values()]
    loss_name, kept_name = loss_out.name, outputs[-1].name  # (before the lowering, as the eval model's)
    proto_out = _finish(model, inputs, outputs, f"{kind} model", cleaned=added, target=target, check_output=check_output,
                        forward=eval_part)
    eval_model = None
    if eval_part is not None:
        proto_out, eval_model = proto_out
    signature = Step(
        batch=tuple(v.name for v in (*batch, *labels)),
        carry=tuple(carry),
        reads=() if kind == "train" else tuple(Read(p.name, p.name) for p in params),
        scalars=scalars,
        loss=loss_name,
        kept=kept_name,
        # how the runner computes the scalar inputs other than lr and step
        coefficients={**{key: coefficient_formulas(spec)[key] for key in coefficients},
                      **{key: DROPOUT_SEEDS[key] for key in seeds}},
    )
    if eval_model is not None:
        evaluation = Evaluation(batch=signature.batch, reads=tuple(Read(v.name, v.name) for v in reads),
                                loss=eval_part[1][0], outputs=tuple(eval_part[1][1:]))
        eval_model = eval_model, evaluation
    return {"model": proto_out, "signature": signature, "labels": [v.name for v in labels], "state": state_names,
            "eval": eval_model}


def _prepared_alike(model: ir.Model, updates: dict, target: str | None) -> bool:
    """Whether :func:`_prepare` made ``model`` for training (``updates``: its buffer updates) as it
    makes it for evaluation: no layer in training mode (BatchNormalization updating its
    statistics, Dropout) and no target lowering the forward or the whole train model."""
    if updates or target in FORWARD_LOWERED or target in OPTIMIZER_LOWERED:
        return False
    return not any(node.op_type == "Dropout" and node.domain in ("", "ai.onnx") for node in model.graph)


def _build_eval(proto, roles: _Roles, loss_spec, target="onnxruntime", check_output: bool = False):
    model, namer, _ = _prepare(proto, roles, training=False)
    graph = model.graph
    batch = [v for v in graph.inputs if v.name not in roles.state]
    reads = [v for v in graph.inputs if v.name in roles.state]
    loss, labels, others = attach_loss(model, namer, loss_spec)
    op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
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
    # the names before the cleanup, which keeps the graph outputs' names but may replace their
    # values (a lowered loss node: the old value loses its name)
    output_names = [v.name for v in outputs]
    proto_out = _finish(model, [*batch, *labels, *reads], outputs, "eval model", target=target,
                        check_output=check_output)
    return proto_out, Evaluation(batch=tuple(v.name for v in (*batch, *labels)),
                                 reads=tuple(Read(v.name, v.name) for v in reads), loss=output_names[0],
                                 outputs=tuple(output_names[1:]))


def _build_apply(proto, roles: _Roles, spec, max_grad_norm, state: dict, accumulators: list[str],
                 target="onnxruntime", check_output: bool = False):
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
    lr = fresh_value(namer, "lr", ir.DataType.FLOAT, [])
    step = fresh_value(namer, "step", ir.DataType.INT64, [])
    scale = fresh_value(namer, "grad_scale", ir.DataType.FLOAT, [])
    grads = [op.Mul(a, op.CastLike(scale, a)) for a in accs]
    coefficients: dict = {}
    states, new_params, new_states, kept = emit_update(op, spec, params, grads, lr, step, namer, max_grad_norm,
                                                        [state.get(p, []) for p in roles.params],
                                                        coefficients=coefficients, group_limit=_group_limit(target))
    taken: set = set()
    outputs, carry = [], []
    for p, new_p in zip(params, new_params):
        outputs.append(_publish(op, namer, new_p, f"{p.name}.new", taken, like=p))
        carry.append(Carried(p.name, p.name, outputs[-1].name))
    for inputs, news in zip(states, new_states):
        for s, new_s in zip(inputs, news):
            outputs.append(_publish(op, namer, new_s, f"{s.name}.new", taken, like=s))
            carry.append(Carried(s.name, s.name, outputs[-1].name))
    outputs.append(_publish(op, namer, kept, "kept", taken))
    kept_name = outputs[-1].name  # (before the cleanup, as the eval model's names)
    state_inputs = [s for inputs in states for s in inputs]
    graph = ir.Graph([*params, *accs, *state_inputs, lr, step, scale, *coefficients.values()], outputs, nodes=op.nodes,
                     opset_imports={"": opset}, name="apply")
    model = ir.Model(graph, ir_version=max(proto.ir_version, 8), producer_name="onnx-autodiff")
    proto_out = _finish(model, list(graph.inputs), outputs, "apply model", target=target, check_output=check_output)
    return proto_out, Step(
        batch=(),
        carry=tuple(carry),
        reads=tuple(Read(a.name, a.name) for a in accs),
        scalars={"lr": lr.name, "step": step.name, "grad_scale": scale.name,
                 **{key: value.name for key, value in coefficients.items()}},
        loss=None,
        kept=kept_name,
        coefficients={key: coefficient_formulas(spec)[key] for key in coefficients},
    )
