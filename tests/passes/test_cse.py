"""CommonSubexpressionPass: equal nodes merge, random ones and large constants never do."""

import numpy as np
import onnx_ir as ir
from helpers import make_model
from onnx import helper, numpy_helper

from onnx_autodiff.passes.cse import CSE_TENSOR_LIMIT, CommonSubexpressionPass

X = np.ones((2, 3), np.float32)


def cleaned(nodes, outputs):
    model = ir.from_proto(make_model(nodes, {"x": X}, outputs))
    result = CommonSubexpressionPass()(model)
    return model, result.modified


def test_two_equal_nodes_merge():
    nodes = [helper.make_node("Exp", ["x"], ["a"]), helper.make_node("Exp", ["x"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    model, modified = cleaned(nodes, ["y"])
    assert modified and [n.op_type for n in model.graph] == ["Exp", "Add"]
    add = model.graph.node(1)
    assert add.inputs[0] is add.inputs[1]
    assert not CommonSubexpressionPass()(model).modified  # a fixed point


def test_random_nodes_never_merge():
    nodes = [helper.make_node("RandomUniformLike", ["x"], [name], seed=1.0) for name in "ab"]
    nodes.append(helper.make_node("Add", ["a", "b"], ["y"]))
    model, modified = cleaned(nodes, ["y"])
    assert not modified and len(model.graph) == 3


def test_large_constants_are_not_compared():
    big, small = np.zeros(CSE_TENSOR_LIMIT + 1, np.float32), np.zeros(2, np.float32)
    nodes = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))
             for name, value in (("b1", big), ("b2", big), ("s1", small), ("s2", small))]
    nodes += [helper.make_node("Concat", ["b1", "b2", "s1", "s2"], ["c"], axis=0),
              helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0), helper.make_node("Add", ["x", "s"], ["y"])]
    model, modified = cleaned(nodes, ["y"])
    assert modified and [n.op_type for n in model.graph].count("Constant") == 3  # the small pair merged
