"""Indexing ops: scatters, TopK, OneHot, Range, CumProd, CenterCropPad, TensorScatter, MaxUnpool,
Unique. Each backward reads dY at the positions the forward wrote (a gather) or puts it back at
the positions the forward read (a scatter into zeros).

Conventions where the forward is ill-defined or not smooth:
- Scatter*/MaxUnpool with duplicate indices and no reduction (ONNX leaves the winner
  unspecified; onnxruntime keeps the last write): every duplicate update receives the gradient
  of the position it targets, as PyTorch's scatter does; data is zeroed there.
- MaxUnpool with an output_shape larger than the inferred one: onnxruntime reads I as flat over
  the output, onnx.reference and the ONNX backend data over the inferred shape placed top-left;
  the rule follows onnxruntime (dX = dY.flat[I]).
- Scatter* reduction max/min: the gradient at a position is shared equally among the elements
  (data and updates) equal to the result, as in PyTorch's scatter_reduce amax/amin.
- Scatter* reduction mul: exact for a position written once; for a position written several
  times an update's partner product is Y/u, non-finite where such an update is 0.
- TopK: the gradient follows the Indices output, so ties go where the runtime put them.
- Range: the output length is piecewise constant in start, limit and delta; it is held fixed, so
  limit gets no gradient.
- CumProd: exact at zeros (no division by a zero element); differentiating that gradient again
  at an exact zero is not exact (entries after the first zero take a constant-0 branch).
- Unique: Y = X at the first occurrence of each value (the `indices` output), so a repeated value's
  gradient goes to its first occurrence; repeated values are not differentiable points anyway.
"""

from __future__ import annotations

import numpy as np

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.math import select
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes


# --- Scatters --------------------------------------------------------------------------------


def _scatter_grads(op, node, dY, gather, scatter):
    """The gradients of a scatter Y = data with updates combined in at the indices.

    ``gather(t)`` reads t at the scattered positions (shaped like updates); ``scatter(t, u, r)``
    writes u into t there with reduction r.
    """
    data, _, updates = node.inputs[:3]
    Y = node.outputs[0]
    reduction = shapes.attr(node, "reduction", "none")
    if reduction == "none":
        return {"data": scatter(dY, shapes.zeros(op, updates), None), "updates": gather(dY)}
    if reduction == "add":
        return {"data": dY, "updates": gather(dY)}
    if reduction == "mul":
        # Y = data·Πu: dData = dY·Πu; du = dY·data·Π(other u), just dY·data when u writes alone.
        writes = gather(scatter(shapes.zeros(op, data), shapes.ones_like(op, updates), "add"))
        alone = op.Equal(writes, 1.0)
        shared = op.Div(gather(op.Mul(dY, Y)), select(op, alone, 1.0, updates))
        return {"data": scatter(dY, updates, "mul"),
                "updates": select(op, alone, gather(op.Mul(dY, data)), shared)}
    if reduction in ("max", "min"):
        data_wins = shapes.cast_like(op, op.Equal(data, Y), data)
        update_wins = shapes.cast_like(op, op.Equal(updates, gather(Y)), updates)
        winners = op.Add(data_wins, scatter(shapes.zeros(op, data), update_wins, "add"))
        share = op.Div(dY, winners)
        return {"data": op.Mul(share, data_wins), "updates": op.Mul(gather(share), update_wins)}
    raise RuleError(f"{node.op_type} with reduction '{reduction}' has no gradient rule")


def _gather_elements_legacy(op, x, indices, axis: int, r: int):
    """GatherElements(x, indices, axis) before opset 11: a one-hot product over x's axis."""
    xd, idims = shapes.dims(x), shapes.dims(indices)
    d = None if xd is None else xd[axis]
    static = isinstance(d, int) and idims is not None and all(
        k == axis or n == m or isinstance(n, int) for k, (n, m) in enumerate(zip(idims, xd)))
    if not static:  # the one-hot form's size; GatherElements (opset 11) reads the shapes at run time
        shapes.require_opset(op, 11, f"a gather along an axis of '{x.name}' by '{indices.name}', of extents "
                                     "only known at run time,")
    ends = [m if k == axis or n == m else n for k, (n, m) in enumerate(zip(idims, xd))]
    if list(ends) != list(xd):
        x = op.slice(x, [0] * r, ends)
    indices = op.Where(op.Less(indices, 0), op.Add(indices, d), indices)
    hot = op.Cast(op.Equal(op.unsqueeze(indices, [r]), op.const(np.arange(d, dtype=np.int64))),
                  to=int(x.dtype))
    perm = [k for k in range(r) if k != axis] + [axis]
    moved = op.unsqueeze(op.Transpose(x, perm=perm), [axis])
    return op.reduce_sum(op.Mul(hot, moved), [r], keepdims=False)


@rule("ScatterElements", differentiable=("data", "updates"))
def scatter_elements(op, node, dY):
    """Y = data with updates written (or combined by reduction) at indices along axis"""
    indices = node.inputs[1]
    axis = shapes.attr(node, "axis", 0)
    return _scatter_grads(
        op, node, dY,
        lambda t: op.GatherElements(t, indices, axis=axis),
        lambda t, u, r: op.ScatterElements(t, indices, u, axis=axis, reduction=r))


@rule("Scatter", differentiable=("data", "updates"), since=9, until=10)
def scatter(op, node, dY):
    """Y = data with updates written at indices along axis (ScatterElements before opset 11;
    the checker rejects the deprecated Scatter from opset 11 on)"""
    data, indices = node.inputs[:2]
    r = shapes.known_rank(data, "data")
    axis = shapes.normalize_axis(shapes.attr(node, "axis", 0), r)
    return _scatter_grads(
        op, node, dY,
        lambda t: _gather_elements_legacy(op, t, indices, axis, r),
        lambda t, u, _: op.Scatter(t, indices, u, axis=axis))


@rule("ScatterND", differentiable=("data", "updates"))
def scatter_nd(op, node, dY):
    """Y = data with updates written (or combined by reduction) at the index tuples in indices"""
    indices = node.inputs[1]
    return _scatter_grads(
        op, node, dY,
        lambda t: op.GatherND(t, indices),
        lambda t, u, r: op.ScatterND(t, indices, u, reduction=r))


@rule("TensorScatter", differentiable=("past_cache", "update"))
def tensor_scatter(op, node, dY):
    """present = past_cache with update written along axis from write_indices[b] on (mod the
    axis length in circular mode); dpast = dY zeroed there, dupdate = dY read there"""
    past, update = node.inputs[:2]
    write = node.inputs[2] if len(node.inputs) > 2 else None
    r = shapes.known_rank(past, "past_cache")
    axis = shapes.normalize_axis(shapes.attr(node, "axis", -2), r)
    d_past = op.TensorScatter(dY, shapes.zeros(op, update), write, axis=axis,
                              mode=shapes.attr(node, "mode", "linear"))
    length = shapes.extent(op, update, axis)
    steps = (op.const(np.arange(length, dtype=np.int64)) if isinstance(length, int)
             else op.Range(0, op.squeeze(length, [0]), 1))
    pos = op.Reshape(steps, [1] * axis + [-1] + [1] * (r - axis - 1))
    if write is not None:
        pos = op.Add(pos, op.Reshape(write, [-1] + [1] * (r - 1)))
    if shapes.attr(node, "mode", "linear") == "circular":
        pos = op.Mod(pos, shapes.extent(op, past, axis))
    index = op.Expand(pos, op.Shape(update))
    return {"past_cache": d_past, "update": op.GatherElements(dY, index, axis=axis)}


@rule("MaxUnpool", differentiable=("X",))
def max_unpool(op, node, dY):
    """Y = zeros with Y.flat[I] = X (I flat over the whole output, as MaxPool's Indices);
    dX = dY.flat[I]"""
    return {"X": op.Gather(op.Reshape(dY, [-1]), node.inputs[1], axis=0)}


# --- Selections ------------------------------------------------------------------------------


@rule("TopK", differentiable=("X",))
def topk(op, node, dValues, dIndices=None):
    """Values, Indices = the k largest (smallest) entries along axis; dX = dValues put back at
    Indices into zeros"""
    if dValues is None:
        return {}
    X, I = node.inputs[0], node.outputs[1]
    axis = shapes.attr(node, "axis", -1)
    if op.opset < 9:
        raise RuleError(f"the TopK gradient needs a scatter, which appears at opset 9 (the model "
                        f"has {op.opset}): convert it with onnx.version_converter")
    put = op.Scatter if op.opset < 11 else op.ScatterElements
    return {"X": put(shapes.zeros(op, X), I, dValues, axis=axis)}


@rule("Unique", differentiable=("X",))
def unique(op, node, dY, *unused):
    """Y = the distinct values (or slices along axis) of X, i.e. X gathered at the first
    occurrences `indices`; dX = dY put back there into zeros"""
    if dY is None:
        return {}
    X = node.inputs[0]
    axis = shapes.attr(node, "axis")
    sorted_ = shapes.attr(node, "sorted", 1)
    if len(node.outputs) > 1 and node.outputs[1].name:
        first = node.outputs[1]
    else:
        first = op.Unique(X, axis=axis, sorted=sorted_, _outputs=2)[1]
    if axis is None:
        flat = op.Reshape(shapes.zeros(op, X), [-1])
        dX = op.ScatterElements(flat, first, dY, axis=0)
        return {"X": op.Reshape(dX, op.Shape(X))}
    r = shapes.known_rank(X, "X")
    axis = shapes.normalize_axis(axis, r)
    index = op.Expand(op.Reshape(first, [1] * axis + [-1] + [1] * (r - axis - 1)), op.Shape(dY))
    return {"X": op.ScatterElements(shapes.zeros(op, X), index, dY, axis=axis)}


@rule("OneHot", differentiable=("values",))
def one_hot(op, node, dY):
    """Y = values[1] where indices hit, values[0] elsewhere; dvalues = [Σ dY off, Σ dY on]"""
    indices, depth, values = node.inputs
    hot = op.OneHot(indices, depth, op.const(np.array([0.0, 1.0]), like=values),
                    axis=shapes.attr(node, "axis", -1))
    on = op.ReduceSum(op.Mul(dY, hot), keepdims=0)
    off = op.Sub(op.ReduceSum(dY, keepdims=0), on)
    return {"values": op.Concat(op.Reshape(off, [1]), op.Reshape(on, [1]), axis=0)}


# --- Sequences and windows -------------------------------------------------------------------


@rule("Range", differentiable=("start", "delta"))
def range_(op, node, dY):
    """Y[i] = start + i·delta (length held fixed); dstart = Σ dY, ddelta = Σ dY·i"""
    i = op.CumSum(shapes.ones_like(op, node.outputs[0]), op.const(np.int64(0)), exclusive=1)
    return {"start": op.ReduceSum(dY, keepdims=0),
            "delta": op.ReduceSum(op.Mul(dY, i), keepdims=0)}


@rule("CumProd", differentiable=("x",))
def cumprod(op, node, dY):
    """Y = running product along axis (exclusive: of the entries before; reverse: from the end).

    dx_j = Σ_i dY_i·Y_i/x_j over the i whose product holds x_j, for j before the first zero z;
    at z the products of the entries after it, times those before; 0 after z (a zero stays)."""
    x, axis = node.inputs
    Y = node.outputs[0]
    rev, exc = shapes.attr(node, "reverse", 0), shapes.attr(node, "exclusive", 0)
    zero = op.Equal(x, 0.0)
    clear = op.Equal(op.CumSum(shapes.cast_like(op, zero, x), axis, exclusive=1, reverse=rev), 0.0)
    before_zero = op.Div(op.CumSum(op.Mul(dY, Y), axis, exclusive=exc, reverse=1 - rev),
                         select(op, zero, 1.0, x))
    after = op.CumProd(select(op, clear, 1.0, x), axis, exclusive=exc, reverse=rev)
    head = Y if exc else op.CumProd(x, axis, exclusive=1, reverse=rev)
    at_zero = op.Mul(head, op.CumSum(op.Mul(dY, after), axis, exclusive=exc, reverse=1 - rev))
    dx = select(op, op.And(clear, op.Not(zero)), before_zero,
                select(op, op.And(clear, zero), at_zero, 0.0))
    return {"x": dx}


@rule("CenterCropPad", differentiable=("input_data",))
def center_crop_pad(op, node, dY):
    """Y = X cropped or zero-padded about its centre on axes (both offsets floor(diff/2)), so the
    adjoint is the same op back to X's extents"""
    X = node.inputs[0]
    r = shapes.known_rank(X, "input_data")
    axes = shapes.attr(node, "axes")
    axes = list(range(r)) if axes is None else [shapes.normalize_axis(a, r) for a in axes]
    known = shapes.dims(X)
    if all(isinstance(known[a], int) for a in axes):
        extents = op.const(np.array([known[a] for a in axes], np.int64))
    else:
        extents = op.Gather(op.Shape(X), axes)
    return {"input_data": op.CenterCropPad(dY, extents, axes=shapes.attr(node, "axes"))}
