"""Zero gradients propagating: an op whose result is zero when one of some inputs is all zeros
(Neg, Mul, MatMul, Transpose, Reshape, Slice, ReduceSum, ...), or when every input is (Add, Sub,
Sum, Concat), becomes zeros of its output's static shape and type, a Constant up to
``analysis.SMALL`` elements, else a ConstantOfShape. Mul by zeros gives zeros even where the
other factor is not finite, as gradients assume."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter import MatchResult

from onnx_autodiff.passes.rewrite_rules.analysis import SMALL, fill, new_constant, opset, size, verdict, zeros_fit
from onnx_autodiff.toolkit.shapes import dims, zeros

# Ops whose result is zero when one of the listed inputs is all zeros (ZERO_IF_ALL: every input).
ZERO_IF_INPUT = {
    "Neg": (0,), "Transpose": (0,), "Reshape": (0,), "Expand": (0,), "Squeeze": (0,),
    "Unsqueeze": (0,), "Flatten": (0,), "Tile": (0,), "Slice": (0,), "Gather": (0,),
    "ReduceSum": (0,), "ReduceMean": (0,), "MatMul": (0, 1), "Mul": (0, 1), "Div": (0,),
}
ZERO_IF_ALL = ("Add", "Sub", "Sum", "Concat")


def _gives_zeros(context, node: ir.Node) -> MatchResult:
    inputs = node.inputs
    if node.op_type in ZERO_IF_ALL:
        present = [v for v in inputs if v is not None]
        zero = bool(present) and all(fill(v) == 0 for v in present)
    else:
        zero = any(i < len(inputs) and fill(inputs[i]) == 0 for i in ZERO_IF_INPUT[node.op_type])
    if not zero:
        return verdict(False, "no zero operand")
    out = node.outputs[0]
    if fill(out) == 0:
        return verdict(False, "zeros already")  # an Expand of zeros: as small as it gets
    return verdict(zeros_fit(out, opset(context.model)), "no static shape, or no Constant of this type")


def _zeros_like(op, x, out):
    # from out's static shape (zeros_fit holds), never Shape(out): the rewrite must not keep
    # out's producer alive
    shape = dims(out)
    if size(shape) <= SMALL:
        return new_constant(op, np.zeros(shape, out.dtype.numpy()))
    return zeros(op, out, new_constant(op, np.array(shape, np.int64)))


def _zero_result(op_type: str) -> RewriteRule:
    def pattern(op, x):
        return getattr(op, op_type)(x, _allow_other_inputs=True, _check=_gives_zeros, _outputs=["out"])

    return RewriteRule(pattern, _zeros_like, name=f"zero_{op_type.lower()}", remove_nodes=False)


def rules() -> list[RewriteRule]:
    return [_zero_result(op_type) for op_type in (*ZERO_IF_INPUT, *ZERO_IF_ALL)]
