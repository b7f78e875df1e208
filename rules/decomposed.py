"""Subgraphs that unoptimised exports spell out op by op, differentiated as one unit each.

- SiLU: y = x·σ(x); dx = dY·(σ + y·(1 − σ)) (4 backward nodes after cleanup; op by op 6).
- RMSNorm without its weight: y = x·r, r = 1/√(mean(x²) + ε) over the reduced axes (keepdims);
  dx = r·(dY − y·mean(dY·y)) over the same axes (5 backward nodes after cleanup; the chain of Pow,
  ReduceMean, Add, Sqrt, Reciprocal and Mul rules takes 21). ε and the axes take no gradient (a match applies
  only where none reaches them).
- GELU, tanh form (GPT-2's "gelu_new"): y = ½·x·(1 + t), t = tanh(c·(x + k·x³));
  dx = dY·(½·(1 + t) + x·(1 − t²)·(½c + 3kc/2·x²)) (10 backward nodes after cleanup; op by op 21).
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.rules.registry import rule


def silu(op, x):
    return op.Mul(x, op.Sigmoid(x, _outputs=["s"]))


@rule(pattern=silu, differentiable=("x",))
def _silu(op, match, dY):
    s, y = match["s"], match.outputs[0]
    return {"x": op.Mul(dY, op.Add(s, op.Mul(y, op.Sub(op.const(1.0, like=s), s))))}


def rms_norm(op, x, two, axes, eps):
    mean = op.ReduceMean(op.Pow(x, two), axes, _outputs=["mean"])
    return op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean, eps)), _outputs=["r"]))


def _squares_kept_dims(context, x, two, axes, eps, **_) -> bool:
    """x² (the exponent a constant 2, as exporters write it) averaged with the reduced axes kept."""
    exponent = ir.convenience.get_const_tensor(two)
    if exponent is None or exponent.numpy().size != 1 or float(exponent.numpy().reshape(())) != 2.0:
        return False
    reduce = next(node for node in context.nodes if node.op_type == "ReduceMean")
    keepdims, noop = reduce.attributes.get("keepdims"), reduce.attributes.get("noop_with_empty_axes")
    return (keepdims is None or keepdims.value == 1) and (noop is None or noop.value == 0)


@rule(pattern=rms_norm, differentiable=("x",), since=18, when=_squares_kept_dims)
def _rms_norm(op, match, dY):
    r, y, axes = match["r"], match.outputs[0], match["axes"]
    mean = op.ReduceMean(op.Mul(dY, y), axes, keepdims=1)
    return {"x": op.Mul(r, op.Sub(dY, op.Mul(y, mean)))}


def gelu_tanh(op, x, half, three, k, c, one):
    inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), k)), c)
    return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner, _outputs=["t"]), one, _outputs=["s"]))


def _number(value) -> float | None:
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None or tensor.numpy().size != 1 else float(tensor.numpy().reshape(()))


def _gelu_constants(context, x, half, three, k, c, one, **_) -> bool:
    """½, 3 and 1 where the formula has them; k and c any constants."""
    values = [_number(v) for v in (half, three, k, c, one)]
    return None not in values and values[0] == 0.5 and values[1] == 3.0 and values[4] == 1.0


@rule(pattern=gelu_tanh, differentiable=("x",), when=_gelu_constants)
def _gelu_tanh(op, match, dY):
    x, t, s = match["x"], match["t"], match["s"]
    k, c = _number(match["k"]), _number(match["c"])
    slope = op.Add(op.Mul(op.Mul(x, x), op.const(1.5 * k * c, like=x)), op.const(0.5 * c, like=x))
    sech2 = op.Sub(op.const(1.0, like=x), op.Mul(t, t))
    total = op.Add(op.Mul(s, op.const(0.5, like=x)), op.Mul(op.Mul(x, sech2), slope))
    return {"x": op.Mul(dY, total)}
