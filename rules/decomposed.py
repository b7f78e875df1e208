"""Subgraphs that unoptimised exports spell out op by op, differentiated as one unit each.

- SiLU: y = x·σ(x); dx = dY·(σ + y·(1 − σ)) (4 nodes; the op-by-op chain takes 6).
- RMSNorm without its weight: y = x·r, r = 1/√(mean(x²) + ε) over the reduced axes (keepdims);
  dx = r·(dY − y·mean(dY·y)) over the same axes (5 nodes; the chain of Pow, ReduceMean, Add,
  Sqrt, Reciprocal and Mul rules takes 13). ε and the axes take no gradient (a match applies
  only where none reaches them).
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
