"""The build's input: the model as given (a proto, an onnx-ir model, a path), its local functions
inlined, and where it differs from the file's form, the model to train and the inference model:
weights stored as Constant nodes lifted, a PyTorch export's parameters recovered, LoRA adapters
added. These stages work on onnx-ir: the model is converted once on the way in and once on the
way out; any other model stays the proto it came as."""

from __future__ import annotations

import dataclasses
import fnmatch
import os

import onnx
import onnx.inliner
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError, UnknownValueError, names_summary
from onnx_autodiff.modelfile import base_dir_of, from_proto, to_proto
from onnx_autodiff.passes.lift import LiftedWeight, LiftWeightConstantsPass
from onnx_autodiff.passes.opsets import OpsetError, convert_in_place, default_opset
from onnx_autodiff.toolkit import FLOAT_TYPES, proto_graphs
from onnx_autodiff.toolkit.inference import infer_shapes
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.fake_quantize import (
    WEIGHTED, FakeQuantization, FakeQuantizePass, of_initializers)
from onnx_autodiff.training.generation.fold_batchnorm import FoldBatchNormPass
from onnx_autodiff.training.generation.roles import proto_default_opset
from onnx_autodiff.training.lora import LoraConfig, LoraPass, adapt, quantize_bases
from onnx_autodiff.training.manifest import ModuleParameter
from onnx_autodiff.training.qat import QatConfig
from onnx_autodiff.training.targets import Target
from onnx_autodiff.weights.quantized import INT4_OPSET
from onnx_autodiff.weights.recovery import RecoverParametersPass, is_torch_export


@dataclasses.dataclass
class Forward:
    """The forward model the build starts from, and what reading it found."""

    proto: onnx.ModelProto  # the model to train
    model: ir.Model | None  # it as onnx-ir, where a stage converted it (else None: converted when built)
    inference: onnx.ModelProto  # the inference model: the input model's, unless a stage changed it
    base_dir: str | None  # where external tensors are read from
    requires_grad: list[str] | str | None  # the options, patterns and module names resolved
    frozen_params: list[str] | str | None
    modules: tuple[ModuleParameter, ...] | None  # a PyTorch export's module parameters (else None)
    constants: tuple[LiftedWeight, ...] | None  # the weights lifted from Constant nodes, for export
    lora: LoraPass | None  # the adapters added
    quantization: FakeQuantization | None = None  # the fake quantization added


def read_forward(model, config: ArtifactsConfig, target: Target) -> Forward:
    """The forward model of ``model`` (an onnx.ModelProto, onnx_ir.Model or path) for ``config``."""
    forward, base_dir = as_proto(model), source_dir(model)
    proto = onnx.ModelProto()
    proto.CopyFrom(forward)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    source = Source(proto, forward, base_dir)
    frozen_params = source.selection(config.frozen_params, "frozen parameter")
    requires_grad = config.requires_grad
    named = set([requires_grad] if isinstance(requires_grad, str) else requires_grad or ())
    requires_grad = source.selection(requires_grad, "parameter")
    if requires_grad is not None and frozen_params:  # what a pattern selects, frozen_params may take back
        requires_grad = [n for n in requires_grad if n in named or n not in set(frozen_params)]
    injected = None
    if config.lora is not None:
        extra = [requires_grad] if isinstance(requires_grad, str) else list(requires_grad or [])
        injected = source.adapt(config.lora, extra, config.upgrade_opset, target, merged=config.qat is not None)
        frozen = {frozen_params} if isinstance(frozen_params, str) else set(frozen_params or [])
        adapters = [name for a in injected.adapters for name in (a.A, a.B)]
        requires_grad = list(dict.fromkeys([*adapters, *(n for n in injected.extra if n not in frozen), *extra]))
    quantization = None
    if config.qat is not None:
        quantization = source.fake_quantize(config.qat, config.upgrade_opset)
    proto = source.proto if source.model is None else to_proto(source.model)  # (what onnx's inference reads)
    inference = source.forward if source.inference is None else to_proto(source.inference)
    return Forward(proto, source.model, inference, base_dir, requires_grad, frozen_params, source.modules,
                   source.constants, injected, quantization)


def as_proto(model) -> onnx.ModelProto:
    """``model`` as a proto of its own (a copy where it is one)."""
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


def source_dir(model) -> str | None:
    """Where the external tensors of ``model`` (as :func:`as_proto` takes it) are read from."""
    if isinstance(model, ir.Model):
        return base_dir_of(model)
    if isinstance(model, (str, os.PathLike)):
        return os.path.dirname(os.path.abspath(os.fspath(model)))
    return None


def _holds_float_constants(proto: onnx.ModelProto) -> bool:
    """Whether a float Constant node is anywhere in ``proto``'s graphs (weights a producer may have
    stored so: :class:`~onnx_autodiff.passes.lift.LiftWeightConstantsPass`)."""
    return any(node.op_type == "Constant" and node.attribute and (
        node.attribute[0].name in ("value_float", "value_floats")
        or (node.attribute[0].name == "value" and ir.DataType(node.attribute[0].t.data_type) in FLOAT_TYPES))
        for graph in proto_graphs(proto.graph) for node in graph.node)


class Source:
    """The model to train and the inference model, where they differ from the file's: for a model
    exported from PyTorch, its parameters recovered (:mod:`~onnx_autodiff.weights.recovery`); with
    LoRA, the adapters added."""

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
        # the inference model from the file's graph: a copy of the model to train unless Constant
        # weights were lifted in that one
        inference = self.model.clone() if self.constants is None else from_proto(self.proto, self.base_dir)
        kept = RecoverParametersPass(tie=False)
        self.inference = kept(inference).model
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

    def adapt(self, lora, trained: list[str], upgrade: bool, target: Target, merged: bool = False) -> LoraPass:
        """Adds the adapters of ``lora`` to the model to train (``merged`` into their weights: for
        quantization-aware training); where their base is stored anew, the inference model stores
        it as the train model does."""
        if self.model is None:
            self.model = from_proto(self.proto, self.base_dir)
        lora = self._nbits_read_by_default(lora, upgrade, target)
        inference_reason = self._upgrade_for(lora, upgrade)
        if merged and isinstance(lora, LoraConfig) and lora.quantization is not None:
            raise TrainingError("quantization-aware training fake-quantizes the float weights: it does not combine "
                                "with quantize_base (train on the float model)")
        injected = adapt(self.model, lora, trained=trained, merged=merged)
        if injected.quantized:
            if self.inference is None:
                self.inference = from_proto(self.forward, self.base_dir)
            if inference_reason is not None:
                self._convert(self.inference, inference_reason)
            quantize_bases(self.inference, lora.quantization, injected.quantized)
        return injected

    def fake_quantize(self, qat: QatConfig, upgrade: bool) -> FakeQuantization:
        """Folds BatchNormalization into the convolutions before it and adds fake quantization to
        the model to train (converted to the opset it needs); the inference model is that model in
        evaluation form (``Trainer.export`` writes it quantized)."""
        if self.model is None:
            self.model = from_proto(self.proto, self.base_dir)
        opset = default_opset(self.model) or 1
        if opset < qat.opset:
            reason = f"quantization-aware training ({qat.scheme}) needs opset {qat.opset}"
            if not upgrade:
                raise OpsetError(f"{reason}; the model imports opset {opset} (upgrade_opset=False)")
            self._convert(self.model, reason, qat.opset)
        FoldBatchNormPass()(self.model)
        if any(node.op_type in WEIGHTED and len(node.inputs) > 1 and node.inputs[1] is not None
               and not node.inputs[1].is_initializer() and node.inputs[1].shape is None
               and of_initializers(node.inputs[1]) for node in self.model.graph):
            infer_shapes(self.model, missing_only=True)  # (the shapes of weights computed from initializers)
        inserted = FakeQuantizePass(qat)
        inserted(self.model)
        if not inserted.quantized:
            raise TrainingError(f"quantization-aware training ({qat.scheme}) found no Conv, ConvTranspose, Gemm or "
                                "MatMul with a float initializer weight to quantize"
                                + (f" that the skip patterns {list(qat.skip)} leave" if qat.skip else ""))
        self.inference = self.model.clone()
        self.constants = None  # (the inference model is the model to train: its weights lifted already)
        return inserted.added

    def _nbits_read_by_default(self, lora, upgrade: bool, target: Target):
        """``lora`` with the kernel chosen for the model's own MatMulNBits where its quantize_format
        is left to the default and DequantizeLinear is not the default's form: on a target that
        keeps the kernel (``nbits_kernel``), or where reading so needs a newer opset and
        ``upgrade`` is off (the model as it is)."""
        if not isinstance(lora, LoraConfig) or lora.quantize_format is not None or lora.quantize_base is not None:
            return lora
        if target.nbits_kernel or (not upgrade and proto_default_opset(self.proto) < INT4_OPSET):
            return dataclasses.replace(lora, quantize_format="matmulnbits")
        return lora

    def _upgrade_for(self, lora, upgrade: bool) -> str | None:
        """Converts the model to train to the opset that ``lora``'s quantized base needs (int4 read
        through DequantizeLinear: 21; also where the model's MatMulNBits are read so); the reason,
        where the inference model, which keeps its MatMulNBits, needs it too (else None)."""
        opset = proto_default_opset(self.proto)  # (the model's until converted here)
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

    def _convert(self, model: ir.Model, reason: str, opset: int = INT4_OPSET) -> None:
        convert_in_place(model, opset, reason)
        if self.base_dir:  # the converted tensors are read from the file's folder, as before
            ir.external_data.set_base_dir(model.graph, self.base_dir)
