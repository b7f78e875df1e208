"""Small helpers shared by the training modules: fresh values, dimensions, atomic writes."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from onnx_autodiff.rules.builder import Namer


def fresh_value(namer: Namer, hint: str, dtype: ir.DataType, shape) -> ir.Value:
    return ir.Value(name=namer.fresh(hint), type=ir.TensorType(dtype), shape=None if shape is None else ir.Shape(shape))


def dim_value(d):
    return d if isinstance(d, int) else (d.value if getattr(d, "value", None) is not None else None)


def shape_text(shape) -> str:
    return "[" + ", ".join("?" if d is None or (hasattr(d, "value") and d.value is None) else str(getattr(d, "value", d)) for d in shape) + "]"


def npz_writer(arrays: Mapping[str, np.ndarray]) -> Callable[[BinaryIO], None]:
    """For :func:`write_atomically`: writes ``arrays`` as an npz an array at a time (numpy copies
    16 MB at a time), so a multi-GB checkpoint is not built in memory first."""
    return lambda stream: np.savez(stream, **arrays)


def load_npz(path: str | os.PathLike, map_from: int = 1 << 16) -> dict[str, np.ndarray]:
    """The arrays of an npz file; those of at least ``map_from`` bytes stored uncompressed (as
    ``np.savez`` writes them) are memory-mapped read-only, so a multi-GB checkpoint is read
    only as it is used, not held in memory whole."""
    import struct
    import zipfile

    path = os.fspath(path)
    arrays: dict[str, np.ndarray] = {}
    with np.load(path) as data, zipfile.ZipFile(path) as archive, open(path, "rb") as stream:
        members = {name + ".npy": name for name in data.files}
        for info in archive.infolist():
            name = members.get(info.filename)
            if name is None:
                continue
            if info.compress_type == zipfile.ZIP_STORED and info.file_size >= map_from:
                stream.seek(info.header_offset + 26)  # the local header's name and extra lengths
                skip = sum(struct.unpack("<HH", stream.read(4)))
                stream.seek(skip, os.SEEK_CUR)
                version = np.lib.format.read_magic(stream)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(stream)
                if not dtype.hasobject:
                    arrays[name] = np.memmap(path, dtype, "r", stream.tell(), shape, "F" if fortran else "C")
                    continue
            arrays[name] = data[name]
    return arrays


def owned_copy(array: np.ndarray, dtype) -> np.ndarray:
    """A writable C-ordered copy of ``array`` in ``dtype``. One memory-mapped by :func:`load_npz`
    is read from its file instead, so that the file's pages are not mapped in as well (they would
    count in this process's memory next to the copy)."""
    if (isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.flags.c_contiguous
            and array.dtype == dtype):
        return np.fromfile(array.filename, array.dtype, array.size, offset=array.offset).reshape(array.shape)
    with np.errstate(over="ignore"):
        return np.array(array, dtype, order="C")


def write_atomically(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``,
    so ``path`` is never half-written and nothing is left behind when writing fails. ``data`` is
    the bytes, or a function that writes them to the stream it is given (streaming a large file).

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
            if callable(data):
                data(stream)
            else:
                stream.write(data)
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
