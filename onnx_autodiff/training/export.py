"""The trained model in the forms other tools take, and back: the inference model (LoRA adapters
merged into their bases, kept apart, or as inputs for onnxruntime's multi-LoRA), the parameters by
PyTorch module name, the adapters as a peft directory or an ``.onnx_adapter`` file."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.files import write_atomically
from onnx_autodiff.modelfile import from_proto, over_limit, save_model, tensor_array, to_inline_proto, uses_external_data
from onnx_autodiff.passes.lift import lifted_in, read_back, write_back
from onnx_autodiff.training.artifacts import TrainingArtifacts
from onnx_autodiff.training.manifest import ModuleParameter
from onnx_autodiff.training.state import TrainingState
from onnx_autodiff.training.values import owned_copy
from onnx_autodiff.weights.quantized import as_read


class Exporter:
    """Writes the state's trained values into the artifacts' inference model and into the
    ecosystem's formats, and sets them from those formats (the methods of the same names of
    :class:`~onnx_autodiff.training.Trainer` describe each)."""

    def __init__(self, artifacts: TrainingArtifacts, state: TrainingState) -> None:
        self.artifacts, self.state = artifacts, state
        self.manifest = artifacts.manifest

    def export(self, path, merge: bool, external_data: bool | None) -> onnx.ModelProto:
        from onnx_autodiff.training.lora import unmerged

        proto = onnx.ModelProto()
        proto.CopyFrom(self.artifacts.inference_model)
        trained = self._trained()
        lora = self.manifest.lora if self.manifest.qat is None else None  # (QAT's model merges them itself)
        if lora and not merge:
            proto = unmerged(self._bases_lifted(proto), lora.config, lora.adapters)
        elif lora:
            trained.update(self._merged_bases(lora.weights))
        trained.update(self._copies(trained))
        if self.manifest.qat is not None:
            from onnx_autodiff.training.qat_export import frozen_quantization

            if self.manifest.qat.activations and self.state.step_count == 0:
                raise TrainingError("the quantized model's activation ranges are observed by the training steps, and "
                                    "none was taken: export after at least one step (or load a trained checkpoint)")
            proto = frozen_quantization(self._written(proto, trained, None, False), self.manifest.qat.quantize_format)
            if path is not None:
                write_atomically(os.fspath(path), proto.SerializeToString(deterministic=True))
            return proto
        return self._written(proto, trained, path, external_data)

    def export_adapter_model(self, path, external_data: bool | None) -> onnx.ModelProto:
        from onnx_autodiff.training.adapters import adapter_input_model

        proto = adapter_input_model(self._bases_lifted(self.artifacts.inference_model), self.manifest)
        adapters = set(self.manifest.lora.tensors)
        trained = {key: value for key, value in self._trained().items() if key not in adapters}
        trained.update(self._copies(trained))
        return self._written(proto, trained, path, external_data)

    def merged_eval_model(self) -> tuple[bytes, set[str]]:
        """The eval model (serialised) with the LoRA bases merged with their adapters as
        :meth:`export` writes them, and the names of those bases."""
        merged = self._merged_bases(self.manifest.lora.weights)
        proto = onnx.ModelProto()
        proto.CopyFrom(self.artifacts.eval_model)
        for i, tensor in enumerate(proto.graph.initializer):
            if tensor.name not in merged:
                continue
            part = merged[tensor.name]
            if list(tensor.dims) == list(part.shape) and tensor.data_type == helper.np_dtype_to_tensor_dtype(part.dtype):
                proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(part, tensor.name))
            else:  # a MatMulNBits base the eval model reads through DequantizeLinear
                proto.graph.initializer[i].CopyFrom(as_read(tensor, part))
        return proto.SerializeToString(), set(merged)

    # PyTorch module names

    def module_state_dict(self) -> dict[str, np.ndarray]:
        modules = self.manifest.modules
        if not modules:
            return {}
        values = self._trained_or_stored({module.initializer for module in modules})
        values.update(self._dequantized_bases({module.initializer: module for module in modules}))
        state = {}
        for module in modules:
            stored = values[module.initializer]
            value = np.ascontiguousarray(stored.T) if module.transposed else stored
            for name in [module.name, *module.aliases]:
                state[name] = value
        return state

    def load_module_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        arrays = {}
        for module in self.manifest.modules or ():
            key = module.initializer
            if key not in self.manifest.params:
                continue
            name = next((n for n in [module.name, *module.aliases] if n in state), None)
            if name is None:
                raise TrainingError(f"the state lacks the module parameter '{module.name}'")
            array = np.asarray(state[name])
            array = array.T if module.transposed else array
            want = self.artifacts.checkpoint[key]
            if array.shape != want.shape:
                raise TrainingError(f"module parameter '{name}' has shape {array.shape[::-1] if module.transposed else array.shape}, "
                                    f"not {tuple(module.shape)}")
            arrays[key] = owned_copy(array, want.dtype)
        if not arrays:
            raise TrainingError("the artifacts record no module parameters (the model was not exported from PyTorch)")
        for key, array in arrays.items():
            self.state.set(key, array, owned=True)

    # LoRA adapters in peft's and onnxruntime's formats (onnx_autodiff.training.adapters)

    def save_peft_adapter(self, directory, strip: str | None, prefix: str, config: Mapping | None) -> dict:
        from onnx_autodiff.training.adapters import peft_adapter, write_peft_adapter

        entries, arrays = peft_adapter(self.manifest, self._adapter_values("a peft adapter"), strip, prefix, config)
        write_peft_adapter(directory, entries, arrays)
        return entries

    def load_peft_adapter(self, directory, strip: str | None, prefix: str) -> None:
        from onnx_autodiff.training.adapters import peft_values

        for key, array in peft_values(self.manifest, self.artifacts.checkpoint, directory, strip, prefix).items():
            self.state.set(key, array, owned=True)

    def save_onnx_adapter(self, path, adapter_version: int, model_version: int) -> None:
        from onnx_autodiff.training.adapters import onnx_adapter_arrays, onnx_adapter_bytes

        arrays = onnx_adapter_arrays(self.manifest, self._adapter_values("an .onnx_adapter file"))
        write_atomically(os.fspath(path), onnx_adapter_bytes(arrays, adapter_version, model_version))

    def _adapter_values(self, what: str) -> dict[str, np.ndarray]:
        """The current A and B of every LoRA adapter, by name."""
        from onnx_autodiff.training.adapters import lora_record

        return {key: self.state.host(key) for key in lora_record(self.manifest, what).tensors}

    # the model's weights: trained, stored, merged

    def _trained(self) -> dict[str, np.ndarray]:
        """The trained parameters and buffers: views of the state's buffers, no copy."""
        return {key: self.state.value(key).numpy() for key in [*self.manifest.params, *self.manifest.buffers]}

    def _copies(self, trained: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors of the exported file that hold a copy of a trained parameter (a tied
        weight stored twice, as it is or transposed), set from it."""
        copies = {}
        for module in self.manifest.modules or ():
            value = trained.get(module.initializer)
            if value is not None:
                for name, transposed in module.copies:
                    copies[name] = np.ascontiguousarray(value.T) if transposed else value
        return copies

    def _trained_or_stored(self, names) -> dict[str, np.ndarray]:
        """``names``' current values: trained ones from the state, LoRA bases merged with their
        adapters, the others as the model stores them."""
        values = {name: self.state.host(name) for name in names if name in self.state}
        values.update(self._merged_bases(set(names)))
        values.update(self._stored(set(names) - set(values)))
        return values

    def _merged_bases(self, names: set[str]) -> dict[str, np.ndarray]:
        """The LoRA base weights among ``names`` with their adapters' current values merged in."""
        from onnx_autodiff.training.lora import QUANTIZED_BASES, merged_weights

        lora = self.manifest.lora
        adapters = [a for a in lora.adapters if a.weight in names] if lora else []
        if not adapters:
            return {}
        values = {key: self.state.value(key).numpy() for a in adapters for key in (a.A, a.B)}
        quantized = any(a.base in QUANTIZED_BASES for a in adapters)
        model = from_proto(self.artifacts.inference_model, self.artifacts.base_dir) if quantized else None
        return merged_weights(adapters, lora.scale, self._stored({a.weight for a in adapters}), values, model)

    def _dequantized_bases(self, entries: Mapping[str, ModuleParameter]) -> dict[str, np.ndarray]:
        """The module parameters among ``entries`` (by initializer) that a quantized or float16
        base stores, as float32 arrays in the stored layout (module_state_dict transposes by the
        entry), their LoRA adapters merged in without quantizing again."""
        from onnx_autodiff.training.lora import merged_weights
        from onnx_autodiff.weights.quantized import frozen_bases, stored_weight

        lora = self.manifest.lora
        model = from_proto(self.artifacts.inference_model, self.artifacts.base_dir)
        bases = {name: node.op_type for name, node in frozen_bases(model.graph).items() if name in entries}
        adapters = [a for a in (lora.adapters if lora else ()) if a.weight in bases]
        values = {key: self.state.value(key).numpy() for a in adapters for key in (a.A, a.B)}
        merged = merged_weights(adapters, lora.scale, {}, values, model, quantize_again=False) if adapters else {}
        values = {}
        for name, base in bases.items():
            w = merged[name] if name in merged else stored_weight(model, name, base)
            if base == "MatMulNBits" and not entries[name].transposed:  # W [K, N] to the layout read as the module's
                w = w.T
            values[name] = np.ascontiguousarray(w.astype(np.float32))
        return values

    def _stored(self, names: set[str]) -> dict[str, np.ndarray]:
        """Initializers of the inference model as it stores them (external ones mapped from their
        file), and the weights it stores as Constant nodes."""
        found = {t.name: tensor_array(t, self.artifacts.base_dir)
                 for t in self.artifacts.inference_model.graph.initializer if t.name in names}
        if self.manifest.constants and len(found) < len(names):
            found.update(read_back(self.artifacts.inference_model.graph, self.manifest.constants, set(names) - set(found)))
        return found

    def _bases_lifted(self, proto: onnx.ModelProto) -> onnx.ModelProto:
        """``proto`` with the LoRA base weights it stores as Constant nodes as initializers, where
        the adapters are added beside them."""
        if not self.manifest.constants:
            return proto
        return lifted_in(proto, self.manifest.constants, self.manifest.lora.weights)

    # writing

    def _written(self, proto: onnx.ModelProto, trained: dict, path, external_data) -> onnx.ModelProto:
        """``proto`` with the ``trained`` values as its initializers (and in the Constant nodes the
        file stores weights in), written to ``path`` when given."""
        if self.manifest.constants:
            write_back(proto.graph, self.manifest.constants, trained)
        if external_data or uses_external_data(proto) or over_limit(sum(a.nbytes for a in trained.values())):
            return self._written_large(proto, trained, path, external_data)
        for i, tensor in enumerate(proto.graph.initializer):
            if tensor.name in trained:
                proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(trained[tensor.name], tensor.name))
        if path is not None:
            write_atomically(os.fspath(path), proto.SerializeToString(deterministic=True))
        return proto

    def _written_large(self, proto: onnx.ModelProto, trained: dict, path, external_data) -> onnx.ModelProto:
        """:meth:`_written` through onnx-ir, which streams the tensors to the data file (no proto holds them)."""
        model = from_proto(proto, self.artifacts.base_dir)
        for name, array in trained.items():
            if name in model.graph.initializers:  # views of the trained values: nothing is copied
                model.graph.initializers[name].const_value = ir.Tensor(array, name=name)
        if path is None:
            return to_inline_proto(model)
        if external_data is None and uses_external_data(proto):  # as the artifacts keep it
            external_data = True
        written = save_model(model, path, external_data)
        return onnx.load(os.fspath(path), load_external_data=not written)
