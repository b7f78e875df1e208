"""Subgraphs that unoptimised exports spell out op by op, differentiated as one unit each.

Node counts are the backward nodes after cleanup, for the gradient with respect to x (the tests'
models; with the same registry less its pattern rules for "op by op").

- SiLU: y = x·σ(x); dx = dY·(σ + y·(1 − σ)) (4 backward nodes; op by op 6).
- RMSNorm without its weight: y = x·r, r = 1/√(mean(x²) + ε) over the reduced axes (keepdims);
  dx = r·(dY − y·mean(dY·y)) over the same axes (5 backward nodes; the chain of Pow, ReduceMean,
  Add, Sqrt, Reciprocal and Mul rules takes 15). ε and the axes take no gradient (a match applies
  only where none reaches them).
- GELU, tanh form (GPT-2's "gelu_new"): y = ½·x·(1 + t), t = tanh(c·(x + k·x³));
  dx = dY·(½·(1 + t) + x·(1 − t²)·(½c + 3kc/2·x²)) (10 backward nodes; op by op 13).
- LayerNorm without its weight and bias (those are a Mul and an Add with rules of their own):
  d = x − mean(x), y = d·r, r = 1/√(mean(d²) + ε) over the same axes (keepdims), d² as Pow(d, 2) or
  Mul(d, d); dx = r·(dY − mean(dY) − y·mean(dY·y)) (7 backward nodes; op by op 18 with Pow, 15 with Mul).
- GELU, erf form: y = x·Φ(x), Φ = ½·(1 + erf(x/√2)), x/√2 as a Div or a Mul by 1/√2;
  dx = dY·(Φ + x·φ), φ = exp(−x²/2)/√(2π). As x·(½·(1 + erf)), torch's nn.GELU() below opset 20
  (7 backward nodes; op by op 10), or as (x·½)·(1 + erf), transformers' gelu_python (8; op by op 10).
- Softmax: e = exp(x − max(x)), y = e / Σe over the same axes (keepdims);
  dx = y·(dY − Σ(dY·y)); the max takes no gradient, as y does not depend on it (4 backward nodes;
  op by op 15).

The reductions' axes are an input or, before opset 18 (ReduceSum: 13), an attribute, as older
exporters wrote them; the backward reduces over the same axes in the same form.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter.pattern import OrValue

from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes


def silu(op, x):
    return op.Mul(x, op.Sigmoid(x, _outputs=["s"]))


@rule(pattern=silu, differentiable=("x",))
def _silu(op, match, dY):
    s, y = match["s"], match.outputs[0]
    return {"x": op.Mul(dY, op.Add(s, op.Mul(y, op.Sub(op.const(1.0, like=s), s))))}


def _mean(op, x):
    """ReduceMean of x, its axes an input or an attribute (read from the node, not bound)."""
    return op.ReduceMean(x, _allow_other_inputs=True)


def rms_norm(op, x, two, eps):
    mean = op.ReduceMean(op.Pow(x, two), _allow_other_inputs=True, _outputs=["mean"])
    return op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean, eps)), _outputs=["r"]))


def _reductions_keep_dims(context) -> bool:
    """Every reduction of the match keeps the reduced axes and reduces over the axes it is given."""
    return all(shapes.attr(node, "keepdims", 1) == 1 and shapes.attr(node, "noop_with_empty_axes", 0) == 0
               for node in _reductions(context.nodes))


def _reductions(nodes) -> list[ir.Node]:
    return [node for node in nodes if node.op_type.startswith("Reduce")]


def _same_axes(nodes, x: ir.Value) -> bool:
    """Every reduction among ``nodes`` reduces x's axes (or a value of x's rank) over the same
    given axes: one value, or constants naming the same axes."""
    given = [shapes.axes(node) for node in _reductions(nodes)]
    if not given or any(a is None for a in given):
        return False
    if all(a is given[0] for a in given):
        return True  # one value known at run time only
    if any(isinstance(a, ir.Value) for a in given):
        return False
    rank = shapes.rank(x)
    numbers = [sorted(a % rank if rank else a for a in axes) for axes in given]
    return all(n == numbers[0] for n in numbers)


def _backward_axes(node: ir.Node) -> ir.Value | list[int] | None:
    """What the reduction ``node`` reduces over, for the backward's reductions in the same form at
    the same opset: its axes input itself (shared, not copied), else its attribute's axes."""
    given = node.inputs[1] if len(node.inputs) > 1 else None
    return given if given is not None else shapes.axes(node)


def _squares_kept_dims(context, x, two, eps, **_) -> bool:
    """x² (the exponent a constant 2, as exporters write it) averaged over given axes, kept."""
    return shapes.number(two) == 2.0 and _same_axes(context.nodes, x) and _reductions_keep_dims(context)


@rule(pattern=rms_norm, differentiable=("x",), when=_squares_kept_dims)
def _rms_norm(op, match, dY):
    r, y = match["r"], match.outputs[0]
    mean = op.reduce("ReduceMean", op.Mul(dY, y), _backward_axes(_reductions(match.nodes)[0]))
    return {"x": op.Mul(r, op.Sub(dY, op.Mul(y, mean)))}


def gelu_tanh(op, x, half, three, k, c, one):
    inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), k)), c)
    return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner, _outputs=["t"]), one, _outputs=["s"]))


def _gelu_constants(context, x, half, three, k, c, one, **_) -> bool:
    """½, 3 and 1 where the formula has them; k and c any constants."""
    values = [shapes.number(v) for v in (half, three, k, c, one)]
    return None not in values and values[0] == 0.5 and values[1] == 3.0 and values[4] == 1.0


@rule(pattern=gelu_tanh, differentiable=("x",), when=_gelu_constants)
def _gelu_tanh(op, match, dY):
    x, t, s = match["x"], match["t"], match["s"]
    k, c = shapes.number(match["k"]), shapes.number(match["c"])
    slope = op.Add(op.Mul(op.Mul(x, x), op.const(1.5 * k * c, like=x)), op.const(0.5 * c, like=x))
    sech2 = op.Sub(op.const(1.0, like=x), op.Mul(t, t))
    total = op.Add(op.Mul(s, op.const(0.5, like=x)), op.Mul(op.Mul(x, sech2), slope))
    return {"x": op.Mul(dY, total)}


def layer_norm(op, x, two, eps):
    d = op.Sub(x, _mean(op, x))
    squares = OrValue([op.Pow(d, two), op.Mul(d, d)])
    return op.Div(d, op.Sqrt(op.Add(_mean(op, squares), eps), _outputs=["root"]))


def _centred_squares_kept_dims(context, x, eps, two=None, **_) -> bool:
    """Centred and averaged over the same axes, kept; squared by Pow(d, 2) or Mul(d, d); ε a constant."""
    squared = two is None or shapes.number(two) == 2.0
    return (squared and shapes.number(eps) is not None and _same_axes(context.nodes, x)
            and _reductions_keep_dims(context))


@rule(pattern=layer_norm, differentiable=("x",), when=_centred_squares_kept_dims)
def _layer_norm(op, match, dY):
    root, y, axes = match["root"], match.outputs[0], _backward_axes(_reductions(match.nodes)[0])
    centred = op.Sub(dY, op.reduce("ReduceMean", dY, axes))
    return {"x": op.Div(op.Sub(centred, op.Mul(y, op.reduce("ReduceMean", op.Mul(dY, y), axes))), root)}


def _erf_argument(op, x, scale):
    """x/√2 as Div(x, √2) or Mul(x, 1/√2) (tagged ``divided``)."""
    return OrValue([op.Div(x, scale), op.Mul(x, scale)], tag_var="divided", tag_values=[True, False])


def gelu_erf(op, x, scale, one, half):
    cdf = op.Mul(half, op.Add(op.Erf(_erf_argument(op, x, scale)), one), _outputs=["cdf"])
    return op.Mul(x, cdf)


def gelu_erf_half_first(op, x, scale, one, half):
    return op.Mul(op.Mul(x, half), op.Add(op.Erf(_erf_argument(op, x, scale)), one, _outputs=["s"]))


def _gelu_erf_constants(context, x, scale, one, half, divided, **_) -> bool:
    """x/√2 (to float32 precision), 1 and ½ where the formula has them."""
    factor = shapes.number(scale)
    expected = 2**0.5 if divided else 2**-0.5
    return (factor is not None and abs(factor - expected) < 1e-6 and shapes.number(one) == 1.0
            and shapes.number(half) == 0.5)


def _gelu_erf_gradient(op, x, cdf, dY):
    density = op.Mul(op.Exp(op.Mul(op.Mul(x, x), op.const(-0.5, like=x))), op.const((2 * math.pi) ** -0.5, like=x))
    return {"x": op.Mul(dY, op.Add(cdf, op.Mul(x, density)))}


@rule(pattern=gelu_erf, differentiable=("x",), when=_gelu_erf_constants)
def _gelu_erf(op, match, dY):
    return _gelu_erf_gradient(op, match["x"], match["cdf"], dY)


@rule(pattern=gelu_erf_half_first, differentiable=("x",), when=_gelu_erf_constants)
def _gelu_erf_half_first(op, match, dY):
    x, s = match["x"], match["s"]
    return _gelu_erf_gradient(op, x, op.Mul(s, op.const(0.5, like=x)), dY)


def softmax(op, x):
    e = op.Exp(op.Sub(x, op.ReduceMax(x, _allow_other_inputs=True)))
    return op.Div(e, op.ReduceSum(e, _allow_other_inputs=True, _outputs=["total"]))


def _shifted_by_max_kept_dims(context, x, **_) -> bool:
    """Shifted by the maximum over the axes it sums (where the shift cancels out), kept."""
    return _same_axes(context.nodes, x) and _reductions_keep_dims(context)


@rule(pattern=softmax, differentiable=("x",), when=_shifted_by_max_kept_dims)
def _softmax(op, match, dY):
    y = match.outputs[0]
    axes = _backward_axes(match["total"].producer())  # ReduceSum's own form (an input from opset 13)
    return {"x": op.Mul(y, op.Sub(dY, op.reduce("ReduceSum", op.Mul(dY, y), axes)))}
