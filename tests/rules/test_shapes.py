"""The shared cast helper every rule family uses: which nodes it emits for known and unknown dtypes."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from onnx_autodiff.errors import OpsetTooOldError
from onnx_autodiff.toolkit import Namer, OpBuilder, shapes


def value(name: str, dtype: ir.DataType | None) -> ir.Value:
    return ir.Value(name=name, type=None if dtype is None else ir.TensorType(dtype))


def test_cast_like_casts_to_the_first_known_dtype():
    op = OpBuilder(11, Namer())
    mask = value("mask", ir.DataType.BOOL)
    out = shapes.cast_like(op, mask, value("unknown", None), value("half", ir.DataType.FLOAT16))
    assert [(n.op_type, n.attributes["to"].value) for n in op.nodes] == [("Cast", ir.DataType.FLOAT16)]
    assert out is op.nodes[0].outputs[0] and op.nodes[0].inputs[0] is mask


def test_cast_like_emits_nothing_for_a_value_of_that_dtype():
    op = OpBuilder(18, Namer())
    dY = value("dY", ir.DataType.FLOAT)
    assert shapes.cast_like(op, dY, value("x", ir.DataType.FLOAT)) is dY
    assert op.nodes == []


def test_cast_like_of_an_unknown_dtype_is_a_cast_like_from_opset_15():
    like = value("like", None)
    op = OpBuilder(15, Namer())
    shapes.cast_like(op, value("mask", ir.DataType.BOOL), like)
    assert [n.op_type for n in op.nodes] == ["CastLike"] and op.nodes[0].inputs[1] is like
    with pytest.raises(OpsetTooOldError, match="needs opset 15") as refused:
        shapes.cast_like(OpBuilder(14, Namer()), value("mask", ir.DataType.BOOL), like)
    assert refused.value.needed == 15  # the passes convert the model to opset 15 and retry


def test_unbroadcast_of_unknown_ranks_before_opset_13_asks_for_13_naming_the_values():
    grad, x = value("grad", ir.DataType.FLOAT), value("bias", ir.DataType.FLOAT)
    with pytest.raises(OpsetTooOldError, match="onto 'bias' from 'grad'.*rank of 'bias', 'grad' is unknown") as refused:
        shapes.unbroadcast(OpBuilder(12, Namer()), grad, x, grad)
    assert refused.value.needed == 13  # the passes convert the model to opset 13 and retry


def test_unbroadcast_of_known_ranks_before_opset_13_sums_by_reshape():
    grad = value("grad", ir.DataType.FLOAT)
    grad.shape = ir.Shape(["N", "C", "H"])
    x = value("bias", ir.DataType.FLOAT)
    x.shape = ir.Shape(["C", None])
    op = OpBuilder(12, Namer())
    shapes.unbroadcast(op, grad, x, grad)
    assert op.nodes[0].op_type == "ReduceSum" and list(op.nodes[0].attributes["axes"].value) == [0]
