"""All shape inference: :func:`infer_shapes` for models, :func:`infer_node_shapes` for nodes
built apart from any model (a rule's decomposition); the rest serves those two and the engine.

onnx's model-level inference leaves values without a shape where a node's shape depends on the
data of an input that is not an initializer: a Constant node's output read inside a subgraph
(Unsqueeze or Squeeze axes inside a Scan or If body), a Split whose sizes are computed, a Reshape
to ``Shape(x)``. Those gaps spread to everything downstream, and rules then lack the ranks they
need. :func:`complete_shapes` therefore infers again, by its own schema's inference, each node
whose outputs lack a shape or hold dimensions onnx made up ("unk__0"), given the types of its
inputs and the values of its small integer inputs that are known before run time
(``shapes.constant``: initializers, Constant nodes in any enclosing scope, Shape and Size of
statically shaped values, the branch of an If whose condition is known, small computations over
those).

Every inferred type reaches a value through :func:`_take_inferred`, whose :class:`Overwrite`
says what of the value's own type and shape it may replace.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.modelfile import to_proto
from onnx_autodiff.toolkit import shapes
from onnx_autodiff.toolkit.graphs import captured_values, graph_and_subgraphs, proto_graphs, subgraphs

__all__ = ["infer_shapes", "infer_node_shapes", "fully_shaped"]

_INDEX_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})
# Values without a shape up to which each one's node is inferred alone first, whatever the graph
# inputs' shapes (the few the cleanup's rewrites made): onnx's inference of the whole model costs as
# much for a few values as for all of them. With static inputs the nodes are always inferred alone first.
BY_NODE = 1000


def infer_shapes(model: ir.Model, *, missing_only: bool = False) -> None:
    """Give the model's values the types and shapes onnx's inference finds.

    By default (the engine's, before a build): the values of every graph, an inferred shape
    replacing the value's own, then completed node by node (:func:`complete_shapes`); where neither
    finds a shape, the value is left as it is. Unlike onnx-ir's ShapeInferencePass, a value without
    a type takes the inferred type whole, so sequence values stay sequences (that pass turns them
    into tensors of the element type).

    ``missing_only=True`` (the cleanup's, between its rounds): only the main graph's node outputs
    that lack a type or a shape, and only what they lack. Static shapes come from each node's own
    inference where that is cheaper (:func:`static_by_node`: up to :data:`BY_NODE` values, or any
    number when the graph inputs are static); the whole model's inference gives the rest.
    """
    if missing_only:
        _infer_missing_shapes(model)
        return
    _infer_model_shapes(model)
    complete_shapes(model.graph, model.opset_imports)


def _infer_model_shapes(model: ir.Model) -> None:
    graph = model.graph
    if _static_inputs(graph) and not any(subgraphs(n) for n in graph):
        # static inputs: each node's own inference finds what the whole model's does, at a
        # fraction of the cost of converting the model for it
        outputs = {v.name: v for node in graph for v in node.outputs if v.name}
        if not static_by_node(graph, outputs, model.opset_imports):
            return
    proto = onnx_inferred(to_proto(model))
    if proto is None:
        return
    # Read from the inferred value_info: deserialising the whole model costs several times more.
    known = inferred_types(proto)
    seen: dict[bytes, ir.Shape | None] = {}
    for value in _defined_values(model.graph):
        found = known.get(value.name)
        if found is not None:
            _take_inferred(value, found, frozen_shape(found, seen), Overwrite.SHAPE)


def _defined_values(graph: ir.Graph):
    """The inputs, initializers and node outputs of ``graph`` and its subgraphs: every value they
    define (graph_and_subgraphs: model.graphs() walks them several times slower)."""
    for held in graph_and_subgraphs(graph):
        yield from held.inputs
        yield from held.initializers.values()
        for node in held:
            yield from node.outputs


def _infer_missing_shapes(model: ir.Model) -> None:
    """``infer_shapes(model, missing_only=True)``: the cleanup's rewrites decide from shapes, which
    the backward values lack. The whole model's inference is read from its value_info directly:
    deserialising the whole inferred model costs ten times more."""
    missing = {v.name: v for node in model.graph for v in node.outputs
               if (v.shape is None or v.type is None) and v.name}
    if missing and (len(missing) <= BY_NODE or _static_inputs(model.graph)):
        missing = static_by_node(model.graph, missing, model.opset_imports)
    if not missing:
        return
    proto = onnx_inferred(to_proto(model))
    if proto is None:  # without shapes fewer rewrites apply
        return
    seen: dict[bytes, ir.Shape | None] = {}
    for info in (*proto.graph.value_info, *proto.graph.output):
        value = missing.get(info.name)
        if value is not None and info.type.WhichOneof("value"):
            _take_inferred(value, info.type, frozen_shape(info.type, seen), Overwrite.NOTHING)


def _static_inputs(graph: ir.Graph) -> bool:
    """Whether every input of ``graph`` has a static shape: then each node's own inference
    (:func:`static_by_node`) finds the static shapes the whole model's does."""
    return all(shapes.static_shape(v) is not None for v in graph.inputs)


def infer_node_shapes(nodes: Sequence[ir.Node], inputs: Sequence[ir.Value], opset: int) -> None:
    """Shapes every value ``nodes`` (and their subgraphs) define, by onnx shape inference of the
    nodes alone (a model's is :func:`infer_shapes`): the templates of the broadcasting ops and
    MatMul need ranks (the builder leaves shapes unset). ``inputs``: the values they read."""
    graph = onnx.helper.make_graph([ir.serde.serialize_node(n) for n in nodes], "decomposition",
                                   [ir.serde.serialize_value(v) for v in inputs], [])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(model).graph
    found = {info.name: info for g in proto_graphs(inferred) for info in (*g.value_info, *g.output)}
    pending = list(nodes)
    while pending:
        n = pending.pop()
        for out in n.outputs:
            info = found.get(out.name)
            if info is not None and out.shape is None and info.type.tensor_type.HasField("shape"):
                shape = _without_made_up_names(ir.serde.deserialize_type_proto_for_shape(info.type))
                _take_inferred(out, info.type, shape, Overwrite.ALL)
        for sub in subgraphs(n):
            pending.extend(sub)


def infer_output_types(node: ir.Node, opset: int, outputs: Sequence[ir.Value]) -> None:
    """Sets the type (and shape, when inferred) of the node's ``outputs`` from the op's schema
    (the engine's, for the optional outputs a rule has a node save)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:  # without a type the rule still works in its input's type
        return
    inferred = infer_node_types(node, schema, [v for v in node.inputs if v is not None and v.type is not None])
    for value in outputs:
        found = inferred.get(value.name)
        if found is not None and found.HasField("tensor_type"):
            shape = _without_made_up_names(ir.serde.deserialize_type_proto_for_shape(found))
            _take_inferred(value, found, shape, Overwrite.ALL)


class Overwrite(enum.Enum):
    """What of a value's own type and shape an inferred one replaces (a missing type, and a
    missing shape where one was inferred, are always filled)."""

    NOTHING = "nothing"
    UNKNOWN_DIMS = "unknown dims"  # the dimensions nobody named, where the rest agrees (_refined)
    SHAPE = "shape"  # the shape, wherever one was inferred
    ALL = "all"  # type and shape: the value has the inferred ones (no shape where none was inferred)


def _take_inferred(value: ir.Value, kind: onnx.TypeProto, shape: ir.Shape | None, overwrite: Overwrite) -> bool:
    """Give ``value`` the inferred type ``kind`` and its ``shape`` (deserialised by the caller,
    which may share one frozen shape among the values of one type) as ``overwrite`` allows;
    returns whether the value's shape changed."""
    if overwrite is Overwrite.ALL:
        changed = value.shape != shape
        value.type, value.shape = ir.serde.deserialize_type_proto_for_type(kind), shape
        return changed
    if value.type is None:
        value.type = ir.serde.deserialize_type_proto_for_type(kind)
    if overwrite is Overwrite.UNKNOWN_DIMS:
        shape = _refined(value, shape)
        changed = shape is not None
    elif overwrite is Overwrite.SHAPE:
        shape = _named_kept(value, shape)
        changed = shape is not None and (value.shape is None or value.shape != shape)
    else:
        changed = shape is not None and value.shape is None
    if changed:
        value.shape = shape
    return changed


def _named_kept(value: ir.Value, found: ir.Shape | None) -> ir.Shape | None:
    """``found``, but where it has the extent 0 for a dimension the value names, that name: some of
    onnx's inference functions read a symbolic extent as 0 (Attention-23's: Y's hidden size, the
    scores' key length), and a seed declared with it would refuse every real one."""
    if found is None or value.shape is None or len(found) != len(value.shape):
        return found
    old = value.shape.dims
    if not any(_zero_for_name(d, o) for d, o in zip(found.dims, old)):
        return found
    return ir.Shape([o if _zero_for_name(d, o) else d
                     for d, o in zip(found.dims, old)])


def _zero_for_name(found, old) -> bool:
    return isinstance(found, int) and found == 0 and isinstance(old, ir.SymbolicDim) and bool(old.value)


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
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            filled += _taken_branch_shapes(node)
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


def _taken_branch_shapes(node: ir.Node) -> int:
    """An If whose condition is known before run time has the types of the branch it takes, where
    onnx merges both (a function body written for several ranks: AffineGrid's 2-D and 3-D
    branches give its theta no rank)."""
    cond = shapes.number(node.inputs[0])
    if cond is None:
        return 0
    branch = shapes.attr(node, "then_branch" if cond else "else_branch")
    filled = 0
    for out, taken in zip(node.outputs, branch.outputs):
        shape = _refined(out, taken.shape) if isinstance(taken.type, ir.TensorType) else None
        if shape is not None and (out.type is None or out.type == taken.type):
            out.type, out.shape = taken.type, shape
            filled += 1
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
            array = shapes.constant(v)
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
        if found is not None and found.tensor_type.HasField("shape"):
            shape = ir.serde.deserialize_type_proto_for_shape(found)
            filled += _take_inferred(out, found, shape, Overwrite.UNKNOWN_DIMS)
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
    # (the nodes making the values, in graph order as ``missing`` lists them: each node's inputs
    # are inferred before it, and a graph's other nodes are not walked)
    for node in dict.fromkeys(value.producer() for value in missing.values()):
        if node is None or node.graph is not graph or node.domain not in ("", "ai.onnx") or subgraphs(node):
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
            _take_inferred(out, kind, shape, Overwrite.SHAPE)
            del left[out.name]
    return left


def _inference_key(node: ir.Node) -> tuple | None:
    """What onnx's inference of the node reads, as a dictionary key (None: a large tensor
    attribute, not worth comparing)."""
    attributes = []
    for name, attribute in node.attributes.data.items():  # (the dict the UserDict holds)
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
        data = shapes.constant(v) if v.dtype in _INDEX_TYPES else None
        inputs.append((v.dtype, shapes.dims(v), None if data is None else (np.shape(data), np.asarray(data).tobytes())))
    return (node.op_type, len(node.outputs), tuple(attributes), tuple(inputs))


def frozen_shape(kind: onnx.TypeProto, seen: dict[bytes, ir.Shape | None]) -> ir.Shape | None:
    """The shape in ``kind``: deserialised once per distinct type (``seen``), and frozen, so that
    one object serves every value of that type."""
    key = kind.SerializeToString()
    if key not in seen:
        seen[key] = ir.serde.deserialize_type_proto_for_shape(kind)
    return seen[key]


def _without_made_up_names(shape: ir.Shape | None) -> ir.Shape | None:
    """``shape`` with the dimensions onnx's inference of a few nodes made up ("unk__0") unnamed:
    that inference knows no other name in the model, so its "unk__0" may be another extent than
    the model's own, and onnxruntime takes equal names for equal sizes (it reuses one's buffer
    for the other)."""
    made_up = [not isinstance(d, int) and d.value is not None and _unknown(d.value) for d in shape.dims] if shape else []
    if not any(made_up):
        return shape
    return ir.Shape([None if gone else d for d, gone in zip(shape.dims, made_up)])


def _unknown(dim) -> bool:
    """A dimension nobody named: none at all, or one onnx's inference made up ("unk__3")."""
    return dim is None or (isinstance(dim, str) and dim.startswith("unk__"))


def fully_shaped(graph: ir.Graph) -> bool:
    """Whether every input and node output of ``graph`` and its subgraphs has a type and a shape
    with no dimension onnx made up: then :func:`infer_shapes` of a model whose shapes onnx's
    inference gave would only find them again."""
    return not any(_incomplete(v) for g in graph_and_subgraphs(graph)
                   for v in (*g.inputs, *(out for node in g for out in node.outputs)))


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


# Ops whose version here computes what every earlier one does (with the defaults of the attributes
# it added) and infers more: Reshape-14 gives its output the rank of a shape input whose values are
# computed (a TorchScript export's Concat of Shape's Gathers); Reshape-5 and -13 give no shape.
_INFERRED_AS = {"Reshape": 14}


@functools.lru_cache(maxsize=None)
def _schema(op_type: str, opset: int):
    try:
        return onnx.defs.get_schema(op_type, max(opset, _INFERRED_AS.get(op_type, 0)), "")
    except onnx.defs.SchemaError:
        return None


def onnx_inferred(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """``proto`` typed by onnx's shape inference (with data propagation, not strict), with the
    dimension names it made up for sequence elements forgotten; None where inference fails.

    onnx knows no ``com.microsoft.MatMulNBits`` and stops there: its products are inferred as
    MatMuls by a weight input [K, N] of their own (the types found then typing ``proto``)."""
    stand_in = _nbits_as_matmul(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(stand_in or proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return None
    if stand_in is not None:  # the stand-in typed: its MatMulNBits put back, its weight inputs dropped
        for index, node in enumerate(proto.graph.node):
            if _is_nbits(node):
                inferred.graph.node[index].CopyFrom(node)
        del inferred.graph.input[len(proto.graph.input):]
    forget_element_names(inferred)
    return inferred


def _is_nbits(node: onnx.NodeProto) -> bool:
    return node.op_type == "MatMulNBits" and node.domain == "com.microsoft"


def _nbits_as_matmul(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``proto`` whose main graph's MatMulNBits nodes are MatMuls by a graph input
    [K, N] of the scales' type; None where it has none."""
    if not any(_is_nbits(node) for node in proto.graph.node):
        return None
    types = {t.name: t.data_type for t in proto.graph.initializer}
    types.update((v.name, v.type.tensor_type.elem_type) for v in proto.graph.input)
    stand_in = onnx.ModelProto()
    stand_in.CopyFrom(proto)
    graph = stand_in.graph
    for node in graph.node:
        if not _is_nbits(node):
            continue
        sizes = {a.name: a.i for a in node.attribute}
        weight = f"{node.output[0]}.nbits_weight"
        graph.input.append(onnx.helper.make_tensor_value_info(
            weight, types.get(node.input[2], onnx.TensorProto.FLOAT), [sizes.get("K"), sizes.get("N")]))
        stand = onnx.helper.make_node("MatMul", [node.input[0], weight], [node.output[0]], name=node.name)
        node.CopyFrom(stand)
    return stand_in


def inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Name → type of the values ``proto`` (an output of :func:`onnx_inferred`) declares: the
    inputs, outputs and value_info of its graph and subgraphs (the first where a name repeats)."""
    types: dict[str, onnx.TypeProto] = {}
    for graph in proto_graphs(proto.graph):
        for info in (*graph.input, *graph.output, *graph.value_info):
            if info.name not in types and info.type.WhichOneof("value"):
                types[info.name] = info.type
    return types


def take_inferred_types(model: ir.Model, inferred: onnx.ModelProto) -> None:
    """Gives the values of ``model`` (``from_proto`` of a proto) the types and shapes that
    :func:`onnx_inferred` of that proto declares, as ``from_proto`` of ``inferred`` would: that one
    deserialises every value's type anew (twice the conversion of a 20,001-node chain), this
    each distinct type once."""
    known = inferred_types(inferred)
    seen: dict[bytes, tuple[ir.TypeProtocol | None, ir.Shape | None]] = {}
    for value in _defined_values(model.graph):
        kind = known.get(value.name)
        if kind is None:
            continue
        key = kind.SerializeToString()
        if key not in seen:  # (deserialised shapes are frozen: one serves every value of its type)
            seen[key] = ir.serde.deserialize_type_proto_for_type(kind), ir.serde.deserialize_type_proto_for_shape(kind)
        value.type, value.shape = seen[key]


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
