"""Small helpers shared by the training modules: fresh values, dimensions, array files (npz and
safetensors)."""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import struct
import zipfile
from collections.abc import Callable, Mapping
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from onnx_autodiff.toolkit import Namer


def fresh_value(namer: Namer, hint: str, dtype: ir.DataType, shape) -> ir.Value:
    return ir.Value(name=namer.fresh(hint), type=ir.TensorType(dtype), shape=None if shape is None else ir.Shape(shape))


def dim_value(d):
    return d if isinstance(d, int) else (d.value if getattr(d, "value", None) is not None else None)


def shape_text(shape) -> str:
    return "[" + ", ".join("?" if d is None or (hasattr(d, "value") and d.value is None) else str(getattr(d, "value", d)) for d in shape) + "]"


# bytes: smaller arrays are written whole, after a .npy header formatted once per dtype and shape
_SMALL_ARRAY = 1 << 16


def npz_writer(arrays: Mapping[str, np.ndarray]) -> Callable[[BinaryIO], None]:
    """For :func:`write_atomically`: writes ``arrays`` as an npz, as ``np.savez`` does (an
    uncompressed ``NAME.npy`` member per array), an array at a time, so a multi-GB checkpoint is
    not built in memory first (numpy copies a large array 16 MB at a time). A small array's
    member is written at once, its header formatted once per dtype and shape: ``np.savez``
    formats each array's anew, 0.7 s of a checkpoint of 20,000 small arrays (a chain's AdamW
    state); the members (dated 1980, as zip's earliest date) read back the same."""

    def write(stream: BinaryIO) -> None:
        headers: dict[tuple, bytes] = {}
        with zipfile.ZipFile(stream, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, value in arrays.items():
                array = np.asanyarray(value)
                member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                if array.nbytes >= _SMALL_ARRAY or array.dtype.hasobject:
                    with archive.open(member, "w", force_zip64=True) as out:
                        np.lib.format.write_array(out, array)
                    continue
                header = np.lib.format.header_data_from_array_1_0(array)
                key = (header["descr"] if isinstance(header["descr"], str) else repr(header["descr"]),
                       header["shape"], header["fortran_order"])
                if key not in headers:
                    headers[key] = _npy_header(header)
                archive.writestr(member, headers[key] + array.tobytes("F" if header["fortran_order"] else "C"))

    return write


def _npy_header(header: dict) -> bytes:
    """The .npy magic and header of an array (``header``: its header_data_from_array_1_0), in the
    first version of the format that holds it, as np.save chooses."""
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header of over 64 KB (a structured dtype of many fields)
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


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


SAFETENSORS_SUFFIX = ".safetensors"
_WRITE_CHUNK = 1 << 24  # bytes written at a time: a large array is never copied whole
# safetensors' dtype codes and the numpy (or ml_dtypes, which onnx depends on) names of the same types
_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "F32": "float32", "F64": "float64",
    "C64": "complex64", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_SAFETENSORS_CODES = {name: code for code, name in _SAFETENSORS_DTYPES.items()}


def arrays_writer(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Callable[[BinaryIO], None]:
    """For :func:`write_atomically`: ``arrays`` in the format ``path`` names, safetensors for a
    ``.safetensors`` file and npz for any other name (as ``np.savez`` writes it)."""
    if os.fspath(path).endswith(SAFETENSORS_SUFFIX):
        return safetensors_writer(arrays)
    return npz_writer(arrays)


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an npz or a safetensors file, told apart by their first bytes (whatever the
    file's name); large ones memory-mapped (:func:`load_npz`, :func:`load_safetensors`)."""
    with open(path, "rb") as stream:
        head = stream.read(9)
    if head[8:] == b"{":  # safetensors: the JSON header after its 8-byte length (a zip has a compression method there)
        return load_safetensors(path)
    if head[:2] == b"PK":  # every zip archive starts so
        return load_npz(path)
    raise ValueError(f"{os.fspath(path)} is neither an npz nor a safetensors file")


def safetensors_writer(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
                       ) -> Callable[[BinaryIO], None]:
    """For :func:`write_atomically`: ``arrays`` (and the text ``metadata``) as a safetensors file,
    streamed 16 MB at a time, so a multi-GB checkpoint is not built in memory first (the library
    serialises to bytes or to a named file only). A 0-d array keeps its shape ``[]``. The tensors
    follow the 8-byte-aligned header by decreasing item size, so each starts at a multiple of its
    item size: memory maps and JavaScript typed arrays can view them in place."""
    entries = []
    for name, array in arrays.items():
        array = np.asanyarray(array)
        code = _SAFETENSORS_CODES.get(array.dtype.name)
        if code is None or name == "__metadata__":
            what = "a reserved name" if code else f"dtype {array.dtype}, which safetensors cannot hold"
            raise ValueError(f"cannot write '{name}' to a safetensors file: {what}")
        entries.append((name, array, code))
    entries.sort(key=lambda entry: -entry[1].dtype.itemsize)  # stable: equal sizes keep their order
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, array, code in entries:
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads its header with spaces

    def write(stream: BinaryIO) -> None:
        stream.write(struct.pack("<Q", len(text)) + text)
        for _, array, _ in entries:
            data = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
            for start in range(0, data.size, _WRITE_CHUNK):
                stream.write(data[start:start + _WRITE_CHUNK])

    return write


def load_safetensors(path: str | os.PathLike, map_from: int = 1 << 16) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file, checked by the safetensors library (a header whose offsets
    do not cover the file or fit the shapes is refused with a ValueError); those of at least
    ``map_from`` bytes are memory-mapped read-only, as :func:`load_npz` does (the library's numpy
    reader copies every tensor)."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="np"):
            pass
    except SafetensorError as error:
        raise ValueError(f"{path} is not a valid safetensors file: {error}") from error
    arrays: dict[str, np.ndarray] = {}
    with open(path, "rb") as stream:
        (size,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(size))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            dtype = _safetensors_dtype(path, name, entry["dtype"])
            shape, (begin, end) = tuple(entry["shape"]), entry["data_offsets"]
            if end - begin >= map_from:
                arrays[name] = np.memmap(path, dtype, "r", 8 + size + begin, shape)
            else:
                stream.seek(8 + size + begin)
                arrays[name] = np.fromfile(stream, dtype, math.prod(shape)).reshape(shape)
    return arrays


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The text metadata in a safetensors file's header ({} when it has none)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="np") as file:
            return dict(file.metadata() or {})
    except SafetensorError as error:
        raise ValueError(f"{os.fspath(path)} is not a valid safetensors file: {error}") from error


def _safetensors_dtype(path: str, name: str, code: str) -> np.dtype:
    import ml_dtypes

    numpy_name = _SAFETENSORS_DTYPES.get(code)
    if numpy_name is None:
        raise ValueError(f"{path}: tensor '{name}' has the safetensors dtype {code}, which numpy cannot hold")
    try:
        dtype = np.dtype(numpy_name)
    except TypeError:  # bfloat16 and the float8 types are ml_dtypes' own
        dtype = np.dtype(getattr(ml_dtypes, numpy_name))
    return dtype.newbyteorder("<")


def owned_copy(array: np.ndarray, dtype) -> np.ndarray:
    """A writable C-ordered copy of ``array`` in ``dtype``. One memory-mapped by :func:`load_npz`
    is read from its file instead, so that the file's pages are not mapped in as well (they would
    count in this process's memory next to the copy)."""
    if (isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.flags.c_contiguous
            and array.dtype == dtype):
        return np.fromfile(array.filename, array.dtype, array.size, offset=array.offset).reshape(array.shape)
    with np.errstate(over="ignore"):
        return np.array(array, dtype, order="C")
