"""Activations: forward meaning in the docstring, backward below it.

Conventions at kinks (subgradients chosen to match PyTorch):
- a kink at 0 takes the left-hand piece: LeakyRelu'(0) = alpha, PRelu'(0) = slope (and the
  slope's gradient is X·dY there, i.e. 0), Elu'(0) = alpha, Selu'(0) = gamma·alpha, Celu'(0) = 1;
- ThresholdedRelu'(alpha) = 0 and Shrink'(±lambd) = 0 (the zero piece owns its end points);
- HardSigmoid passes alpha·dY only strictly inside its linear range (0 < Y < 1);
- HardSwish'(x) = x/3 + 1/2 on the closed interval [-3, 3], 0 below, 1 above.

Rules start at opset 7 (the first NumPy-broadcasting opset), see math.py.
"""

from __future__ import annotations

import math

import numpy as np

from onnx_autodiff.rules.math import gate, needs_opset7, scale_where, select
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

for _op_type, _inputs in {
    "LeakyRelu": ("X",), "PRelu": ("X", "slope"), "Elu": ("X",), "Selu": ("X",),
    "HardSigmoid": ("X",), "Softplus": ("X",), "Softsign": ("input",),
}.items():
    rule(_op_type, differentiable=_inputs, until=6)(needs_opset7)


def _positive(op, X):
    return op.Greater(X, 0.0)


@rule("LeakyRelu", differentiable=("X",), since=7)
def leaky_relu(op, node, dY):
    """Y = X for X > 0, alpha·X otherwise"""
    alpha = shapes.attr(node, "alpha", 0.01)
    return {"X": scale_where(op, _positive(op, node.inputs[0]), dY, 1.0, alpha)}


@rule("PRelu", differentiable=("X", "slope"), broadcast=True, since=7)
def prelu(op, node, dY):
    """Y = X for X > 0, slope·X otherwise (slope broadcasts to X)"""
    X, slope = node.inputs
    up = _positive(op, X)
    return {
        "X": scale_where(op, up, dY, 1.0, slope),
        "slope": gate(op, op.Not(up), op.Mul(dY, X)),
    }


_RUN_TIME = "run time"


def _channel_slope_axis(node) -> int | str | None:
    """The axis of X whose extent is the only match for a 1-D slope that does not broadcast;
    _RUN_TIME when X's symbolic extents leave the axis open until run time; None when it broadcasts.

    Models converted from opset 6 keep PRelu's older per-channel slope [C] against X [N, C, ...];
    runtimes that accept them (the reference evaluator) broadcast the slope when they can and
    otherwise apply it along the one axis of extent C.
    """
    X, slope = node.inputs
    x_dims, s_dims = shapes.dims(X), shapes.dims(slope)
    if x_dims is None or s_dims is None or len(s_dims) != 1 or len(x_dims) < 2:
        return None
    c, last = s_dims[0], x_dims[-1]
    if not isinstance(c, int) or c == 1 or last == c:
        return None
    matches = [k for k, d in enumerate(x_dims) if d == c]
    if isinstance(last, int) and len(matches) == 1:
        return matches[0]
    return _RUN_TIME if not all(isinstance(d, int) for d in x_dims) else None


def _channel_mask(op, X, c: int, r: int):
    """The axis of X a slope [C] applies along, as a bool [r] one-hot found at run time: the last
    when its extent is C (numpy's broadcast), else the one of extent C."""
    matching = op.Equal(op.Shape(X), [c])
    last_matches = op.Slice(matching, [r - 1], [r])
    return op.And(matching, op.Or(op.Not(last_matches), op.const(np.arange(r) == r - 1)))


@rule("PRelu", differentiable=("X", "slope"), since=7, when=lambda n: _channel_slope_axis(n) is not None)
def prelu_per_channel(op, node, dY):
    """Y = X for X > 0, slope·X otherwise, a slope [C] applied along X's one axis of extent C"""
    X, slope = node.inputs
    axis, r = _channel_slope_axis(node), shapes.rank(X)
    if axis == _RUN_TIME:
        shapes.require_opset(op, 13, "PRelu's per-channel slope along an axis found at run time (ReduceSum's axes)")
        c = shapes.dims(slope)[0]
        along = _channel_mask(op, X, c, r)
        shaped = op.Reshape(slope, op.Where(along, [c], [1]))
        others = op.Reshape(op.NonZero(op.Not(along)), [-1])
    else:
        shaped = op.Reshape(slope, [-1 if k == axis else 1 for k in range(r)])
        others = [k for k in range(r) if k != axis]
    up = _positive(op, X)
    d_slope = gate(op, op.Not(up), op.Mul(dY, X))
    return {
        "X": scale_where(op, up, dY, 1.0, shaped),
        "slope": op.reduce_sum(d_slope, others, keepdims=False),
    }


@rule("Elu", differentiable=("X",), since=7)
def elu(op, node, dY):
    """Y = X for X > 0, alpha·(exp(X) - 1) otherwise; dX = dY·(Y + alpha) there"""
    alpha = shapes.attr(node, "alpha", 1.0)
    down = op.Mul(dY, op.Add(node.outputs[0], alpha))
    return {"X": select(op, _positive(op, node.inputs[0]), dY, down)}


@rule("Selu", differentiable=("X",), since=7)
def selu(op, node, dY):
    """Y = gamma·X for X > 0, gamma·alpha·(exp(X) - 1) otherwise; dX = dY·(Y + gamma·alpha) there"""
    alpha = shapes.attr(node, "alpha", 1.67326319217681884765625)
    gamma = shapes.attr(node, "gamma", 1.05070102214813232421875)
    up = op.Mul(dY, gamma)
    down = op.Mul(dY, op.Add(node.outputs[0], gamma * alpha))
    return {"X": select(op, _positive(op, node.inputs[0]), up, down)}


@rule("Celu", differentiable=("X",))
def celu(op, node, dY):
    """Y = max(0, X) + min(0, alpha·(exp(X/alpha) - 1)); dX = dY·(Y/alpha + 1) for X <= 0"""
    alpha = shapes.attr(node, "alpha", 1.0)
    down = op.Mul(dY, op.Add(op.Div(node.outputs[0], alpha), 1.0))
    return {"X": select(op, _positive(op, node.inputs[0]), dY, down)}


@rule("ThresholdedRelu", differentiable=("X",))
def thresholded_relu(op, node, dY):
    """Y = X for X > alpha, 0 otherwise"""
    alpha = shapes.attr(node, "alpha", 1.0)
    return {"X": gate(op, op.Greater(node.inputs[0], alpha), dY)}


@rule("Shrink", differentiable=("input",))
def shrink(op, node, dY):
    """Y = X - bias for X > lambd, X + bias for X < -lambd, 0 otherwise"""
    lambd = shapes.attr(node, "lambd", 0.5)
    X = node.inputs[0]
    outside = op.Or(op.Greater(X, lambd), op.Less(X, -lambd))
    return {"input": gate(op, outside, dY)}


@rule("Gelu", differentiable=("X",))
def gelu(op, node, dY):
    """Y = X·Phi(X) (approximate="none") or 0.5·X·(1 + tanh(z)), z = sqrt(2/pi)·(X + 0.044715·X³)"""
    X = node.inputs[0]
    if shapes.attr(node, "approximate", "none") == "tanh":
        # 0.5·(1 + tanh z) = s = sigmoid(2z) and 1 - tanh² z = 4s(1 - s), so
        # Y' = s + s(1 - s)·q with q = X·2k(1 + 3a·X²), k = sqrt(2/pi), a = 0.044715.
        k, a = math.sqrt(2.0 / math.pi), 0.044715
        x2 = op.Mul(X, X)
        s = op.Sigmoid(op.Mul(X, op.Add(op.Mul(x2, 2 * k * a), 2 * k)))
        q = op.Mul(X, op.Add(op.Mul(x2, 6 * k * a), 2 * k))
        slope = op.Mul(s, op.Add(op.Mul(op.Sub(1.0, s), q), 1.0))
        return {"X": op.Mul(dY, slope)}
    # With u = X/sqrt(2): Y' = Phi(X) + X·phi(X) = 0.5·(1 + erf(u) + u·exp(log(2/sqrt(pi)) - u²)).
    u = op.Mul(X, math.sqrt(0.5))
    bump = op.Mul(u, op.Exp(op.Sub(math.log(2.0 / math.sqrt(math.pi)), op.Mul(u, u))))
    # Two Adds rather than a Sum broadcasting the 1 (benchmarks/README.md, "Why the onnxruntime lowering").
    # dY scaled first: runtimes fold a scalar factor into the MatMul that usually makes dY.
    return {"X": op.Mul(op.Mul(dY, 0.5), op.Add(op.Add(op.Erf(u), bump), 1.0))}


@rule("Softplus", differentiable=("X",), since=7)
def softplus(op, node, dY):
    """Y = log(1 + exp(X)); dX = dY·sigmoid(X)"""
    return {"X": op.Mul(dY, op.Sigmoid(node.inputs[0]))}


@rule("Softsign", differentiable=("input",), since=7)
def softsign(op, node, dY):
    """Y = X / (1 + |X|); dX = dY / (1 + |X|)² = dY·(1 - |Y|)²"""
    r = op.Sub(1.0, op.Abs(node.outputs[0]))
    return {"input": op.Mul(dY, op.Mul(r, r))}


@rule("HardSigmoid", differentiable=("X",), since=7)
def hard_sigmoid(op, node, dY):
    """Y = max(0, min(1, alpha·X + beta))"""
    alpha = shapes.attr(node, "alpha", 0.2)
    Y = node.outputs[0]
    inside = op.And(op.Greater(Y, 0.0), op.Less(Y, 1.0))
    return {"X": gate(op, inside, op.Mul(dY, alpha))}


@rule("HardSwish", differentiable=("X",))
def hard_swish(op, node, dY):
    """Y = X·max(0, min(1, X/6 + 1/2))"""
    X = node.inputs[0]
    inner = op.Mul(dY, op.Add(op.Div(X, 3.0), 0.5))
    return {"X": select(op, op.Less(X, -3.0), 0.0, select(op, op.Greater(X, 3.0), dY, inner))}


@rule("Mish", differentiable=("X",))
def mish(op, node, dY):
    """Y = X·tanh(softplus(X)); dX = dY·(t + X·sigmoid(X)·(1 - t²)), t = tanh(softplus(X))"""
    X = node.inputs[0]
    t = op.Tanh(op.Softplus(X))
    slope = op.Add(t, op.Mul(op.Mul(X, op.Sigmoid(X)), op.Sub(1.0, op.Mul(t, t))))
    return {"X": op.Mul(dY, slope)}


def _swish_slope(op, X, Y, alpha):
    """d/dX of X·sigmoid(alpha·X) = s + alpha·(Y - Y·s), s = sigmoid(alpha·X)"""
    s = op.Sigmoid(op.Mul(X, alpha) if alpha != 1.0 else X)
    tail = op.Sub(Y, op.Mul(Y, s))
    return op.Add(s, op.Mul(tail, alpha) if alpha != 1.0 else tail)


@rule("Swish", differentiable=("X",))
def swish(op, node, dY):
    """Y = X·sigmoid(alpha·X)"""
    alpha = shapes.attr(node, "alpha", 1.0)
    return {"X": op.Mul(dY, _swish_slope(op, node.inputs[0], node.outputs[0], alpha))}


@rule("SwiGLU", differentiable=("A", "B"))
def swiglu(op, node, dY):
    """Y = swish_alpha(A)·B (same shapes); dA = dY·B·swish'(A), dB = dY·swish(A)"""
    A, B = node.inputs
    alpha = shapes.attr(node, "alpha", 1.0)
    s = op.Sigmoid(op.Mul(A, alpha) if alpha != 1.0 else A)
    gate_ = op.Mul(A, s)
    slope = op.Add(s, op.Mul(op.Sub(gate_, op.Mul(gate_, s)), alpha))
    return {"A": op.Mul(op.Mul(dY, B), slope), "B": op.Mul(dY, gate_)}
