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


def shipped_base(form: str, rng):
    """y = (x · s) @ W with W frozen in a shipped form, and W dequantized (float64) for the oracle."""
    if form.startswith("nbits"):
        packed, scales, zero, weight = quantized(int(form[5]), form.endswith("zp"), rng)
        return model(int(form[5]), packed, scales, zero, None), weight
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, K).astype(np.float32), "s")]
    opset = 18
    if form == "float16":
        stored = rng.standard_normal((K, N)).astype(np.float16)
        inits.append(numpy_helper.from_array(stored, "W16"))
        read = helper.make_node("Cast", ["W16"], ["W"], to=TensorProto.FLOAT)
        weight = stored.astype(np.float64)
    elif form == "int8_axis":
        q = rng.integers(-128, 128, (K, N)).astype(np.int8)
        scale = rng.uniform(0.01, 0.1, N).astype(np.float32)
        zero = rng.integers(-5, 5, N).astype(np.int8)
        inits += [numpy_helper.from_array(q, "Wq"), numpy_helper.from_array(scale, "Wscale"),
                  numpy_helper.from_array(zero, "Wzero")]
        read = helper.make_node("DequantizeLinear", ["Wq", "Wscale", "Wzero"], ["W"], axis=1)
        weight = (q.astype(np.float64) - zero) * scale
    else:  # int4 blocked along K (opset 21)
        opset = 21
        q = rng.integers(-8, 8, (K, N)).astype(np.int8)
        scale = rng.uniform(0.01, 0.1, (K // 8, N)).astype(np.float32)
        inits += [helper.make_tensor("Wq", TensorProto.INT4, [K, N], q.reshape(-1).tolist()),
                  numpy_helper.from_array(scale, "Wscale")]
        read = helper.make_node("DequantizeLinear", ["Wq", "Wscale"], ["W"], axis=0, block_size=8)
        weight = q.astype(np.float64) * np.repeat(scale, 8, axis=0)
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"]), read, helper.make_node("MatMul", ["h", "W"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), weight


FORMS = ["nbits4", "nbits4zp", "nbits8", "int8_axis", "int4_blocked", "float16"]


@pytest.mark.parametrize("form", FORMS)
def test_lora_on_a_frozen_base(form):
    """The base is a LoRA target in each shipped form; the adapters' gradients through it are
    those of x·s @ W + (x·s @ A) @ B with W dequantized in numpy."""
    from onnx_autodiff.training.lora import LoraConfig, LoraPass

    rng = np.random.default_rng(FORMS.index(form))
    proto, weight = shipped_base(form, rng)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    h = x.astype(np.float64) * np.linspace(0.5, 1.5, K)
    # onnxruntime fuses an int8 DequantizeLinear into its MatMul and quantizes x to int8 on the fly
    # (dynamic quantization): about 1% off the exact product
    tolerance = 2e-2 if form == "int8_axis" else 1e-3

    def close(actual, desired, name=""):
        np.testing.assert_allclose(actual, desired, rtol=0, atol=tolerance * np.abs(desired).max(), err_msg=name)

    close(_session(proto).run(None, {"x": x})[0], h @ weight)
    model_ir = ir.from_proto(proto)
    lora = LoraPass(LoraConfig(rank=3))
    lora(model_ir)
    [adapter] = lora.adapters
    assert adapter.base == {"nbits": "MatMulNBits", "float": "Cast"}.get(form[:5], "DequantizeLinear")
    a = rng.standard_normal((K, 3)).astype(np.float32)  # B random too: with B = 0 A's gradient is 0
    b = rng.standard_normal((3, N)).astype(np.float32)
    model_ir.graph.initializers[adapter.A].const_value = ir.Tensor(a)
    model_ir.graph.initializers[adapter.B].const_value = ir.Tensor(b)
    autodiff = autodiff_pass(of="y", wrt=[adapter.A, adapter.B, "x"])
    result = ir.to_proto(ir.passes.PassManager([autodiff, *cleanup_passes()])(model_ir).model)
    onnx.checker.check_model(result, full_check=True)
    dy = rng.standard_normal((2, 3, N)).astype(np.float32)
    outputs = dict(zip([o.name for o in result.graph.output], _session(result).run(None, {"x": x, autodiff.seed_name: dy})))
    r = dy.astype(np.float64)
    want = {adapter.A: np.einsum("btk,btn,rn->kr", h, r, b), adapter.B: np.einsum("btk,kr,btn->rn", h, a, r),
            "x": (r @ weight.T + r @ b.T @ a.T) * np.linspace(0.5, 1.5, K)}
    close(outputs["y"], h @ weight + h @ a @ b)
    for name, value in want.items():
        close(outputs[autodiff.gradient_names[name]], value, name)


@pytest.mark.parametrize("form", ["nbits4zp", "float16"])
def test_lora_artifacts_on_a_frozen_base_train_and_export(form):
    from onnx_autodiff.training.lora import LoraConfig
    from onnx_autodiff.training import Trainer, generate_artifacts

    rng = np.random.default_rng(0)
    proto, weight = shipped_base(form, rng)
    artifacts = generate_artifacts(proto, loss="mse", optimizer="adamw", optimizer_options={"lr": 1e-2},
                                   lora=LoraConfig(rank=2))
    assert len(artifacts.params) == 2
    trainer = Trainer(artifacts)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    labels = rng.standard_normal((2, 3, N)).astype(np.float32)
    losses = [trainer.step({"x": x, "labels": labels}) for _ in range(8)]
    assert losses[-1] < losses[0]
    kept = trainer.export(merge=False)
    want = _session(kept).run(None, {"x": x})[0]
    merged = trainer.export()  # the merged weight stored again in the base's own form
    assert [t.name for t in merged.graph.initializer] == [t.name for t in proto.graph.initializer]
    assert [t.data_type for t in merged.graph.initializer] == [t.data_type for t in proto.graph.initializer]
    onnx.checker.check_model(merged, full_check=True)
    h = np.abs(x.astype(np.float64) * np.linspace(0.5, 1.5, K))
    if form == "float16":  # rounded to float16: half a unit in the last place per weight
        step = np.abs(weight) * 2.0 ** -11 + 1e-7
    else:  # rounded to the merged scales: half a step per weight
        scales = numpy_helper.to_array(next(t for t in merged.graph.initializer if t.name == "scales"))
        step = np.repeat(scales.reshape(N, -1), BLOCK, axis=1)[:, :K].T / 2
    bound = h @ step + 1e-4
    assert np.all(np.abs(_session(merged).run(None, {"x": x})[0] - want) <= bound)


@pytest.mark.parametrize("bits,zero_points", [(4, False), (4, True), (8, True)])
def test_a_large_weight_is_dequantized_a_slice_at_a_time(bits, zero_points, monkeypatch):
    """With room for one column of W at a time the backward sums N partial products: the same gradients."""
    from onnx_autodiff.rules import quantized as rule

    monkeypatch.setattr(rule, "CHUNK", K)
    test_gradients_through_the_frozen_base(bits, zero_points, True)
