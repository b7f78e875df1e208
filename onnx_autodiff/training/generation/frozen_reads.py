"""Frozen weights read the way the runtime holds them once: a large float weight multiplied
transposed read in place by a Gemm; a frozen base stored in another type (half precision, 4 or 8
bits) read in pieces where its floats are large, and as floats where each node uses it, one
reader's at a time."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.rules.quantized import CHUNK
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.targets import Target
from onnx_autodiff.training.values import fresh_initializer


class FrozenReadsPass(ir.passes.InPlacePass):
    """The reads of frozen weights of a finished model (its inputs and outputs final) placed as
    ``target``'s runtime holds them once: :func:`_frozen_read_in_place` always; where the target
    reads frozen bases so (``Target.frozen_base_reads``) and the model holds weights stored in
    another type, :func:`_frozen_bases_read_in_pieces` and :func:`_frozen_bases_read_at_use`."""

    def __init__(self, target: Target) -> None:
        super().__init__()
        self.target = target

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        _frozen_read_in_place(model)
        if self.target.frozen_base_reads and _holds_stored_weights(model.graph):
            _frozen_bases_read_in_pieces(model)
            _frozen_bases_read_at_use(model)
        return ir.passes.PassResult(model, True)


FROZEN_IN_PLACE = 1 << 18  # bytes: a frozen weight this large is read where it is stored, never copied transposed
_GEMM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


def _frozen_read_in_place(model: ir.Model) -> None:
    """``MatMul(x, Transpose(W))`` of a large frozen weight ``W`` (an initializer of at least
    :data:`FROZEN_IN_PLACE` bytes; torch exports ``nn.Linear`` so) as a Gemm that reads W
    transposed in place, x of rank > 2 flattened to a matrix and back (the same products):
    onnxruntime would fold the Transpose of the constant into a second, transposed copy of W when
    it creates the session, and keep both where the backward reads W too."""
    graph = model.graph
    if default_opset(model) < 11:  # Gemm's C input is optional from opset 11
        return
    namer = None
    for node in list(graph):
        weight = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        tensor = weight.const_value if weight is not None and weight.is_initializer() else None
        if (tensor is None or weight.is_graph_input() or tensor.dtype not in _GEMM_TYPES or len(tensor.shape) != 2
                or tensor.nbytes < FROZEN_IN_PLACE or list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]):
            continue
        transposed = node.outputs[0]
        for user, index in list(transposed.uses()):
            x = user.inputs[0]
            if (user.op_type != "MatMul" or user.domain not in ("", "ai.onnx") or index != 1 or x is None
                    or x.shape is None or len(x.shape) < 2 or user.outputs[0].is_graph_output()):
                continue
            namer = namer or Namer.for_graph(graph, prefix="frozen")
            out, (n, k), lead = user.outputs[0], tensor.shape.dims, list(x.shape.dims[:-1])
            nodes, rows = [], x
            if len(x.shape) > 2:
                nodes.append(ir.node("Reshape", [x, fresh_initializer(graph, namer, np.array([-1, k], np.int64), "rows")]))
                rows = nodes[-1].outputs[0]
                rows.name, rows.dtype, rows.shape = namer.fresh(f"{x.name}.rows"), x.dtype, ir.Shape([None, k])
            nodes.append(ir.node("Gemm", [rows, weight], attributes={"transB": 1}))
            product = nodes[-1].outputs[0]
            product.name, product.dtype = namer.fresh(f"{out.name}.rows"), out.dtype
            if len(x.shape) > 2:
                if all(isinstance(d, int) for d in lead):
                    shape = fresh_initializer(graph, namer, np.array([*lead, n], np.int64), "shape")
                else:  # the leading dims of x, then N
                    start, end = (fresh_initializer(graph, namer, np.array([i], np.int64), "axis") for i in (0, -1))
                    nodes.append(ir.node("Shape", [x]))
                    nodes.append(ir.node("Slice", [nodes[-1].outputs[0], start, end]))
                    last = fresh_initializer(graph, namer, np.array([n], np.int64), "columns")
                    nodes.append(ir.node("Concat", [nodes[-1].outputs[0], last], attributes={"axis": 0}))
                    shape = nodes[-1].outputs[0]
                    for value in (nodes[-3].outputs[0], nodes[-2].outputs[0], shape):
                        value.name = namer.fresh(f"{out.name}.shape")
                nodes.append(ir.node("Reshape", [product, shape]))
            result = nodes[-1].outputs[0]
            result.type, result.shape = out.type, out.shape
            ir.convenience.replace_nodes_and_values(graph, user, [user], nodes, [out], [result])
        if not transposed.uses() and not transposed.is_graph_output():
            graph.remove(node, safe=True)


_HALF_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_STORED_TYPES = _HALF_TYPES | {ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.INT8, ir.DataType.UINT8}


def _holds_stored_weights(graph: ir.Graph) -> bool:
    """Whether ``graph`` holds weights stored in another type than they are computed in (half
    precision, 4 or 8 bits): the reads that the lowerings below place have nothing to do
    otherwise (a walk of a 20,001-node chain's train model spared)."""
    return any(value.dtype in _STORED_TYPES for value in graph.initializers.values())


def _frozen_base_reads(graph: ir.Graph):
    """The nodes that read a frozen base weight stored in another type as floats: a Cast from
    float16/bfloat16 or a DequantizeLinear of initializers, at least :data:`FROZEN_IN_PLACE` bytes
    of floats, each with the stored weight."""
    for node in list(graph):
        stored = node.inputs[0] if node.inputs and node.domain in ("", "ai.onnx") else None
        tensor = stored.const_value if stored is not None and stored.is_initializer() else None
        floats = node.outputs[0].dtype
        if (tensor is None or floats is None or tensor.size * floats.itemsize < FROZEN_IN_PLACE
                or not all(v is None or v.is_initializer() for v in node.inputs)):
            continue
        if node.op_type == "DequantizeLinear" or node.op_type == "Cast" and tensor.dtype in _HALF_TYPES:
            yield node, stored


_SAMPLING = frozenset({"Bernoulli", "Multinomial", "Dropout"})  # nodes whose values are drawn: kept in place
_PIECES_BITS = 4  # bits of a stored weight, at most, that _frozen_bases_read_in_pieces stores in pieces


def _frozen_bases_read_in_pieces(model: ir.Model) -> None:
    """A frozen base weight W [R, C] stored in at most :data:`_PIECES_BITS` bits whose floats are
    more than :data:`~onnx_autodiff.rules.quantized.CHUNK` (a language model's head: 32,000 x 768,
    98 MB of floats) is read in pieces along its shorter axis by the products that multiply by it,
    each piece stored and read as floats by itself, never the whole weight's floats at once (as in
    MatMulNBits' backward, rules/quantized.py):

    - a product contracting that axis (the head's forward, ``x @ Wᵀ``: the logits) sums the
      pieces' products through Gemm's C, which onnxruntime's order computes first: the sum so
      far, the next product and one piece's floats are alive (2 x 33 + 16 MB, where the whole
      read held 33 + 98: a 155 M Llama's 4-bit steps, 619 -> 560 MB at their peak);
    - a product contracting the other axis (the head's backward, ``dY @ W``: 768 numbers per
      token) takes the pieces' products side by side.

    The pieces replace W in the train and eval models; stored in 4 bits, they cost an eighth of
    the floats they spare (a float16 head's pieces cost a step more than they spared). A weight
    the model stores in a file (a shipped MatMulNBits file read through DequantizeLinear) is cut
    the same way: pieces of its rows are the bytes of that file where they are, pieces of its
    columns copies, which the saved artifacts write into a data file of their own (reading the
    whole weight in the forward instead kept that 155 M Llama's steps at 693 MB, not 559)."""
    graph = model.graph
    opset = default_opset(model)  # (21 or later: DequantizeLinear of 4 bits)
    namer = None
    for read, stored in list(_frozen_base_reads(graph)):
        shape = stored.const_value.shape
        if len(shape) != 2 or shape[0] * shape[1] <= CHUNK or stored.const_value.dtype.bitwidth > _PIECES_BITS:
            continue
        along, side_by_side = int(shape[1] < shape[0]), True
        products = [(product, axis) for axis in (0, 1) if axis == along or side_by_side
                    for product in _products_contracting(read.outputs[0], axis)]
        if not products:
            continue
        namer = namer or Namer.for_graph(graph, prefix="frozen")
        length = _piece_length(read, along, CHUNK // shape[1 - along])
        cuts = [(start, min(shape[along], start + length)) for start in range(0, shape[along], length)]
        pieces = [_stored_piece(graph, namer, read, along, start, end) for start, end in cuts]
        for product, axis in products:
            op = OpBuilder(opset, namer)
            x, out = product.inputs[0], product.outputs[0]
            if axis == along:
                total = _summed_through_gemm(op, read, x, out, along, cuts, pieces)
            else:
                floats = (_read_piece(op, read, stored_inputs) for stored_inputs in pieces)
                total = op.Concat(*[op.MatMul(x, op.Transpose(piece, perm=[1, 0]) if along == 0 else piece)
                                    for piece in floats], axis=-1)
            total.type, total.shape = out.type, out.shape
            ir.convenience.replace_nodes_and_values(graph, product, [product], op.nodes, [out], [total])
        for user in list(dict.fromkeys(user for user, _ in read.outputs[0].uses())):
            if user.op_type == "Transpose" and not user.outputs[0].uses():
                graph.remove(user, safe=True)
        if not read.outputs[0].uses():
            stored_inputs = [value for value in read.inputs if value is not None]
            graph.remove(read, safe=True)  # (which detaches its inputs)
            for value in stored_inputs:
                if not value.uses() and not value.is_graph_input():
                    graph.initializers.pop(value.name)


def _summed_through_gemm(op: OpBuilder, read: ir.Node, x: ir.Value, out: ir.Value, along: int, cuts, pieces) -> ir.Value:
    """x @ W (``along`` 0) or x @ Wᵀ (``along`` 1) of W's pieces along the contracted axis: the
    pieces' products summed, each through the C of the next one's Gemm, over x's rows (x
    flattened to a matrix and back)."""
    rank = x.shape.rank() if x.shape is not None else None
    rows = x if rank == 2 else op.reshape(x, [-1, x.shape[-1]])
    total = None
    for (start, end), stored_inputs in zip(cuts, pieces):
        piece = _read_piece(op, read, stored_inputs)
        columns = op.slice(rows, [start], [end], axes=[1])
        total = op.Gemm(columns, piece, *([total] if total is not None else []), transB=along)
    if rank == 2:
        return total
    lead = list(x.shape.dims[:-1])
    if all(isinstance(d, int) for d in lead):
        return op.reshape(total, [*lead, out.shape[-1]])
    # the leading dims of x, then the output's columns
    return op.reshape(total, op.Concat(op.slice(op.Shape(x), [0], [-1]), op.const([out.shape[-1]]), axis=0))


def _products_contracting(floats: ir.Value, axis: int) -> list[ir.Node]:
    """The MatMuls that multiply by ``floats`` (a weight W [R, C]) contracting its ``axis``: ``x @ W``
    contracts axis 0, ``x @ Transpose(W)`` axis 1."""
    found = []
    for user, index in floats.uses():
        if user.op_type == "MatMul" and user.domain in ("", "ai.onnx") and index == 1 and axis == 0:
            found.append(user)
        elif (user.op_type == "Transpose" and user.domain in ("", "ai.onnx") and axis == 1
              and list(user.attributes.get_ints("perm", [1, 0])) == [1, 0]):
            found.extend(product for product, position in user.outputs[0].uses()
                         if product.op_type == "MatMul" and product.domain in ("", "ai.onnx") and position == 1)
    return [product for product in found if not product.outputs[0].is_graph_output()]


def _piece_length(read: ir.Node, axis: int, length: int) -> int:
    """``length`` as a whole number of the read's quantization blocks where they run along ``axis``."""
    block = read.attributes.get_int("block_size", 0) if read.op_type == "DequantizeLinear" else 0
    if block and read.attributes.get_int("axis", 1) % 2 == axis:
        return max(block, length // block * block)
    return max(1, length)


def _stored_piece(graph: ir.Graph, namer: Namer, read: ir.Node, axis: int, start: int, end: int) -> list:
    """The inputs of ``read`` (a Cast or DequantizeLinear of a stored weight [R, C]) for the piece
    ``start:end`` along ``axis``, as initializers: the weight's piece, and its scale's and zero
    point's where they vary along ``axis`` (per row or column, or in blocks). Rows of a tensor
    stored in a file are the bytes of that file where they are (a model's own weights: nothing is
    copied), other pieces copies."""
    quantized_axis = read.attributes.get_int("axis", 1) % 2
    block = read.attributes.get_int("block_size", 0)
    inputs = []
    for position, value in enumerate(read.inputs):
        array = value.const_value.numpy() if value is not None else None
        if position == 0 or array is not None and array.ndim == 2:
            cut = slice(start // block, -(-end // block)) if position and block and quantized_axis == axis else slice(start, end)
            part = array[cut] if axis == 0 else array[:, cut]
        elif array is not None and array.ndim == 1 and quantized_axis == axis:
            part = array[start:end]
        else:  # one scale (zero point) for the whole piece, or none
            inputs.append(value)
            continue
        name = namer.fresh(f"{value.name}.{'rows' if axis == 0 else 'columns'}{start}")
        stored = _stored_rows(value.const_value, cut, name) if axis == 0 else None
        piece = ir.Value(name=name, type=value.type, shape=ir.Shape(part.shape),
                         const_value=stored or ir.tensor(np.ascontiguousarray(part), dtype=value.dtype, name=name))
        graph.register_initializer(piece)
        inputs.append(piece)
    return inputs


def _stored_rows(tensor, rows: slice, name: str) -> ir.ExternalTensor | None:
    """Rows ``rows`` of ``tensor`` as the bytes of its file that hold them, where it is stored in a
    file and they start and end on whole bytes; else None."""
    if not isinstance(tensor, ir.ExternalTensor) or tensor.offset is None:
        return None
    dims = list(tensor.shape.dims)
    bits = int(np.prod(dims[1:], dtype=np.int64)) * tensor.dtype.bitwidth
    if bits % 8:
        return None
    start, stop, _ = rows.indices(dims[0])
    return ir.ExternalTensor(tensor.location, tensor.offset + start * bits // 8, (stop - start) * bits // 8, tensor.dtype,
                             shape=ir.Shape([stop - start, *dims[1:]]), name=name, base_dir=tensor.base_dir)


def _read_piece(op: OpBuilder, read: ir.Node, inputs: list) -> ir.Value:
    """``read`` (Cast, DequantizeLinear) again, of a piece's stored inputs."""
    floats = op.emit(read.op_type, *inputs, **{name: attribute.value for name, attribute in read.attributes.items()})
    floats.dtype, floats.shape = read.outputs[0].dtype, inputs[0].shape
    return floats


def _frozen_bases_read_at_use(model: ir.Model) -> None:
    """Frozen base weights stored in another type (read through a Cast from float16/bfloat16 or a
    DequantizeLinear, at least :data:`FROZEN_IN_PLACE` bytes as floats) become floats where each node
    uses them, one reader's floats at a time, never a whole model's at once. Left as written,
    onnxruntime folds a Cast of a constant into a float copy of the weight when it creates the
    session (a float16 Llama's train step then peaks above its float32 base's), and runs reads
    that depend on no other node before the first layer, holding their floats until used.

    - A Cast's weight becomes an overridable graph input (its initializer the default), which
      onnxruntime does not fold; each node reading the Cast gets a Cast of its own, the second and
      later ones through a Reshape of a shape of their own, so that the common-subexpression
      elimination at session creation cannot merge them back into one copy alive from the forward
      to the backward (onnxruntime gives each reader of a DequantizeLinear a copy itself).
    - Every node computed from stored weights alone comes first in the graph (these reads, a
      MatMulNBits backward's unpacking): onnxruntime's order visits a node's later inputs first,
      so what comes first runs just before the node that uses it. Where such a node comes after
      the activation it meets, the backward's reads all run before the loss's gradient and
      stay alive until their layer's turn (a 155 M Llama's MatMulNBits step: 20 MB more at
      its peak)."""
    graph = model.graph
    inputs = set(graph.inputs)
    namer = None
    for node, stored in _frozen_base_reads(graph):
        tensor = stored.const_value
        if node.op_type == "Cast":
            namer = namer or Namer.for_graph(graph, prefix="frozen")
            if stored not in inputs:
                graph.inputs.append(stored)
                inputs.add(stored)
            out = node.outputs[0]
            readers = list(dict.fromkeys(user for user, _ in out.uses()))
            dims = fresh_initializer(graph, namer, np.array(tensor.shape.dims, np.int64), "dims") if len(readers) > 1 else None
            for rank, reader in enumerate(readers[1:], start=1):
                flat = fresh_initializer(graph, namer, np.array([1] * (rank - 1) + [-1], np.int64), "flat")
                copy = [ir.node("Reshape", [stored, flat])]
                copy.append(ir.node("Cast", [copy[0].outputs[0]], attributes={"to": node.attributes["to"].value}))
                copy.append(ir.node("Reshape", [copy[1].outputs[0], dims]))
                for value in (c.outputs[0] for c in copy):
                    value.name = namer.fresh(f"{stored.name}.read")
                copy[-1].outputs[0].type, copy[-1].outputs[0].shape = out.type, out.shape
                for index, value in enumerate(reader.inputs):
                    if value is out:
                        reader.replace_input_with(index, copy[-1].outputs[0])
                graph.insert_before(reader, copy)
    _stored_alone_first(graph)


def _stored_alone_first(graph: ir.Graph) -> None:
    """Moves the nodes that compute from initializers alone (no graph input other than an
    overridable initializer, no subgraph, nothing random) to the front, in their order."""
    computed = {v for v in graph.inputs if not v.is_initializer()}
    first = []
    for node in graph:
        if (node.op_type.startswith("Random") or node.op_type in _SAMPLING
                or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
                or any(v in computed for v in node.inputs if v is not None)):
            computed.update(node.outputs)
        else:
            first.append(node)
    if first and len(first) < len(graph):
        graph.remove(first)
        graph.insert_before(graph.node(0), first)
