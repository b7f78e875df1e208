"""How a trainer opens its onnxruntime sessions: options, providers, device and shared frozen weights."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

import numpy as np
from onnx import TensorProto, helper

from onnx_autodiff.modelfile import tensor_array
from onnx_autodiff.toolkit import proto_graphs
from onnx_autodiff.training.artifacts import FROZEN_IN_PLACE, TrainingArtifacts

LARGE_STATE = 1 << 30  # bytes of parameters and optimiser state from which the CPU arena is off

# onnxruntime's type names (OrtValue.data_type(), NodeArg.type) as numpy dtypes
ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
}

_SHAREABLE = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime has it, then CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class Sessions:
    """The options, providers and device of a trainer's sessions. With the trainer's own options
    on the CPU, the large frozen weights (``frozen``: {name: (array, OrtValue)}, see
    :func:`_shared_frozen`) are mapped once and given to every session; they must outlive them."""

    def __init__(self, artifacts: TrainingArtifacts, providers: Sequence, session_options=None) -> None:
        self.artifacts = artifacts
        self.providers = list(providers)
        own_options = session_options is None
        self.options = _session_options(artifacts, session_options)
        first = self.providers[0] if self.providers else "CPUExecutionProvider"
        first = first[0] if isinstance(first, tuple) else first
        self.device = "cuda" if first == "CUDAExecutionProvider" else "cpu"
        self.frozen = _shared_frozen(artifacts, self.options) if own_options and self.device == "cpu" else {}

    def open(self, model: bytes, replaced: Collection[str] = ()):
        """An InferenceSession of the serialised ``model``. ``replaced``: initializers the model
        holds other values of than the stored ones, which the shared frozen weights must not
        override (merge_cost's merged weights)."""
        import onnxruntime as ort

        options = self.options
        if any(name in self.frozen for name in replaced):
            options = _session_options(self.artifacts, None)
            for name, (_, value) in self.frozen.items():
                if name not in replaced:
                    options.add_initializer(name, value)
        return ort.InferenceSession(model, sess_options=options, providers=self.providers)


def _session_options(artifacts: TrainingArtifacts, session_options):
    """``session_options`` (the trainer's own where None) reading the artifacts' external tensors
    from their folder."""
    import onnxruntime as ort

    if session_options is None:
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # the memory pattern adds a planned block of every activation beside the arena's
        # (GPT benchmark: a step's peak +100 MB) and no measurable speed
        session_options.enable_mem_pattern = False
        # warnings only about the models' form, which is ours: frozen weights stored as half
        # floats are overridable inputs on purpose (one warning per weight otherwise)
        session_options.log_severity_level = 3
        # onnxruntime's arena would keep one step's gradient buffers and take new ones for the
        # next (4x the parameters' memory where 3x will do): large models allocate directly
        if sum(a.nbytes for a in artifacts.checkpoint.values()) >= LARGE_STATE:
            session_options.enable_cpu_mem_arena = False
    if artifacts.base_dir:  # the models' external tensors are read from there
        session_options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.path.abspath(artifacts.base_dir))
    return session_options


def _shared_frozen(artifacts: TrainingArtifacts, options) -> dict[str, tuple]:
    """The large frozen weights of the models (floating-point initializers of at least
    ``FROZEN_IN_PLACE`` bytes stored in a file: a LoRA base), each mapped from its file once and
    given to every session through ``options`` (``add_initializer``), with pre-packing off: each
    kernel that pre-packs a constant keeps a packed copy of it (the forward's and the backward's
    products one each), and each session would map the file itself. The pages are read when a step
    first uses them, and only those (an embedding's rows). Returns {name: (array, OrtValue)}, which
    must outlive the sessions; nothing where a model runs MatMulNBits, whose kernels need their
    packed weights."""
    from onnxruntime import OrtValue

    models = [m for m in (artifacts.train_model, artifacts.eval_model, artifacts.accumulate_model) if m is not None]
    if any(node.op_type == "MatMulNBits" for m in models for g in proto_graphs(m.graph) for node in g.node):
        return {}
    state, found = set(artifacts.checkpoint), {}
    for model in models:
        for tensor in model.graph.initializer:
            if (tensor.data_location == TensorProto.EXTERNAL and tensor.data_type in _SHAREABLE
                    and tensor.name not in state and tensor.name not in found
                    and int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
                    >= FROZEN_IN_PLACE):
                found[tensor.name] = tensor
    if not found:
        return {}
    options.add_session_config_entry("session.disable_prepacking", "1")
    shared = {}
    for name, tensor in found.items():
        array = tensor_array(tensor, artifacts.base_dir)  # mapped, read-only; onnxruntime only reads it
        value = OrtValue.ortvalue_from_numpy(array, "cpu", 0)
        options.add_initializer(name, value)
        shared[name] = (array, value)
    return shared
