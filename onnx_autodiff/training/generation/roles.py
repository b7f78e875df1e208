"""The roles of a forward model's initializers: the parameters to train, the buffers the forward
updates (BatchNormalization's running statistics), the constants left out; and its opset."""

from __future__ import annotations

import dataclasses
import functools

import onnx
import onnx_ir as ir

from onnx_autodiff.errors import NotDifferentiableError, TrainingError, TrainingOpsetError, UnknownValueError, names_summary
from onnx_autodiff.modelfile import from_proto
from onnx_autodiff.passes.parameters import default_parameters
from onnx_autodiff.toolkit import FLOAT_TYPES
from onnx_autodiff.training.generation.fake_quantize import FakeQuantization
from onnx_autodiff.weights.quantized import STORED_INPUT


@dataclasses.dataclass
class Roles:
    params: list[str]
    buffers: list[str]  # BatchNormalization running statistics and fake quantization's observers
    opset: int
    left_out: list[str]  # float initializers the default parameters left out (constants)
    base_dir: str | None = None  # where external tensors are read from
    quantization: FakeQuantization | None = None  # what quantization-aware training added

    @functools.cached_property
    def state(self) -> frozenset[str]:
        """The parameters and buffers: the initializers the trainer carries from step to step."""
        return frozenset(self.params) | frozenset(self.buffers)


def proto_default_opset(proto: onnx.ModelProto) -> int:
    """The default ONNX domain's opset that ``proto`` imports."""
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise TrainingError("the model imports no version of the default ONNX domain")


def analyse(proto, requires_grad, frozen_params, freeze_batchnorm, registry=None, base_dir=None,
            model: ir.Model | None = None, quantization: FakeQuantization | None = None) -> Roles:
    """The parameters, buffers and opset of ``proto`` (``model``: it as onnx-ir, when the caller
    has it, which this leaves as it is; ``quantization``: the fake quantization added to it)."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = {v.name for v in graph.input}
    opset = proto_default_opset(proto)
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

    observers = quantization.buffers if quantization is not None else []

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
        left_out = [n for n in default.left_out if n not in stats and n not in frozen and n not in observers]
        params = [v.name for v in default.parameters if v.name not in frozen and v.name not in stats
                  and v.name not in observers]
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
            if name in observers:
                raise TrainingError(f"'{name}' is a fake quantization's observed range: it is updated by the forward pass, not trained")
        if len(set(params)) != len(params):
            raise TrainingError(f"requires_grad names a parameter twice: {params}")
    if quantization is not None:  # the learned scales train with whatever else does
        params += [name for name in quantization.learned if name not in params]
        left_out = [name for name in left_out if name not in quantization.learned]
    if not params:
        constants = f"; the default left out {names_summary(left_out)}: name them in requires_grad" if left_out else ""
        raise TrainingError(f"there is no parameter to train: the model has no floating-point initializer left after freezing{constants}")
    buffers = ([] if freeze_batchnorm else [s for s in stats if s not in frozen]) + observers
    left_out += [n for n in quantized_weight_names(proto) if n not in left_out]
    return Roles(params=params, buffers=buffers, opset=opset, left_out=left_out, base_dir=base_dir,
                 quantization=quantization)


def quantized_weight_names(proto: onnx.ModelProto) -> list[str]:
    """The integer initializers that hold a quantized weight (passes.parameters.quantized_weights,
    read off a proto)."""
    integers = {t.name for t in proto.graph.initializer if ir.DataType(t.data_type) not in FLOAT_TYPES}
    return [name for name in stored_inputs(proto) if name in integers]


def stored_inputs(proto: onnx.ModelProto) -> list[str]:
    """The inputs of ``proto``'s nodes that hold a weight in a stored form (quantize.STORED_INPUT),
    each once, in node order."""
    found = []
    for node in proto.graph.node:
        position = STORED_INPUT.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
        if position is not None and len(node.input) > position and node.input[position]:
            found.append(node.input[position])
    return list(dict.fromkeys(found))
