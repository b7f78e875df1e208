"""gradient_of_nodes / gradient_of_function: self-contained FunctionProtos that onnxruntime runs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import UnknownValueError, gradient_of_function, gradient_of_nodes
from onnx_autodiff.conformance import fd_vjp
from onnx_autodiff.conformance.check import compare


def call_function(function: onnx.FunctionProto, feeds: dict, n_out: int):
    inputs = list(function.input)
    outputs = [f"out{i}" for i in range(n_out)]
    graph = helper.make_graph(
        [helper.make_node(function.name, inputs, outputs, domain=function.domain)],
        "caller",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(feeds[n].dtype), list(feeds[n].shape))
         for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[x].shape)) for n, x in zip(outputs, inputs)],
    )
    opsets = [helper.make_opsetid(o.domain, o.version) for o in function.opset_import]
    model = helper.make_model(graph, opset_imports=opsets + [helper.make_opsetid(function.domain, 1)],
                              functions=[function], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
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


def assert_matches_finite_differences(function, model, feeds, xs, dy):
    """The function's gradients, run on onnxruntime, against float64 central differences of the
    model's VJP for the cotangent ``dy`` (its only output)."""
    grads = call_function(function, {**feeds, "dy": dy}, len(xs))
    fd = fd_vjp(model, {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}, xs, [dy])
    for x, grad in zip(xs, grads):
        assert compare(grad, fd.details[x], atol=1e-4, rtol=1e-3) <= 1.0, (x, grad, fd[x])
        assert np.any(grad != 0)


def _if_reading_outer_values(w_initializer: bool):
    """y = sum(If(cond, tanh(x * W), sin(W) * x)): both branches read x and W from the outer graph."""
    f = TensorProto.FLOAT
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["x", "W"], ["t1"]), helper.make_node("Tanh", ["t1"], ["t2"])], "then", [],
        [helper.make_tensor_value_info("t2", f, [3])])
    else_branch = helper.make_graph(
        [helper.make_node("Sin", ["W"], ["e1"]), helper.make_node("Mul", ["e1", "x"], ["e2"])], "else", [],
        [helper.make_tensor_value_info("e2", f, [3])])
    nodes = [helper.make_node("If", ["cond"], ["h"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("x", f, [3]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])]
    W = np.array([0.5, -1.5, 2.0], np.float32)
    initializers = [numpy_helper.from_array(W, "W")] if w_initializer else []
    if not w_initializer:
        inputs.append(helper.make_tensor_value_info("W", f, [3]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", f, [])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), W


@pytest.mark.parametrize("w_initializer", [False, True])
@pytest.mark.parametrize("cond", [True, False])
def test_gradient_of_function_through_an_if_reading_the_variables(w_initializer, cond):
    """The branches' VJPs read the seed's expansion from the outer graph: it must be kept."""
    model, W = _if_reading_outer_values(w_initializer)
    feeds = {"x": np.array([1.0, -2.0, 0.25], np.float32), "cond": np.array(cond), "W": W}
    function = gradient_of_function(model, ["W", "x"], "y", zs=["cond"])
    assert_matches_finite_differences(function, model, feeds, ["W", "x"], np.array(1.5, np.float32))
    function = gradient_of_nodes(list(model.graph.node), ["x"], "y", zs=["W", "cond"], opset_imports={"": 18})
    assert_matches_finite_differences(function, model, feeds, ["x"], np.array(-0.5, np.float32))


def _unshaped_matmul_model():
    """y = Tanh(x) @ W + x @ V, with no value_info: u = Tanh(x) has no recorded shape."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["u"]), helper.make_node("MatMul", ["u", "W"], ["a"]),
         helper.make_node("MatMul", ["x", "V"], ["b"]), helper.make_node("Add", ["a", "b"], ["y"])],
        "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "W"),
         numpy_helper.from_array(np.linspace(2, -1, 12, dtype=np.float32).reshape(4, 3), "V")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_gradient_of_function_and_nodes_complete_shapes_as_the_pass_does():
    model = _unshaped_matmul_model()
    assert not model.graph.value_info
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    dy = np.linspace(1, -2, 6, dtype=np.float32).reshape(2, 3)
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    function = gradient_of_function(model, ["W", "x"], "y", zs=["V"])
    assert_matches_finite_differences(function, model, {"x": x, **params}, ["W", "x"], dy)
    gradient_of_function(model.graph, ["W", "x"], "y", zs=["V"])  # a bare graph too (at onnx's newest opset)
    # Nodes alone carry no types: value_info gives the inputs', inference the rest.
    initializer_types = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 3]) for n in ("W", "V")]
    function = gradient_of_nodes(list(model.graph.node), ["x", "W"], "y", zs=["V"], opset_imports={"": 18},
                                 value_info=[*model.graph.input, *initializer_types])
    assert_matches_finite_differences(function, model, {"x": x, **params}, ["x", "W"], dy)
    function_proto = onnx.helper.make_function(
        "lib", "F", ["x", "W", "V"], ["y"], list(model.graph.node), [helper.make_opsetid("", 18)],
        value_info=[*model.graph.input, *initializer_types])
    function = gradient_of_function(function_proto, ["W"], "y", zs=["x", "V"])
    assert_matches_finite_differences(function, model, {"x": x, **params}, ["W"], dy)
