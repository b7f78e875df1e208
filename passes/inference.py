"""Shape completion after onnx's model-level inference: node by node, with constant inputs known.

onnx's inference leaves values without a shape where a node's shape depends on the data of an
input that is not an initializer: a Constant node's output read inside a subgraph (Unsqueeze or
Squeeze axes inside a Scan or If body), a Split whose sizes are computed, a Reshape to
``Shape(x)``. Those gaps spread to everything downstream, and rules then lack the ranks they need.
Here each node whose outputs lack a shape, or hold dimensions onnx made up ("unk__0"), is inferred
again by its own schema's inference, given the types of its inputs and the values of its small
integer inputs that are known before run time (``shapes.constant_input``: initializers, Constant
nodes in any enclosing scope, Shape and Size of statically shaped values, the branch of an If whose
condition is known, small computations over those).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.passes.graphs import captured_values, proto_graphs, subgraphs
from onnx_autodiff.rules import shapes

_INDEX_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})


def complete_shapes(graph: ir.Graph, opsets: dict[str, int]) -> int:
    """Fills in the shapes (and types) of node outputs that lack them, and dimensions onnx left
    unknown; returns how many values it changed.

    Nodes are visited in graph order, subgraphs before the node holding them, so one sweep
    carries what it finds downstream.
    """
    imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    return _complete(graph, opsets.get("", opsets.get("ai.onnx", 1)), imports)


def _complete(graph: ir.Graph, opset: int, imports) -> int:
    filled = 0
    for node in graph:
        held = subgraphs(node)
        for sub in held:
            filled += _complete(sub, opset, imports)
        if not any(_incomplete(out) for out in node.outputs):
            continue
        schema = _schema(node.op_type, opset) if node.domain in ("", "ai.onnx") else None
        inputs = [v for v in node.inputs if v is not None]
        outer = captured_values(node) if held else []
        if schema is None or any(v.type is None for v in (*inputs, *outer)):
            continue
        if not held and all(v.shape is None for v in inputs):
            continue
        filled += _infer_node(node, schema, inputs, outer, imports)
        if node.op_type in ("Loop", "Scan"):
            filled += _carried_shapes(node)
    return filled


def _carried_shapes(node: ir.Node) -> int:
    """Loop-carried and Scan state outputs, which onnx leaves without a shape because it may
    change between iterations: where the body gives each state the rank it receives, that rank
    holds at every iteration, and so do the dimensions the body keeps as they are."""
    body = node.attributes["body"].value
    if node.op_type == "Loop":  # inputs (M, cond, v...), body (i, cond, v...) -> (cond, v..., scans)
        given, before, after = node.inputs[2:], body.inputs[2:], body.outputs[1:]
    else:  # inputs (states..., scanned...), body (states..., elements...) -> (states..., scans)
        n = len(node.inputs) - node.attributes["num_scan_inputs"].value
        given, before, after = node.inputs[:n], body.inputs[:n], body.outputs[:n]
    filled = 0
    for out, *values in zip(node.outputs, given, before, after):
        if out.shape is not None or values[0] is None:
            continue
        ranks = {shapes.rank(v) for v in values}
        if len(ranks) != 1 or None in ranks:
            continue
        dims = [a if isinstance(a, int) and a == b == c else None
                for a, b, c in zip(*(shapes.dims(v) for v in values))]
        out.shape = ir.Shape(dims)
        if out.type is None:
            out.type = values[0].type
        filled += 1
    return filled


def infer_node_types(node: ir.Node, schema, inputs, outer=(), imports=None) -> dict[str, onnx.TypeProto]:
    """onnx's inference of one node's outputs (name → TypeProto) from the types of ``inputs`` and
    ``outer`` (values its subgraphs read) and the values of its small constant integer inputs;
    empty when onnx cannot infer them."""
    types = {v.name: ir.serde.serialize_value(v).type for v in (*inputs, *outer)}
    data = {}
    for v in inputs:
        if v.dtype in _INDEX_TYPES and v.name not in data:
            array = shapes.constant_input(v)
            if array is not None:
                data[v.name] = onnx.numpy_helper.from_array(np.asarray(array, v.dtype.numpy()), v.name)
    try:
        return onnx.shape_inference.infer_node_outputs(
            schema, ir.serde.serialize_node(node), types, data, opset_imports=imports
        )
    except Exception:  # noqa: BLE001 - inference is a help: an op it cannot infer keeps no shape
        return {}


def _infer_node(node: ir.Node, schema, inputs, outer, imports) -> int:
    inferred = infer_node_types(node, schema, inputs, outer, imports)
    filled = 0
    for out in node.outputs:
        found = inferred.get(out.name)
        if found is None or not found.tensor_type.HasField("shape"):
            continue
        if out.type is None:
            out.type = ir.serde.deserialize_type_proto_for_type(found)
        shape = _refined(out, ir.serde.deserialize_type_proto_for_shape(found))
        if shape is not None:
            out.shape = shape
            filled += 1
    return filled


def static_by_node(graph: ir.Graph, missing: dict[str, ir.Value], opsets: dict[str, int]) -> dict[str, ir.Value]:
    """Gives the values in ``missing`` (name → node output of ``graph``) the static shape their
    node's own inference finds, in graph order; returns the ones left. A static shape is what
    onnx's inference of the whole model finds too (where that one reads a stale declared shape,
    a less precise one); the others are left to that inference, which may know more (symbolic
    dimensions, data through several nodes). Nodes that agree in all that
    inference reads (op, attributes, input types and constant data) are inferred once: a backward
    graph repeats a few patterns thousands of times."""

    opset = opsets.get("", opsets.get("ai.onnx", 1))
    imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    left = dict(missing)
    inferred: dict[tuple, list[tuple[onnx.TypeProto, ir.Shape | None] | None]] = {}
    seen: dict[bytes, ir.Shape | None] = {}
    for node in graph:
        outputs = [out for out in node.outputs if out.name in left]
        if not outputs or node.domain not in ("", "ai.onnx") or subgraphs(node):
            continue
        schema = _schema(node.op_type, opset)
        inputs = [v for v in node.inputs if v is not None]
        if schema is None or any(not isinstance(v.type, ir.TensorType) or v.shape is None for v in inputs):
            continue
        key = _inference_key(node)
        found = inferred.get(key) if key is not None else None
        if found is None:
            types = infer_node_types(node, schema, inputs, (), imports)
            found = [None if out.name not in types else (types[out.name], frozen_shape(types[out.name], seen))
                     for out in node.outputs]
            if key is not None:
                inferred[key] = found
        for out, item in zip(node.outputs, found):
            if out.name not in left or item is None or item[1] is None:
                continue
            kind, shape = item
            if not all(isinstance(d, int) for d in shape.dims):
                continue
            if out.type is None:
                out.type = ir.serde.deserialize_type_proto_for_type(kind)
            out.shape = shape
            del left[out.name]
    return left


def _inference_key(node: ir.Node) -> tuple | None:
    """What onnx's inference of the node reads, as a dictionary key (None: a large tensor
    attribute, not worth comparing)."""
    attributes = []
    for name, attribute in node.attributes.items():
        value = attribute.value
        if attribute.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
            value = tuple(value)
        elif attribute.type is ir.AttributeType.TENSOR:
            if value.size > 64:
                return None
            value = (value.dtype, tuple(value.shape), value.tobytes())
        elif attribute.type not in (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING):
            return None
        attributes.append((name, value))
    inputs = []
    for v in node.inputs:
        if v is None:
            inputs.append(None)
            continue
        data = shapes.constant_input(v) if v.dtype in _INDEX_TYPES else None
        inputs.append((v.dtype, shapes.dims(v), None if data is None else (np.shape(data), np.asarray(data).tobytes())))
    return (node.op_type, len(node.outputs), tuple(attributes), tuple(inputs))


def frozen_shape(kind: onnx.TypeProto, seen: dict[bytes, ir.Shape | None]) -> ir.Shape | None:
    """The shape in ``kind``: deserialised once per distinct type (``seen``), and frozen, so that
    one object serves every value of that type."""
    key = kind.SerializeToString()
    if key not in seen:
        seen[key] = ir.serde.deserialize_type_proto_for_shape(kind)
    return seen[key]


def _unknown(dim) -> bool:
    """A dimension nobody named: none at all, or one onnx's inference made up ("unk__3")."""
    return dim is None or (isinstance(dim, str) and dim.startswith("unk__"))


def _incomplete(value: ir.Value) -> bool:
    return value.type is None or value.shape is None or any(_unknown(d) for d in shapes.dims(value))


def _refined(value: ir.Value, found: ir.Shape | None) -> ir.Shape | None:
    """``found`` where it knows more than the value's shape and contradicts none of it, else None."""
    if found is None:
        return None
    if value.shape is None:
        return found
    old, new = shapes.dims(value), [d if isinstance(d, int) else None for d in found.dims]
    if len(old) != len(new) or any(isinstance(o, int) and o != n for o, n in zip(old, new)):
        return None
    if not any(_unknown(o) and n is not None for o, n in zip(old, new)):
        return None
    return ir.Shape([n if _unknown(o) and n is not None else value.shape.dims[k]
                     for k, (o, n) in enumerate(zip(old, new))])


@functools.lru_cache(maxsize=None)
def _schema(op_type: str, opset: int):
    try:
        return onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def onnx_inferred(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """``proto`` typed by onnx's shape inference (with data propagation, not strict), with the
    dimension names it made up for sequence elements forgotten; None where inference fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return None
    forget_element_names(inferred)
    return inferred


def inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Name → type of the values ``proto`` (an output of :func:`onnx_inferred`) declares: the
    inputs, outputs and value_info of its graph and subgraphs (the first where a name repeats)."""
    types: dict[str, onnx.TypeProto] = {}
    for graph in proto_graphs(proto.graph):
        for info in (*graph.input, *graph.output, *graph.value_info):
            if info.name not in types and info.type.WhichOneof("value"):
                types[info.name] = info.type
    return types


def forget_element_names(proto: onnx.ModelProto) -> None:
    """Clears the dimension names onnx's inference made up ("unk__3") for sequences' element
    types, wherever they appear in ``proto`` (an output of that inference).

    A sequence has one element type: where its elements' extents differ (SplitToSequence into 7
    and 8 columns) that type's dimension is unknown, and inference names it. Every SequenceAt then
    reads a tensor of that one name, which claims all elements are equal; onnxruntime then plans to
    reuse one element's buffer for another ("Shape mismatch attempting to re-use buffer").
    """
    infos = [info for graph in proto_graphs(proto.graph) for info in (*graph.input, *graph.output, *graph.value_info)]
    made_up = {d.dim_param for info in infos if info.type.WhichOneof("value") != "tensor_type"
               for d, in_sequence in _tensor_dims(info.type) if in_sequence and d.dim_param.startswith("unk__")}
    for info in infos if made_up else ():
        for d, _ in _tensor_dims(info.type):
            if d.dim_param in made_up:
                d.ClearField("dim_param")


def _tensor_dims(kind: onnx.TypeProto, in_sequence: bool = False) -> list:
    """(dim, whether inside a sequence) for the dims of the tensor types within ``kind``."""
    field = kind.WhichOneof("value")
    if field == "tensor_type":
        return [(d, in_sequence) for d in kind.tensor_type.shape.dim]
    if field == "sequence_type":
        return _tensor_dims(kind.sequence_type.elem_type, True)
    if field == "optional_type":
        return _tensor_dims(kind.optional_type.elem_type, in_sequence)
    return []
