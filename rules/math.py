"""Elementwise arithmetic and activations: forward meaning in the docstring, backward below it.

Kink convention: the derivative at a kink is that of the right-hand piece at x > 0 and of the
left-hand piece otherwise (Relu'(0) = 0, Abs'(0) = 0).
"""

from __future__ import annotations

from onnx_autodiff.rules.registry import rule


@rule("Add", differentiable=("A", "B"), broadcast=True)
def add(op, node, dY):
    """Y = A + B"""
    return {"A": dY, "B": dY}


@rule("Sub", differentiable=("A", "B"), broadcast=True)
def sub(op, node, dY):
    """Y = A - B"""
    return {"A": dY, "B": op.Neg(dY)}


@rule("Mul", differentiable=("A", "B"), broadcast=True)
def mul(op, node, dY):
    """Y = A * B"""
    A, B = node.inputs
    return {"A": op.Mul(dY, B), "B": op.Mul(dY, A)}


@rule("Div", differentiable=("A", "B"), broadcast=True)
def div(op, node, dY):
    """Y = A / B"""
    B = node.inputs[1]
    dA = op.Div(dY, B)
    return {"A": dA, "B": op.Neg(op.Mul(dA, node.outputs[0]))}


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
    return {"input": op.CastLike(dY, node.inputs[0])}


@rule("CastLike", differentiable=("input",))
def cast_like(op, node, dY):
    """Y = X converted to the type of target_type"""
    return {"input": op.CastLike(dY, node.inputs[0])}


@rule("Relu", differentiable=("X",))
def relu(op, node, dY):
    """Y = max(X, 0)"""
    X = node.inputs[0]
    return {"X": op.Where(op.Greater(X, 0.0), dY, 0.0)}


@rule("Sigmoid", differentiable=("X",))
def sigmoid(op, node, dY):
    """Y = 1 / (1 + exp(-X)); dX = dY * Y * (1 - Y)"""
    Y = node.outputs[0]
    return {"X": op.Mul(dY, op.Mul(Y, op.Sub(1.0, Y)))}


@rule("Tanh", differentiable=("input",))
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


@rule("Sqrt", differentiable=("X",))
def sqrt(op, node, dY):
    """Y = sqrt(X); dX = dY / (2 Y)"""
    return {"X": op.Div(dY, op.Mul(node.outputs[0], 2.0))}


@rule("Reciprocal", differentiable=("X",))
def reciprocal(op, node, dY):
    """Y = 1 / X; dX = -dY * Y²"""
    Y = node.outputs[0]
    return {"X": op.Neg(op.Mul(dY, op.Mul(Y, Y)))}
