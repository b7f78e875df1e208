"""Quantization-aware training end to end: steps equal torch.ao.quantization's FakeQuantize with the
same observers, the exported QDQ model runs on onnxruntime's quantized kernels and agrees with the
eval model."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training import Trainer, generate_artifacts
from onnx_autodiff.training.qat import QatConfig

torch = pytest.importorskip("torch")
F = torch.nn.functional
quantization = pytest.importorskip("torch.ao.quantization")


class Net:
    """conv 1→4 (3×3, pad 1), ReLU, conv 4→6 (3×3), ReLU, flatten, linear 96→5: in torch and as ONNX
    (opset 17, dynamic batch), the same weights."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.conv1, self.conv2 = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Conv2d(4, 6, 3)
        self.fc = torch.nn.Linear(6 * 4 * 4, 5)
        self.params = {"c1.w": self.conv1.weight, "c1.b": self.conv1.bias, "c2.w": self.conv2.weight,
                       "c2.b": self.conv2.bias, "fc.w": self.fc.weight, "fc.b": self.fc.bias}

    def onnx(self) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(p.detach().numpy().copy(), n) for n, p in self.params.items()]
        nodes = [helper.make_node("Conv", ["x", "c1.w", "c1.b"], ["y1"], pads=[1, 1, 1, 1], name="conv1"),
                 helper.make_node("Relu", ["y1"], ["r1"]),
                 helper.make_node("Conv", ["r1", "c2.w", "c2.b"], ["y2"], name="conv2"),
                 helper.make_node("Relu", ["y2"], ["r2"]), helper.make_node("Flatten", ["r2"], ["f"]),
                 helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], transB=1, name="fc")]
        graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 6, 6])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def activation_fake_quant():
    return quantization.FakeQuantize(observer=quantization.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                     dtype=torch.quint8, qscheme=torch.per_tensor_affine, averaging_constant=0.01)


def weight_fake_quant(bits: int):
    # the weights' range of each step: torch's per-channel observer with averaging constant 1
    qmax = 2 ** (bits - 1) - 1
    return quantization.FakeQuantize(observer=quantization.MovingAveragePerChannelMinMaxObserver, quant_min=-qmax,
                                     quant_max=qmax, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                     averaging_constant=1.0, ch_axis=0)


def quantized_forward(x, p: dict, acts: dict, weights: list):
    """The Net's forward on parameters ``p`` (by initializer name) with torch's fake quantization
    where the build puts it: ``acts`` by the observed value's name (each layer's input and its
    output after its ReLU; an input that a previous layer's output already is read as it is),
    ``weights`` one per quantized layer (two: fc left in float)."""
    def act(name, v):
        return acts[name](v) if name in acts else v

    y = act("r1", F.relu(F.conv2d(act("x", x), weights[0](p["c1.w"]), p["c1.b"], padding=1)))
    y = act("r2", F.relu(F.conv2d(y, weights[1](p["c2.w"]), p["c2.b"]))).flatten(1)
    if len(weights) < 3:
        return F.linear(y, p["fc.w"], p["fc.b"])
    return act("logits", F.linear(act("f", y), weights[2](p["fc.w"]), p["fc.b"]))


def batches(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield (2 * rng.standard_normal((8, 1, 6, 6))).astype(np.float32), rng.integers(0, 5, 8)


@pytest.mark.parametrize("scheme, skip", [("int8", ()), ("int4-weights", ("fc",)),
                                          ("int4-weights-int8-activations", ("fc",))])
def test_steps_equal_torch_fake_quantize_with_the_same_observers(scheme, skip):
    net, calibration = Net(), 2
    qat = QatConfig(scheme, calibration_steps=calibration, skip=skip)
    quantized_fc = "fc" not in skip
    # where the build observes: each quantized layer's input and its output (after its ReLU), an
    # input that a previous layer's output already is read as it is
    observed = ["x", "r1", "r2", *(["f", "logits"] if quantized_fc else [])] if qat.activations else []
    acts = {name: activation_fake_quant() for name in observed}
    weights = [weight_fake_quant(qat.weight_bits) for _ in range(3 if quantized_fc else 2)]

    trainer = Trainer(generate_artifacts(net.onnx(), qat=qat, optimizer="sgd", optimizer_options={"lr": 0.1}))
    optimizer = torch.optim.SGD(list(net.params.values()), lr=0.1)
    for step, (x, labels) in enumerate(batches(5), start=1):
        if step == calibration + 1:
            for fake_quant in acts.values():
                fake_quant.disable_observer()
        loss = trainer.step({"x": x, "labels": labels})
        optimizer.zero_grad()
        expected = F.cross_entropy(quantized_forward(torch.from_numpy(x), net.params, acts, weights), torch.from_numpy(labels))
        expected.backward()
        optimizer.step()
        assert sorted(k[: -len("_observed_min")] for k in trainer.state_dict() if k.endswith("_observed_min")) == sorted(acts)
        assert loss == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
        state = trainer.state_dict()
        for name, p in net.params.items():
            np.testing.assert_allclose(state[name], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{name} at step {step}")
        for name, fake_quant in acts.items():
            observer = fake_quant.activation_post_process
            np.testing.assert_allclose(state[f"{name}_observed_min"].reshape(()), observer.min_val.item(), rtol=1e-6)
            np.testing.assert_allclose(state[f"{name}_observed_max"].reshape(()), observer.max_val.item(), rtol=1e-6)


def optimized_ops(path) -> set[str]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path) + ".optimized.onnx"
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return {node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node}


@pytest.mark.parametrize("scheme, kernels, floats", [
    ("int8", {"QLinearConv", "QGemm"}, {"Conv", "FusedConv", "Gemm", "MatMul"}),  # every layer runs in integers
    ("int4-weights", {"MatMulNBits"}, set()),  # (onnxruntime has no int4 convolution)
])
def test_export_runs_on_quantized_kernels_and_agrees_with_the_eval_model(tmp_path, scheme, kernels, floats):
    net = Net().onnx()
    for node in net.graph.node:  # (nameless nodes, as many exporters write them)
        node.name = ""
    trainer = Trainer(generate_artifacts(net, qat=QatConfig(scheme, calibration_steps=2), optimizer="sgd",
                                         optimizer_options={"lr": 0.05}))
    for x, labels in batches(4):
        trainer.step({"x": x, "labels": labels})
    path = tmp_path / "quantized.onnx"
    exported = trainer.export(path)
    onnx.checker.check_model(exported, full_check=True)
    integers = {t.name for t in exported.graph.initializer if t.data_type in (TensorProto.INT8, TensorProto.INT4)}
    assert integers and all(n.op_type != "QuantizeLinear" for n in exported.graph.node if n.input[0] in integers)
    ops = optimized_ops(path)
    assert kernels <= ops and not floats & ops, ops
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for size in (1, 7):  # the forward's dynamic batch
        x = np.random.default_rng(size).standard_normal((size, 1, 6, 6)).astype(np.float32)
        expected = trainer.evaluate({"x": x, "labels": np.zeros(size, np.int64)})["logits"]
        (got,) = session.run(None, {"x": x})
        # the kernels' own accumulation order: within a fraction of one output quantization step
        np.testing.assert_allclose(got, expected, atol=0.02)
    with pytest.raises(AssertionError):  # (the check can fail: the float model's output is another)
        float_out = ort.InferenceSession(Net().onnx().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, float_out, atol=1e-4)


def test_batchnorm_is_folded_into_the_conv_before_its_weight_is_quantized():
    net = Net().onnx()
    rng = np.random.default_rng(3)
    norm = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in [
        ("bn.scale", rng.uniform(0.5, 1.5, 4)), ("bn.bias", rng.normal(0, 0.1, 4)),
        ("bn.mean", rng.normal(0, 0.1, 4)), ("bn.var", rng.uniform(0.5, 1.5, 4))]]
    graph = net.graph
    graph.initializer.extend(norm)
    graph.node[1].input[0] = "n1"
    graph.node.insert(1, helper.make_node("BatchNormalization", ["y1", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["n1"]))
    artifacts = generate_artifacts(net, qat="int8")
    assert not {"bn.scale", "bn.bias", "bn.mean", "bn.var"} & set(artifacts.manifest.params + artifacts.manifest.buffers)
    assert all(n.op_type != "BatchNormalization" for n in artifacts.train_model.graph.node)


def test_builds_are_byte_identical_and_pass_the_full_check():
    first = generate_artifacts(Net().onnx(), qat="int4-weights-int8-activations", check_output=True)
    second = generate_artifacts(Net().onnx(), qat="int4-weights-int8-activations", check_output=True)
    for name in ("train_model", "eval_model"):
        assert getattr(first, name).SerializeToString(deterministic=True) == getattr(second, name).SerializeToString(deterministic=True)
    assert first.manifest.to_json()["qat"]["scheme"] == "int4-weights-int8-activations"


def test_refusals_say_why():
    with pytest.raises(TrainingError, match="gradient accumulation"):
        generate_artifacts(Net().onnx(), qat="int8", gradient_accumulation=True)
    with pytest.raises(TrainingError, match="no Conv, ConvTranspose, Gemm or MatMul"):
        generate_artifacts(Net().onnx(), qat=QatConfig("int8", skip=("conv*", "fc")))
    with pytest.raises(TrainingError, match="qat must be one of"):
        generate_artifacts(Net().onnx(), qat="int3")


def test_lora_adapters_are_merged_before_the_weight_is_fake_quantized(tmp_path):
    from onnx_autodiff.training.lora import LoraConfig

    net = Net()
    artifacts = generate_artifacts(net.onnx(), lora=LoraConfig(rank=2, alpha=4, targets=["fc.w"]), qat="int8",
                                   optimizer="sgd", optimizer_options={"lr": 0.1})
    adapter = artifacts.manifest.lora.adapters[0]
    assert set(artifacts.manifest.params) == {adapter.A, adapter.B}
    trainer = Trainer(artifacts)
    state = trainer.state_dict()
    a = torch.tensor(state[adapter.A], requires_grad=True)  # [96, 2]: x @ A @ B
    b = torch.tensor(state[adapter.B] + 0.01, requires_grad=True)  # (B starts at 0: move it so A gets a gradient)
    trainer.load_state_dict({**state, adapter.B: b.detach().numpy()})
    acts = {name: activation_fake_quant() for name in ("x", "r1", "r2", "f", "logits")}
    x, labels = next(batches(1))
    p = {name: value.detach() for name, value in net.params.items()}
    p["fc.w"] = p["fc.w"] + 2.0 * (a @ b).T  # scale alpha / rank = 2, W [5, 96] multiplied transposed
    logits = quantized_forward(torch.from_numpy(x), p, acts, [weight_fake_quant(8) for _ in range(3)])
    expected = F.cross_entropy(logits, torch.from_numpy(labels))
    expected.backward()
    loss = trainer.step({"x": x, "labels": labels})
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    after = trainer.state_dict()
    np.testing.assert_allclose(after[adapter.A], (a - 0.1 * a.grad).detach().numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(after[adapter.B], (b - 0.1 * b.grad).detach().numpy(), rtol=1e-5, atol=1e-7)
    # the export quantizes the merged weight: no adapter is left in it
    exported = trainer.export(tmp_path / "merged.onnx")
    names = {t.name for t in exported.graph.initializer}
    assert adapter.A not in names and adapter.B not in names
    x = np.random.default_rng(5).standard_normal((3, 1, 6, 6)).astype(np.float32)
    (got,) = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, trainer.evaluate({"x": x, "labels": np.zeros(3, np.int64)})["logits"], atol=0.02)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_export_as_matmulnbits_computes_what_the_qdq_form_does(tmp_path, symmetric):
    qat = QatConfig("int4-weights", quantize_format="matmulnbits", symmetric=symmetric, block_size=64)  # (a short block)
    trainer = Trainer(generate_artifacts(Net().onnx(), qat=qat,
                                         optimizer="sgd", optimizer_options={"lr": 0.05}))
    for x, labels in batches(2):
        trainer.step({"x": x, "labels": labels})
    exported = trainer.export(tmp_path / "nbits.onnx")
    assert [n.op_type for n in exported.graph.node if n.domain == "com.microsoft"] == ["MatMulNBits"]
    assert not any(t.data_type == TensorProto.INT4 and len(t.dims) == 2 and t.dims[0] == 96 for t in exported.graph.initializer)
    x = np.random.default_rng(9).standard_normal((4, 1, 6, 6)).astype(np.float32)
    (got,) = ort.InferenceSession(str(tmp_path / "nbits.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, trainer.evaluate({"x": x, "labels": np.zeros(4, np.int64)})["logits"], atol=0.02)


def test_learned_scales_step_as_torch_learnable_fake_quantize():
    """Scales s0·exp(t): t's gradient is LSQ's scale gradient times s (torch's learnable fake
    quantization, grad_factor 1, autograd through exp), the observed s0 and the zero points fixed."""
    net = Net()
    trainer = Trainer(generate_artifacts(net.onnx(), qat=QatConfig("int8", calibration_steps=1, learn_scales=True),
                                         optimizer="sgd", optimizer_options={"lr": 0.1}))
    logs = [k for k in trainer.state_dict() if k.endswith("_scale_log")]
    assert len(logs) == 8  # three weights' (per channel) and five activations'
    first, second = batches(2)
    trainer.step({"x": first[0], "labels": first[1]})  # observes the ranges, then they freeze
    state = trainer.state_dict()
    params = {name: torch.tensor(state[name], requires_grad=True) for name in [*net.params, *logs]}

    def activation(v, stem):
        low, high = min(float(state[f"{stem}_observed_min"].item()), 0.0), max(float(state[f"{stem}_observed_max"].item()), 0.0)
        scale = torch.tensor(max((high - low) / 255, float(np.finfo(np.float32).eps))) * torch.exp(params[f"{stem}_scale_log"])
        zero = torch.clamp(-torch.round(torch.tensor(low) / scale.detach()), 0, 255)
        return torch._fake_quantize_learnable_per_tensor_affine(v, scale.reshape(1), zero.reshape(1), 0, 255, 1.0)

    def weight(w, node):
        magnitude = w.detach().abs().reshape(w.shape[0], -1).amax(1)
        scale = torch.clamp(magnitude / 127, min=float(np.finfo(np.float32).eps)) * torch.exp(params[f"{node}_weight_scale_log"])
        return torch._fake_quantize_learnable_per_channel_affine(w, scale, torch.zeros_like(scale), 0, -128, 127, 1.0)

    acts = {stem: functools.partial(activation, stem=stem) for stem in ("x", "r1", "r2", "f", "logits")}
    weights = [functools.partial(weight, node=node) for node in ("conv1", "conv2", "fc")]
    logits = quantized_forward(torch.from_numpy(second[0]), params, acts, weights)
    expected = F.cross_entropy(logits, torch.from_numpy(second[1]))
    expected.backward()
    loss = trainer.step({"x": second[0], "labels": second[1]})
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    after = trainer.state_dict()
    moved = 0
    for name, value in params.items():
        np.testing.assert_allclose(after[name], (value - 0.1 * value.grad).detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
        moved += name in logs and bool(np.any(after[name] != state[name]))
    assert moved == len(logs)


def test_export_before_any_step_is_refused_where_activations_are_observed(tmp_path):
    trainer = Trainer(generate_artifacts(Net().onnx(), qat="int8"))
    with pytest.raises(TrainingError, match="export after at least one step"):
        trainer.export(tmp_path / "early.onnx")
    assert not (tmp_path / "early.onnx").exists()
    weights_only = Trainer(generate_artifacts(Net().onnx(), qat="int4-weights"))
    assert any(t.data_type == TensorProto.INT4 for t in weights_only.export(tmp_path / "ptq.onnx").graph.initializer)


@pytest.mark.parametrize("scheme", ["int4-weights", "int8"])
def test_a_transposed_weight_is_quantized_as_stored(tmp_path, scheme):
    """PyTorch's exporter writes x @ W.T as MatMul(x, Transpose(W)): the stored W is quantized
    along the matching axis, the step runs with onnxruntime's default optimizations (which move a
    Transpose below a blocked QuantizeLinear wrongly), and the export reads it as the kernels do."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (5, 64)).astype(np.float32), "linear.weight")  # [out, in]
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["linear.weight"], ["wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "wt"], ["logits"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], [w])
    trainer = Trainer(generate_artifacts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                                         qat=scheme, optimizer="sgd", optimizer_options={"lr": 0.1}))
    x = rng.normal(size=(8, 64)).astype(np.float32)
    losses = [trainer.step({"x": x, "labels": np.arange(8) % 5}) for _ in range(3)]
    assert losses[-1] < losses[0]
    path = tmp_path / "linear.onnx"
    exported = trainer.export(path)
    assert "Transpose" not in {n.op_type for n in exported.graph.node}
    assert ("MatMulNBits" if scheme == "int4-weights" else "QLinearMatMul") in optimized_ops(path)
    (got,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, trainer.evaluate({"x": x, "labels": np.zeros(8, np.int64)})["logits"], atol=0.05)
