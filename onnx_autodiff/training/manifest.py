"""What ``artifacts.json`` holds: the manifest of a set of training artifacts, as frozen dataclasses.

Each model the artifacts hold has a signature: :class:`Step` for the train, accumulate and apply
models, :class:`Evaluation` for the eval model. A signature names the batch inputs the caller
feeds, the state the model carries from run to run (:class:`Carried`: the output that replaces
each input), the state it only reads, its scalar inputs and how the trainer computes them, its
loss and its "kept" flag. :class:`Manifest` holds the four signatures with the parameters, the
optimiser, the target and the records export needs (module names, weights stored as Constant
nodes, LoRA adapters). Each class has one ``to_json`` and one ``from_json``; a file of an older
format reaches them through :func:`upgrade` alone. :func:`json_schema` derives the JSON Schema
from the same classes (``js/artifacts.schema.json``); ``docs/artifacts.md`` describes the format
for trainers in other languages.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import ClassVar, NamedTuple, Union

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.passes.lift import LiftedWeight
from onnx_autodiff.training.lora import Adapter, LoraConfig
from onnx_autodiff.training.qat import QatConfig
from onnx_autodiff.training.schedules import LRSchedule
from onnx_autodiff.training.targets import DEFAULT as DEFAULT_TARGET
from onnx_autodiff.training.optimizers import (
    COEFFICIENT_OPERATORS,
    OPTIMIZER_CLASSES,
    Optimizer,
    optimizer_from_json,
    optimizer_to_json,
)

# 2: Adam's and AdamW's per-step coefficients are scalar inputs that the runner computes (the
# signatures' "coefficients"), no longer float64 nodes of the graph; 1 still loads and runs.
# 3: a model also takes the trainer's step and micro-batch as uint32 inputs (the webgpu target's
# hashed Dropout), which a trainer reading format 2 would not feed; only such artifacts say 3.
FORMAT_VERSION = 2
SEEDED_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)

# A coefficient expression (optimizers.coefficient_formulas): a number, the name of a value the
# trainer gives ("lr", "step", "micro_batch", "grad_scale"), or [operator, operand, ...].
Expression = Union[float, str, list]


class Carried(NamedTuple):
    """State a model carries: the value of ``key`` is fed to ``input``, and ``output`` is the key's
    value for the next run (kept only when the run is)."""

    key: str
    input: str
    output: str


class Read(NamedTuple):
    """State a model reads and leaves as it is: the value of ``key`` fed to ``input``."""

    key: str
    input: str


@dataclasses.dataclass(frozen=True)
class Step:
    """The signature of the train, accumulate or apply model. ``scalars``: the scalar inputs by
    key; each is the value of that name the trainer gives (lr, step, micro_batch, grad_scale) or,
    where ``coefficients`` has the key, that expression of them, computed in float64. ``loss``:
    the loss output (None for the apply model); ``kept``: the boolean output that says whether the
    run's new values are finite (None in artifacts from before the models had it: the trainer
    then checks the new values itself); ``in_place``: the carried keys whose new value the model
    may write over the old one, in the old one's buffer (the build's analysis,
    :func:`~onnx_autodiff.training.in_place.in_place_keys`; None where not recorded: the trainer
    then makes it, or, without ``kept``, writes every new value to a buffer of its own)."""

    batch: tuple[str, ...]
    carry: tuple[Carried, ...]
    reads: tuple[Read, ...]
    scalars: Mapping[str, str]
    loss: str | None
    kept: str | None = None
    coefficients: Mapping[str, Expression] = dataclasses.field(default_factory=dict)
    in_place: tuple[str, ...] | None = None

    def to_json(self) -> dict:
        document = {"batch": list(self.batch), "carry": [list(c) for c in self.carry],
                    "reads": [list(r) for r in self.reads], "scalars": dict(self.scalars), "loss": self.loss}
        if self.kept is not None:
            document["kept"] = self.kept
        if self.coefficients:
            document["coefficients"] = dict(self.coefficients)
        if self.in_place is not None:
            document["in_place"] = list(self.in_place)
        return document

    @classmethod
    def from_json(cls, document: Mapping) -> Step:
        return cls(batch=tuple(document["batch"]), carry=tuple(Carried(*c) for c in document["carry"]),
                   reads=tuple(Read(*r) for r in document["reads"]), scalars=dict(document["scalars"]),
                   loss=document["loss"], kept=document.get("kept"),
                   coefficients=dict(document.get("coefficients", {})),
                   in_place=None if document.get("in_place") is None else tuple(document["in_place"]))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The signature of the eval model: the batch, the state it reads, the loss output and the
    model's own outputs after it."""

    batch: tuple[str, ...]
    reads: tuple[Read, ...]
    loss: str
    outputs: tuple[str, ...]
    # it carries nothing and takes no scalar: a runner reads it as a step without them
    carry: ClassVar[tuple[Carried, ...]] = ()
    scalars: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    coefficients: ClassVar[Mapping[str, Expression]] = types.MappingProxyType({})
    kept: ClassVar[None] = None

    def to_json(self) -> dict:
        return {"batch": list(self.batch), "reads": [list(r) for r in self.reads], "loss": self.loss,
                "outputs": list(self.outputs)}

    @classmethod
    def from_json(cls, document: Mapping) -> Evaluation:
        return cls(batch=tuple(document["batch"]), reads=tuple(Read(*r) for r in document["reads"]),
                   loss=document["loss"], outputs=tuple(document["outputs"]))


@dataclasses.dataclass(frozen=True)
class ModuleParameter:
    """A parameter of the PyTorch module the model was exported from (parameter recovery): its
    ``state_dict()`` name and the other names of a tied one, the initializer that holds it
    (``transposed``: as the module's transpose), the module's shape, how recovery found it, and
    the other initializers that hold a copy, which export sets from it (each [name, transposed
    relative to the initializer])."""

    name: str
    initializer: str
    transposed: bool
    shape: tuple[int, ...]
    found_by: str
    copies: tuple[tuple[str, bool], ...]
    aliases: tuple[str, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "initializer": self.initializer, "transposed": self.transposed,
                "shape": list(self.shape), "found_by": self.found_by,
                "copies": [list(c) for c in self.copies], "aliases": list(self.aliases)}

    @classmethod
    def from_json(cls, document: Mapping) -> ModuleParameter:
        return cls(name=document["name"], initializer=document["initializer"], transposed=document["transposed"],
                   shape=tuple(document["shape"]), found_by=document["found_by"],
                   copies=tuple((name, transposed) for name, transposed in document["copies"]),
                   aliases=tuple(document["aliases"]))


@dataclasses.dataclass(frozen=True)
class LoraRecord:
    """The LoRA adapters: the config they were added with (its entries inline in the JSON), the
    scale alpha / rank their products are multiplied by, and each adapter."""

    config: LoraConfig = dataclasses.field(metadata={"inline": True})
    scale: float
    adapters: tuple[Adapter, ...]

    @property
    def weights(self) -> set[str]:
        """The adapted base weights."""
        return {a.weight for a in self.adapters}

    @property
    def tensors(self) -> list[str]:
        """The adapters' A and B, in order."""
        return [name for a in self.adapters for name in (a.A, a.B)]

    def to_json(self) -> dict:
        return {**self.config.to_json(), "scale": self.scale,
                "adapters": [dataclasses.asdict(a) for a in self.adapters]}

    @classmethod
    def from_json(cls, document: Mapping) -> LoraRecord:
        config = {key: value for key, value in document.items() if key not in ("scale", "adapters")}
        return cls(config=LoraConfig(**config), scale=document["scale"],
                   adapters=tuple(Adapter(**a) for a in document["adapters"]))


@dataclasses.dataclass(frozen=True)
class ExternalData:
    """The data files that the models read their tensors from where they are (see
    ``TrainingArtifacts.save``): their folder relative to the artifacts' directory (None: on
    another drive) and absolute, and each file's size."""

    folder: str | None
    path: str
    files: Mapping[str, int]

    def to_json(self) -> dict:
        return {"folder": self.folder, "path": self.path, "files": dict(self.files)}

    @classmethod
    def from_json(cls, document: Mapping) -> ExternalData:
        return cls(folder=document["folder"], path=document["path"], files=dict(document["files"]))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What ``artifacts.json`` holds. ``inputs``: the model's inputs; ``labels``: the inputs the
    loss adds; ``params``: the trained initializers; ``buffers``: the state the train model updates
    besides them (BatchNormalization's running statistics); ``max_grad_norm``: the clipping norm
    (None: none); ``target``: the runtime the models were lowered for (None: standard forms);
    ``class_axis``: the output axis that integer labels index (None: the labels are no classes);
    ``modules``: the module parameters of a PyTorch export; ``constants``: the weights lifted from
    Constant nodes, which export writes back into them; ``external_data``: where the models' data
    files are, when saved referencing them; ``lr_schedule``: how the learning rate changes from
    step to step (None: it stays the optimiser's); ``qat``: the quantization-aware training the models
fake-quantize by (None: none), whose observers' ranges are among the ``buffers``."""

    format: int = dataclasses.field(metadata={"schema": {"enum": [FORMAT_VERSION, SEEDED_FORMAT]}})
    inputs: tuple[str, ...]
    labels: tuple[str, ...]
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    optimizer: Optimizer
    max_grad_norm: float | None
    train: Step
    eval: Evaluation
    accumulate: Step | None = None
    apply: Step | None = None
    target: str | None = DEFAULT_TARGET.name
    class_axis: int | None = 1
    modules: tuple[ModuleParameter, ...] | None = None
    constants: tuple[LiftedWeight, ...] | None = None
    lora: LoraRecord | None = None
    external_data: ExternalData | None = None
    lr_schedule: LRSchedule | None = None
    qat: QatConfig | None = None

    def signature(self, kind: str) -> Step | Evaluation | None:
        """The signature of the "train", "eval", "accumulate" or "apply" model (None: no such model)."""
        return {"train": self.train, "eval": self.eval, "accumulate": self.accumulate, "apply": self.apply}[kind]

    def to_json(self) -> dict:
        document = {"format": self.format, "inputs": list(self.inputs), "labels": list(self.labels),
                    "params": list(self.params), "buffers": list(self.buffers),
                    "optimizer": optimizer_to_json(self.optimizer), "max_grad_norm": self.max_grad_norm,
                    "train": self.train.to_json(), "eval": self.eval.to_json()}
        # the rest only where it is not the default (the default's artifacts.json as before)
        if self.accumulate is not None:
            document["accumulate"] = self.accumulate.to_json()
        if self.apply is not None:
            document["apply"] = self.apply.to_json()
        if self.target != DEFAULT_TARGET.name:
            document["target"] = self.target
        if self.class_axis != 1:
            document["class_axis"] = self.class_axis
        if self.modules is not None:
            document["modules"] = [m.to_json() for m in self.modules]
        if self.constants is not None:
            document["constants"] = [w.to_json() for w in self.constants]
        if self.lora is not None:
            document["lora"] = self.lora.to_json()
        if self.external_data is not None:
            document["external_data"] = self.external_data.to_json()
        if self.lr_schedule is not None:
            document["lr_schedule"] = self.lr_schedule.to_json()
        if self.qat is not None:
            document["qat"] = self.qat.to_json()
        return document

    @classmethod
    def from_json(cls, document: Mapping, source: str = "artifacts.json") -> Manifest:
        """The manifest of ``document`` in any format this version reads (``source``: its file, for
        the errors)."""
        document = upgrade(document, source)

        def each(key, read):
            return None if document.get(key) is None else tuple(map(read, document[key]))

        def optional(key, read):
            return None if document.get(key) is None else read(document[key])

        try:
            return cls(format=document["format"], inputs=tuple(document["inputs"]), labels=tuple(document["labels"]),
                       params=tuple(document["params"]), buffers=tuple(document["buffers"]),
                       optimizer=optimizer_from_json(document["optimizer"]), max_grad_norm=document["max_grad_norm"],
                       train=Step.from_json(document["train"]), eval=Evaluation.from_json(document["eval"]),
                       accumulate=optional("accumulate", Step.from_json), apply=optional("apply", Step.from_json),
                       target=document.get("target", DEFAULT_TARGET.name), class_axis=document.get("class_axis", 1),
                       modules=each("modules", ModuleParameter.from_json),
                       constants=each("constants", LiftedWeight.from_json),
                       lora=optional("lora", LoraRecord.from_json),
                       external_data=optional("external_data", ExternalData.from_json),
                       lr_schedule=optional("lr_schedule", LRSchedule.from_json),
                       qat=optional("qat", QatConfig.from_json))
        except (KeyError, TypeError, ValueError) as error:
            raise TrainingError(f"{source} is no artifacts.json of format {document['format']} ({type(error).__name__}: "
                                f"{error}): generate the artifacts again") from error


def upgrade(document: Mapping, source: str = "artifacts.json") -> Mapping:
    """``document``, an artifacts.json of any format this version reads, in the current format:
    the one place that knows the older ones. Format 1 computed Adam's and AdamW's coefficients
    in its models (in float64): its signatures have no "coefficients" and its models take none,
    which is format 2 as it is. (Artifacts older still, from before the models returned their
    "kept" flag, have none: :attr:`Step.kept` is None, and the trainer checks the new values.)"""
    version = document.get("format") if isinstance(document, Mapping) else None
    if version not in READABLE_FORMATS:
        raise TrainingError(f"{source}: unsupported artifacts format {version!r} (this version of onnx-autodiff reads "
                            f"formats {', '.join(map(str, READABLE_FORMATS))}): generate the artifacts again, or use the "
                            "onnx-autodiff that wrote them")
    if version == 1:
        document = {**document, "format": FORMAT_VERSION}
    return document


# The JSON Schema, derived from the classes above: a field without a default is required, one
# with a default may be left out (it then has that value), ``X | None`` may be null, a tuple or
# sequence is an array (a NamedTuple or fixed tuple one of that length), a mapping an object.

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _expression_schema() -> dict:
    """A coefficient expression's: a number, a name, or [operator, operand, ...] with as many
    operands as the operator takes (optimizers.COEFFICIENT_OPERATORS)."""
    arities: dict[int, list[str]] = {}
    for name, operator in COEFFICIENT_OPERATORS.items():
        arities.setdefault(len(inspect.signature(operator).parameters), []).append(name)
    applications = [{"type": "array", "prefixItems": [{"enum": names}, *[{"$ref": "#/$defs/Expression"}] * arity],
                     "items": False, "minItems": 1 + arity} for arity, names in sorted(arities.items())]
    return {"description": "A coefficient expression, computed in float64: a number; the name of a value the trainer "
                           "gives (lr, step, micro_batch, grad_scale); or [operator, operand, ...]: +, -, *, / and "
                           "pow of two operands, sqrt and float32 (rounding to the nearest float32) of one.",
            "anyOf": [{"type": "number"}, {"type": "string"}, *applications]}


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of ``artifacts.json`` in the current format."""
    definitions = {"Expression": _expression_schema()}
    root = _object_schema(Manifest, definitions)
    return {"$schema": SCHEMA_DIALECT, "title": "onnx-autodiff training artifacts (artifacts.json)", **root,
            "$defs": dict(sorted(definitions.items()))}


def schema_text() -> str:
    """:func:`json_schema` as ``js/artifacts.schema.json`` holds it."""
    return json.dumps(json_schema(), indent=1, ensure_ascii=False) + "\n"


def _description(cls) -> str:
    """The first paragraph of ``cls``'s docstring, on one line, in Markdown."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split()).replace("``", "`")


def _object_schema(cls, definitions: dict) -> dict:
    hints = typing.get_type_hints(cls)
    properties, required = {}, []
    if issubclass(cls, Optimizer):  # written with its "name" (optimizer_to_json)
        properties["name"] = {"const": cls.name}
        required.append("name")
    for field in dataclasses.fields(cls):
        if field.metadata.get("inline"):  # its entries written beside the others
            inner = _object_schema(hints[field.name], definitions)
            properties.update(inner["properties"])
            required.extend(inner["required"])
            continue
        properties[field.name] = {**_schema(hints[field.name], definitions), **field.metadata.get("schema", {})}
        if field.default is not dataclasses.MISSING:
            properties[field.name]["default"] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            properties[field.name]["default"] = field.default_factory()
        else:
            required.append(field.name)
    return {"description": _description(cls), "type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _schema(hint, definitions: dict) -> dict:
    """The schema of a field of type ``hint`` (a class in ``definitions``, by reference)."""
    if hint == Expression:
        return {"$ref": "#/$defs/Expression"}
    if hint is Optimizer:  # one of the registered optimisers
        return {"anyOf": [_schema(cls, definitions) for cls in OPTIMIZER_CLASSES.values()]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        options = [_schema(a, definitions) for a in args if a is not type(None)]
        if type(None) in args:
            options.append({"type": "null"})
        if all(set(o) == {"type"} for o in options):
            return {"type": [o["type"] for o in options]}
        return {"anyOf": options}
    if hint in (str, bool, int, float):  # (bool before int: a bool is an int)
        return {"type": {str: "string", bool: "boolean", int: "integer", float: "number"}[hint]}
    if origin is tuple and args[-1] is not Ellipsis:
        return {"type": "array", "prefixItems": [_schema(a, definitions) for a in args], "items": False,
                "minItems": len(args)}
    if origin in (tuple, list, Sequence):
        return {"type": "array", "items": _schema(args[0], definitions)}
    if origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _schema(args[1], definitions)}
    if dataclasses.is_dataclass(hint) or (isinstance(hint, type) and issubclass(hint, tuple)):
        if hint.__name__ not in definitions:
            definitions[hint.__name__] = {}  # (taken before its fields are: a class may refer to itself)
            definitions[hint.__name__] = (_object_schema(hint, definitions) if dataclasses.is_dataclass(hint)
                                          else _tuple_schema(hint, definitions))
        return {"$ref": f"#/$defs/{hint.__name__}"}
    raise TypeError(f"no JSON schema for {hint!r}")


def _tuple_schema(cls, definitions: dict) -> dict:
    """A NamedTuple's: an array of its fields in order."""
    hints = typing.get_type_hints(cls)
    return {"description": _description(cls), "type": "array",
            "prefixItems": [{"title": name, **_schema(hints[name], definitions)} for name in cls._fields],
            "items": False, "minItems": len(cls._fields)}
