"""Reductions Y = reduce(X, axes): forward meaning in the docstring, backward below it.

Every rule works on the "kept" form of Y and dY (reduced axes reinserted with extent 1 when
keepdims=0), which broadcasts against X. Axes come from the attribute (before opset 13 for
ReduceSum, 18 for the others) or the optional input, constant or computed at run time; negative
axes need no normalisation because Unsqueeze counts them on its output rank, X's rank. With
noop_with_empty_axes=1 and no axes the reduction runs over no axis at all, so each "slice" is one
element (runtimes still apply the elementwise part: ReduceSumSquare gives X², ReduceL1 |X|).

Conventions: ReduceMax/ReduceMin split the gradient evenly among the tied extrema of a slice (as
torch.amax); ReduceL1 uses sign(0) = 0; ReduceL2 gives 0 for an all-zero slice; ReduceProd gives
each element the exact product of the others, so a slice with one zero still passes a finite
gradient to that zero and a slice with two or more zeros passes none.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes


def _axes(node):
    """(axes, keepdims, noop): axes a list of ints, an int64 value known at run time, or None (all)."""
    keepdims = shapes.attr(node, "keepdims", 1)
    noop = shapes.attr(node, "noop_with_empty_axes", 0)
    axes = shapes.axes(node)
    if isinstance(axes, ir.Value):
        return axes, keepdims, noop
    if not axes:
        axes = [] if noop else None
    return axes, keepdims, noop


def _kept(op, node, value):
    """Y or dY with the reduced axes reinserted, so that it broadcasts against X."""
    axes, keepdims, _ = _axes(node)
    if keepdims or axes is None or (isinstance(axes, list) and not axes):
        return value  # kept already, a scalar, or not reduced at all
    return op.unsqueeze(value, axes)


def _reduce(op, node, op_type, x):
    """``op_type`` of x over the node's axes, keeping dims."""
    axes, _, noop = _axes(node)
    return op.reduce(op_type, x, axes, keepdims=True, noop_with_empty_axes=noop or None)


def _expand(op, g, x):
    shapes.require_opset(op, 8, "this gradient's Expand")
    shape = shapes.static_shape(x)
    return op.Expand(g, list(shape) if shape is not None else op.Shape(x))


def _count(op, node):
    """The number of elements per reduced slice: a Python number when static, else Size(X)/Size(Y)."""
    X, Y = node.inputs[0], node.outputs[0]
    axes, _, _ = _axes(node)
    x_dims = shapes.dims(X)
    if x_dims is not None and not isinstance(axes, ir.Value):
        picked = x_dims if axes is None else [x_dims[a] for a in axes]
        if all(isinstance(d, int) for d in picked):
            count = 1
            for d in picked:
                count *= d
            return count
    return shapes.cast_like(op, op.Div(op.Size(X), op.Size(Y)), X)


@rule("ReduceSum", differentiable=("data",))
def reduce_sum(op, node, dY):
    """Y = Σ X"""
    return {"data": _expand(op, _kept(op, node, dY), node.inputs[0])}


@rule("ReduceMean", differentiable=("data",))
def reduce_mean(op, node, dY):
    """Y = Σ X / n; dX = dY / n"""
    count = _count(op, node)
    dYk = _kept(op, node, dY)
    scaled = op.Mul(dYk, 1.0 / max(count, 1)) if isinstance(count, int) else op.Div(dYk, count)
    return {"data": _expand(op, scaled, node.inputs[0])}


@rule("ReduceSumSquare", differentiable=("data",))
def reduce_sum_square(op, node, dY):
    """Y = Σ X²; dX = 2 X dY"""
    return {"data": op.Mul(node.inputs[0], op.Mul(_kept(op, node, dY), 2.0))}


@rule("ReduceL1", differentiable=("data",))
def reduce_l1(op, node, dY):
    """Y = Σ |X|; dX = sign(X) dY"""
    return {"data": op.Mul(op.Sign(node.inputs[0]), _kept(op, node, dY))}


@rule("ReduceL2", differentiable=("data",))
def reduce_l2(op, node, dY):
    """Y = sqrt(Σ X²); dX = X dY / Y"""
    shapes.require_opset(op, 11, "this gradient's Equal on floats")
    Yk = _kept(op, node, node.outputs[0])
    safe = op.Add(Yk, shapes.cast_like(op, op.Equal(Yk, 0.0), Yk))  # Y = 0 only when X = 0 there
    return {"data": op.Mul(node.inputs[0], op.Div(_kept(op, node, dY), safe))}


@rule("ReduceLogSum", differentiable=("data",))
def reduce_log_sum(op, node, dY):
    """Y = log Σ X; dX = dY / exp(Y)"""
    Yk = _kept(op, node, node.outputs[0])
    return {"data": _expand(op, op.Div(_kept(op, node, dY), op.Exp(Yk)), node.inputs[0])}


@rule("ReduceLogSumExp", differentiable=("data",))
def reduce_log_sum_exp(op, node, dY):
    """Y = log Σ exp(X); dX = dY exp(X - Y)"""
    Yk = _kept(op, node, node.outputs[0])
    return {"data": op.Mul(_kept(op, node, dY), op.Exp(op.Sub(node.inputs[0], Yk)))}


@rule("ReduceProd", differentiable=("data",))
def reduce_prod(op, node, dY):
    """Y = Π X; dX_i = dY Π_{j≠i} X_j, computed without dividing by zero"""
    shapes.require_opset(op, 11, "this gradient's Equal on floats")
    X = node.inputs[0]
    is_zero = op.Equal(X, 0.0)
    zero_count = shapes.cast_like(op, is_zero, X)
    nonzero = op.Where(is_zero, 1.0, X)
    product = _reduce(op, node, "ReduceProd", nonzero)  # of the slice's nonzero elements
    zeros_elsewhere = op.Sub(_reduce(op, node, "ReduceSum", zero_count), zero_count)
    others = op.Where(op.Equal(zeros_elsewhere, 0.0), op.Div(product, nonzero), 0.0)
    return {"data": op.Mul(others, _kept(op, node, dY))}


def _extremum(op, node, dY):
    """dX = dY / k at the k elements equal to the slice's extremum, 0 elsewhere."""
    shapes.require_opset(op, 11, "this gradient's Equal on floats")
    X = node.inputs[0]
    mask = shapes.cast_like(op, op.Equal(X, _kept(op, node, node.outputs[0])), X)
    share = op.Div(_kept(op, node, dY), _reduce(op, node, "ReduceSum", mask))
    return {"data": op.Mul(mask, share)}


@rule("ReduceMax", differentiable=("data",))
def reduce_max(op, node, dY):
    """Y = max X; ties share the gradient evenly"""
    return _extremum(op, node, dY)


@rule("ReduceMin", differentiable=("data",))
def reduce_min(op, node, dY):
    """Y = min X; ties share the gradient evenly"""
    return _extremum(op, node, dY)
