"""Small helpers shared by the training modules: fresh values, dimensions, atomic writes."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
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


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``,
    so ``path`` is never half-written and nothing is left behind when writing fails.

    The file gets the mode an ordinary ``open(path, "wb")`` gives: a replaced file keeps its mode,
    a new one gets 0o666 less the umask (mkstemp's private 0o600 would surprise users)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    while True:
        temporary = os.path.join(directory, f".onnx-autodiff-{secrets.token_hex(6)}.tmp")
        try:  # 0o666: the kernel applies the umask (and a directory's default ACL) as for any new file
            handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
