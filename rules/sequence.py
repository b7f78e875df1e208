"""Sequences: the gradient of a sequence is the sequence of its elements' gradients.

Positions are never differentiable. Zeros shaped like a sequence's elements and run-time element
extents are computed per element (SequenceMap, or a Loop before opset 17).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import not_differentiable, rule
from onnx_autodiff.toolkit import FLOAT_TYPES, shapes

not_differentiable("SequenceEmpty", "SequenceLength")


def _elem_type(seq: ir.Value) -> ir.TensorType | None:
    kind = seq.type
    if isinstance(kind, ir.SequenceType) and isinstance(kind.elem_type, ir.TensorType):
        return kind.elem_type
    return None


def _typed(value: ir.Value, seq: ir.Value) -> ir.Value:
    """Types an element taken out of ``seq`` (the builder leaves sequence ops untyped)."""
    if _elem_type(seq) is not None:
        value.type = _elem_type(seq)
    return value


def _map(op, seq: ir.Value, body_fn, name: str) -> ir.Value:
    """The sequence [body_fn(body_op, x) for x in seq]: a SequenceMap, or before opset 17 a Loop
    carrying the result (Loop carries sequences from opset 13)."""
    body = op.child()
    if op.opset >= 17:
        x = ir.Value(name=op.namer.fresh(), type=_elem_type(seq))
        return op.SequenceMap(seq, body=body.graph([x], [body_fn(body, x)], name=name))
    if op.opset < 13 or seq.dtype is None:
        raise RuleError(
            f"this gradient maps over a sequence's elements, with SequenceMap (opset 17) or a Loop "
            f"carrying a sequence (opset 13) of known element type; the model has opset {op.opset}: "
            "convert it with onnx.version_converter"
        )
    i = ir.Value(name=op.namer.fresh(), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(name=op.namer.fresh(), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    mapped = body_fn(body, _typed(body.SequenceAt(seq, i), seq))
    acc = ir.Value(name=op.namer.fresh(), type=ir.SequenceType(ir.TensorType(mapped.dtype)))
    graph = body.graph([i, cond, acc], [cond, body.SequenceInsert(acc, mapped)], name=name)
    graph.outputs[1].type = acc.type
    return op.Loop(_length(op, seq), op.const(np.array(True)), op.SequenceEmpty(dtype=int(mapped.dtype)), body=graph)


def _zeros_like_seq(op, seq: ir.Value) -> ir.Value:
    """A sequence of zeros shaped like each element of ``seq``."""
    return _map(op, seq, shapes.zeros, "zeros_like")


def _index(op, position: ir.Value, seq: ir.Value) -> ir.Value:
    """``position`` as a non-negative int64 index: a negative one counts back from len(seq)."""
    known = shapes.number(position)
    if known is not None and known >= 0:
        return position
    p = op.Cast(position, to=int(ir.DataType.INT64))
    return op.Where(op.Less(p, _int(op, 0)), op.Add(p, _length(op, seq)), p)


def _int(op, i: int) -> ir.Value:
    return op.const(np.array(i, np.int64))


def _length(op, seq: ir.Value) -> ir.Value:
    length = op.SequenceLength(seq)
    length.dtype = ir.DataType.INT64  # the builder would type it like the elements
    return length


@rule("SplitToSequence", differentiable=("input",), since=11)
def split_to_sequence(op, node, dS):
    """S = the pieces of X along axis: of size 1 with the axis removed when split is absent and
    keepdims=0, else of the sizes split gives (one scalar: equal pieces, the last smaller)."""
    X = node.inputs[0]
    axis = shapes.attr(node, "axis", 0)
    split = node.inputs[1] if len(node.inputs) > 1 else None
    keepdims = shapes.attr(node, "keepdims", 1)
    if split is None:
        return {"input": op.ConcatFromSequence(dS, axis=axis, new_axis=int(keepdims == 0))}
    size = shapes.constant(split)
    scalar = shapes.rank(split) == 0 or (size is not None and size.ndim == 0)
    if scalar and keepdims == 0 and (size is None or int(size) == 1):
        # The spec ignores keepdims when split is given, onnxruntime removes the axis (what
        # torch's unbind exports rely on): pieces of size 1 stacked then reshaped suit both.
        stacked = op.ConcatFromSequence(dS, axis=axis, new_axis=1)
        return {"input": op.Reshape(stacked, op.Shape(X))}
    return {"input": op.ConcatFromSequence(dS, axis=axis, new_axis=0)}


def _extents(op, seq: ir.Value, axis: int) -> ir.Value | int:
    """The length along ``axis`` of each element of ``seq``: an int when static, else 1-D int64."""
    shape = shapes.dims(seq)  # onnx-ir keeps the elements' common shape on the sequence value
    if shape is not None and -len(shape) <= axis < len(shape) and isinstance(shape[axis], int):
        return shape[axis]
    lengths = _map(op, seq, lambda body, x: body.Gather(body.Shape(x), [axis]), "extent")
    return op.ConcatFromSequence(lengths, axis=0)


@rule("ConcatFromSequence", differentiable=("input_sequence",), since=11)
def concat_from_sequence(op, node, dY):
    """Y = the elements of S concatenated (new_axis=0) or stacked (new_axis=1) along axis."""
    axis = shapes.attr(node, "axis")
    if shapes.attr(node, "new_axis", 0):
        return {"input_sequence": op.SplitToSequence(dY, axis=axis, keepdims=0)}
    extents = _extents(op, node.inputs[0], axis)
    split = _int(op, extents) if isinstance(extents, int) else extents
    return {"input_sequence": op.SplitToSequence(dY, split, axis=axis)}


@rule("SequenceAt", differentiable=("input_sequence",), since=11)
def sequence_at(op, node, dY):
    """Y = S[position]; dS is zeros with dY at the position."""
    seq, position = node.inputs
    index = _index(op, position, seq)
    zeros = op.SequenceErase(_zeros_like_seq(op, seq), index)
    return {"input_sequence": op.SequenceInsert(zeros, dY, index)}


@rule("SequenceConstruct", differentiable=("inputs",), since=11)
def sequence_construct(op, node, dS):
    """S = [x_0, x_1, ...]; dx_i = dS[i]."""
    return {"inputs": [op.SequenceAt(dS, _int(op, i)) for i in range(len(node.inputs))]}


@rule("SequenceInsert", differentiable=("input_sequence", "tensor"), since=11)
def sequence_insert(op, node, dOut):
    """Out = S with tensor inserted at position (appended when absent)."""
    seq, position = node.inputs[0], (node.inputs[2] if len(node.inputs) > 2 else None)
    if position is None:
        last = _int(op, -1)
        return {"input_sequence": op.SequenceErase(dOut), "tensor": op.SequenceAt(dOut, last)}
    # A negative position counts back from the end of S, not of Out.
    index = _index(op, position, seq)
    return {"input_sequence": op.SequenceErase(dOut, index), "tensor": op.SequenceAt(dOut, index)}


@rule("SequenceErase", differentiable=("input_sequence",), since=11)
def sequence_erase(op, node, dOut):
    """Out = S without the element at position (the last when absent)."""
    seq, position = node.inputs[0], (node.inputs[1] if len(node.inputs) > 1 else None)
    erased = op.SequenceAt(seq, position if position is not None else _int(op, -1))
    zeros = shapes.zeros(op, _typed(erased, seq))
    if position is None:
        return {"input_sequence": op.SequenceInsert(dOut, zeros)}
    return {"input_sequence": op.SequenceInsert(dOut, zeros, _index(op, position, seq))}


def _like_element(op, body_value: ir.Value, outer: ir.Value) -> ir.Value:
    """A fresh body input typed like ``body_value``, else like an element of ``outer``."""
    value_type = body_value.type or (ir.TensorType(outer.dtype) if outer.dtype is not None else None)
    return ir.Value(name=op.namer.fresh(), type=value_type, shape=body_value.shape)


def _sum_elements(op, seq: ir.Value) -> ir.Value:
    """The sum of a sequence's equally shaped elements."""
    return op.reduce_sum(op.ConcatFromSequence(seq, axis=0, new_axis=1), [0], keepdims=False)


@rule("SequenceMap", differentiable=("input_sequence", "additional_inputs"), since=17, captures=True)
def sequence_map(op, node, *dOuts, captures):
    """Outs = [body(s_i, a_i, ...) for each i]; the backward maps the body's VJP over (ins, dOuts).

    Tensor inputs (and captured values) are shared by every element: their gradients are summed.
    """
    body = shapes.attr(node, "body")
    wanted = list(captures)
    if any(v.type is None for v in node.inputs):
        raise RuleError("the types of SequenceMap's inputs are unknown (run shape inference first)")
    # Body values may be untyped (as in the engine's own accumulation): type them from the node's.
    floats = [k for k, v in enumerate(node.inputs) if v.dtype in FLOAT_TYPES]
    seeded = [k for k, d in enumerate(dOuts) if d is not None]

    grad = op.child()
    xs = [_like_element(op, b, v) for b, v in zip(body.inputs, node.inputs)]
    ds = [_like_element(op, body.outputs[k], node.outputs[k]) for k in seeded]
    outputs, nodes = grad.inline(body, xs)
    targets = [xs[k] for k in floats] + wanted
    grads = grad.differentiate(nodes, [(outputs[k], d) for k, d in zip(seeded, ds)], targets)
    grads = [shapes.zeros(grad, t) if g is None else g for g, t in zip(grads, targets)]
    graph = grad.graph([*xs, *ds], grads, name="sequence_map_grad")
    for out, t in zip(graph.outputs, targets):
        out.type, out.shape = t.type, t.shape
    seeds = [dOuts[k] for k in seeded]
    results = op.SequenceMap(*node.inputs, *seeds, body=graph, _outputs=len(targets))
    results = results if isinstance(results, tuple) else (results,)

    per_input = [None] * len(node.inputs)
    for k, g in zip(floats, results):
        per_input[k] = g if isinstance(node.inputs[k].type, ir.SequenceType) else _sum_elements(op, g)
    gradients: dict = {w: _sum_elements(op, g) for w, g in zip(wanted, results[len(floats):])}
    gradients["input_sequence"] = per_input[0]
    gradients["additional_inputs"] = per_input[1:]
    return gradients


@rule("Optional", differentiable=("input",), since=15)
def optional(op, node, dY):
    """Y = an optional holding the input: the gradient is the element of dY."""
    grad = op.OptionalGetElement(dY)
    grad.type = node.inputs[0].type
    return {"input": grad}


@rule("OptionalGetElement", differentiable=("input",), since=15)
def optional_get_element(op, node, dY):
    """Y = the element of an optional input (from opset 18 a tensor or sequence passes through)."""
    X = node.inputs[0]
    if isinstance(X.type, ir.OptionalType):
        grad = op.Optional(dY)
        grad.type = X.type
        return {"input": grad}
    return {"input": dY}
