"""What a trainer trains: parameters, optimiser state and buffers as OrtValues on the device, and the step count."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.files import write_atomically
from onnx_autodiff.training.artifacts import TrainingArtifacts
from onnx_autodiff.training.sessions import ORT_TYPES
from onnx_autodiff.training.values import arrays_writer, owned_copy


class TrainingState:
    """The values of the checkpoint's keys, two OrtValues per key: the current one and a spare
    that a run writes the new value to, swapped in when the run is kept. A key written in place
    never needs its spare, which is made when first asked for.

    ``generation`` counts the times a key got new buffers (a value of another shape or dtype):
    IO bindings made before then hold the old ones."""

    def __init__(self, artifacts: TrainingArtifacts, device: str) -> None:
        # the artifacts, not their checkpoint: a caller may drop the initial values once loaded
        # (benchmarks/large_model.py), and the keys, shapes and dtypes are read from there
        self.artifacts = artifacts
        self.device = device
        self.step_count = 0
        self.generation = 0
        self._pairs: dict[str, list] = {}
        self._current: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._pairs

    def value(self, key: str, spare: bool = False):
        """``key``'s current OrtValue, or the spare one a run writes its new value to."""
        pair = self._pairs[key]
        index = self._current[key] ^ int(spare)
        if pair[index] is None:
            from onnxruntime import OrtValue

            current = pair[self._current[key]]
            pair[index] = OrtValue.ortvalue_from_shape_and_type(
                current.shape(), ORT_TYPES[current.data_type()], self.device, 0
            )
        return pair[index]

    def host(self, key: str) -> np.ndarray:
        # a copy: on the CPU, OrtValue.numpy() is a view of a buffer that later steps overwrite
        return np.array(self.value(key).numpy(), copy=True)

    def parity(self, key: str) -> int:
        """Which of ``key``'s two buffers is the current one."""
        if key not in self._pairs:
            raise TrainingError(f"the checkpoint has no value for '{key}'")
        return self._current[key]

    def swap(self, key: str) -> None:
        """Makes ``key``'s spare value, which a kept run has written, the current one."""
        self._current[key] ^= 1

    def set(self, key: str, array: np.ndarray, owned: bool = False) -> None:
        """``array`` as ``key``'s current value (``owned``: a fresh array the state may keep)."""
        from onnxruntime import OrtValue

        array = np.asarray(array, order="C")  # (np.ascontiguousarray makes a scalar 1-D: an observer's range)
        pair = self._pairs.get(key)
        if pair is not None:
            current = pair[self._current[key]]
            if tuple(current.shape()) == array.shape and ORT_TYPES[current.data_type()] == array.dtype:
                current.update_inplace(array)
                return
        self._pairs[key] = [OrtValue.ortvalue_from_numpy(array if owned else array.copy(), self.device, 0), None]
        self._current[key] = 0
        self.generation += 1

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every key's value as a numpy array, with ``__step__``."""
        state = {key: self.host(key) for key in self.artifacts.checkpoint}
        state["__step__"] = np.array(self.step_count, np.int64)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Every key's value from ``state`` (and the step count from its ``__step__``), each
        checked, before any changes, against the checkpoint's shape and for NaN or Inf."""
        checkpoint = self.artifacts.checkpoint
        missing = sorted(set(checkpoint) - set(state))
        if missing:
            raise TrainingError(f"the checkpoint lacks {missing}")
        arrays = {}
        for key, want in checkpoint.items():
            array = np.asanyarray(state[key])  # a memory map stays one (owned_copy reads its file)
            if array.shape != want.shape:
                raise TrainingError(f"checkpoint value '{key}' has shape {array.shape}, not {want.shape}")
            arrays[key] = owned_copy(array, want.dtype)  # the one copy the trainer keeps
            if np.issubdtype(want.dtype, np.inexact) and not np.isfinite(arrays[key]).all():
                bad = arrays[key].size - int(np.count_nonzero(np.isfinite(arrays[key])))
                raise TrainingError(f"checkpoint value '{key}' holds {bad} NaN or Inf of its {arrays[key].size} values: "
                                    "refusing to load it (a diverged run or a damaged file); load an earlier checkpoint")
        for key, array in arrays.items():
            self.set(key, array, owned=True)
        self.step_count = int(state.get("__step__", 0))

    def save(self, path: str | os.PathLike) -> None:
        """:meth:`state_dict` written to ``path`` (npz or safetensors by its suffix), never half-written."""
        write_atomically(os.fspath(path), arrays_writer(path, self.state_dict()))
