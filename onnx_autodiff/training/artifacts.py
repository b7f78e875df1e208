"""Training artifacts: the train-step, eval, accumulate and apply models built from a forward model
(:mod:`~onnx_autodiff.training.generation`), and their files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping

import numpy as np
import onnx

from onnx_autodiff.errors import TrainingError, names_summary
from onnx_autodiff.files import json_text, write_atomically
from onnx_autodiff.modelfile import (
    external_files,
    from_proto,
    over_limit,
    reading_written,
    save_model,
    uses_external_data,
    with_small_tensors_inline,
)
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.frozen_reads import FROZEN_IN_PLACE
from onnx_autodiff.training.generation.pipeline import build_artifacts
from onnx_autodiff.training.generation.roles import quantized_weight_names, stored_inputs
from onnx_autodiff.training.manifest import ExternalData, Manifest
from onnx_autodiff.training.values import arrays_writer, load_arrays

CHECKPOINT_FILES = {"npz": "checkpoint.npz", "safetensors": "checkpoint.safetensors"}

__all__ = ["CHECKPOINT_FILES", "FROZEN_IN_PLACE", "ArtifactsConfig", "TrainingArtifacts", "generate_artifacts",
           "quantized_weight_names"]


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
    stored = set(stored_inputs(proto))
    return any(t.name in stored and len(t.raw_data) >= FROZEN_IN_PLACE for t in large)


def generate_artifacts(model, config: ArtifactsConfig | None = None, /, **options) -> TrainingArtifacts:
    """The training artifacts of ``model`` (an onnx.ModelProto, onnx_ir.Model or path) for ``config``,
    an :class:`~onnx_autodiff.training.generation.config.ArtifactsConfig`, whose fields are also taken as
    keywords (``generate_artifacts(model, loss="mse", optimizer="sgd")``; with a config, they
    replace its fields). The options are described there.

    Tensors stored beside a model file (external data) stay there: they are read when used, the
    checkpoint maps the parameters' initial values from their file, and ``save`` writes the
    models that hold such tensors with a data file of their own.

    Python's cyclic collector rescans the ever larger graphs while they are built (the optimiser's
    nodes of 10,000 parameters: 7.6 s with it, 1.8 s without): a large build runs faster inside
    :func:`onnx_autodiff.collector_paused`, as the command line runs it.
    """
    if config is None:
        config = ArtifactsConfig(**options)
    elif not isinstance(config, ArtifactsConfig):
        raise TypeError(f"generate_artifacts(model, config): config is an ArtifactsConfig, not a {type(config).__name__} "
                        "(give the other options as keywords: requires_grad=..., loss=...)")
    elif options:
        config = dataclasses.replace(config, **options)
    return _generate_artifacts(model, config)


def _generate_artifacts(model, config: ArtifactsConfig) -> TrainingArtifacts:
    # (one call per build, with the config made: what tests/fingerprints.py records)
    built = build_artifacts(model, config)
    return TrainingArtifacts(built.train_model, built.eval_model, built.inference_model, built.checkpoint,
                             built.manifest, built.accumulate_model, built.apply_model, left_out=built.left_out,
                             base_dir=built.base_dir)
