"""Casts that change nothing: a Cast or CastLike to the type it already has, and a Cast of an
exactly widening Cast (the wide type holds every value of the narrow one)."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter import MatchResult
from onnxscript.rewriter.rules.common import no_op_cast_rule

_F16, _BF16, _F32, _F64 = ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE
# Casts that represent every value of the source type exactly, so casting back is the identity.
EXACT_WIDENING = {
    _F16: {_F32, _F64},
    _BF16: {_F32, _F64},
    _F32: {_F64},
    ir.DataType.INT8: {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, _F32, _F64},
    ir.DataType.UINT8: {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, _F32, _F64},
    ir.DataType.INT16: {ir.DataType.INT32, ir.DataType.INT64, _F32, _F64},
    ir.DataType.INT32: {ir.DataType.INT64, _F64},
    ir.DataType.BOOL: {ir.DataType.INT32, ir.DataType.INT64, _F16, _F32, _F64},
}


def _cast_of_cast(op, x, wide, to):
    return op.Cast(op.Cast(x, to=wide, _allow_other_attributes=False), to=to, _allow_other_attributes=False)


def _widening_first(context, x, wide, to) -> MatchResult:
    check = MatchResult()
    if x.dtype is None or ir.DataType(wide.as_int()) not in EXACT_WIDENING.get(x.dtype, ()):
        return check.fail("the first Cast is not an exact widening")  # saturate/round_mode: narrow floats only
    return check


def _cast_once(op, x, wide, to):
    return op.Identity(x) if x.dtype == to.as_int() else op.Cast(x, to=to.as_int())


def _cast_like_itself(op, x, like):
    return op.CastLike(x, like)


def _same_type(context, x, like) -> MatchResult:
    check = MatchResult()
    if x.dtype is None or x.dtype != like.dtype:
        return check.fail("CastLike changes the type")
    return check


def _identity(op, x, like):
    return op.Identity(x)


def rules() -> list[RewriteRule]:
    return [
        no_op_cast_rule,  # onnxscript's: Cast(x, to=x's type) is x
        RewriteRule(_cast_of_cast, _cast_once, _widening_first, name="cast_of_exact_widening"),
        RewriteRule(_cast_like_itself, _identity, _same_type, name="no_op_cast_like"),
    ]
