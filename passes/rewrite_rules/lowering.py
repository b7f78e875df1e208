"""Runtime lowerings: the forms a runtime runs fastest, rewritten from the canonical graphs the
gradient rules emit (plain standard ops, each derivative stated once).

The cleanup applies the rules of its ``target`` in every round
(``cleanup_passes(target="onnxruntime")``, the default; ``target=None`` keeps canonical graphs).
Every rewrite computes the same function (sums in another order; Relu's gate, below, differs only
where the gradient is not finite). The target "webgpu" (onnxruntime-web's WebGPU provider)
applies rules of its own, in :mod:`.webgpu`, before these. The onnxruntime rules, and the figures
that chose them (benchmarks/README.md, "Why the onnxruntime lowering"):

- MatMul of a 2-D Transpose is a Gemm with transA/transB, which reads the matrix transposed in
  place; a Gemm of a 2-D Transpose flips the flag instead;
- MatMul(Mᵀ, v) is MatMul(v, M) and MatMul(v, Mᵀ) is MatMul(M, v) for a 1-D v: onnxruntime 1.32's
  MatmulTransposeFusion turns the first form into a FusedMatMul that miscomputes it;
- a bias sum, ReduceSum over every axis but the last, is the product of a stored vector of ones
  with the rows (at most :data:`COLUMN_SUM_ROWS` of them, static shapes);
- a slope Where(mask, 1, b) with one number 0 <= b <= 1 is Max(Cast(mask), b);
- SoftmaxCrossEntropyLoss (opset 13 on, without log_prob) is NegativeLogLikelihoodLoss of
  LogSoftmax(scores, axis=1): onnxruntime runs the loss as its function, which moves the class
  axis last and back, two copies of the scores; a Softmax of scores that a LogSoftmax also reads
  (its gradient's) is the Exp of that LogSoftmax, so the scores die at the forward's;
- Relu's gate Where(X > 0, dY, 0) is dY·Cast(X > 0): a NaN or infinite dY where X <= 0 then gives
  NaN there (0·NaN), not 0. Only the gate the Relu rule emitted (its node's provenance,
  :func:`~onnx_autodiff.passes.metadata.provenance`, names a default-domain Relu):
  elsewhere, as in Where(x > 0, log(x), 0), the Where keeps a NaN out.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, RewriteRuleSet

from onnx_autodiff.passes.metadata import provenance
from onnx_autodiff.passes.rewrite_rules.analysis import (fill, new_constant, normalized, opset, perm,
                                                      produced_by, size, static, verdict)
from onnx_autodiff.toolkit.shapes import axes, dims, rank
from onnx_autodiff.passes.rewrite_rules.webgpu import webgpu_rules
from onnx_autodiff.toolkit import FLOAT_TYPES

_GEMM_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE})
_COLUMN_SUM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})
COLUMN_SUM_ROWS = 1 << 16  # at most this many rows: the vector of ones is stored in the model


def _transposed_2d(value: ir.Value) -> ir.Value | None:
    """The input of the 2-D Transpose producing ``value``, else None."""
    node = produced_by(value, "Transpose")
    if node is None or rank(node.inputs[0]) != 2 or perm(node, 2) != [1, 0]:
        return None
    return node.inputs[0]


# Each pattern's root carries the whole check (``_check=``), which the cleanup's rule index
# also runs before matching: a failed attempt then costs that check only.

# MatMul(Mᵀ, v) and MatMul(v, Mᵀ), v 1-D


def _transposed_times_vector(context, node: ir.Node):
    a, b = node.inputs
    return verdict(_transposed_2d(a) is not None and rank(b) == 1 or _transposed_2d(b) is not None and rank(a) == 1,
                   "no Transpose of a matrix next to a vector")


def _product_with_vector(op, a, b):
    return op.MatMul(a, b, _check=_transposed_times_vector)


def _vector_product(op, a, b):
    matrix = _transposed_2d(a)
    if matrix is not None and rank(b) == 1:
        return op.MatMul(b, matrix)
    return op.MatMul(_transposed_2d(b), a)


# Gemm reading its operands transposed


def _reads_a_transpose(model: ir.Model, a: ir.Value, b: ir.Value):
    if opset(model) < 11:
        return verdict(False, "Gemm needs C before opset 11")
    return verdict(_transposed_2d(a) is not None or _transposed_2d(b) is not None, "no operand is a Transpose of a matrix")


def _matrices_for_gemm(context, node: ir.Node):
    a, b = node.inputs
    if rank(a) != 2 or rank(b) != 2 or node.outputs[0].dtype not in _GEMM_TYPES:
        return verdict(False, "not a product of two matrices of a type Gemm takes")
    return _reads_a_transpose(context.model, a, b)


def _product_of_matrices(op, a, b):
    return op.MatMul(a, b, _check=_matrices_for_gemm)


def _gemm_of_transposes(op, a, b):
    ta, tb = _transposed_2d(a), _transposed_2d(b)
    flags = {name: 1 for name, source in (("transA", ta), ("transB", tb)) if source is not None}
    return op.Gemm(ta or a, tb or b, **flags)


def _gemm_of_a_transpose(context, node: ir.Node):
    return _reads_a_transpose(context.model, *node.inputs[:2])


def _gemm(op, a, b):
    return op.Gemm(a, b, _allow_other_inputs=True, _allow_other_attributes=True, _check=_gemm_of_a_transpose,
                   _outputs=["y"])


def _gemm_flipped(op, a, b, y):
    node = y.producer()
    attributes = {name: attribute.value for name, attribute in node.attributes.items()}
    ta, tb = _transposed_2d(a), _transposed_2d(b)
    if ta is not None:
        attributes["transA"] = 1 - int(attributes.get("transA", 0))
    if tb is not None:
        attributes["transB"] = 1 - int(attributes.get("transB", 0))
    return op.Gemm(ta or a, tb or b, *node.inputs[2:], **attributes)


# Bias sums: ReduceSum over every axis but the last


def _sums_the_rows(context, node: ir.Node):
    x = node.inputs[0]
    if node.attributes.get_int("keepdims", 1) != 0 or x.dtype not in _COLUMN_SUM_TYPES or opset(context.model) < 5:
        return verdict(False, "not a float or double sum without keepdims")
    shape = dims(x)
    leading = list(range(len(shape) - 1)) if static(shape) else None
    if not leading or normalized(axes(node, computed=False), len(shape)) != leading:
        return verdict(False, "not a sum over every axis but the last of a static shape")
    return verdict(size(shape[:-1]) <= COLUMN_SUM_ROWS,
                   f"more than {COLUMN_SUM_ROWS} rows (the vector of ones would bloat the model)")


def _reduce_sum(op, x):
    return op.ReduceSum(x, _allow_other_inputs=True, _allow_other_attributes=True, _check=_sums_the_rows)


def _column_sums(op, x):
    # Its Reshape is the one a linear layer's weight gradient already made (merged as common).
    shape = dims(x)
    ones = new_constant(op, np.ones(size(shape[:-1]), x.dtype.numpy()))
    rows = x if len(shape) == 2 else op.Reshape(x, new_constant(op, np.array([-1, shape[-1]], np.int64)))
    return op.MatMul(ones, rows)


# Slopes and Relu's gate


def _slope(context, node: ir.Node):
    _, a, b = node.inputs
    slope = fill(b)
    return verdict(fill(a) == 1.0 and slope is not None and 0.0 <= slope <= 1.0 and a.dtype == b.dtype
                   and b.dtype in FLOAT_TYPES, "not Where(mask, 1, b) with one float 0 <= b <= 1")


def _where_of_slopes(op, cond, a, b):
    return op.Where(cond, a, b, _check=_slope)


def _max_of_mask(op, cond, a, b):
    return op.Max(op.Cast(cond, to=int(b.dtype)), b)


def _relu_gate(context, node: ir.Node):
    origin = provenance(node)
    if origin is None or not origin.is_op("Relu"):
        return verdict(False, "not the gate of Relu's gradient")
    _, a, b = node.inputs
    return verdict(fill(b) == 0.0 and a.dtype in FLOAT_TYPES, "not Where(mask, dY, 0) of a float dY")


def _where_of_relu(op, cond, a, b):
    return op.Where(cond, a, b, _check=_relu_gate)


def _masked(op, cond, a, b):
    return op.Mul(a, op.Cast(cond, to=int(a.dtype)))


# SoftmaxCrossEntropyLoss as LogSoftmax and NegativeLogLikelihoodLoss


def _plain_cross_entropy(context, node: ir.Node):
    log_prob = len(node.outputs) > 1 and node.outputs[1].name
    return verdict(opset(context.model) >= 13 and not log_prob and node.inputs[0].dtype in FLOAT_TYPES,
                   "not a float SoftmaxCrossEntropyLoss without log_prob at opset 13 or later")


def _cross_entropy(op, scores, labels):
    return op.SoftmaxCrossEntropyLoss(scores, labels, _allow_other_inputs=True, _allow_other_attributes=True,
                                      _check=_plain_cross_entropy, _outputs=["y"])


def _nll_of_log_softmax(op, scores, labels, y):
    node = y.producer()
    weights = node.inputs[2:3] if len(node.inputs) > 2 and node.inputs[2] is not None else []
    attributes = {name: node.attributes[name].value for name in ("reduction", "ignore_index") if name in node.attributes}
    return op.NegativeLogLikelihoodLoss(op.LogSoftmax(scores, axis=1), labels, *weights, **attributes)


# Softmax beside the LogSoftmax of the same scores


def _log_softmax_beside(node: ir.Node) -> ir.Value | None:
    """The output of a LogSoftmax over the same scores and axis as the Softmax ``node``."""
    x, axis = node.inputs[0], node.attributes.get_int("axis", -1)
    for user, _ in x.uses():
        if (user.op_type == "LogSoftmax" and user.domain == "" and user.graph is node.graph
                and user.attributes.get_int("axis", -1) == axis):
            return user.outputs[0]
    return None


def _softmax_of_log_softmaxed(context, node: ir.Node):
    return verdict(opset(context.model) >= 13 and _log_softmax_beside(node) is not None,
                   "no LogSoftmax of the same scores beside it")


def _softmax(op, x):
    return op.Softmax(x, _allow_other_attributes=True, _check=_softmax_of_log_softmaxed, _outputs=["y"])


def _exp_of_log_softmax(op, x, y):
    return op.Exp(_log_softmax_beside(y.producer()))


def _kernel_forms() -> list[RewriteRule]:
    # remove_nodes=False: a Transpose (or a mask) that others read stays for them.
    return [
        RewriteRule(_product_with_vector, _vector_product, remove_nodes=False, name="ort_vector_product_without_transpose"),
        RewriteRule(_product_of_matrices, _gemm_of_transposes, remove_nodes=False, name="ort_matmul_to_gemm"),
        RewriteRule(_gemm, _gemm_flipped, remove_nodes=False, name="ort_gemm_of_transpose"),
        RewriteRule(_reduce_sum, _column_sums, remove_nodes=False, name="ort_bias_sum_by_ones"),
        RewriteRule(_where_of_slopes, _max_of_mask, remove_nodes=False, name="ort_slope_as_max"),
        RewriteRule(_where_of_relu, _masked, remove_nodes=False, name="ort_relu_gate_as_mask"),
    ]


def onnxruntime_rules() -> list[RewriteRule]:
    return [
        *_kernel_forms(),
        RewriteRule(_cross_entropy, _nll_of_log_softmax, name="ort_cross_entropy_as_nll"),
        RewriteRule(_softmax, _exp_of_log_softmax, name="ort_softmax_as_exp_of_log_softmax"),
    ]


def webgpu_target_rules() -> list[RewriteRule]:
    """onnxruntime-web's WebGPU provider: the rewrites of what it lacks (:mod:`.webgpu`), then the
    onnxruntime rules whose forms it runs too (not the loss's: it has no kernel for either)."""
    return [*webgpu_rules(), *_kernel_forms()]


TARGETS = {"onnxruntime": onnxruntime_rules, "webgpu": webgpu_target_rules}
DEFAULT_TARGET = "onnxruntime"  # what the cleanup lowers for unless told otherwise


def lowering_rules(target) -> RewriteRuleSet:
    """The lowering rules of ``target`` as an onnxscript RewriteRuleSet: one of :data:`TARGETS` by
    name, or an object that carries its own (``target.lowering_rules()``: a training
    :class:`~onnx_autodiff.training.targets.Target`)."""
    if not isinstance(target, str):
        return target.lowering_rules()
    if target not in TARGETS:
        known = ", ".join(repr(name) for name in TARGETS)
        raise ValueError(f"unknown lowering target {target!r}: the known targets are {known} (or None, no lowering)")
    return RewriteRuleSet(TARGETS[target]())
