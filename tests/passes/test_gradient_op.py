"""Lowering ai.onnx.preview.training::Gradient nodes: the two ONNX backend cases and a nested one."""

import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnx_autodiff import GradientOpLoweringPass

SIMPLE = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "simple")


@pytest.mark.parametrize("case", ["test_gradient_of_add", "test_gradient_of_add_and_mul"])
def test_backend_gradient_cases_run_on_onnxruntime(case):
    model = ir.load(os.path.join(SIMPLE, case, "model.onnx"))
    GradientOpLoweringPass()(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    data = os.path.join(SIMPLE, case, "test_data_set_0")
    load = lambda name: numpy_helper.to_array(onnx.load_tensor(os.path.join(data, name)))  # noqa: E731
    feeds = {proto.graph.input[i].name: load(f"input_{i}.pb") for i in range(2)}
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for i, got in enumerate(session.run(None, feeds)):
        np.testing.assert_array_equal(got, load(f"output_{i}.pb"))


def test_second_order_through_two_gradient_nodes():
    """y = x³; the inner Gradient gives 3x², the outer one differentiates that: 6x."""
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["x2"]),
        helper.make_node("Mul", ["x2", "x"], ["y"]),
        helper.make_node("Gradient", ["x"], ["dy_dx"], domain="ai.onnx.preview.training", xs=["x"], y="y"),
        helper.make_node("Gradient", ["x"], ["d2y_dx2"], domain="ai.onnx.preview.training", xs=["x"], y="dy_dx"),
    ]
    float_scalar = lambda n: helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [])  # noqa: E731
    graph = helper.make_graph(nodes, "g", [float_scalar("x")], [float_scalar("dy_dx"), float_scalar("d2y_dx2")])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)],
        ir_version=8,
    )
    lowered = ir.from_proto(model)
    GradientOpLoweringPass()(lowered)
    proto = ir.to_proto(lowered)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    first, second = session.run(None, {"x": np.array(1.5, np.float32)})
    assert first == pytest.approx(3 * 1.5**2) and second == pytest.approx(6 * 1.5)
