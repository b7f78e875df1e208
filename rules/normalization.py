"""Normalization layers: x̂ = (x - mean) / sqrt(var + eps) over some axes, then an affine map.

They share one backward: for x̂ standardised over axes A (N elements) and g = ∂L/∂x̂,
``dX = inv · (g - mean_A(g) - x̂ · mean_A(g · x̂))`` (:func:`_standardize_backward`).
LayerNormalization reads the statistics from the forward node (the engine adds the outputs it
lacks) and gets x̂ from one unit-scale LayerNormalization (one fused pass, not Sub and Mul); the
others recompute them in the backward graph. The backward
runs in X's type, widened to float32 for 16-bit X when ``stash_type`` asks for float (never
narrowed: float64 X stays float64 even though stash_type=1 computes its forward in float32).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.math import needs_opset7
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

_NARROW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _present(node: ir.Node, index: int) -> ir.Value | None:
    """The node's output ``index`` if the node produces it (an empty name means omitted)."""
    outs = node.outputs
    return outs[index] if index < len(outs) and outs[index].name else None


def _work_dtype(x: ir.Value, stash_type: int | None) -> ir.DataType | None:
    if stash_type == ir.DataType.FLOAT and x.dtype in _NARROW:
        return ir.DataType.FLOAT
    return x.dtype


def _cast(op, v, dtype):
    """v in ``dtype`` (no node when it already is, or when the dtype is unknown)."""
    return v if v is None or dtype is None or v.dtype == dtype else op.Cast(v, to=dtype)


def _like(op, v, ref):
    """v in the type of ``ref`` (for gradients going back to an input of another type); None
    stays None, and v stays as it is when both types are unknown."""
    return v if v is None or v.dtype == ref.dtype else shapes.cast_like(op, v, ref)


def _mean(op, x, axes):
    return op.reduce("ReduceMean", x, axes, keepdims=True)


def _count(op, x, axes, like):
    """Number of elements of x over ``axes``, a scalar of like's type (run time if not static)."""
    d = shapes.dims(x)
    if d is not None and all(isinstance(d[a], int) for a in axes):
        return op.const(np.prod([d[a] for a in axes]), like=like)
    sizes = op.Gather(op.Shape(x), list(axes))
    return op.CastLike(op.reduce("ReduceProd", sizes, None, keepdims=False), like)


def _moments(op, x, axes, eps):
    """(x - mean, 1/sqrt(var + eps)) over ``axes``, statistics kept as size-1 axes."""
    xc = op.Sub(x, _mean(op, x, axes))
    inv = op.Reciprocal(op.Sqrt(op.Add(_mean(op, op.Mul(xc, xc), axes), eps)))
    return xc, inv


def _standardize_backward(op, g, xhat, inv, axes):
    """dX for x̂ = (x - mean_A x) · inv, inv = 1/sqrt(var_A x + eps), given g = ∂L/∂x̂."""
    centered = op.Sub(g, _mean(op, g, axes))
    return op.Mul(inv, op.Sub(centered, op.Mul(xhat, _mean(op, op.Mul(g, xhat), axes))))


def _per_channel(op, v, rank):
    """A (C,) vector shaped (C, 1, ..., 1) to broadcast along axis 1 of a rank-``rank`` tensor."""
    return op.unsqueeze(v, list(range(1, rank - 1))) if rank > 2 else v


def _standardized(op, node, x, axes):
    """x̂ by a LayerNormalization with unit scale: one fused pass instead of Sub and Mul, and in
    x's precision where the saved statistics are float32 (stash_type=1 on a float64 x).

    The unit scale is a constant of the normalised dims' shape, or made from x's shape where those
    dims are symbolic; None when x's dtype is unknown.
    """
    if x.dtype is None:
        return None
    d = shapes.dims(x)
    if d is not None and all(isinstance(d[a], int) for a in axes):
        ones = op.const(np.ones([d[a] for a in axes]), dtype=x.dtype)
    else:
        ones = op.ConstantOfShape(op.Shape(x, start=axes[0]), value=np.ones(1, dtype=x.dtype.numpy()))
    return op.LayerNormalization(x, ones, axis=axes[0], epsilon=shapes.attr(node, "epsilon", 1e-5),
                                 stash_type=shapes.attr(node, "stash_type", 1))


@rule("LayerNormalization", differentiable=("X", "Scale", "B"), since=17,
      broadcast=("Scale", "B"), saves=("Mean", "InvStdDev"))
def layer_normalization(op, node, dY, dMean=None, dInvStdDev=None):
    """Y = x̂ · Scale + B, x̂ standardised over axes [axis, rank); optional Mean, InvStdDev."""
    X, Scale = node.inputs[:2]
    B = node.inputs[2] if len(node.inputs) > 2 else None
    r = shapes.known_rank(X)
    axes = list(range(shapes.normalize_axis(shapes.attr(node, "axis", -1), r), r))
    work = _work_dtype(X, shapes.attr(node, "stash_type", 1))
    x = _cast(op, X, work)
    # The engine gave the node its statistics outputs (saves=): no recomputation.
    _, mean, inv = node.outputs[:3]
    inv = _cast(op, inv, work)
    xhat = _standardized(op, node, x, axes) or op.Mul(op.Sub(x, _cast(op, mean, work)), inv)
    grads, dx = {}, None
    if dY is not None:
        dy = _cast(op, dY, work)
        # Scale and B: in Y's shape, the engine sums them over the broadcast axes (once for
        # all the uses of a tied parameter) and casts them to the parameter's type.
        grads["Scale"] = op.Mul(dy, xhat)
        if B is not None:
            grads["B"] = dy
        dx = _standardize_backward(op, op.Mul(dy, _cast(op, Scale, work)), xhat, inv, axes)
    if dMean is not None or dInvStdDev is not None:
        # ∂mean/∂x = 1/N; ∂inv/∂x = -inv² · x̂ / N
        n = _count(op, X, axes, x)
        stats = []
        if dInvStdDev is not None:
            coef = op.Neg(op.Mul(_cast(op, dInvStdDev, work), op.Mul(inv, inv)))
            stats.append(op.Div(op.Mul(xhat, coef), n))
        if dMean is not None:
            stats.append(op.Expand(op.Div(_cast(op, dMean, work), n), op.Shape(X)))
        dx = shapes.accumulate(op, ([dx] if dx is not None else []) + stats)
    grads["X"] = _like(op, dx, X)
    return grads


def _batch_norm_training(op, node) -> bool:
    if op.opset >= 14:
        return bool(shapes.attr(node, "training_mode", 0))
    # before opset 14 the optional outputs select training mode (onnxruntime agrees)
    return any(_present(node, i) is not None for i in range(1, 5))


@rule("BatchNormalization", differentiable=("X", "scale", "B", "input_mean", "input_var"), since=14)
@rule("BatchNormalization", differentiable=("X", "scale", "B", "mean", "var"), since=9, until=13)
def batch_normalization(op, node, dY, dRunningMean=None, dRunningVar=None, *dSaved):
    """Y = (X - mean) / sqrt(var + eps) · scale + B per channel (axis 1).

    Inference: mean and var are the inputs. Training: the batch statistics over every axis but 1,
    and running_mean = m · input_mean + (1 - m) · batch_mean (same for var, population variance).
    """
    if any(d is not None for d in dSaved):
        raise RuleError("gradients through saved_mean/saved_var (opset < 14) are not supported")
    X, scale, B, mean, var = node.inputs
    mean_name, var_name = ("input_mean", "input_var") if op.opset >= 14 else ("mean", "var")
    r = shapes.known_rank(X)
    if r < 2:
        raise RuleError(f"BatchNormalization needs an input of rank 2 or more, not {r}")
    axes = [0, *range(2, r)]
    eps = shapes.attr(node, "epsilon", 1e-5)
    grads, dx = {}, []
    if not _batch_norm_training(op, node):
        inv = op.Reciprocal(op.Sqrt(op.Add(_like(op, var, X), eps)))
        xhat = op.Mul(op.Sub(X, _per_channel(op, _like(op, mean, X), r)), _per_channel(op, inv, r))
        if dY is not None:
            d_b = op.reduce_sum(dY, axes, keepdims=False)
            d_scale = op.reduce_sum(op.Mul(dY, xhat), axes, keepdims=False)
            scale_inv = op.Mul(_like(op, scale, X), inv)
            dx.append(op.Mul(dY, _per_channel(op, scale_inv, r)))
            grads[mean_name] = _like(op, op.Neg(op.Mul(d_b, scale_inv)), mean)
            grads[var_name] = _like(op, op.Mul(op.Mul(d_scale, op.Mul(scale_inv, inv)), -0.5), var)
    else:
        xc, inv = _moments(op, X, axes, eps)
        xhat = op.Mul(xc, inv)
        if dY is not None:
            d_b = op.reduce_sum(dY, axes, keepdims=False)
            d_scale = op.reduce_sum(op.Mul(dY, xhat), axes, keepdims=False)
            g = op.Mul(dY, _per_channel(op, _like(op, scale, X), r))
            dx.append(_standardize_backward(op, g, xhat, inv, axes))
        momentum = shapes.attr(node, "momentum", 0.9)
        batch_share = op.Div(1.0 - momentum, _count(op, X, axes, X))
        if dRunningMean is not None:
            grads[mean_name] = op.Mul(dRunningMean, momentum)
            d_mean = op.Mul(_per_channel(op, _like(op, dRunningMean, X), r), batch_share)
            dx.append(op.Expand(d_mean, op.Shape(X)))
        if dRunningVar is not None:
            grads[var_name] = op.Mul(dRunningVar, momentum)
            d_var = op.Mul(_per_channel(op, _like(op, dRunningVar, X), r), batch_share)
            dx.append(op.Mul(op.Mul(d_var, xc), 2.0))
    if dY is not None:
        grads["B"] = _like(op, d_b, B)
        grads["scale"] = _like(op, d_scale, scale)
    if dx:
        grads["X"] = shapes.accumulate(op, dx)
    return grads


@rule("BatchNormalization", differentiable=("X", "scale", "B", "mean", "var"), until=8)
def batch_normalization_before_9(op, node, *dYs):
    """Opsets 7 and 8 differ from 9 by the ``spatial`` attribute (1, the default, is opset 9's only
    form): the model is converted to opset 9, whose rule then applies."""
    shapes.require_opset(op, 9, "the gradient of BatchNormalization (its opset-9 form, without 'spatial')")


# Their backward graphs need Sub/Mul/ReduceMean kernels of opset 7 or later (onnxruntime has none
# before): older models are refused with advice to convert them.
rule("InstanceNormalization", differentiable=("input", "scale", "B"), until=6)(needs_opset7)
rule("LpNormalization", differentiable=("input",), until=6)(needs_opset7)


@rule("InstanceNormalization", differentiable=("input", "scale", "B"), since=7)
def instance_normalization(op, node, dY):
    """Y = x̂ · scale + B per channel, x̂ standardised over the spatial axes of each (n, c)."""
    X, scale, _ = node.inputs
    r = shapes.known_rank(X)
    if r < 3:
        raise RuleError(f"InstanceNormalization needs an input of rank 3 or more, not {r}")
    axes = list(range(2, r))
    xc, inv = _moments(op, X, axes, shapes.attr(node, "epsilon", 1e-5))
    xhat = op.Mul(xc, inv)
    dx = _standardize_backward(op, op.Mul(dY, _per_channel(op, scale, r)), xhat, inv, axes)
    summed = [0, *axes]
    return {
        "input": dx,
        "scale": op.reduce_sum(op.Mul(dY, xhat), summed, keepdims=False),
        "B": op.reduce_sum(dY, summed, keepdims=False),
    }


@rule("GroupNormalization", differentiable=("X", "scale", "bias"), since=18)
def group_normalization(op, node, dY):
    """Y = x̂ · scale + bias, x̂ standardised per (n, group of channels).

    scale and bias hold one value per group at opset 18-20 and one per channel from opset 21.
    """
    X, scale, bias = node.inputs
    groups = shapes.attr(node, "num_groups")
    r = shapes.known_rank(X)
    if not groups or r < 2:
        raise RuleError(f"GroupNormalization needs num_groups (here {groups}) and an input of rank 2 or more "
                        f"(input '{X.name}' has rank {r})")
    channels = shapes.dims(X)[1]
    if not isinstance(channels, int) and op.opset >= 21:  # scale holds one value per channel
        channels = (shapes.static_shape(scale) or (None,))[0]
    if isinstance(channels, int) and channels % groups:
        raise RuleError(f"GroupNormalization needs a channel count divisible by num_groups={groups}; "
                        f"input '{X.name}' has {channels}")
    # channels per group: static when the channel count is, else computed from it at run time
    size = channels // groups if isinstance(channels, int) else op.Div(shapes.extent(op, X, 1), [groups])
    per_channel = op.opset >= 21
    work = _work_dtype(X, shapes.attr(node, "stash_type", 1) if per_channel else None)
    # work in the view (N, G, C/G, spatial): statistics over axes 2, 3
    view = shapes.shape_from(op, 0, groups, size, -1)
    xg = op.Reshape(_cast(op, X, work), view)
    dyg = op.Reshape(_cast(op, dY, work), view)
    xc, inv = _moments(op, xg, [2, 3], shapes.attr(node, "epsilon", 1e-5))
    xhat = op.Mul(xc, inv)
    scale_view = shapes.shape_from(op, 1, groups, size if per_channel else 1, 1)
    g = op.Mul(dyg, op.Reshape(_cast(op, scale, work), scale_view))
    dx = op.Reshape(_standardize_backward(op, g, xhat, inv, [2, 3]), op.Shape(X))
    summed = [0, 3] if per_channel else [0, 2, 3]

    def param_grad(v, like):
        return _like(op, op.Reshape(op.reduce_sum(v, summed, keepdims=False), [-1]), like)

    return {
        "X": _like(op, dx, X),
        "scale": param_grad(op.Mul(dyg, xhat), scale),
        "bias": param_grad(dyg, bias),
    }


@rule("LpNormalization", differentiable=("input",), since=7)
def lp_normalization(op, node, dY):
    """Y = X / ‖X‖_p along axis (p = 1, 2).

    dX = (dY - s · Σ dY·Y) / ‖X‖_p with s = Y for p = 2, sign(X) for p = 1.
    """
    X, Y = node.inputs[0], node.outputs[0]
    p = shapes.attr(node, "p", 2)
    if p not in (1, 2):
        raise RuleError(f"LpNormalization with p={p}: only p = 1 and p = 2 are defined")
    axis = [shapes.normalize_axis(shapes.attr(node, "axis", -1), shapes.known_rank(X))]
    norm = op.reduce("ReduceL2" if p == 2 else "ReduceL1", X, axis, keepdims=True)
    s = Y if p == 2 else op.Sign(X)
    projected = op.Mul(s, op.reduce_sum(op.Mul(dY, Y), axis, keepdims=True))
    return {"input": op.Div(op.Sub(dY, projected), norm)}


@rule("MeanVarianceNormalization", differentiable=("X",), since=9)
def mean_variance_normalization(op, node, dY):
    """Y = (X - mean) / (std + 1e-9) over axes (default [0, 2, 3]).

    dX = (dY - mean(dY)) / (std + 1e-9) - Y · mean(dY · Y) / std.
    """
    X, Y = node.inputs[0], node.outputs[0]
    r = shapes.known_rank(X)
    axes = sorted(shapes.normalize_axis(a, r) for a in shapes.attr(node, "axes", [0, 2, 3]))
    xc = op.Sub(X, _mean(op, X, axes))
    std = op.Sqrt(_mean(op, op.Mul(xc, xc), axes))
    centered = op.Div(op.Sub(dY, _mean(op, dY, axes)), op.Add(std, 1e-9))
    return {"X": op.Sub(centered, op.Div(op.Mul(Y, _mean(op, op.Mul(dY, Y), axes)), std))}


@rule("RMSNormalization", differentiable=("X", "scale"), since=23)
def rms_normalization(op, node, dY):
    """Y = x̂ · scale, x̂ = X · inv, inv = 1/sqrt(mean(X²) + eps) over axes [axis, rank).

    With g = dY · scale: dX = inv · (g - x̂ · mean(g · x̂)).
    """
    X, scale = node.inputs
    r = shapes.known_rank(X)
    axes = list(range(shapes.normalize_axis(shapes.attr(node, "axis", -1), r), r))
    work = _work_dtype(X, shapes.attr(node, "stash_type", 1))
    x, dy = _cast(op, X, work), _cast(op, dY, work)
    eps = shapes.attr(node, "epsilon", 1e-5)
    inv = op.Reciprocal(op.Sqrt(op.Add(_mean(op, op.Mul(x, x), axes), eps)))
    xhat = op.Mul(x, inv)
    g = op.Mul(dy, _cast(op, scale, work))
    dx = op.Mul(inv, op.Sub(g, op.Mul(xhat, _mean(op, op.Mul(g, xhat), axes))))
    d_scale = shapes.unbroadcast(op, op.Mul(dy, xhat), scale, X)
    return {"X": _like(op, dx, X), "scale": _like(op, d_scale, scale)}
