"""Nodes that return an input: x·1, x/1, x+0, x−0 (the other operand all ones or zeros, and
broadcasting it leaves x's shape), a Sum with zero terms, Identity, Reshape, Expand, Flatten or
Tile to the shape x already has, a reduction over axes of length 1 keeping them, and Squeeze and
Unsqueeze of the same axes undoing each other.

A replacement that is one Identity of an input is that input to the cleanup, which keeps the
graph outputs' names (an Identity stays only where the input cannot take the name).
onnxscript's x·1 rules (``rules.common.mul_by_1_rule``, ...) match scalar constants only; these
read the fill of any operand, through ConstantOfShape, Expand and Cast. onnx-ir's
IdentityEliminationPass removes one node at a time (each removal copies the list of graph
outputs) and can leave two graph outputs on one value.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter import MatchResult

from onnx_autodiff.passes.rewrite_rules.analysis import (
    broadcast, fill, normalized, produced_by, renamable, same, static, verdict,
)
from onnx_autodiff.toolkit.shapes import attr, axes, constant, dims, rank

# The neutral operand of each binary op, and whether it may stand first.
_NEUTRAL = {"Mul": (1.0, True), "Div": (1.0, False), "Add": (0.0, True), "Sub": (0.0, False)}
# Ops that return their data input when the output shape equals the input shape.
_SAME_SHAPE_IDENTITY = ("Reshape", "Expand", "Flatten", "Tile")
# Reductions that return their input when every reduced axis has length 1 and keepdims=1.
_REDUCE_IDENTITY = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd")


def _passes_through(keep: ir.Value | None, other: ir.Value | None, neutral: float, out: ir.Value) -> bool:
    """Whether ``other`` is all ``neutral`` and broadcasting it leaves ``keep``'s shape and type."""
    if keep is None or other is None or fill(other) != neutral:
        return False
    if keep.dtype != out.dtype and out.dtype is not None:
        return False
    return same(broadcast(dims(keep), dims(other)), dims(keep))


def _unchanged_operand(node: ir.Node) -> ir.Value | None:
    """The operand that a Mul, Div, Add or Sub by its neutral element returns."""
    if len(node.inputs) != 2:
        return None
    neutral, commutes = _NEUTRAL[node.op_type]
    a, b = node.inputs
    if _passes_through(a, b, neutral, node.outputs[0]):
        return a
    if commutes and _passes_through(b, a, neutral, node.outputs[0]):
        return b
    return None


def _has_neutral_operand(context, node: ir.Node) -> MatchResult:
    return verdict(_unchanged_operand(node) is not None, "no operand is neutral")


def _unchanged(op, a, b, out):
    return op.Identity(_unchanged_operand(out.producer()))


def _by_neutral(op_type: str) -> RewriteRule:
    def pattern(op, a, b):
        return getattr(op, op_type)(a, b, _check=_has_neutral_operand, _outputs=["out"])

    return RewriteRule(pattern, _unchanged, name=f"{op_type.lower()}_by_neutral", remove_nodes=False)


def _nonzero_terms(node: ir.Node) -> list[ir.Value] | None:
    """The terms of a Sum that has zero terms, when dropping them changes neither shape nor type
    (a Sum of one term: that term)."""
    inputs = list(node.inputs)
    if len(inputs) == 1:
        return inputs
    kept = [v for v in inputs if fill(v) != 0]
    if not kept or len(kept) == len(inputs):
        return None
    if not same(broadcast(*(dims(v) for v in kept)), broadcast(*(dims(v) for v in inputs))):
        return None
    if len(kept) == 1 and kept[0].dtype != node.outputs[0].dtype:
        return None
    return kept


def _has_zero_terms(context, node: ir.Node) -> MatchResult:
    return verdict(_nonzero_terms(node) is not None, "no zero term to drop")


def _sum_with_zeros(op, x):
    return op.Sum(x, _allow_other_inputs=True, _check=_has_zero_terms, _outputs=["out"])


def _sum_of_the_rest(op, x, out):
    kept = _nonzero_terms(out.producer())
    if len(kept) == 1:
        return op.Identity(kept[0])
    return op.Add(*kept) if len(kept) == 2 else op.Sum(*kept)


def _identity(op, x):
    return op.Identity(x, _check=_removable, _outputs=["out"])


def _removable(context, node: ir.Node) -> MatchResult:
    """An Identity goes unless it gives a graph output a name that its input cannot take."""
    holds = not node.outputs[0].is_graph_output() or renamable(node.inputs[0], node.graph)
    return verdict(holds, "a graph output whose input cannot take its name")


def _input_itself(op, x, **_):
    return op.Identity(x)


def _keeps_shape(context, node: ir.Node) -> MatchResult:
    """Reshape, Expand, Flatten or Tile to its input's static shape, or Expand by ones."""
    x, out = node.inputs[0], node.outputs[0]
    if static(dims(x)) and same(dims(x), dims(out)) and x.dtype == out.dtype:
        return verdict(True, "")
    target = constant(node.inputs[1], computed=False) if node.op_type == "Expand" and len(node.inputs) > 1 else None
    ones = target is not None and dims(x) is not None and target.size <= len(dims(x)) and bool(np.all(target == 1))
    return verdict(ones, "the shape changes")


def _returns_its_input(op_type: str, check) -> RewriteRule:
    """``op_type`` of x (other inputs allowed) is x where ``check`` holds."""
    def pattern(op, x):
        return getattr(op, op_type)(x, _allow_other_inputs=True, _check=check)

    return RewriteRule(pattern, _input_itself, name=f"no_op_{op_type.lower()}", remove_nodes=False)


def _reduces_nothing(context, node: ir.Node) -> MatchResult:
    """A reduction keeping its axes over axes of length 1 (or none, with noop_with_empty_axes)."""
    x = node.inputs[0]
    if attr(node, "keepdims", 1) != 1 or dims(x) is None:
        return verdict(False, "keepdims=0 or an unknown rank")
    reduced = axes(node, computed=False)
    if isinstance(reduced, ir.Value):
        return verdict(False, "axes known at run time only")
    if not reduced:
        return verdict(attr(node, "noop_with_empty_axes", 0) == 1, "no axes: every axis reduces")
    r = len(dims(x))
    holds = all(-r <= a < r and dims(x)[a] == 1 for a in reduced) and x.dtype == node.outputs[0].dtype
    return verdict(holds, "an axis longer than 1")


def _squeeze_of_unsqueeze(op, x):
    return op.Squeeze(op.Unsqueeze(x, _allow_other_inputs=True, _outputs=["inner"]), _allow_other_inputs=True)


def _squeezes_what_was_unsqueezed(context, x, inner) -> MatchResult:
    unsqueezed = axes(produced_by(inner, "Unsqueeze"), computed=False)
    if not isinstance(unsqueezed, list):
        return verdict(False, "other axes")
    r = None if rank(x) is None else rank(x) + len(unsqueezed)
    squeezed = normalized(axes(context.root, computed=False), r)
    return verdict(squeezed is not None and squeezed == normalized(unsqueezed, r), "other axes")


def _unsqueeze_of_squeeze(op, x):
    return op.Unsqueeze(op.Squeeze(x, _allow_other_inputs=True, _outputs=["inner"]), _allow_other_inputs=True)


def _unsqueezes_what_was_squeezed(context, x, inner) -> MatchResult:
    """An explicit Squeeze removes exactly its axes, which the Unsqueeze puts back."""
    unsqueezed = normalized(axes(context.root, computed=False), rank(x))
    squeezed = axes(produced_by(inner, "Squeeze"), computed=False)
    return verdict(bool(unsqueezed) and unsqueezed == normalized(squeezed, rank(x)),
                   "other axes")


def rules() -> list[RewriteRule]:
    return [
        *(_by_neutral(op_type) for op_type in _NEUTRAL),
        RewriteRule(_sum_with_zeros, _sum_of_the_rest, name="sum_without_zeros", remove_nodes=False),
        RewriteRule(_identity, _input_itself, name="identity", remove_nodes=False),
        *(_returns_its_input(op_type, _keeps_shape) for op_type in _SAME_SHAPE_IDENTITY),
        *(_returns_its_input(op_type, _reduces_nothing) for op_type in _REDUCE_IDENTITY),
        RewriteRule(_squeeze_of_unsqueeze, _input_itself, _squeezes_what_was_unsqueezed,
                    name="squeeze_of_unsqueeze", remove_nodes=False),
        RewriteRule(_unsqueeze_of_squeeze, _input_itself, _unsqueezes_what_was_squeezed,
                    name="unsqueeze_of_squeeze", remove_nodes=False),
    ]
