"""Shape and axis helpers shared by every rule family and by the engine's broadcast reduction
(shape inference is :mod:`onnx_autodiff.toolkit.inference`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import OpsetTooOldError, RuleError
from onnx_autodiff.toolkit.builder import OpBuilder

Dim = int | str | None


def require_opset(op: OpBuilder, needed: int, why: str) -> None:
    """Refuse, naming ``why``, when the model's default-domain opset is below ``needed`` (the passes
    then convert the model to ``needed``)."""
    if op.opset < needed:
        raise OpsetTooOldError(f"{why} needs opset {needed} or later (the model has {op.opset})", needed)


def dims(value: ir.Value | None) -> tuple[Dim, ...] | None:
    """The value's shape as ints (static), strings (symbolic) and None (unknown); None if no rank
    (or no value: an omitted optional input)."""
    if value is None or value.shape is None:
        return None
    out: list[Dim] = []
    for d in value.shape.dims:
        if isinstance(d, int):
            out.append(d)
        else:
            out.append(d.value if d.value else None)
    return tuple(out)


def static_shape(value: ir.Value) -> tuple[int, ...] | None:
    """The shape when every dimension is a known integer, else None."""
    shape = dims(value)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return shape  # type: ignore[return-value]


def rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def known_rank(value: ir.Value, what: str = "input") -> int:
    """The value's rank, which the rule needs: a RuleError naming the value when it is unknown."""
    r = rank(value)
    if r is None:
        raise RuleError(f"the rank of {what} '{value.name}' is unknown; run shape inference first")
    return r


def attr(node: ir.Node, name: str, default=None):
    """An attribute's Python value (lists for repeated fields), or ``default``."""
    attribute = node.attributes.get(name)
    if attribute is None:
        return default
    value = attribute.value
    if attribute.type in _REPEATED:
        return list(value)
    return value


_REPEATED = frozenset({
    ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS,
    ir.AttributeType.TENSORS, ir.AttributeType.GRAPHS,
})


def extent(op: OpBuilder, x: ir.Value, axis: int):
    """x's extent along ``axis``: an int when static, else a 1-element int64 value."""
    d = dims(x)
    if d is not None and isinstance(d[axis], int):
        return d[axis]
    if op.opset < 10:  # (Slice took starts and ends as attributes)
        return op.Gather(op.Shape(x), [axis])
    return op.Slice(op.Shape(x), [axis], [axis + 1])


def shape_between(op: OpBuilder, x: ir.Value, start: int, end: int) -> ir.Value:
    """x's dimensions start:end, a 1-D int64 value computed at run time (Shape's own start and
    end from opset 15)."""
    if op.opset >= 15:
        return op.Shape(x, start=start, end=end)
    return op.Slice(op.Shape(x), [start], [end])


def shape_from(op: OpBuilder, *parts):
    """An int64 shape from ints and 1-element int64 values (a list when all are ints)."""
    if all(isinstance(p, int) for p in parts):
        return list(parts)
    return op.Concat(*(op.const(np.array([p], np.int64)) if isinstance(p, int) else p for p in parts), axis=0)


def normalize_axis(axis: int, rank_: int) -> int:
    return axis + rank_ if axis < 0 else axis


def inverse_perm(perm: Sequence[int]) -> list[int]:
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def swap_last2(op: OpBuilder, x: ir.Value, rank_: int) -> ir.Value:
    perm = list(range(rank_))
    perm[-2:] = perm[-1], perm[-2]
    return op.Transpose(x, perm=perm)


def constant(value: ir.Value | None, *, computed: bool = True) -> np.ndarray | None:
    """The numpy value of ``value`` when it is known before run time, else None.

    Initializers and Constant outputs, and with ``computed`` (the rules' reading) also Shape and
    Size of a statically shaped value, the output of an If whose condition is known, and small
    computations over those (unoptimised exports compute axes, pads and shapes with
    Reshape/Concat/Gather of constants): evaluated here, never folded into the graph. The cleanup
    reads with ``computed=False``: it folds computed constants itself, and evaluating them in its
    checks would cost every round.
    """
    return _computed(value, depth=0) if computed else _stored(value)


def number(value: ir.Value | None) -> bool | int | float | None:
    """The one number ``value`` holds before run time (a constant of one element, as
    :func:`constant` reads it) as a Python number of its dtype's kind; None otherwise."""
    array = constant(value)
    return None if array is None or array.size != 1 else array.reshape(()).item()


def axes(node: ir.Node, index: int = 1, *, computed: bool = True) -> list[int] | ir.Value | None:
    """The axes ``node`` is given: its input ``index`` (from opset 13; Reduce* but ReduceSum: 18),
    else its ``axes`` attribute. Ints when known before run time (read as :func:`constant`
    reads), the input itself when only the run knows them, None when the node has neither."""
    if len(node.inputs) > index and node.inputs[index] is not None:
        given = node.inputs[index]
        array = constant(given, computed=computed)
        return given if array is None else [int(a) for a in array.reshape(-1)]
    listed = attr(node, "axes")
    return None if listed is None else [int(a) for a in listed]


_MAX_FOLDED_ELEMENTS = 4096
_NEVER_FOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                           "Multinomial", "Bernoulli", "Dropout"})


def _stored(value: ir.Value | None) -> np.ndarray | None:
    """The value's array when it is an initializer or a Constant's output (not one computed from
    them) and its data is there; None otherwise."""
    if value is None:
        return None
    tensor = value.const_value
    try:
        if tensor is None:
            node = value.producer()
            if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
                return None
            attribute = node.attributes.get("value") if len(node.attributes) == 1 else None
            # the tensor attribute read directly: get_const_tensor's protocol check of it costs
            # more than the rest of a cleanup round's analysis
            tensor = attribute.value if attribute is not None else ir.convenience.get_const_tensor(value)
        return None if tensor is None else tensor.numpy()
    except (OSError, ValueError):  # external data that is not there, a malformed Constant
        return None


def _computed(value: ir.Value | None, depth: int) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return _stored(value)
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx") or depth > 12:
        return None
    if producer.op_type == "Constant":
        return _stored(value)
    if producer.op_type == "Shape":
        shape = dims(producer.inputs[0])
        if shape is None:
            return None
        picked = shape[attr(producer, "start", 0):attr(producer, "end", None)]
        return np.asarray(picked, np.int64) if all(isinstance(d, int) for d in picked) else None
    if producer.op_type == "Size":
        shape = static_shape(producer.inputs[0])
        return None if shape is None else np.asarray(int(np.prod(shape, dtype=np.int64)), np.int64)
    if producer.op_type == "If":
        # A condition known before run time picks the branch whose output this is.
        cond = _computed(producer.inputs[0], depth + 1)
        if cond is None or cond.size != 1:
            return None
        branch = attr(producer, "then_branch" if bool(cond.reshape(())) else "else_branch")
        return _computed(branch.outputs[list(producer.outputs).index(value)], depth + 1)
    if producer.op_type in _NEVER_FOLDED or any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in producer.attributes.values()
    ):
        return None
    arrays = []
    for given in producer.inputs:
        array = None if given is None else _computed(given, depth + 1)
        if given is not None and (array is None or array.size > _MAX_FOLDED_ELEMENTS):
            return None
        arrays.append(array)
    return _evaluate(producer, arrays, value)


def _evaluate(node: ir.Node, arrays: list, wanted: ir.Value) -> np.ndarray | None:
    from onnx.reference import ReferenceEvaluator  # here: heavy to import, and only computed constants need it

    names = [f"in{i}" if a is not None else "" for i, a in enumerate(arrays)]
    outputs = [f"out{i}" for i in range(len(node.outputs))]
    proto = ir.serde.serialize_node(node)
    del proto.input[:], proto.output[:]
    proto.input.extend(names)
    proto.output.extend(outputs)
    version = node.graph.opset_imports.get("", None) if node.graph is not None else None
    try:
        evaluator = ReferenceEvaluator(proto, opsets={"": version} if version else None)
        results = evaluator.run(None, {n: a for n, a in zip(names, arrays) if n})
    except Exception:  # noqa: BLE001 - not evaluable here: the rule takes its run-time path
        return None
    result = np.asarray(results[list(node.outputs).index(wanted)])
    return result if result.size <= _MAX_FOLDED_ELEMENTS else None


def cast_like(op: OpBuilder, value: ir.Value, *likes: ir.Value) -> ir.Value:
    """``value`` in the dtype of the first of ``likes`` whose dtype is known (no node when it has
    that dtype already); CastLike of the first when none is known, which needs opset 15."""
    dtype = next((v.dtype for v in likes if v.dtype is not None), None)
    if dtype is None:
        require_opset(op, 15, "a cast to a dtype unknown until run time (CastLike)")
        return op.CastLike(value, likes[0])
    return value if value.dtype == dtype else op.Cast(value, to=int(dtype))


def typed_like(values: Sequence[ir.Value], likes: Sequence[ir.Value]) -> Sequence[ir.Value]:
    """Give each of ``values`` the type and shape of its counterpart in ``likes`` (new values of
    the same tensors, as a subgraph's or an If's outputs); returns ``values``."""
    for value, like in zip(values, likes):
        value.type, value.shape = like.type, like.shape
    return values


def fill_like(op: OpBuilder, x: ir.Value, fill: float, shape: ir.Value | None = None) -> ir.Value:
    """A tensor of x's dtype filled with ``fill``, of x's shape or of ``shape`` (an int64 shape
    value; then only ``op.<OpType>`` calls are made, which the cleanup's rewriter tape takes too)."""
    if shape is None:
        static = static_shape(x)
        if x.dtype is not None and static is not None and int(np.prod(static)) <= 1:
            return op.const(np.full(static, fill), dtype=x.dtype)
        shape = op.Shape(x)
    if x.dtype is not None:
        return op.ConstantOfShape(shape, value=ir.Tensor(np.array([fill], x.dtype.numpy())))
    filled = op.ConstantOfShape(shape, value=ir.Tensor(np.array([fill], np.float32)))
    return op.CastLike(filled, x)


def zeros(op: OpBuilder, like: ir.Value, shape: ir.Value | None = None) -> ir.Value:
    """Zeros of ``like``'s dtype, and of its shape or of ``shape`` (see :func:`fill_like`)."""
    return fill_like(op, like, 0.0, shape)


zeros_like = zeros  # the name the design card gives rule writers


def ones_like(op: OpBuilder, x: ir.Value) -> ir.Value:
    return fill_like(op, x, 1.0)


def accumulate(op: OpBuilder, contributions: Sequence[ir.Value], like: ir.Value | None = None) -> ir.Value:
    """One value for the sum: itself, an Add of two, a Sum of more; sequences add elementwise."""
    if len(contributions) == 1:
        return contributions[0]
    if like is not None and isinstance(like.type, ir.SequenceType):
        total = contributions[0]
        element = like.type.elem_type
        for other in contributions[1:]:
            total = op.SequenceMap(total, other, body=_pairwise_add(op, element))
        return total
    if len(contributions) == 2:
        return op.Add(*contributions)
    return op.Sum(*contributions)


def _pairwise_add(op: OpBuilder, element: ir.TypeProtocol) -> ir.Graph:
    body = op.child()
    a, b = (ir.Value(name=op.namer.fresh(), type=element) for _ in range(2))
    return body.graph([a, b], [body.Add(a, b)], name="add")


def alias(op: OpBuilder, value: ir.Value) -> ir.Value:
    """A new name for the same tensor (for graph outputs that must be distinct values)."""
    return op.Identity(value)


def unbroadcast(op: OpBuilder, grad: ir.Value, x: ir.Value, broadcast_like: ir.Value) -> ir.Value:
    """Sum ``grad`` (shaped like ``broadcast_like``) down to the shape of ``x``.

    Static axes when the shapes decide them, a run-time computation from Shape otherwise.
    """
    x_dims, y_dims = dims(x), dims(broadcast_like)
    if x_dims is not None and y_dims is not None and len(y_dims) >= len(x_dims):
        lead = len(y_dims) - len(x_dims)
        inner: list[int] = []
        decided = True
        for i, (xd, yd) in enumerate(zip(x_dims, y_dims[lead:])):
            if xd == yd and xd is not None:
                continue
            if xd == 1:
                inner.append(lead + i)
            elif not (isinstance(xd, int) and isinstance(yd, int)):
                decided = False
                break
        if decided:
            return _reduce_static(op, grad, list(range(lead)), inner)
    return _reduce_dynamic(op, grad, x, broadcast_like)


def _reduce_static(op: OpBuilder, grad: ir.Value, lead: list[int], inner: list[int]) -> ir.Value:
    if not lead and not inner:
        return grad
    if not inner:
        return op.reduce_sum(grad, lead, keepdims=False)
    summed = op.reduce_sum(grad, lead + inner, keepdims=True)
    return op.squeeze(summed, lead) if lead else summed


def _reduce_dynamic(op: OpBuilder, grad: ir.Value, x: ir.Value, like: ir.Value) -> ir.Value:
    """Axes where x (left-padded with ones) has extent 1, found at run time; then Reshape."""
    if op.opset < 13:
        return _reduce_dynamic_by_reshape(op, grad, x, like)
    grad_shape = op.Shape(grad)
    x_shape = op.Shape(x)
    pad_len = op.Sub(op.Shape(grad_shape), op.Shape(x_shape))
    ones = op.ConstantOfShape(pad_len, value=ir.Tensor(np.array([1], np.int64)))
    padded = op.Concat(ones, x_shape, axis=0)
    axes = op.Reshape(op.NonZero(op.Equal(padded, [1])), [-1])
    summed = op.ReduceSum(grad, axes, keepdims=1, noop_with_empty_axes=1)
    return op.Reshape(summed, x_shape)


def _reduce_dynamic_by_reshape(op: OpBuilder, grad: ir.Value, x: ir.Value, like: ir.Value) -> ir.Value:
    """The same for ReduceSum with axes as an attribute (before opset 13): with the ranks known,
    sum the leading axes, then view each remaining axis of extent y as (x, y / x) and sum the
    second part: x is 1 (broadcast, the whole axis sums) or y (nothing sums) at run time. Without
    the ranks, the passes convert the model to opset 13, where the axes are a run-time input."""
    rx, ry = rank(x), rank(like) if rank(grad) is None else rank(grad)
    if rx is None or ry is None:
        unknown = ", ".join(f"'{v.name}'" for v, r in ((x, rx), (like, ry)) if r is None)
        require_opset(op, 13, f"undoing a broadcast onto '{x.name}' from '{like.name}' along axes only "
                              f"known at run time, where the rank of {unknown} is unknown,")
    if ry < rx:
        raise RuleError(f"cannot undo a broadcast onto '{x.name}' (rank {rx}) from '{like.name}' "
                        f"(rank {ry}): the gradient has fewer axes than the value")
    if ry > rx:
        grad = op.reduce_sum(grad, list(range(ry - rx)), keepdims=False)
    if rx == 0:
        return grad
    x_shape, grad_shape = op.Shape(x), op.Shape(grad)
    # An empty x axis divides by 1 rather than by zero.
    divisor = op.Add(x_shape, op.Cast(op.Equal(x_shape, [0]), to=int(ir.DataType.INT64)))
    pairs = [op.unsqueeze(v, [1]) for v in (x_shape, op.Div(grad_shape, divisor))]
    split = op.Reshape(grad, op.Reshape(op.Concat(*pairs, axis=1), [-1]))
    return op.reduce_sum(split, list(range(1, 2 * rx, 2)), keepdims=False)
