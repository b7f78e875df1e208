"""Fake quantization's insertion: which inputs get a QDQ pair, and the pairs' values in evaluation
form against numpy's quantization of the same ranges."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_autodiff.modelfile import from_proto, to_proto
from onnx_autodiff.training.generation.fake_quantize import FakeQuantizePass
from onnx_autodiff.training.qat import QatConfig


def matmuls(k: int = 40, n: int = 6, transposed: bool = False):
    """x [N, k] → MatMul by w [k, n] (or Gemm by its transpose) → MatMul by v [n, 3] named 'head'."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (k, n)).astype(np.float32)
    first = (helper.make_node("Gemm", ["x", "w"], ["h"], transB=1, name="body") if transposed
             else helper.make_node("MatMul", ["x", "w"], ["h"], name="body"))
    inits = [numpy_helper.from_array(w.T.copy() if transposed else w, "w"),
             numpy_helper.from_array(rng.normal(0, 0.5, (n, 3)).astype(np.float32), "v")]
    graph = helper.make_graph([first, helper.make_node("MatMul", ["h", "v"], ["y"], name="head")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), w


def inserted(proto, config):
    model = from_proto(proto)
    fake = FakeQuantizePass(config)
    fake(model)
    return to_proto(model), fake


def blocked_reference(w: np.ndarray, block: int) -> np.ndarray:
    """Symmetric int4 round-to-nearest of w [k, n] in blocks of ``block`` rows, on ±7."""
    out = np.empty_like(w)
    for start in range(0, w.shape[0], block):
        part = w[start:start + block]
        scale = np.maximum(np.abs(part).max(0) / np.float32(7), np.finfo(np.float32).eps).astype(np.float32)
        out[start:start + block] = np.clip(np.round(part / scale), -8, 7) * scale
    return out


@pytest.mark.parametrize("transposed", [False, True])
def test_int4_blocks_along_the_reduction_axis_with_a_short_last_block(transposed):
    proto, w = matmuls(k=40, transposed=transposed)
    fake_quantized, fake = inserted(proto, QatConfig("int4-weights", block_size=32, skip=("head",)))
    assert fake.quantized == ["body"] and fake.observers == []
    onnx.checker.check_model(fake_quantized, full_check=True)
    x = np.eye(40, dtype=np.float32)  # the identity reads the quantized weight's rows back
    v = numpy_helper.to_array(proto.graph.initializer[1])
    (got,) = ort.InferenceSession(fake_quantized.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, blocked_reference(w, 32) @ v, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, w @ v, rtol=1e-5, atol=1e-6)


def test_int8_per_channel_weights_and_observed_activations():
    proto, w = matmuls(k=8)
    fake_quantized, fake = inserted(proto, QatConfig("int8"))
    assert fake.quantized == ["body", "head"]
    # each layer's input and output; the head's input is the body's output, quantized once; the
    # graph output keeps its name, read from the fake quantization of what the head computes
    assert [(o.observed, o.minimum, o.maximum) for o in fake.observers] == [
        ("x", "x_observed_min", "x_observed_max"), ("h", "h_observed_min", "h_observed_max"),
        ("y_float", "y_observed_min", "y_observed_max")]
    quantizers = [n for n in fake_quantized.graph.node if n.op_type == "QuantizeLinear"]
    assert sorted(n.input[0] for n in quantizers) == ["h", "v", "w", "x", "y_float"]
    assert fake_quantized.graph.output[0].name == "y"
    # the observers' buffers hold [0, 0] until a step observes a range: the eval form stays finite
    out = ReferenceEvaluator(fake_quantized).run(None, {"x": np.ones((2, 8), np.float32)})[0]
    assert np.isfinite(out).all()
    # set the ranges: the activation quantizes as uint8 on [min, max] widened to hold 0
    for t in fake_quantized.graph.initializer:
        if t.name.endswith("_observed_max"):
            t.CopyFrom(numpy_helper.from_array(np.array(2.0, np.float32), t.name))
    x = np.linspace(-1, 3, 16, dtype=np.float32).reshape(2, 8)
    scale = np.float32(2.0 / 255)
    x_q = np.clip(np.round(x / scale), 0, 255) * scale
    w_scale = (np.abs(w).max(0) / np.float32(127)).astype(np.float32)
    w_q = np.clip(np.round(w / w_scale), -128, 127) * w_scale
    h = x_q @ w_q
    h_q = np.clip(np.round(h / scale), 0, 255) * scale
    v = numpy_helper.to_array(proto.graph.initializer[1])
    v_scale = (np.abs(v).max(0) / np.float32(127)).astype(np.float32)
    y = h_q @ (np.clip(np.round(v / v_scale), -128, 127) * v_scale)
    expected = np.clip(np.round(y / scale), 0, 255) * scale
    np.testing.assert_allclose(ReferenceEvaluator(fake_quantized).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_a_maxpool_of_a_quantized_output_is_read_as_it_is():
    """conv → relu → MaxPool → conv: the pooled values are on the first output's grid already (as
    torch's QAT and onnxruntime's kernels take them), so the second conv's input gets no observer."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
             for name, shape in (("w1", (4, 1, 3, 3)), ("w2", (2, 4, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    _, fake = inserted(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), QatConfig("int8"))
    assert fake.quantized == ["conv1", "conv2"]
    assert [o.observed for o in fake.observers] == ["x", "r1", "y_float"]
