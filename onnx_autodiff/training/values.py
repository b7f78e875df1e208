"""Small helpers shared by the training modules: fresh values, dimensions, atomic writes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnx_autodiff.rules.builder import Namer


def fresh_value(namer: Namer, hint: str, dtype: ir.DataType, shape) -> ir.Value:
    return ir.Value(name=namer.fresh(hint), type=ir.TensorType(dtype), shape=None if shape is None else ir.Shape(shape))


def dim_value(d):
    return d if isinstance(d, int) else (d.value if getattr(d, "value", None) is not None else None)


def shape_text(shape) -> str:
    return "[" + ", ".join("?" if d is None or (hasattr(d, "value") and d.value is None) else str(getattr(d, "value", d)) for d in shape) + "]"


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def write_atomically(path: str, data: bytes) -> None:
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
