"""Structural and indexing ops: each backward is the structural inverse (Transpose by the inverse
perm, Concat by Split, Slice by Pad or a scatter, Expand and Tile by a sum) or a scatter-add of dY
back to the positions it was read from (Gather, GatherElements, GatherND, Compress, Pad's reflect,
edge and wrap modes)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

# Shape vectors below are Python lists of ints when every dimension is known while the rule runs,
# else int64 values computed at run time from Shape, so one graph serves every batch size.


def _kept_rank(node: ir.Node, dY) -> int:
    """The rank of the node's first input, which its output and so dY share (known on any)."""
    for value in (node.inputs[0], node.outputs[0], dY):
        if value is not None and shapes.rank(value) is not None:
            return shapes.rank(value)
    return shapes.known_rank(node.inputs[0])


def _dims(op, x, start: int, end: int):
    """x's dimensions start:end: a list when static, else a 1-D int64 value."""
    known = shapes.dims(x)
    if end <= start:
        return []
    if known is not None and all(isinstance(d, int) for d in known[start:end]):
        return list(known[start:end])
    return shapes.shape_between(op, x, start, end)


def _scalar_extent(op, x, axis: int):
    """x's extent along axis: an int when static, else a scalar int64 value (where
    :func:`shapes.extent` gives a 1-element one)."""
    known = shapes.dims(x)
    if known is not None and isinstance(known[axis], int):
        return known[axis]
    return op.Gather(op.Shape(x), axis)


def _cat(op, *parts):
    """Concatenate shape pieces (lists and 1-D int64 values)."""
    if all(isinstance(p, list) for p in parts):
        return [d for p in parts for d in p]
    values = [op.const(np.array(p, np.int64)) if isinstance(p, list) else p for p in parts if
              not (isinstance(p, list) and not p)]
    return values[0] if len(values) == 1 else op.Concat(*values, axis=0)


def _reshape_to(op, g, x):
    """g reshaped to x's shape (static when known, else Shape(x))."""
    shape = shapes.static_shape(x)
    if op.opset < 5:
        if shape is None:
            raise RuleError("Reshape before opset 5 takes a static shape; x's shape is not static")
        return op.Reshape(g, shape=list(shape))
    if shape is not None and op.opset >= 9:  # Constant holds int64 from opset 9
        return op.Reshape(g, list(shape), allowzero=1 if 0 in shape and op.opset >= 14 else None)
    # A run-time shape may hold a real 0 dimension, which must not mean "copy".
    return op.Reshape(g, op.Shape(x), allowzero=1 if op.opset >= 14 else None)


def _arange(op, d):
    """0, 1, ..., d-1 as int64 (d an int or a scalar int64 value)."""
    return op.const(np.arange(d, dtype=np.int64)) if isinstance(d, int) else op.Range(0, d, 1)


def _scatter_axis(op, g, idx, d, axis: int, rank: int, add: bool):
    """out[.., idx[i], ..] (+)= g[.., i, ..] along axis, out's extent there being d (int or scalar).

    Repeated indices sum (add=True): ScatterElements/ScatterND with reduction="add" from opset
    16, before that a one-hot matrix product.
    """
    if not add or not isinstance(d, int):
        shapes.require_opset(op, 11, "this gradient")
    if op.opset >= 16 or not add:
        shape_g = op.Shape(g)
        d_vec = [d] if isinstance(d, int) else op.Reshape(d, [1])
        head = op.Slice(shape_g, [0], [axis]) if axis > 0 else []
        tail = op.Slice(shape_g, [axis + 1], [rank]) if axis + 1 < rank else []
        zeros = shapes.zeros(op, g, _cat(op, head, d_vec, tail))
        reduction = "add" if add else None
        if axis == 0:
            return op.ScatterND(zeros, op.unsqueeze(idx, [1]), g, reduction=reduction)
        index = op.Expand(op.Reshape(idx, [1] * axis + [-1] + [1] * (rank - axis - 1)), shape_g)
        return op.ScatterElements(zeros, index, g, axis=axis, reduction=reduction)
    if g.dtype is None:
        raise RuleError("the one-hot scatter-add used before opset 16 needs the gradient's dtype")
    hot = op.Cast(op.Equal(op.unsqueeze(idx, [1]), _arange(op, d)), to=g.dtype)
    if axis == rank - 1:
        return op.MatMul(g, hot)
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = op.MatMul(op.Transpose(g, perm=perm), hot)
    return op.Transpose(moved, perm=shapes.inverse_perm(perm))


def _flat_index(op, indices, d):
    """indices flattened to 1-D int64 with negatives wrapped by d."""
    known = shapes.constant(indices)
    if known is not None and (isinstance(d, int) or np.all(known >= 0)):
        flat = known.reshape(-1).astype(np.int64)
        return op.const(np.where(flat < 0, flat + (d if isinstance(d, int) else 0), flat))
    flat = op.Reshape(op.Cast(indices, to=ir.DataType.INT64), [-1])
    if op.opset >= 10:
        return op.Mod(flat, d)  # integer Mod takes the divisor's sign: [-d, d) maps onto [0, d)
    if op.opset >= 9:
        return op.Where(op.Less(flat, 0), op.Add(flat, d), flat)
    # No Where, and Less takes floats only, before opset 9: add d times the negativity mask.
    negative = op.Cast(op.Less(op.Cast(flat, to=ir.DataType.FLOAT), 0.0), to=ir.DataType.INT64)
    return op.Add(flat, op.Mul(negative, d))


def _pad(op, x, pads, mode: str, axes=None):
    if op.opset < 11:
        return op.Pad(x, pads=list(pads), mode=mode)
    return op.Pad(x, pads, None, axes, mode=mode)


# --- Pure rearrangements ---------------------------------------------------------------------


@rule("Reshape", differentiable=("data",))
def reshape(op, node, dY):
    """Y = X with a new shape; dX = Reshape(dY, Shape(X))"""
    return {"data": _reshape_to(op, dY, node.inputs[0])}


@rule("Flatten", differentiable=("input",))
def flatten(op, node, dY):
    """Y = X as 2-D (dims before axis, dims after); dX = Reshape(dY, Shape(X))"""
    return {"input": _reshape_to(op, dY, node.inputs[0])}


@rule("Squeeze", differentiable=("data",))
def squeeze(op, node, dY):
    """Y = X without the 1-sized axes (all of them if none given); dX = Unsqueeze(dY, axes)"""
    axes = shapes.axes(node)
    if axes is None:
        return {"data": _reshape_to(op, dY, node.inputs[0])}
    return {"data": op.unsqueeze(dY, axes)}


@rule("Unsqueeze", differentiable=("data",))
def unsqueeze(op, node, dY):
    """Y = X with 1-sized axes inserted; dX = Squeeze(dY, axes)"""
    return {"data": op.squeeze(dY, shapes.axes(node))}


@rule("Transpose", differentiable=("data",))
def transpose(op, node, dY):
    """Y = X with axes permuted (reversed by default); dX = Transpose(dY, inverse perm)"""
    perm = shapes.attr(node, "perm")
    return {"data": op.Transpose(dY, perm=None if perm is None else shapes.inverse_perm(perm))}


@rule("DepthToSpace", differentiable=("input",))
def depth_to_space(op, node, dY):
    """Y = channel blocks moved into b×b spatial blocks (DCR or CRD order)"""
    X = node.inputs[0]
    b = shapes.attr(node, "blocksize")
    if shapes.attr(node, "mode", "DCR") == "DCR":
        return {"input": op.SpaceToDepth(dY, blocksize=b)}
    # CRD: Y = reshape(transpose(reshape(X, [N, C/b², b, b, H, W]), [0, 1, 4, 2, 5, 3]), ...)
    g = op.Reshape(dY, _cat(op, [0, 0, -1, b], _dims(op, X, 3, 4), [b]))
    g = op.Transpose(g, perm=[0, 1, 3, 5, 2, 4])
    return {"input": _reshape_to(op, g, X)}


@rule("SpaceToDepth", differentiable=("input",))
def space_to_depth(op, node, dY):
    """Y = b×b spatial blocks moved into channels; dX = DepthToSpace(dY) in the same order (DCR or,
    from opset 28, CRD): the two ops invert each other."""
    mode = shapes.attr(node, "mode", "DCR")
    return {"input": op.DepthToSpace(dY, blocksize=shapes.attr(node, "blocksize"), mode=None if mode == "DCR" else mode)}


@rule("ReverseSequence", differentiable=("input",))
def reverse_sequence(op, node, dY):
    """Y = each batch entry's first sequence_lens steps reversed; an involution, dX = the same op"""
    return {"input": op.ReverseSequence(
        dY, node.inputs[1],
        batch_axis=shapes.attr(node, "batch_axis", 1), time_axis=shapes.attr(node, "time_axis", 0))}


# --- Joining and cutting ---------------------------------------------------------------------


@rule("Concat", differentiable=("inputs",))
def concat(op, node, dY):
    """Y = inputs joined along axis; dX_i = Split(dY, input sizes)[i]"""
    inputs = list(node.inputs)
    axis = shapes.attr(node, "axis", 1)
    axis = axis if axis >= 0 else shapes.normalize_axis(axis, _kept_rank(node, dY))
    if len(inputs) == 1:
        return {"inputs": [dY]}
    sizes = _cat(op, *(_dims(op, x, axis, axis + 1) for x in inputs))
    if isinstance(sizes, ir.Value):  # the inputs' extents along the Concat axis are not static
        shapes.require_opset(op, 13, "splitting the gradient by run-time sizes")
    return {"inputs": list(op.split(dY, sizes, axis, count=len(inputs)))}


@rule("Split", differentiable=("input",))
def split(op, node, *dYs):
    """Y_i = consecutive chunks of X along axis; dX = Concat(dY_i, zeros for unused outputs)"""
    parts = [g if g is not None else shapes.zeros(op, y) for g, y in zip(dYs, node.outputs)]
    return {"input": op.Concat(*parts, axis=shapes.attr(node, "axis", 0))}


def _slice_params(op, node):
    """Slice's (starts, ends, axes, steps) as inputs (None if absent) and as lists (None if not
    constant); absent axes and steps take their defaults."""
    if op.opset < 10:
        starts, ends, axes = (shapes.attr(node, k) for k in ("starts", "ends", "axes"))
        return [None] * 4, [starts, ends, axes or list(range(len(starts))), [1] * len(starts)]
    values = [node.inputs[i] if len(node.inputs) > i else None for i in range(1, 5)]
    known = [None if v is None else shapes.constant(v) for v in values]
    known = [None if k is None else [int(i) for i in k.reshape(-1)] for k in known]
    count = (shapes.static_shape(values[0]) or [None])[0]
    if count is not None:
        known[2] = list(range(count)) if values[2] is None else known[2]
        known[3] = [1] * count if values[3] is None else known[3]
    return values, known


@rule("Slice", differentiable=("data",))
def slice_(op, node, dY):
    """Y = X[starts:ends:steps] on axes; dX = dY put back into zeros (a Pad for unit steps)"""
    X = node.inputs[0]
    values, (starts, ends, axes, steps) = _slice_params(op, node)
    if axes is None or all(shapes.rank(v) is None for v in (X, node.outputs[0], dY)):
        return {"data": _slice_by_positions(op, X, dY, values)}
    r = _kept_rank(node, dY)
    dims = shapes.dims(X) or (None,) * r
    axes = [shapes.normalize_axis(a, r) for a in axes]
    static = None not in (starts, ends, steps) and all(isinstance(dims[a], int) for a in axes)
    if static:
        ranges = {a: range(*slice(*p).indices(dims[a])) for a, *p in zip(axes, starts, ends, steps)}
        if all(rg.step == 1 for rg in ranges.values()):
            pads = [0] * (2 * r)
            for a, rg in ranges.items():
                pads[a], pads[a + r] = rg.start, dims[a] - max(rg.stop, rg.start)
            return {"data": _pad(op, dY, pads, "constant")}
    shapes.require_opset(op, 11, "this Slice gradient")
    g = dY
    for i, a in enumerate(axes):
        d = _scalar_extent(op, X, a)
        if static:
            idx = op.const(np.array(list(ranges[a]), np.int64))
        else:
            # The same slice applied to arange(d) yields exactly the positions it read. Axes
            # given: onnxruntime 1.32 drops a Slice without axes from 0 to INT64_MAX as a no-op,
            # whatever its steps.
            pick = [None if v is None else op.Cast(op.Gather(v, [i]), to=int(ir.DataType.INT64)) for v in values]
            idx = op.Slice(_arange(op, d), pick[0], pick[1], [0], pick[3])
        g = _scatter_axis(op, g, idx, d, a, r, add=False)
    return {"data": g}


def _slice_by_positions(op, X, dY, values):
    """Slice's gradient where its axes (or X's rank) are known only at run time: the same slice
    of X's flat positions says where each element of dY came from."""
    shapes.require_opset(op, 11, "the gradient of a Slice whose axes are only known at run time")
    x_shape = op.Shape(X)
    positions = op.Reshape(op.Range(0, op.ReduceProd(x_shape, keepdims=0), 1), x_shape)
    picked = op.Reshape(op.Slice(positions, *values), [-1])
    flat = op.ScatterElements(shapes.zeros(op, dY, op.ReduceProd(x_shape, keepdims=1)), picked,
                              op.Reshape(dY, [-1]), axis=0)
    return op.Reshape(flat, x_shape)


@rule("Pad", differentiable=("data", "constant_value"))
def pad(op, node, dY):
    """Y = X padded by a constant, a reflection, the edge value or wrapping around.

    Constant mode: dX = Pad(dY, -pads) (negative pads crop), d(constant_value) = the sum of dY
    over the padding. Other modes: Y reads X through one index map per axis, whose adjoint
    scatter-adds dY; the map is the same Pad applied to arange(d).
    """
    X = node.inputs[0]
    mode = shapes.attr(node, "mode", "constant")
    axes = None
    if op.opset < 11:
        pads = shapes.attr(node, "pads", shapes.attr(node, "paddings"))
    else:
        known = shapes.constant(node.inputs[1])
        pads = node.inputs[1] if known is None else [int(p) for p in known]
        axes = shapes.axes(node, 3)
    if mode == "constant":
        dX = _pad(op, dY, [-p for p in pads] if isinstance(pads, list) else op.Neg(pads), mode,
                  axes)
        grads = {"data": dX}
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            padding = op.Sub(op.ReduceSum(dY, keepdims=0), op.ReduceSum(dX, keepdims=0))
            grads["constant_value"] = op.Reshape(padding, op.Shape(node.inputs[2]))
        return grads
    r = shapes.known_rank(X)
    if isinstance(axes, ir.Value):
        pads, axes = _pads_of_every_axis(op, pads, axes, r), None
    axes = list(range(r)) if axes is None else [shapes.normalize_axis(a, r) for a in axes]
    g = dY
    for i, a in enumerate(axes):
        if isinstance(pads, list):
            if pads[i] == 0 and pads[i + len(axes)] == 0:
                continue
            pads_a = [pads[i], pads[i + len(axes)]]
        else:
            pads_a = op.Gather(pads, [i, i + len(axes)])
        d = _scalar_extent(op, X, a)
        if op.opset >= 11:
            idx = _pad(op, _arange(op, d), pads_a, mode)
        elif isinstance(d, int):  # Pad-2 has float kernels only
            arange = op.const(np.arange(d, dtype=np.float32))
            idx = op.Cast(_pad(op, arange, pads_a, mode), to=ir.DataType.INT64)
        else:
            shapes.require_opset(op, 11, f"Pad with mode {mode} on a dynamic axis")
        g = _scatter_axis(op, g, idx, d, a, r, add=True)
    return {"data": g}


def _pads_of_every_axis(op, pads, axes: ir.Value, r: int) -> ir.Value:
    """Pads given for ``axes`` known only at run time, as the pads of all r axes (0 elsewhere)."""
    at = op.Mod(op.Cast(axes, to=int(ir.DataType.INT64)), [r])  # negative axes count from the end
    return op.ScatterElements(op.const(np.zeros(2 * r, np.int64)), op.Concat(at, op.Add(at, [r]), axis=0),
                              pads, axis=0)


@rule("Expand", differentiable=("input",))
def expand(op, node, dY):
    """Y = X broadcast to a shape; dX = dY summed over the broadcast axes"""
    return {"input": shapes.unbroadcast(op, dY, node.inputs[0], node.outputs[0])}


@rule("Tile", differentiable=("input",), since=6)
def tile(op, node, dY):
    """Y = X repeated; dX = ReduceSum over r of dY reshaped to (r0, d0, r1, d1, ...)"""
    X, repeats = node.inputs
    r = next((shapes.rank(v) for v in (X, node.outputs[0], dY) if shapes.rank(v) is not None), None)
    r = r if r is not None else (shapes.static_shape(repeats) or [None])[0]
    reps, shape = shapes.constant(repeats), shapes.static_shape(X)
    if reps is not None and shape is not None:
        target = [int(v) for pair in zip(reps.tolist(), shape) for v in pair]
    else:
        pairs = op.Concat(op.unsqueeze(repeats, [1]), op.unsqueeze(op.Shape(X), [1]), axis=1)
        target = op.Reshape(pairs, [-1])
    g = op.Reshape(dY, target)
    if r is None:  # the repeats' axes, every other one, counted at run time
        shapes.require_opset(op, 13, f"the gradient of Tile of '{X.name}', whose rank is only known at run time,")
        return {"input": op.ReduceSum(g, op.Range(0, op.Size(target), 2), keepdims=0)}
    return {"input": op.reduce_sum(g, list(range(0, 2 * r, 2)), keepdims=False)}


# --- Selection -------------------------------------------------------------------------------


@rule("Where", differentiable=("X", "Y"), broadcast=True)
def where(op, node, dY):
    """Out = condition ? X : Y"""
    C = node.inputs[0]
    return {"X": op.Where(C, dY, 0.0), "Y": op.Where(C, 0.0, dY)}


@rule("Trilu", differentiable=("input",))
def trilu(op, node, dY):
    """Y = the upper or lower triangle of X (offset k), zeros elsewhere; dX = the same mask of dY"""
    k = node.inputs[1] if len(node.inputs) > 1 else None
    return {"input": op.Trilu(dY, k, upper=shapes.attr(node, "upper", 1))}


@rule("CumSum", differentiable=("x",))
def cumsum(op, node, dY):
    """Y = running sum along axis; dX = the running sum of dY in the other direction"""
    return {"x": op.CumSum(dY, node.inputs[1], exclusive=shapes.attr(node, "exclusive", 0),
                           reverse=1 - shapes.attr(node, "reverse", 0))}


@rule("Gather", differentiable=("data",))
def gather(op, node, dY):
    """Y = X indexed by indices along axis; dX scatter-adds dY there (repeated indices sum)"""
    X, indices = node.inputs
    r = shapes.rank(X)
    if r is None and shapes.rank(indices) is not None and shapes.rank(dY) is not None:
        r = shapes.rank(dY) - shapes.rank(indices) + 1  # Y's axes: X's with the one gathered replaced by indices'
    if r is None:
        return {"data": _gather_any_rank(op, X, indices, dY, shapes.attr(node, "axis", 0))}
    a = shapes.normalize_axis(shapes.attr(node, "axis", 0), r)
    d = _scalar_extent(op, X, a)
    g = op.Reshape(dY, _cat(op, _dims(op, X, 0, a), [-1], _dims(op, X, a + 1, r)))
    return {"data": _scatter_axis(op, g, _flat_index(op, indices, d), d, a, r, add=True)}


def _gather_any_rank(op, X, indices, dY, a: int):
    """Gather's gradient where X's rank is known only at run time: X viewed as (before, d, after)
    around the gathered axis, dY as (before, indices, after), scattered along the middle axis."""
    shapes.require_opset(op, 11, f"the gradient of Gather from '{X.name}', whose rank is only known at run time,")
    x_shape = op.Shape(X)
    after = [a + 1] if a != -1 else [np.iinfo(np.int64).max]
    d = op.Squeeze(op.Slice(x_shape, [a], after)) if op.opset < 13 else op.Squeeze(op.Slice(x_shape, [a], after), [0])
    sizes = [op.ReduceProd(op.Slice(x_shape, [0], [a]), keepdims=1), [-1],
             op.ReduceProd(op.Slice(x_shape, after, [np.iinfo(np.int64).max]), keepdims=1)]
    g = op.Reshape(dY, _cat(op, *sizes))
    return op.Reshape(_scatter_axis(op, g, _flat_index(op, indices, d), d, 1, 3, add=True), x_shape)


@rule("GatherElements", differentiable=("data",))
def gather_elements(op, node, dY):
    """Y[i][j] = X[indices[i][j]][j] (for axis 0); dX = ScatterElements-add of dY into zeros
    (before opset 16, a one-hot weighted sum)"""
    X, indices = node.inputs
    axis = shapes.attr(node, "axis", 0)
    if op.opset >= 16:
        return {"data": op.ScatterElements(shapes.zeros(op, X), indices, dY, axis=axis,
                                           reduction="add")}
    # No scatter-add yet: compare each index with arange(d) on a new axis after `axis`, weigh
    # dY by that one-hot mask and sum over the gathered axis.
    r = shapes.rank(X) or shapes.rank(indices) or shapes.known_rank(dY, "the gradient")
    a = shapes.normalize_axis(axis, r)
    d = _scalar_extent(op, X, a)
    idx = op.Cast(indices, to=ir.DataType.INT64)
    idx = op.Where(op.Less(idx, 0), op.Add(idx, d), idx)
    positions = op.Reshape(_arange(op, d), [1] * (a + 1) + [-1] + [1] * (r - a - 1))
    hot = shapes.cast_like(op, op.Equal(op.unsqueeze(idx, [a + 1]), positions), dY, X)
    g = op.reduce_sum(op.Mul(op.unsqueeze(dY, [a + 1]), hot), [a], keepdims=False)
    x_dims, i_dims = shapes.dims(X), shapes.dims(indices)
    if x_dims is not None and i_dims is not None and all(
            k == a or (isinstance(m, int) and m == n) for k, (m, n) in enumerate(zip(x_dims, i_dims))):
        return {"data": g}
    # indices may be shorter than X on the other axes: X's positions never read get zeros.
    short = op.Sub(op.Shape(X), op.Shape(g))
    return {"data": _pad(op, g, op.Concat(op.const(np.zeros(r, np.int64)), short, axis=0), "constant")}


@rule("GatherND", differentiable=("data",))
def gather_nd(op, node, dY):
    """Y = X at the index tuples in indices' last axis (after batch_dims shared leading axes);
    dX = ScatterND-add of dY into zeros, the batch coordinates prepended to each tuple (before
    opset 16, a one-hot matrix product)"""
    X, indices = node.inputs
    b = shapes.attr(node, "batch_dims", 0)
    k = (shapes.dims(indices) or [None])[-1]
    if not isinstance(k, int):  # the tuples' length, known at run time: ScatterND reads it there
        shapes.require_opset(op, 16, "the gradient of GatherND whose index tuples' length is only known at run time")
    idx = indices
    if shapes.constant(indices) is None or np.any(shapes.constant(indices) < 0):
        if isinstance(k, int):
            extent = _dims(op, X, b, b + k)
        else:
            length = op.Slice(op.Shape(indices), [-1], [np.iinfo(np.int64).max])
            extent = op.Slice(op.Shape(X), [b], op.Add(length, [b]))
        idx = op.Where(op.Less(indices, 0), op.Add(indices, extent), indices)
    if b:
        q = shapes.known_rank(indices, "the indices")
        grid_shape = _cat(op, _dims(op, indices, 0, q - 1), [1])
        grids = []
        for j in range(b):
            column = op.Reshape(_arange(op, _scalar_extent(op, indices, j)), [1] * j + [-1] + [1] * (q - 1 - j))
            grids.append(op.Expand(column, grid_shape))
        idx = op.Concat(*grids, idx, axis=-1)
    if op.opset >= 16:
        return {"data": op.ScatterND(shapes.zeros(op, X), idx, dY, reduction="add")}
    return {"data": _scatter_nd_add_onehot(op, X, idx, dY, b + k)}


def _scatter_nd_add_onehot(op, X, idx, g, n: int):
    """ScatterND-add of g into zeros like X at the n-tuples idx (non-negative), before opset 16:
    each tuple becomes a linear index p into X's first n axes, and dX = onehot(p)ᵀ · g, with g
    and dX flattened to (tuples, rest) and (positions, rest)."""
    linear, positions = op.Gather(idx, 0, axis=-1), _scalar_extent(op, X, 0)
    for j in range(1, n):
        d = _scalar_extent(op, X, j)
        linear = op.Add(op.Mul(linear, d), op.Gather(idx, j, axis=-1))
        positions = positions * d if isinstance(positions, int) and isinstance(d, int) else op.Mul(positions, d)
    hot = shapes.cast_like(op, op.Equal(op.Reshape(linear, [-1, 1]), op.Reshape(_arange(op, positions), [1, -1])), g, X)
    r = shapes.known_rank(X)
    rest = _dims(op, X, n, r)
    rest = [int(np.prod(rest))] if isinstance(rest, list) else op.ReduceProd(rest, keepdims=1)
    flat = op.MatMul(op.Transpose(hot, perm=[1, 0]), op.Reshape(g, _cat(op, [-1], rest)))
    return _reshape_to(op, flat, X)


@rule("Compress", differentiable=("input",))
def compress(op, node, dY):
    """Y = the slices of X (flattened if no axis) where condition is true; dX scatters dY back"""
    X, condition = node.inputs
    shapes.require_opset(op, 11, "the Compress gradient")
    idx = op.Reshape(op.NonZero(condition), [-1])
    axis = shapes.attr(node, "axis")
    if axis is None:
        shape = shapes.static_shape(X)
        n = int(np.prod(shape)) if shape is not None else op.Size(X)
        return {"input": _reshape_to(op, _scatter_axis(op, dY, idx, n, 0, 1, add=False), X)}
    r = shapes.known_rank(X)
    a = shapes.normalize_axis(axis, r)
    return {"input": _scatter_axis(op, dY, idx, _scalar_extent(op, X, a), a, r, add=False)}
