import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers import assert_gradients, make_model, rng

R = rng(11)


def branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])


def if_model():
    then_branch = branch("then", [helper.make_node("Mul", ["x", "W"], ["t1"]), helper.make_node("Tanh", ["t1"], ["t2"])], "t2")
    else_branch = branch("else", [helper.make_node("Sin", ["x"], ["e1"])], "e1")
    nodes = [
        helper.make_node("If", ["cond"], ["h"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["h", "x"], ["y"]),
    ]
    x = np.zeros((2, 3), np.float32)
    return make_model(nodes, {"cond": np.array(True), "x": x, "W": x}, ["y"], output_shapes={"y": [2, 3]})


@pytest.mark.parametrize("cond", [True, False])
def test_if_captured_values(cond):
    feeds = {"cond": np.array(cond), "x": R.standard_normal((2, 3)).astype(np.float32),
             "W": R.standard_normal((2, 3)).astype(np.float32)}
    result = assert_gradients(if_model(), feeds, ["x", "W"])
    if not cond:
        assert np.all(result.ad["W"] == 0)


def test_nested_if():
    inner = helper.make_node(
        "If", ["c2"], ["i"],
        then_branch=branch("t", [helper.make_node("Exp", ["x"], ["ti"])], "ti"),
        else_branch=branch("e", [helper.make_node("Neg", ["x"], ["ei"])], "ei"),
    )
    outer_then = branch("ot", [inner, helper.make_node("Mul", ["i", "x"], ["o"])], "o")
    outer_else = branch("oe", [helper.make_node("Cos", ["x"], ["c"])], "c")
    nodes = [helper.make_node("If", ["c1"], ["y"], then_branch=outer_then, else_branch=outer_else)]
    x = R.standard_normal(4).astype(np.float32)
    model = make_model(nodes, {"c1": np.array(True), "c2": np.array(True), "x": x}, ["y"], output_shapes={"y": [4]})
    for c1 in (True, False):
        for c2 in (True, False):
            assert_gradients(model, {"c1": np.array(c1), "c2": np.array(c2), "x": x}, ["x"])
