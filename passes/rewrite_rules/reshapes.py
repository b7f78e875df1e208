"""Reshapes: a Reshape of a Reshape is one Reshape (to a constant shape without zeros, which would
copy the inner one's dims), and a Concat of Reshapes that merge the same trailing axes, along the
merged axis, is one Reshape of the Concat along the first merged axis (the backward of a fused
q/k/v projection).

onnxscript's ``reshape_reshape_rule`` leaves a Reshape read elsewhere as it is, and writes its
shape as an initializer, which a function cannot hold.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter import MatchResult

from onnx_autodiff.passes.rewrite_rules.analysis import (
    concat_axis, new_constant, only_use, opset, produced_by, same, verdict,
)
from onnx_autodiff.toolkit.shapes import attr, constant, dims


def _reshape_of_reshape(op, x, first, shape):
    return op.Reshape(op.Reshape(x, first), shape)


def _to_explicit_shape(context, x, first, shape) -> MatchResult:
    target = constant(shape, computed=False)
    return verdict(target is not None and not np.any(target == 0), "the shape is not a constant without zeros")


def _one_reshape(op, x, first, shape):
    return op.Reshape(x, shape)


def _merged_tail(value: ir.Value | None, axis: int) -> ir.Value | None:
    """x when ``value`` = Reshape(x) only merges x's axes from ``axis`` on into one (and nothing
    else reads ``value``)."""
    node = produced_by(value, "Reshape")
    if node is None or not only_use(value):
        return None
    x = node.inputs[0]
    dx, dv = dims(x), dims(value)
    if dx is None or dv is None or len(dv) != axis + 1 or len(dx) < axis + 2 or not same(dx[:axis], dv[:axis]):
        return None
    return x


def _merged_sources(node: ir.Node, axis: int) -> list[ir.Value] | None:
    """The inputs of the merging Reshapes a Concat along their merged (last) axis joins, when
    their axes after the first merged one and their types agree."""
    sources = [_merged_tail(v, axis) for v in node.inputs]
    if any(x is None for x in sources):
        return None
    tail = dims(sources[0])[axis + 1 :]
    if not all(same(dims(x)[axis + 1 :], tail) for x in sources) or len({x.dtype for x in sources}) != 1:
        return None
    return sources


def _joins_merged(context, node: ir.Node) -> MatchResult:
    axis = concat_axis(node, opset(context.model))
    holds = axis is not None and axis == len(dims(node.outputs[0])) - 1 and _merged_sources(node, axis) is not None
    return verdict(holds, "not Reshapes merging the same trailing axes")


def _concat_of_reshapes(op, a):
    return op.Concat(a, _allow_other_inputs=True, _check=_joins_merged, _outputs=["out"])


def _reshape_of_concat(op, a, out):
    node = out.producer()
    axis = attr(node, "axis") % len(dims(out))
    shape = new_constant(op, np.array([0] * axis + [-1], np.int64))
    return op.Reshape(op.Concat(*_merged_sources(node, axis), axis=axis), shape)


def rules() -> list[RewriteRule]:
    return [
        RewriteRule(_reshape_of_reshape, _one_reshape, _to_explicit_shape, name="reshape_of_reshape",
                    remove_nodes=False),
        RewriteRule(_concat_of_reshapes, _reshape_of_concat, name="concat_of_merging_reshapes", remove_nodes=False),
    ]
