"""LiftConstantsPass: the main graph's Constants become initializers, except graph outputs and
before IR version 4."""

import numpy as np
import onnx_ir as ir
from helpers import make_model
from onnx import helper, numpy_helper

TWO = numpy_helper.from_array(np.full((2, 3), 2, np.float32))


def model_with_constants(ir_version=None):
    nodes = [helper.make_node("Constant", [], ["two"], value=TWO), helper.make_node("Mul", ["x", "two"], ["y"]),
             helper.make_node("Constant", [], ["out"], value=TWO)]
    proto = make_model(nodes, {"x": np.ones((2, 3), np.float32)}, ["y", "out"])
    if ir_version is not None:
        proto.ir_version = ir_version
    return ir.from_proto(proto)


def test_a_constant_becomes_an_initializer_and_a_graph_output_stays():
    from onnx_autodiff.passes.lift import LiftConstantsPass

    model = model_with_constants()
    assert LiftConstantsPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Mul", "Constant"]
    lifted = model.graph.initializers["two"]
    assert model.graph.node(0).inputs[1] is lifted
    np.testing.assert_array_equal(lifted.const_value.numpy(), np.full((2, 3), 2, np.float32))
    assert not LiftConstantsPass()(model).modified


def test_nothing_is_lifted_before_ir_version_4():
    from onnx_autodiff.passes.lift import LiftConstantsPass

    model = model_with_constants(ir_version=3)
    assert not LiftConstantsPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Constant", "Mul", "Constant"] and not model.graph.initializers
