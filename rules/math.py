"""Elementwise arithmetic: forward meaning in the docstring, backward below it.

Conventions where the derivative is not defined (subgradients chosen to match PyTorch):
- a kink at 0 takes the left-hand piece: Relu'(0) = 0, Abs'(0) = Sign(0) = 0;
- Relu, as the other gates (Clip, ThresholdedRelu, ...), passes dY where X > 0 and 0 elsewhere,
  also where dY is NaN or infinite (as PyTorch). The onnxruntime lowering multiplies dY by the
  0/1 mask instead, so there a NaN or infinite dY where X <= 0 gives NaN (IEEE 0·NaN = NaN);
- Max/Min ties send the whole gradient to the first input that attains the result;
- Clip passes the gradient to the input on the closed interval [min, max] and to min (max) only
  where the input lies strictly below (above) it; with min > max everything goes to max;
- Sign, Floor, Ceil, Round have zero gradient (zeros, not a stop: the walk goes on);
- Mod: dA = dY, dB = -dY·n where Y = A - n·B (n = floor or trunc of A/B, read off the output);
- Pow: dX = dY·E·X^(E-1) (0 where E = 0, so X = 0 gives no NaN), dE = dY·Y·log(X), which is
  NaN for X <= 0 as in the math.

The templates need NumPy-style broadcasting, so most rules start at opset 7; earlier versions of
ops that broadcast scalars are refused with advice to convert the model (onnxruntime has no Add
or Mul kernel before opset 7 anyway). Where appears at opset 9: `gate`/`select` fall back to a
multiplication by the mask below it.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import may_be_float, shapes


def select(op, cond, a, b):
    """Where(cond, a, b); a or b may be a Python number, typed like the other branch."""
    if op.opset < 9 and isinstance(b, (int, float)) and b == 0:
        return op.Mul(a, shapes.cast_like(op, cond, a))
    # Left to the builder, a bare number next to a dY of unknown dtype would be typed like cond: bool.
    a = a if isinstance(a, ir.Value) else op.const(a, like=b)
    b = b if isinstance(b, ir.Value) else op.const(b, like=a)
    if op.opset >= 9:
        return op.Where(cond, a, b)
    return op.Add(op.Mul(a, shapes.cast_like(op, cond, a)), op.Mul(b, shapes.cast_like(op, op.Not(cond), a)))


def gate(op, cond, dY):
    """dY where ``cond`` holds, 0 elsewhere."""
    return select(op, cond, dY, 0.0)


def scale_where(op, cond, dY, a, b):
    """dY·a where ``cond`` holds, dY·b elsewhere (a, b numbers or values broadcasting to dY),
    written dY·Where(cond, a, b): the Where chooses between the factors, not two full-size tensors."""
    if op.opset < 9 or dY.dtype is None:  # no Where, or no type for its scalars without CastLike
        return select(op, cond, _times(op, dY, a), _times(op, dY, b))
    a = a if isinstance(a, ir.Value) else op.const(a, dtype=dY.dtype)
    b = b if isinstance(b, ir.Value) else op.const(b, dtype=dY.dtype)
    return op.Mul(dY, op.Where(cond, a, b))


def _times(op, dY, a):
    return dY if isinstance(a, (int, float)) and a == 1 else op.Mul(dY, a)


def needs_opset7(op, node, *dYs):
    """Before opset 7 these ops broadcast the legacy way, which the templates do not emit."""
    shapes.require_opset(op, 7, f"the gradient of {node.op_type} (numpy broadcasting)")


_LEGACY = {
    "Add": ("A", "B"), "Sub": ("A", "B"), "Mul": ("A", "B"), "Div": ("A", "B"), "Pow": ("X", "Y"),
    "Relu": ("X",), "Sigmoid": ("X",), "Tanh": ("input",), "Sqrt": ("X",), "Abs": ("X",),
    "Floor": ("X",), "Ceil": ("X",), "Max": ("data_0",), "Min": ("data_0",), "Mean": ("data_0",),
}
for _op_type, _inputs in _LEGACY.items():
    rule(_op_type, differentiable=_inputs, until=6)(needs_opset7)


@rule("Add", differentiable=("A", "B"), broadcast=True, since=7)
def add(op, node, dY):
    """Y = A + B"""
    return {"A": dY, "B": dY}


@rule("Sub", differentiable=("A", "B"), broadcast=True, since=7)
def sub(op, node, dY):
    """Y = A - B"""
    return {"A": dY, "B": op.Neg(dY)}


@rule("Mul", differentiable=("A", "B"), broadcast=True, since=7)
def mul(op, node, dY):
    """Y = A * B"""
    A, B = node.inputs
    return {"A": op.Mul(dY, B), "B": op.Mul(dY, A)}


@rule("Div", differentiable=("A", "B"), broadcast=True, since=7)
def div(op, node, dY):
    """Y = A / B"""
    B = node.inputs[1]
    dA = op.Div(dY, B)
    return {"A": dA, "B": op.Neg(op.Mul(dA, node.outputs[0]))}


@rule("Pow", differentiable=("X", "Y"), broadcast=True, since=7)
def pow_(op, node, dY):
    """Z = X ** E; dX = dY·E·X^(E-1), dE = dY·Z·log(X) (0 where Z = 0)"""
    X, E = node.inputs
    Z = node.outputs[0]
    same = E.dtype == X.dtype
    Ef = E if same else op.Cast(E, to=int(X.dtype))
    slope = op.Mul(Ef, op.Pow(X, op.Sub(Ef, 1.0)))
    # E = 0 makes 0·X^-1 = NaN at X = 0, though Z = 1 there is constant.
    nonzero = op.Or(op.Less(Ef, 0.0), op.Greater(Ef, 0.0))
    grads = {"X": gate(op, nonzero, op.Mul(dY, slope))}
    if may_be_float(E):
        dE = op.Mul(dY, op.Mul(Z, op.Log(X)))
        if op.opset >= 11:  # float Equal; Z·log(X) is 0·(-inf) at X = 0 where Z = 0: dE = 0 there
            dE = gate(op, op.Not(op.Equal(Z, 0.0)), dE)
        grads["Y"] = dE if same else op.Cast(dE, to=int(E.dtype))
    return grads


@rule("Mod", differentiable=("A", "B"), broadcast=True)
def mod(op, node, dY):
    """Y = A - n·B, n = floor(A/B) (fmod=0) or trunc(A/B) (fmod=1); dA = dY, dB = -dY·n"""
    A, B = node.inputs
    # n read off the output agrees with the forward; +0.5 then Floor rounds away its float error.
    n = op.Floor(op.Add(op.Div(op.Sub(A, node.outputs[0]), B), 0.5))
    return {"A": dY, "B": op.Neg(op.Mul(dY, n))}


@rule("Neg", differentiable=("X",))
def neg(op, node, dY):
    """Y = -X"""
    return {"X": op.Neg(dY)}


@rule("Identity", differentiable=("input",))
def identity(op, node, dY):
    """Y = X"""
    return {"input": dY}


@rule("Cast", differentiable=("input",))
def cast(op, node, dY):
    """Y = X converted to another type; the gradient goes back to X's type."""
    return {"input": shapes.cast_like(op, dY, node.inputs[0])}


@rule("CastLike", differentiable=("input",))
def cast_like(op, node, dY):
    """Y = X converted to the type of target_type"""
    return {"input": shapes.cast_like(op, dY, node.inputs[0])}


@rule("Relu", differentiable=("X",), since=7)
def relu(op, node, dY):
    """Y = max(X, 0)"""
    return {"X": gate(op, op.Greater(node.inputs[0], 0.0), dY)}


@rule("Abs", differentiable=("X",), since=7)
def abs_(op, node, dY):
    """Y = |X|; dX = dY·sign(X)"""
    X = node.inputs[0]
    if op.opset >= 9:
        sign = op.Sign(X)
    else:
        sign = op.Sub(shapes.cast_like(op, op.Greater(X, 0.0), X), shapes.cast_like(op, op.Less(X, 0.0), X))
    return {"X": op.Mul(dY, sign)}


@rule("Sigmoid", differentiable=("X",), since=7)
def sigmoid(op, node, dY):
    """Y = 1 / (1 + exp(-X)); dX = dY * Y * (1 - Y)"""
    Y = node.outputs[0]
    return {"X": op.Mul(dY, op.Mul(Y, op.Sub(1.0, Y)))}


@rule("Tanh", differentiable=("input",), since=7)
def tanh(op, node, dY):
    """Y = tanh(X); dX = dY * (1 - Y²)"""
    Y = node.outputs[0]
    return {"input": op.Mul(dY, op.Sub(1.0, op.Mul(Y, Y)))}


@rule("Exp", differentiable=("input",))
def exp(op, node, dY):
    """Y = exp(X)"""
    return {"input": op.Mul(dY, node.outputs[0])}


@rule("Log", differentiable=("input",))
def log(op, node, dY):
    """Y = log(X)"""
    return {"input": op.Div(dY, node.inputs[0])}


@rule("Sqrt", differentiable=("X",), since=7)
def sqrt(op, node, dY):
    """Y = sqrt(X); dX = dY / (2 Y)"""
    return {"X": op.Div(dY, op.Mul(node.outputs[0], 2.0))}


@rule("Reciprocal", differentiable=("X",))
def reciprocal(op, node, dY):
    """Y = 1 / X; dX = -dY * Y²"""
    Y = node.outputs[0]
    return {"X": op.Neg(op.Mul(dY, op.Mul(Y, Y)))}


@rule("Sin", differentiable=("input",))
def sin(op, node, dY):
    """Y = sin(X); dX = dY·cos(X)"""
    return {"input": op.Mul(dY, op.Cos(node.inputs[0]))}


@rule("Cos", differentiable=("input",))
def cos(op, node, dY):
    """Y = cos(X); dX = -dY·sin(X)"""
    return {"input": op.Neg(op.Mul(dY, op.Sin(node.inputs[0])))}


@rule("Tan", differentiable=("input",))
def tan(op, node, dY):
    """Y = tan(X); dX = dY·(1 + Y²)"""
    Y = node.outputs[0]
    return {"input": op.Mul(dY, op.Add(op.Mul(Y, Y), 1.0))}


def _one_minus_sq(op, X):
    return op.Sub(1.0, op.Mul(X, X))


@rule("Asin", differentiable=("input",))
def asin(op, node, dY):
    """Y = asin(X); dX = dY / sqrt(1 - X²)"""
    return {"input": op.Div(dY, op.Sqrt(_one_minus_sq(op, node.inputs[0])))}


@rule("Acos", differentiable=("input",))
def acos(op, node, dY):
    """Y = acos(X); dX = -dY / sqrt(1 - X²)"""
    return {"input": op.Neg(op.Div(dY, op.Sqrt(_one_minus_sq(op, node.inputs[0]))))}


@rule("Atan", differentiable=("input",))
def atan(op, node, dY):
    """Y = atan(X); dX = dY / (1 + X²)"""
    X = node.inputs[0]
    return {"input": op.Div(dY, op.Add(op.Mul(X, X), 1.0))}


@rule("Sinh", differentiable=("input",))
def sinh(op, node, dY):
    """Y = sinh(X); dX = dY·cosh(X)"""
    return {"input": op.Mul(dY, op.Cosh(node.inputs[0]))}


@rule("Cosh", differentiable=("input",))
def cosh(op, node, dY):
    """Y = cosh(X); dX = dY·sinh(X)"""
    return {"input": op.Mul(dY, op.Sinh(node.inputs[0]))}


@rule("Asinh", differentiable=("input",))
def asinh(op, node, dY):
    """Y = asinh(X); dX = dY / sqrt(X² + 1)"""
    X = node.inputs[0]
    return {"input": op.Div(dY, op.Sqrt(op.Add(op.Mul(X, X), 1.0)))}


@rule("Acosh", differentiable=("input",))
def acosh(op, node, dY):
    """Y = acosh(X); dX = dY / sqrt((X - 1)(X + 1))"""
    X = node.inputs[0]
    return {"input": op.Div(dY, op.Sqrt(op.Mul(op.Sub(X, 1.0), op.Add(X, 1.0))))}


@rule("Atanh", differentiable=("input",))
def atanh(op, node, dY):
    """Y = atanh(X); dX = dY / (1 - X²)"""
    return {"input": op.Div(dY, _one_minus_sq(op, node.inputs[0]))}


@rule("Erf", differentiable=("input",))
def erf(op, node, dY):
    """Y = erf(X); dX = dY·2/sqrt(pi)·exp(-X²)"""
    X = node.inputs[0]
    return {"input": op.Mul(dY, op.Mul(op.Exp(op.Neg(op.Mul(X, X))), 2.0 / math.sqrt(math.pi)))}


def _zero_gradient(name):
    def backward(op, node, dY):
        X = node.inputs[0]
        # ConstantOfShape appears at opset 9; before it, X·0 (NaN where X is inf)
        return {name: shapes.zeros(op, X) if op.opset >= 9 else op.Mul(X, 0.0)}

    return backward


for _op_type, _name in (("Sign", "input"), ("Floor", "X"), ("Ceil", "X"), ("Round", "X")):
    _zero = _zero_gradient(_name)
    _zero.__doc__ = f"Y = {_op_type.lower()}(X): piecewise constant, zero gradient"
    rule(_op_type, differentiable=(_name,), since=7)(_zero)


@rule("Sum", differentiable=("data_0",), broadcast=True)
def sum_(op, node, dY):
    """Y = X_1 + ... + X_n"""
    return {"data_0": [dY] * len(node.inputs)}


@rule("Mean", differentiable=("data_0",), broadcast=True, since=7)
def mean(op, node, dY):
    """Y = (X_1 + ... + X_n) / n"""
    share = op.Mul(dY, 1.0 / len(node.inputs)) if len(node.inputs) > 1 else dY
    return {"data_0": [share] * len(node.inputs)}


def _first_attaining(op, node, dY, beaten):
    """dY to the first input equal to the output; ``beaten(X, Y)`` says X lost."""
    if len(node.inputs) == 1:
        return [dY]
    Y = node.outputs[0]
    grads, taken = [], None
    for i, X in enumerate(node.inputs):
        hit = op.Not(beaten(X, Y))
        if taken is not None:
            hit = op.And(hit, op.Not(taken))
        if i < len(node.inputs) - 1:
            taken = hit if taken is None else op.Or(taken, hit)
        grads.append(gate(op, hit, dY))
    return grads


@rule("Max", differentiable=("data_0",), broadcast=True, since=7)
def max_(op, node, dY):
    """Y = max(X_1, ..., X_n); ties to the first"""
    return {"data_0": _first_attaining(op, node, dY, op.Less)}


@rule("Min", differentiable=("data_0",), broadcast=True, since=7)
def min_(op, node, dY):
    """Y = min(X_1, ..., X_n); ties to the first"""
    return {"data_0": _first_attaining(op, node, dY, op.Greater)}


@rule("Clip", differentiable=("input",), until=10)
def clip_attributes(op, node, dY):
    """Y = min(max(X, min), max) with attributes; dX = dY where Y == X"""
    X, Y = node.inputs[0], node.outputs[0]
    # Before opset 7 nothing broadcasts and Where/Equal(float) do not exist: Ceil(Clip(|X - Y|, 0, 1))
    # is exactly 1 where clipped, 0 elsewhere, and needs only same-shape ops.
    clipped = op.Ceil(op.Clip(op.Abs(op.Sub(X, Y)), min=0.0, max=1.0))
    return {"input": op.Sub(dY, op.Mul(dY, clipped))}


@rule("Clip", differentiable=("input", "min", "max"), broadcast=True, since=11)
def clip(op, node, dY):
    """Y = min(max(X, min), max); min and max optional inputs"""
    X = node.inputs[0]
    lo = node.inputs[1] if len(node.inputs) > 1 else None
    hi = node.inputs[2] if len(node.inputs) > 2 else None
    above = below = None
    if hi is not None:
        above = op.Greater(X, hi)
        if lo is not None:
            above = op.Or(above, op.Greater(lo, hi))
    if lo is not None:
        below = op.Less(X, lo)
        if above is not None:
            below = op.And(below, op.Not(above))
    grads = {}
    outside = [m for m in (above, below) if m is not None]
    if not outside:
        return {"input": dY}
    clipped = outside[0] if len(outside) == 1 else op.Or(*outside)
    grads["input"] = gate(op, op.Not(clipped), dY)
    if below is not None:
        grads["min"] = gate(op, below, dY)
    if above is not None:
        grads["max"] = gate(op, above, dY)
    return grads
