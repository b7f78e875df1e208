"""gradient_of_nodes / gradient_of_function: self-contained FunctionProtos that onnxruntime runs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import UnknownValueError, gradient_of_function, gradient_of_nodes


def call_function(function: onnx.FunctionProto, feeds: dict, n_out: int):
    inputs = list(function.input)
    outputs = [f"out{i}" for i in range(n_out)]
    graph = helper.make_graph(
        [helper.make_node(function.name, inputs, outputs, domain=function.domain)],
        "caller",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[n].shape)) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[x].shape)) for n, x in zip(outputs, inputs)],
    )
    opsets = [helper.make_opsetid(o.domain, o.version) for o in function.opset_import]
    model = helper.make_model(graph, opset_imports=opsets + [helper.make_opsetid(function.domain, 1)],
                              functions=[function], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_gradient_of_nodes_signature_and_values():
    nodes = [helper.make_node("Mul", ["a", "b"], ["m"]), helper.make_node("Add", ["m", "a"], ["c"])]
    function = gradient_of_nodes(nodes, ["a", "b"], "c", opset_imports={"": 18})
    assert list(function.input) == ["a", "b", "dy"] and list(function.output) == ["grad_a", "grad_b"]
    a, b, dy = (np.array(v, np.float32) for v in ([1, 2, 3], [4, 5, 6], [1, -1, 2]))
    grad_a, grad_b = call_function(function, {"a": a, "b": b, "dy": dy}, 2)
    np.testing.assert_allclose(grad_a, dy * (b + 1))
    np.testing.assert_allclose(grad_b, dy * a)


def test_gradient_of_nodes_with_zs_and_missing_zs():
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"])]
    function = gradient_of_nodes(nodes, ["x"], "y", zs=["w"], opset_imports={"": 18})
    assert list(function.input) == ["x", "w", "dy"]
    x, w, dy = (np.array(v, np.float32) for v in ([1, 2], [3, 4], [1, 1]))
    (grad_x,) = call_function(function, {"x": x, "w": w, "dy": dy}, 1)
    np.testing.assert_allclose(grad_x, w)
    with pytest.raises(UnknownValueError, match="add them to zs"):
        gradient_of_nodes(nodes, ["x"], "y", opset_imports={"": 18})


def test_gradient_of_model_embeds_unnamed_initializers_and_leaves_input_unchanged():
    W = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    bias = np.array([0.5, -0.5], np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "bias"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    before = model.SerializeToString(deterministic=True)
    function = gradient_of_function(model, ["W"], "y", zs=["x"])
    assert model.SerializeToString(deterministic=True) == before
    assert list(function.input) == ["W", "x", "dy"]
    x = np.array([[1.0, -2.0]], np.float32)
    dy = np.array([[0.5, 2.0]], np.float32)
    (grad_W,) = call_function(function, {"W": W, "x": x, "dy": dy}, 1)
    np.testing.assert_allclose(grad_W, x.T @ dy)


def test_gradient_of_function_proto():
    body = helper.make_function(
        "lib", "Square", ["X"], ["Y"], [helper.make_node("Mul", ["X", "X"], ["Y"])],
        [helper.make_opsetid("", 18)],
    )
    function = gradient_of_function(body, ["X"], "Y")
    x = np.array([1.0, -3.0], np.float32)
    (grad,) = call_function(function, {"X": x, "dy": np.ones(2, np.float32)}, 1)
    np.testing.assert_allclose(grad, 2 * x)
