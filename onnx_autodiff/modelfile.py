"""Model files of any size: tensors read lazily, files written atomically, external data beside them.

Protobuf cannot serialise a message of 2 GiB or more, so a model whose tensors add up to that is
written with them in a data file beside it (``OUT.onnx`` and ``OUT.onnx.data``), which onnx-ir
writes a tensor at a time. Models are read without their external data: onnx-ir maps a tensor's
bytes from its file when something reads it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import stat
import tempfile

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import UnsupportedModelError
from onnx_autodiff.files import write_atomically

PROTO_LIMIT = 2**31  # bytes: protobuf's limit on one serialised message
_GRAPH_ROOM = 2**26  # bytes left for the graph itself when deciding from the tensors' size
THRESHOLD = 1024  # bytes: smaller tensors stay in the .onnx file (onnx.save's default)


def _tensor_protos(graph: onnx.GraphProto):
    """The tensors of ``graph`` and its subgraphs: initializers and tensor attributes. One walk over
    the nodes, reading only the attributes of nodes that have some (a train model's 60,000 nodes
    are walked at every save: reading each attribute's fields twice cost 0.3 s there)."""
    yield from graph.initializer
    for node in graph.node:
        if not node.attribute:
            continue
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            if attribute.tensors:
                yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensor_protos(attribute.g)
            for sub in attribute.graphs:
                yield from _tensor_protos(sub)


def uses_external_data(proto: onnx.ModelProto) -> bool:
    """Whether some tensor of ``proto`` is stored in a file beside the model."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _tensor_protos(proto.graph))


def external_files(proto: onnx.ModelProto) -> list[str]:
    """The data files (``location``, relative to the model's folder) that tensors of ``proto`` are stored in."""
    files = (next((e.value for e in t.external_data if e.key == "location"), "") for t in _tensor_protos(proto.graph)
             if t.data_location == onnx.TensorProto.EXTERNAL)
    return list(dict.fromkeys(files))


def with_small_tensors_inline(proto: onnx.ModelProto, base_dir: str | None) -> onnx.ModelProto:
    """A copy of ``proto`` (small: external data stays where it is) with its external tensors under
    1 KB (shapes, axes) read from ``base_dir`` into it, as a model file written with external data
    holds them: onnxruntime's shape inference reads them when it creates a session."""
    proto_copy = onnx.ModelProto()
    proto_copy.CopyFrom(proto)
    for tensor in _tensor_protos(proto_copy.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL and _nbytes(tensor) < THRESHOLD:
            onnx.external_data_helper.load_external_data_for_tensor(tensor, base_dir or "")
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return proto_copy


def reading_written(proto: onnx.ModelProto, written: onnx.ModelProto, base_dir: str | None,
                    directory: str) -> onnx.ModelProto | None:
    """A copy of ``proto`` whose initializers read the data file of ``written`` (a model saved
    with external data in ``directory``) where ``written`` stores a tensor of that name with the
    same type, shape and bytes, its other tensors in it: models built from one another (the
    artifacts') then share one copy of their frozen weights on disk. None when no tensor is shared
    or the rest would not fit in one file (``base_dir``: where ``proto``'s own external tensors are)."""
    stored = {t.name: t for t in written.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    initializers = list(copy.graph.initializer)  # held: their ids stay theirs
    shared, main = 0, {id(t) for t in initializers}
    for tensor in _tensor_protos(copy.graph):
        there = stored.get(tensor.name) if id(tensor) in main else None
        if there is not None and _same_tensor(tensor, base_dir, there, directory):
            tensor.ClearField("raw_data")
            del tensor.external_data[:]
            tensor.external_data.extend(there.external_data)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            shared += 1
        elif tensor.data_location == onnx.TensorProto.EXTERNAL:
            onnx.external_data_helper.load_external_data_for_tensor(tensor, base_dir or "")
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return copy if shared and not over_limit(copy.ByteSize()) else None


def _same_tensor(tensor: onnx.TensorProto, base_dir: str | None, other: onnx.TensorProto, other_dir: str) -> bool:
    if tensor.data_type != other.data_type or list(tensor.dims) != list(other.dims) or _nbytes(tensor) < THRESHOLD:
        return False
    if onnx.TensorProto.STRING in (tensor.data_type, other.data_type):
        return False
    return all(a == b for a, b in itertools.zip_longest(_stored_bytes(tensor, base_dir), _stored_bytes(other, other_dir)))


def _stored_bytes(tensor: onnx.TensorProto, base_dir: str | None, size: int = 1 << 24):
    """The bytes of ``tensor`` as stored, ``size`` at a time: read from its file, never mapped (a
    comparison of two large weights would make both resident)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        data = memoryview(tensor.raw_data if tensor.HasField("raw_data") else
                          onnx.numpy_helper.to_array(tensor).tobytes())
        for start in range(0, len(data), size):
            yield bytes(data[start:start + size])
        return
    info = {entry.key: entry.value for entry in tensor.external_data}
    with open(os.path.join(base_dir or "", info["location"]), "rb") as stream:
        stream.seek(int(info.get("offset", 0)))
        left = int(info["length"]) if "length" in info else None
        while left is None or left > 0:
            block = stream.read(size if left is None else min(size, left))
            if not block:
                return
            yield block
            if left is not None:
                left -= len(block)


def from_proto(proto: onnx.ModelProto, base_dir: str | None = None) -> ir.Model:
    """``proto`` as onnx-ir, its external tensors read (lazily) from ``base_dir``, the folder of the
    model file they were stored beside (None: the working directory, as onnx does)."""
    model = ir.from_proto(proto)
    if base_dir:
        ir.external_data.set_base_dir(model.graph, base_dir)
    return model


def _external_tensors(model: ir.Model, graphs: list[ir.Graph] | None = None) -> list[ir.ExternalTensor]:
    return [t for g in (model.graphs() if graphs is None else graphs) for v in g.initializers.values()
            if isinstance(t := v.const_value, ir.ExternalTensor)]


def base_dir_of(model: ir.Model) -> str | None:
    """The folder the external tensors of ``model`` are read from (None when it has none)."""
    return next((os.fspath(t.base_dir) or None for t in _external_tensors(model)), None)


def tensor_array(tensor: onnx.TensorProto, base_dir: str | None = None) -> np.ndarray:
    """The value of ``tensor``: an external one memory-mapped read-only from its file (nothing is
    read until used), others copied out of the proto."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(tensor).copy()
    value = ir.serde.deserialize_tensor(tensor, base_dir or "")
    return value.numpy()


def tensor_bytes(model: ir.Model, graphs: list[ir.Graph] | None = None) -> int:
    """The bytes of the initializers of ``model`` (every graph; ``graphs``: ``model.graphs()``
    where the caller has them: each call walks every node)."""
    return sum(v.const_value.nbytes for g in (model.graphs() if graphs is None else graphs)
               for v in g.initializers.values() if v.const_value is not None)


def over_limit(nbytes: int) -> bool:
    """Whether tensors of ``nbytes`` in all are too many for one protobuf message with their graph."""
    return nbytes + _GRAPH_ROOM >= PROTO_LIMIT


def needs_external_data(model: ir.Model, graphs: list[ir.Graph] | None = None) -> bool:
    """Whether ``model`` is too large for one protobuf message."""
    return over_limit(tensor_bytes(model, graphs))


def keeps_external_data(model: ir.Model, graphs: list[ir.Graph] | None = None) -> bool:
    """Whether ``model`` is written with external data by default: it is too large for one
    protobuf message, or some of its tensors were read from a file beside a model (a model read
    with external data is written with it, without holding every tensor in memory)."""
    return bool(_external_tensors(model, graphs)) or needs_external_data(model, graphs)


CHECK_OUTPUT_ENV = "ONNX_AUTODIFF_CHECK_OUTPUT"  # set (not "0"): every generated model gets the full check


def full_output_check(asked: bool = False) -> bool:
    """Whether a generated model gets onnx.checker's full check (strict shape inference of the whole
    graph) rather than the structural one: when ``asked`` (``--check-output``, ``check_output=True``)
    or when the environment sets :data:`CHECK_OUTPUT_ENV` (the test suite does, for every model it
    generates, which is how the structural default is known to be enough: the generated graphs are
    valid by construction, and the full check costs 4× the structural one, 0.5 s of the
    20,001-node chain's grad and 1.6 s of its artifacts)."""
    return asked or os.environ.get(CHECK_OUTPUT_ENV, "0") not in ("", "0")


def check_model(proto: onnx.ModelProto | str, base_dir: str | None = None, full: bool = True) -> None:
    """onnx.checker (full check; ``full=False``: the structural one, without shape inference) on a
    model file (with its external data) or on ``proto`` in memory.

    In memory, external tensors under 1 KB (shapes, axes) are read from ``base_dir`` when given
    (onnx's inference cannot read external data) and larger ones are checked as graph inputs of
    their type and shape (the checker would look for their files in the working directory); with
    ``base_dir``, each data file must exist."""
    if isinstance(proto, str):
        onnx.checker.check_model(proto, full_check=full)
        return
    held = any(_held_large(t) for t in proto.graph.initializer)
    if held or uses_external_data(proto):
        stand_in = _copy_but_initializers(proto)
        graph = stand_in.graph
        inputs = {v.name for v in graph.input}
        kept = []
        for tensor in proto.graph.initializer:
            if _held_large(tensor):  # checked as an input of its type and shape
                if tensor.name not in inputs:
                    graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
                continue
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                kept.append(tensor)
                continue
            if base_dir is not None:
                location = next((e.value for e in tensor.external_data if e.key == "location"), "")
                if not os.path.isfile(os.path.join(base_dir, location)):
                    raise onnx.checker.ValidationError(
                        f"the data of tensor '{tensor.name}' should be in {location!r} beside the model, "
                        "but there is no such file")
                if _nbytes(tensor) < THRESHOLD:
                    tensor = _copy(tensor)  # (the caller's proto stays as it is)
                    onnx.external_data_helper.load_external_data_for_tensor(tensor, base_dir)
                    tensor.data_location = onnx.TensorProto.DEFAULT
                    del tensor.external_data[:]
                    kept.append(tensor)
                    continue
            if tensor.name not in inputs:
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
        graph.initializer.extend(kept)
        proto = stand_in
    onnx.checker.check_model(proto, full_check=full)


HELD_LARGE = 1 << 20  # bytes: a tensor held in the proto this large is checked as an input of its type and shape


def _held_large(tensor: onnx.TensorProto) -> bool:
    """A tensor whose data the proto holds, of at least :data:`HELD_LARGE` bytes: the checker
    would copy it, and serialise the copy, to read its type and shape (a float16 base's weights:
    a gigabyte for a 584 MB model)."""
    # (ByteSize: reading raw_data would copy it)
    return tensor.data_location != onnx.TensorProto.EXTERNAL and tensor.ByteSize() >= HELD_LARGE


def _copy_but_initializers(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` copied without its graph's initializers (the caller adds those it keeps)."""
    copy = onnx.ModelProto()
    for field, value in proto.ListFields():
        if field.name != "graph":
            _copy_field(copy, field, value)
    for field, value in proto.graph.ListFields():
        if field.name != "initializer":
            _copy_field(copy.graph, field, value)
    return copy


def _copy(tensor: onnx.TensorProto) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    return copy


def _copy_field(target, field, value) -> None:
    # (protobuf 6.31 on say is_repeated, older releases label)
    if field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED:
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _nbytes(tensor: onnx.TensorProto) -> int:
    try:
        size = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):  # strings and sub-byte types: count them as large
        return THRESHOLD
    return int(np.prod(tensor.dims, dtype=np.int64)) * size


@contextlib.contextmanager
def _in_memory(model: ir.Model, graphs: list[ir.Graph] | None = None):
    """Within: the external tensors of ``model`` replaced by in-memory views of their data."""
    values = [v for g in (model.graphs() if graphs is None else graphs) for v in g.initializers.values()
              if isinstance(v.const_value, ir.ExternalTensor)]
    tensors = [v.const_value for v in values]
    try:
        for value, tensor in zip(values, tensors):
            value.const_value = ir.Tensor(tensor.numpy(), name=tensor.name, dtype=tensor.dtype)
        yield model
    finally:
        for value, tensor in zip(values, tensors):
            value.const_value = tensor
            tensor.release()


def to_inline_proto(model: ir.Model, graphs: list[ir.Graph] | None = None) -> onnx.ModelProto:
    """``model`` as one ModelProto holding every tensor (read from external files where needed;
    ``graphs``: ``model.graphs()`` where the caller has them)."""
    graphs = list(model.graphs()) if graphs is None else graphs
    if needs_external_data(model, graphs):
        raise UnsupportedModelError(
            f"the model's tensors take {tensor_bytes(model, graphs) / 1e9:.2f} GB, more than one protobuf message "
            "holds (2 GB): write it to a file, which puts them in a data file beside it")
    with _in_memory(model, graphs):
        return to_proto(model)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as the ModelProto ``ir.to_proto`` makes of it, made faster: its graphs are written
    in protobuf's wire format, each type and shape once and the rest by ``ir.serde``'s own
    functions, then parsed in one go, where onnx-ir sets a proto's fields one call at a time for
    every node and value (a train model of 65,000 nodes and 120,000 typed inputs, outputs and
    If-branch outputs spends most of its conversion there). A model that holds what
    :class:`_GraphWriter` leaves to onnx-ir (functions, metadata, quantization annotations,
    reference attributes) is converted by ``ir.to_proto``."""
    if model.functions or getattr(model, "device_configurations", None):
        return ir.to_proto(model)
    try:
        graph = _GraphWriter().graph(model.graph)
    except _Unwritten:
        return ir.to_proto(model)
    proto = onnx.ModelProto(ir_version=model.ir_version)
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        if getattr(model, field):
            setattr(proto, field, getattr(model, field))
    for domain, version in model.opset_imports.items():
        proto.opset_import.add(domain=domain, version=version)
    for key in sorted(model.metadata_props):
        proto.metadata_props.add(key=key, value=model.metadata_props[key])
    proto.graph.MergeFromString(graph)
    return proto


class _Unwritten(Exception):
    """Raised by :class:`_GraphWriter` on what it leaves to ``ir.to_proto``."""


def _varint(number: int) -> bytes:
    data = bytearray()
    while number > 0x7F:
        data.append(number & 0x7F | 0x80)
        number >>= 7
    data.append(number)
    return bytes(data)


def _field(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a message) of the given tag."""
    return tag + (_SMALL_LENGTHS[len(data)] if len(data) < 128 else _varint(len(data))) + data


_SMALL_LENGTHS = [bytes((n,)) for n in range(128)]
# the tags (field number, wire type 2) of the fields written here, by message
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP_TYPE, _NODE_ATTRIBUTE = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a"
_NODE_DOC_STRING, _NODE_DOMAIN, _NODE_OVERLOAD, _NODE_METADATA_PROPS = b"\x32", b"\x3a", b"\x42", b"\x4a"
_ENTRY_KEY, _ENTRY_VALUE = b"\x0a", b"\x12"
_NO_INPUT = _NODE_INPUT + b"\x00"  # an omitted optional input: ""
_GRAPH_NODE, _GRAPH_NAME, _GRAPH_INITIALIZER, _GRAPH_DOC_STRING = b"\x0a", b"\x12", b"\x2a", b"\x52"
_GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO = b"\x5a", b"\x62", b"\x6a"
_VALUE_NAME, _VALUE_TYPE, _VALUE_DOC_STRING = b"\x0a", b"\x12", b"\x1a"
_ATTRIBUTE_NAME, _ATTRIBUTE_G, _ATTRIBUTE_GRAPHS, _ATTRIBUTE_DOC_STRING = b"\x0a", b"\x32", b"\x5a", b"\x6a"
_ATTRIBUTE_TYPE = b"\xa0\x01"  # field 20, a varint
_CACHED_ATTRIBUTES = frozenset({ir.AttributeType.INT, ir.AttributeType.INTS, ir.AttributeType.STRING})
_QUANTIZATION = "quant_parameter_tensor_names"  # the value meta that ir.to_proto writes as an annotation


class _GraphWriter:
    """Graphs in protobuf's wire format, field for field what ``ir.serde.serialize_graph_into``
    writes; raises :class:`_Unwritten` on what it leaves to it.

    A train model has 55,000 nodes, 30,000 graph inputs and outputs and 60,000 If-branch outputs:
    the loops over them read each property once, and a value's private slots where the public
    property makes what it returns when first read (``meta``, ``metadata_props``: most values
    have neither, and reading them for each value of a large graph made one for each)."""

    def __init__(self) -> None:
        # field 1 with a value's name, by value: a node's input and a value_info's name are both
        # field 1, so one encoding serves both (a value is written once as an output, then read
        # by its consumers and described by a value_info)
        self.named: dict[ir.Value | None, bytes] = {None: _NO_INPUT}
        self.types: dict[tuple, bytes] = {}  # a value's type field, by its type's and shape's ids
        self.typed: dict[tuple, bytes] = {}  # the same, by what they hold
        self.attributes: dict[tuple, bytes] = {}
        self.op_types: dict[str, bytes] = {}
        self.entries: dict[tuple[str, str], bytes] = {}

    def graph(self, graph: ir.Graph) -> bytes:
        if graph.metadata_props:
            raise _Unwritten
        parts = [_field(_GRAPH_NAME, graph.name.encode())] if graph.name else []
        if graph.doc_string:
            parts.append(_field(_GRAPH_DOC_STRING, graph.doc_string.encode()))
        # (.data: the list a UserList holds; iterating the UserList calls __getitem__ for each item)
        self.values(_GRAPH_INPUT, graph.inputs.data, parts)
        inputs = {v.name for v in graph.inputs.data}
        for value in graph.initializers.values():
            if self.described(value) and value.name not in inputs:
                self.values(_GRAPH_VALUE_INFO, (value,), parts)
            if value.const_value is None:  # (ir.to_proto warns)
                raise _Unwritten
            value.const_value.name = value.name  # as ir.to_proto names it
            parts.append(_field(_GRAPH_INITIALIZER, ir.serde.serialize_tensor(value.const_value).SerializeToString()))
        for node in graph:
            self.node(node, parts)
        self.values(_GRAPH_OUTPUT, graph.outputs.data, parts)
        return b"".join(parts)

    def values(self, tag: bytes, values, parts: list[bytes]) -> None:
        """Appends to ``parts`` a field of ``tag`` (an input, output or value_info) for each of ``values``."""
        named, types = self.named, self.types
        for value in values:
            meta = value._metadata
            if meta and _QUANTIZATION in meta or value._metadata_props or value.doc_string:
                raise _Unwritten
            name = named.get(value) or self.name(value)
            type_, shape = value.type, value.shape
            if type_ is None:
                if shape is not None:  # (ir.to_proto warns)
                    raise _Unwritten
                parts.append(_field(tag, name))
                continue
            typed = types.get((id(type_), id(shape)))
            if typed is None:
                typed = types[id(type_), id(shape)] = self.type_field(type_, shape)
            size = len(name) + len(typed)
            parts += (tag, _SMALL_LENGTHS[size] if size < 128 else _varint(size), name, typed)

    @staticmethod
    def described(value: ir.Value) -> bool:
        """Whether ir.to_proto writes a value_info of ``value`` (a node's output, an initializer)."""
        meta = value._metadata
        if meta and _QUANTIZATION in meta:
            raise _Unwritten
        return (value.type is not None or value.shape is not None or bool(value._metadata_props)
                or bool(value.doc_string)) and bool(value.name)

    def name(self, value: ir.Value) -> bytes:
        """Field 1 with the name of ``value``."""
        name = value.name
        if name is None:  # (where ir.to_proto would fail)
            raise _Unwritten
        named = self.named[value] = _field(_VALUE_NAME, name.encode())
        return named

    def type_field(self, type_, shape: ir.Shape | None) -> bytes:
        # (the shape's list of denotations: get_denotation for each dimension took half the time
        # of the graph's inputs and outputs, whose types and shapes are mostly each their own)
        key = (type_.__class__, type_.dtype if isinstance(type_, ir.TensorType) else repr(type_), type_.denotation,
               None if shape is None else (shape.dims, tuple(shape._denotations)))
        typed = self.typed.get(key)
        if typed is None:
            proto = onnx.TypeProto()
            ir.serde.serialize_type_into(proto, type_)
            if shape is not None:
                ir.serde.serialize_shape_into(proto, shape)
            typed = self.typed[key] = _field(_VALUE_TYPE, proto.SerializeToString())
        return typed

    def node(self, node: ir.Node, parts: list[bytes]) -> None:
        """Appends to ``parts`` the field of ``node``, then the value_infos of its outputs."""
        if getattr(node, "device_configurations", None):
            raise _Unwritten
        named = self.named
        fields = list(map(named.get, node.inputs))  # (most written before: as an output, a graph's input)
        if None in fields:
            fields = [named.get(v) or self.name(v) for v in node.inputs]
        outputs = node.outputs
        if outputs and not outputs[-1].name:  # trailing unnamed outputs are left out
            outputs = list(outputs)
            while outputs and not outputs[-1].name:
                self.described(outputs.pop())
        described = []
        for output in outputs:  # (each written once here: its consumers read its name from `named`)
            name = output.name
            if name is None:  # (where ir.to_proto would fail)
                raise _Unwritten
            data = name.encode()
            length = _SMALL_LENGTHS[len(data)] if len(data) < 128 else _varint(len(data))
            named[output] = _VALUE_NAME + length + data
            fields += (_NODE_OUTPUT, length, data)
            meta = output._metadata
            if meta and _QUANTIZATION in meta:
                raise _Unwritten
            if output.type is None and output.shape is None and not output.doc_string and not output._metadata_props:
                continue  # no value_info: most outputs (the artifacts forget intermediate types)
            if name and not output.is_graph_output():
                described.append(output)
        name = node.name
        if name:
            data = name.encode()
            fields += (_NODE_NAME, _SMALL_LENGTHS[len(data)] if len(data) < 128 else _varint(len(data)), data)
        op_type = node.op_type
        fields.append(self.op_types.get(op_type) or self.op_type(op_type))
        attributes = node.attributes.data  # (the dict a UserDict holds: its own methods are slow)
        if attributes:
            fields += map(self.attribute, attributes.values())
        if node.doc_string:
            fields.append(_field(_NODE_DOC_STRING, node.doc_string.encode()))
        if node.domain:
            fields.append(_field(_NODE_DOMAIN, node.domain.encode()))
        if node.overload:
            fields.append(_field(_NODE_OVERLOAD, node.overload.encode()))
        if node.metadata_props:  # (the backward's nodes name the forward node they differentiate)
            fields += [self.entries.get(item) or self.entry(item) for item in sorted(node.metadata_props.items())]
        body = b"".join(fields)
        parts += (_GRAPH_NODE, _SMALL_LENGTHS[len(body)] if len(body) < 128 else _varint(len(body)), body)
        if described:
            self.values(_GRAPH_VALUE_INFO, described, parts)

    def op_type(self, op_type: str) -> bytes:
        self.op_types[op_type] = _field(_NODE_OP_TYPE, op_type.encode())
        return self.op_types[op_type]

    def entry(self, item: tuple[str, str]) -> bytes:
        """A metadata property of a node (``ir.serde`` writes them in the order of their keys)."""
        key, value = item
        self.entries[item] = _field(_NODE_METADATA_PROPS, _field(_ENTRY_KEY, key.encode()) + _field(_ENTRY_VALUE, value.encode()))
        return self.entries[item]

    def attribute(self, attribute: ir.Attr) -> bytes:
        """The field of ``attribute`` in its node."""
        if attribute.is_ref():
            raise _Unwritten
        kind = attribute.type
        if kind in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            parts = [_field(_ATTRIBUTE_NAME, attribute.name.encode())]
            if attribute.doc_string:
                parts.append(_field(_ATTRIBUTE_DOC_STRING, attribute.doc_string.encode()))
            if kind == ir.AttributeType.GRAPH:
                parts.append(_field(_ATTRIBUTE_G, self.graph(attribute.value)))
            else:
                parts.extend(_field(_ATTRIBUTE_GRAPHS, self.graph(g)) for g in attribute.value)
            parts += (_ATTRIBUTE_TYPE, _varint(onnx.AttributeProto.AttributeType.Value(kind.name)))
            return _field(_NODE_ATTRIBUTE, b"".join(parts))
        if kind not in _CACHED_ATTRIBUTES:
            return _field(_NODE_ATTRIBUTE, ir.serde.serialize_attribute(attribute).SerializeToString())
        value = attribute.value
        key = (attribute.name, attribute.doc_string, kind, tuple(value) if kind == ir.AttributeType.INTS else value)
        field = self.attributes.get(key)
        if field is None:
            field = self.attributes[key] = _field(_NODE_ATTRIBUTE, ir.serde.serialize_attribute(attribute).SerializeToString())
        return field


def save_model(model: ir.Model, path: str | os.PathLike, external_data: bool | None = None,
               check=check_model) -> bool:
    """Writes ``model`` to ``path``, never half-written; returns whether it wrote a data file.

    external_data: tensors of at least 1 KB go to ``PATH.data`` beside the model (the model file's
    name plus ``.data``; none is written when no tensor is that large); None: as
    :func:`keeps_external_data` says (over protobuf's 2 GB, or read with external data).
    check: called before ``path`` is replaced, with the proto (tensors inline) or the path of the
    written model with its data beside it; None: no check. Without external data the tensors are
    copied into the file; with it, onnx-ir streams them into the data file a tensor at a time.
    Files get the modes an ordinary write gives (a replaced file keeps its mode); the data file is
    put in place first, then the model.
    """

    path = os.fspath(path)
    graphs = list(model.graphs())  # (once: each walk visits every node)
    if external_data is None:
        external_data = keeps_external_data(model, graphs)
    if not external_data:
        proto = to_inline_proto(model, graphs)
        if check is not None:
            check(proto)
        write_atomically(path, proto.SerializeToString(deterministic=True))
        return False
    directory = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    data = name + ".data"
    _small_external_in_memory(graphs)
    staging = tempfile.mkdtemp(prefix=".onnx-autodiff-", dir=directory)
    try:
        # written where the final names resolve, so that the check reads the real data file
        ir.save(model, os.path.join(staging, name), external_data=data, size_threshold_bytes=THRESHOLD)
        staged_data = os.path.join(staging, data)
        written = os.path.exists(staged_data) and os.path.getsize(staged_data) > 0
        if not written:  # every tensor was under the threshold: they are all in the model file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged_data)
        if check is not None:
            check(os.path.join(staging, name))
        sources = [t for t in _external_tensors(model, graphs) if _same_file(t.path, os.path.join(directory, data))]
        for filename in (data, name):  # data first: the model never names a data file not yet there
            staged, final = os.path.join(staging, filename), os.path.join(directory, filename)
            if os.path.exists(staged):
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(staged, stat.S_IMODE(os.stat(final).st_mode))
                for tensor in sources if filename == data else ():
                    tensor.release()
                os.replace(staged, final)
        for tensor in sources:  # they named the data file just replaced
            tensor.invalidate()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _small_external_in_memory(graphs: list[ir.Graph]) -> None:
    """Copies into memory the external tensors that will be written into the model file, which
    onnx-ir would otherwise copy and then unmap: an array a pass made as a view of that mapping
    (a folded Constant of a weight) keeps it open, and unmapping it raises BufferError."""
    for graph in graphs:
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= THRESHOLD:
                value.const_value = ir.Tensor(tensor.numpy().copy(), name=tensor.name, dtype=tensor.dtype)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
