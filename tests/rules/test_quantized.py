"""MatMulNBits: gradients through a frozen 4- or 8-bit base to the activation, the bias and float
parameters before it, against the product with the weight dequantized in numpy (whose forward
onnxruntime's kernel reproduces), and on a model onnxruntime's own quantizer wrote."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import autodiff_pass, cleanup_passes

K, N, BLOCK = 40, 6, 16  # K not a multiple of the block: the last block is padded


def quantized(bits: int, zero_points: bool, rng):
    """B, scales, zero points (packed as MatMulNBits reads them, or None) and the dequantized W [K, N]."""
    blocks = -(-K // BLOCK)
    top = 2 ** bits - 1
    q = rng.integers(0, top + 1, (N, blocks, BLOCK)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (N, blocks)).astype(np.float32)
    zero = rng.integers(0, top + 1, (N, blocks)).astype(np.uint8) if zero_points else None
    offset = zero.astype(np.float32)[..., None] if zero_points else float(2 ** (bits - 1))
    weight = ((q.astype(np.float32) - offset) * scales[..., None]).reshape(N, -1)[:, :K].T
    if bits == 4:
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        if zero_points:
            padded = np.concatenate([zero, np.zeros((N, blocks % 2), np.uint8)], axis=1)
            zero = (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)
    else:
        packed = q
        zero = zero.reshape(-1) if zero_points else None
    return packed, scales.reshape(-1), zero, weight.astype(np.float64)


def model(bits, packed, scales, zero, bias):
    """y = MatMulNBits(x · s, B) (+ bias): s a float parameter before the frozen base."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, K).astype(np.float32), "s"),
             numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["h", "B", "scales"]
    if zero is not None:
        inits.append(numpy_helper.from_array(zero, "zero_points"))
    inputs.append("zero_points" if zero is not None else "")
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        inputs += ["", "bias"]
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"]),
             helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=K, N=N, bits=bits,
                              block_size=BLOCK)]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def _session(proto):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gradients_through_the_frozen_base(bits, zero_points, with_bias):
    rng = np.random.default_rng(bits + 2 * zero_points)
    packed, scales, zero, weight = quantized(bits, zero_points, rng)
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    proto = model(bits, packed, scales, zero, bias)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    dy = rng.standard_normal((2, 3, N)).astype(np.float32)
    s = np.linspace(0.5, 1.5, K)
    h = x.astype(np.float64) * s
    forward = _session(proto).run(None, {"x": x})[0]
    np.testing.assert_allclose(forward, h @ weight + (0 if bias is None else bias), rtol=1e-5, atol=1e-5)

    wrt = ["x", "s", *(["bias"] if with_bias else [])]
    autodiff = autodiff_pass(of="y", wrt=wrt)
    result = ir.to_proto(ir.passes.PassManager([autodiff, *cleanup_passes()])(ir.from_proto(proto)).model)
    onnx.checker.check_model(result, full_check=True)
    added = {(n.domain or "", n.op_type) for n in result.graph.node} - {(n.domain or "", n.op_type) for n in proto.graph.node}
    assert all(domain == "" for domain, _ in added)  # the backward is standard operators
    outputs = dict(zip([o.name for o in result.graph.output],
                       _session(result).run(None, {"x": x, autodiff.seed_name: dy})))
    dh = dy.astype(np.float64) @ weight.T
    want = {"x": dh * s, "s": (dh * x).sum((0, 1)), "bias": dy.astype(np.float64).sum((0, 1))}
    for name in wrt:
        np.testing.assert_allclose(outputs[autodiff.gradient_names[name]], want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_model_from_onnxruntimes_quantizer():
    quantization = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x], [y],
                              [numpy_helper.from_array(w, "W")])
    quantizer = quantization.MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                                                  block_size=32, is_symmetric=True)
    quantizer.process()
    proto = quantizer.model.model
    assert [n.op_type for n in proto.graph.node] == ["MatMulNBits"]
    identity = np.eye(64, dtype=np.float32)[:2]
    eye = np.eye(64, dtype=np.float32)
    dequantized = np.concatenate([_session(proto).run(None, {"x": eye[i:i + 2]})[0]
                                  for i in range(0, 64, 2)])  # W [64, 16], as the kernel computes it
    autodiff = autodiff_pass(of="y", wrt=["x"])
    result = ir.to_proto(ir.passes.PassManager([autodiff, *cleanup_passes()])(ir.from_proto(proto)).model)
    dy = rng.standard_normal((2, 16)).astype(np.float32)
    outputs = _session(result).run(None, {"x": identity, autodiff.seed_name: dy})
    np.testing.assert_allclose(outputs[1], dy @ dequantized.T, rtol=1e-5, atol=1e-5)
