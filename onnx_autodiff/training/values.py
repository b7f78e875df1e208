"""Small helpers shared by the training modules: fresh values and initializers, dimensions, array
files (npz and safetensors)."""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from onnx_autodiff.toolkit import Namer


def fresh_value(namer: Namer, hint: str, dtype: ir.DataType, shape) -> ir.Value:
    return ir.Value(name=namer.fresh(hint), type=ir.TensorType(dtype), shape=None if shape is None else ir.Shape(shape))


def fresh_initializer(graph: ir.Graph, namer: Namer, array: np.ndarray, hint: str) -> ir.Value:
    """A new initializer of ``graph`` holding ``array`` (in C order: a transposed view is copied),
    under a fresh name."""
    value = ir.Value(name=namer.fresh(hint), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     shape=ir.Shape(array.shape), const_value=ir.Tensor(np.asarray(array, order="C")))
    graph.register_initializer(value)
    return value


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
    state); the members (dated 1980, as zip's earliest date) read back the same. The archive is
    the bytes ``zipfile`` writes (:class:`_StoredZip`)."""

    def write(stream: BinaryIO) -> None:
        headers: dict[tuple, bytes] = {}
        archive = _StoredZip(stream)
        for name, value in arrays.items():
            array = np.asanyarray(value)
            if array.nbytes >= _SMALL_ARRAY or array.dtype.hasobject:
                archive.add_streamed(f"{name}.npy", lambda out, array=array: np.lib.format.write_array(out, array))
                continue
            header = np.lib.format.header_data_from_array_1_0(array)
            key = (header["descr"] if isinstance(header["descr"], str) else repr(header["descr"]),
                   header["shape"], header["fortran_order"])
            if key not in headers:
                headers[key] = _npy_header(header)
            archive.add(f"{name}.npy", headers[key] + array.tobytes("F" if header["fortran_order"] else "C"))
        archive.close()

    return write


class _StoredZip:
    """A zip archive of uncompressed members written to a seekable stream, byte for byte as
    ``zipfile.ZipFile(stream, "w", allowZip64=True)`` writes members added with ``writestr`` (a
    ``ZipInfo`` dated 1980) and, for the streamed ones, ``open(info, "w", force_zip64=True)``.
    zipfile spends most of a checkpoint of many small arrays per member (each header written
    twice, the stream flushed by the seeks between); here a small member is one write."""

    _LIMIT = (1 << 31) - 1  # zipfile's ZIP64_LIMIT: larger sizes and offsets take the zip64 fields
    _COUNT_LIMIT = (1 << 16) - 1
    _DOS_DATE = 1 << 5 | 1  # 1980-01-01, 00:00:00
    _MODE = 0o600 << 16  # external attributes: ?rw-------, as zipfile gives a member written so

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.offset = stream.tell()
        self.members: list[tuple[bytes, int, int, int, int, bool]] = []  # name, flags, crc, size, offset, zip64

    def add(self, name: str, data: bytes) -> None:
        encoded, flags = self._encoded(name)
        crc = zlib.crc32(data)
        self.stream.write(self._local_header(encoded, flags, crc, len(data), False))
        self.stream.write(data)
        self.members.append((encoded, flags, crc, len(data), self.offset, False))
        self.offset += 30 + len(encoded) + len(data)

    def add_streamed(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        """A member whose bytes ``write`` writes to the file-like object it is given, in pieces;
        its header is written again, with its size and CRC, once it is done."""
        encoded, flags = self._encoded(name)
        header = self._local_header(encoded, flags, 0, 0, True)
        self.stream.write(header)
        member = _Counted(self.stream)
        write(member)
        end = self.offset + len(header) + member.size
        self.stream.seek(self.offset)
        self.stream.write(self._local_header(encoded, flags, member.crc, member.size, True))
        self.stream.seek(end)
        self.members.append((encoded, flags, member.crc, member.size, self.offset, True))
        self.offset = end

    def close(self) -> None:
        """Writes the central directory and the end records."""
        directory = []
        for encoded, flags, crc, size, offset, zip64 in self.members:
            extra = [size, size] if size > self._LIMIT else []
            if offset > self._LIMIT:
                extra.append(offset)
            version = 45 if zip64 or extra else 20  # (zipfile's ZIP64_VERSION and DEFAULT_VERSION)
            extra_data = struct.pack(f"<HH{len(extra)}Q", 1, 8 * len(extra), *extra) if extra else b""
            stored = 0xFFFFFFFF if size > self._LIMIT else size
            directory.append(struct.pack(
                "<4s4B4HL2L5H2L", b"PK\001\002", version, 3, version, 0, flags, 0, 0, self._DOS_DATE, crc, stored,
                stored, len(encoded), len(extra_data), 0, 0, 0, self._MODE, 0xFFFFFFFF if offset > self._LIMIT else offset))
            directory.append(encoded + extra_data)
        data = b"".join(directory)
        self.stream.write(data)
        count, size, start = len(self.members), len(data), self.offset
        if count > self._COUNT_LIMIT or start > self._LIMIT or size > self._LIMIT:
            self.stream.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start))
            self.stream.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, start + size, 1))
            count, size, start = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(start, 0xFFFFFFFF)
        self.stream.write(struct.pack("<4s4H2LH", b"PK\005\006", 0, 0, count, count, size, start, 0))
        self.stream.flush()

    @staticmethod
    def _encoded(name: str) -> tuple[bytes, int]:
        try:
            return name.encode("ascii"), 0
        except UnicodeEncodeError:
            return name.encode("utf-8"), 0x800  # the UTF-8 file name flag

    def _local_header(self, encoded: bytes, flags: int, crc: int, size: int, zip64: bool) -> bytes:
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        stored = 0xFFFFFFFF if zip64 else size
        return struct.pack("<4s2B4HL2L2H", b"PK\003\004", 45 if zip64 else 20, 0, flags, 0, 0, self._DOS_DATE, crc,
                           stored, stored, len(encoded), len(extra)) + encoded + extra


class _Counted:
    """A write-only file-like object over ``stream`` that counts the bytes written and their CRC-32."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.size, self.crc = stream, 0, 0

    def write(self, data) -> int:
        data = memoryview(data)
        self.crc = zlib.crc32(data, self.crc)
        self.size += data.nbytes
        self.stream.write(data)
        return data.nbytes


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
