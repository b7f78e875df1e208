import numpy as np
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, op_model, rng

R = rng()
BROADCAST_SHAPES = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((4,), (2, 3, 4)), ((2, 1, 4), (3, 1))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shape_a,shape_b", BROADCAST_SHAPES)
def test_binary_broadcast(op, shape_a, shape_b):
    a = R.standard_normal(shape_a).astype(np.float32)
    b = R.uniform(0.5, 2.0, shape_b).astype(np.float32)
    model = op_model(op, {"A": a, "B": b})
    assert_gradients(model, {"A": a, "B": b}, ["A", "B"])


@pytest.mark.parametrize("op", ["Add", "Mul", "Div"])
def test_binary_symbolic_batch(op):
    a = R.standard_normal((5, 3, 4)).astype(np.float32)
    b = R.uniform(0.5, 2.0, (1, 3, 1)).astype(np.float32)
    model = op_model(op, {"A": a, "B": b}, shapes={"A": ["N", 3, 4], "B": [1, 3, 1]})
    assert_gradients(model, {"A": a, "B": b}, ["A", "B"])


def test_same_input_twice():
    x = R.standard_normal((3, 2)).astype(np.float32)
    model = make_model([helper.make_node("Mul", ["X", "X"], ["Y"])], {"X": x}, ["Y"])
    assert_gradients(model, {"X": x}, ["X"])


POSITIVE = {"Log", "Sqrt", "Reciprocal"}


@pytest.mark.parametrize(
    "op,input_name",
    [("Neg", "X"), ("Identity", "input"), ("Relu", "X"), ("Sigmoid", "X"), ("Tanh", "input"),
     ("Exp", "input"), ("Log", "input"), ("Sqrt", "X"), ("Reciprocal", "X")],
)
def test_unary(op, input_name):
    x = R.standard_normal((3, 5)).astype(np.float32)
    if op in POSITIVE:
        x = np.abs(x) + 0.5
    if op == "Relu":
        x = np.where(np.abs(x) < 0.05, 0.3, x).astype(np.float32)
    model = op_model(op, {input_name: x})
    assert_gradients(model, {input_name: x}, [input_name])


@pytest.mark.parametrize("to", [1, 11])
def test_cast_float_types(to):
    x = R.standard_normal((4,)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=to), helper.make_node("Mul", ["c", "c"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"])
    assert_gradients(model, {"x": x}, ["x"])
