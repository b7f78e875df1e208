"""LoRA training artifacts: only adapters trained, merged and unmerged export, CLI, peft."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_valid_model
from onnx import helper, numpy_helper
from test_training import BATCH, IN, OUT, batches, mlp

from onnx_autodiff.cli import main
from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training import Trainer, TrainingArtifacts, generate_artifacts

ADAPTERS = ["W1.lora_A", "W1.lora_B", "W2.lora_A", "W2.lora_B"]


def run(proto: onnx.ModelProto, X: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]


def trained(lora: LoraConfig, steps: int = 20, **options) -> tuple[TrainingArtifacts, Trainer, list[float]]:
    artifacts = generate_artifacts(mlp(), lora=lora, optimizer="adamw", optimizer_options={"lr": 0.05}, **options)
    trainer = Trainer(artifacts)
    data = list(batches(3))
    losses = [trainer.step(data[i % 3]) for i in range(steps)]
    return artifacts, trainer, losses


def test_only_the_adapters_are_trained():
    artifacts, trainer, losses = trained(LoraConfig(rank=2, alpha=4))
    assert artifacts.params == ADAPTERS
    train = artifacts.train_model.graph
    names = {v.name for v in (*train.input, *train.output)}
    assert not {"W1", "b1", "W2", "b2", "W1.new", "W1.exp_avg"} & names  # no gradient, no optimiser state
    assert {"W1", "W2", "b1", "b2"} <= {t.name for t in train.initializer}  # the base weights are constants
    assert sorted(artifacts.checkpoint) == sorted(f"{a}{s}" for a in ADAPTERS for s in ("", ".exp_avg", ".exp_avg_sq"))
    assert sorted(trainer.state_dict()) == sorted([*artifacts.checkpoint, "__step__"])
    assert artifacts.checkpoint["W1.lora_A"].shape == (IN, 2) and artifacts.checkpoint["W1.lora_B"].shape == (2, 7)
    assert_valid_model(artifacts.train_model)
    assert losses[-1] < 0.8 * losses[0]
    first = Trainer(artifacts).evaluate({"X": next(batches(1))[0], "labels": next(batches(1))[1]})
    base = run(mlp(), next(batches(1))[0])
    np.testing.assert_array_equal(first["logits"], base)  # step 0 is the base model (B = 0)


def test_merged_export_is_the_input_graph_with_merged_weights():
    _, trainer, _ = trained(LoraConfig(rank=3, alpha=6))
    forward = mlp()
    merged, unmerged = trainer.export(), trainer.export(merge=False)
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in forward.graph.node]
    assert [t.name for t in merged.graph.initializer] == [t.name for t in forward.graph.initializer]
    values = trainer.parameters()
    base = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in merged.graph.initializer}
    for w in ("W1", "W2"):  # Gemm(transB=1): the adapter is in X @ Wᵀ's orientation
        want = base[w] + 2.0 * (values[f"{w}.lora_A"] @ values[f"{w}.lora_B"]).T
        np.testing.assert_allclose(got[w], want, rtol=1e-6, atol=1e-7)
        assert not np.allclose(got[w], base[w], atol=1e-3)  # training moved them
    np.testing.assert_array_equal(got["b1"], base["b1"])
    assert_valid_model(unmerged)
    kept = {t.name: numpy_helper.to_array(t) for t in unmerged.graph.initializer}
    np.testing.assert_array_equal(kept["W1"], base["W1"])
    np.testing.assert_array_equal(kept["W1.lora_B"], values["W1.lora_B"])
    X = np.random.default_rng(5).standard_normal((BATCH, IN)).astype(np.float32)
    np.testing.assert_allclose(run(merged, X), run(unmerged, X), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(unmerged, X), trainer.evaluate({"X": X, "labels": np.zeros(BATCH, np.int64)})["logits"],
                               rtol=1e-6, atol=1e-6)


def test_dropout_in_the_train_model_only():
    artifacts, trainer, _ = trained(LoraConfig(rank=2, dropout=0.5), steps=5)
    train = artifacts.train_model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in train.initializer}
    dropouts = [n for n in train.node if n.op_type == "Dropout"]
    assert [(n.input[0], inits[n.input[1]], inits[n.input[2]]) for n in dropouts] == [("X", 0.5, True), ("a", 0.5, True)]
    assert not any(n.op_type == "Dropout" for n in artifacts.eval_model.graph.node)
    X, y = next(batches(1))
    once, twice = trainer.evaluate((X, y)), trainer.evaluate((X, y))
    np.testing.assert_array_equal(once["logits"], twice["logits"])
    np.testing.assert_allclose(run(trainer.export(), X), once["logits"], rtol=1e-5, atol=1e-5)


def test_biases_norms_and_extra_parameters():
    forward = mlp(extra_nodes=[helper.make_node("LayerNormalization", ["logits", "g", "beta"], ["normed"])],
                  extra_inits=[numpy_helper.from_array(np.ones(OUT, np.float32), "g"),
                               numpy_helper.from_array(np.zeros(OUT, np.float32), "beta")])
    forward.graph.output[0].name = "normed"
    artifacts = generate_artifacts(forward, lora=LoraConfig(rank=2, train_biases=True, train_norms=True), frozen_params=["b2"])
    assert artifacts.params == [*ADAPTERS, "b1", "g", "beta"]
    artifacts = generate_artifacts(forward, lora=LoraConfig(rank=2, targets=["W2"]), requires_grad=["b2"])
    assert artifacts.params == ["W2.lora_A", "W2.lora_B", "b2"]


def test_gradient_accumulation_with_adapters():
    artifacts = generate_artifacts(mlp(), lora=LoraConfig(rank=2), optimizer_options={"lr": 0.05}, gradient_accumulation=True)
    big, accumulated = Trainer(artifacts), Trainer(artifacts)
    for X, y in batches(3):
        big.step((X, y))
        accumulated.accumulate((X[:3], y[:3]))
        accumulated.accumulate((X[3:], y[3:]))
        accumulated.apply()
    for name, value in big.parameters().items():
        np.testing.assert_allclose(accumulated.parameters()[name], value, rtol=1e-5, atol=1e-6)


def test_artifacts_command_with_lora(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    out = tmp_path / "out"
    assert main(["artifacts", str(path), "-o", str(out), "--lora", "4", "--lora-alpha", "8", "--lora-targets", "W2*",
                 "--lora-dropout", "0.1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote 5 files to {out}") and "2 parameters (W2.lora_A, W2.lora_B), LoRA rank 4 on 1 weight," in line
    loaded = TrainingArtifacts.load(out)
    assert loaded.params == ["W2.lora_A", "W2.lora_B"]
    assert loaded.layout["lora"]["scale"] == 2.0 and loaded.layout["lora"]["dropout"] == 0.1
    assert len(Trainer(out).export().graph.node) == len(mlp().graph.node)
    assert main(["artifacts", str(path), "-o", str(out), "--lora-alpha", "8"]) == 2
    assert "--lora-alpha needs --lora RANK" in capsys.readouterr().err
    assert main(["artifacts", str(path), "-o", str(out), "--lora", "0"]) == 2
    assert main(["artifacts", str(path), "-o", str(out), "--lora", "2", "--lora-targets", "*q_proj*"]) == 2
    assert "matches no weight" in capsys.readouterr().err


def test_matches_peft():
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.head = torch.nn.Linear(5, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 4, 5)  # 3-D: the exporter writes MatMul(x, Transpose(W))
    exported = torch.onnx.export(net.eval(), (x,), dynamo=True, optimize=False, verbose=False).model_proto
    options = {"lr": 0.01, "weight_decay": 0.1}
    artifacts = generate_artifacts(exported, loss="mse", optimizer="adamw", optimizer_options=options,
                                   lora=LoraConfig(rank=4, alpha=8, targets=["fc1.weight", "fc2.weight"]))
    assert artifacts.params == ["fc1.weight.lora_A", "fc1.weight.lora_B", "fc2.weight.lora_A", "fc2.weight.lora_B"]
    model = peft.get_peft_model(net, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"], lora_dropout=0.0))
    for name in ("fc1", "fc2"):  # the same initial A; ours is [in, r], peft's lora_A.weight [r, in]
        layer = getattr(model.base_model.model, name)
        layer.lora_A["default"].weight.data = torch.from_numpy(artifacts.checkpoint[f"{name}.weight.lora_A"].T.copy())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **options)
    trainer = Trainer(artifacts)
    rng = np.random.default_rng(0)
    for _ in range(3):
        labels = rng.standard_normal((2, 4, 3)).astype(np.float32)
        ours = trainer.step({exported.graph.input[0].name: x.numpy(), "labels": labels})
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        assert ours == pytest.approx(loss.item(), rel=1e-5)
    values = trainer.parameters()
    for name in ("fc1", "fc2"):
        layer = getattr(model.base_model.model, name)
        for part, ref in (("A", layer.lora_A["default"].weight), ("B", layer.lora_B["default"].weight)):
            want = ref.detach().numpy().T
            got = values[f"{name}.weight.lora_{part}"]
            assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), f"{name} lora_{part}"
    merged = {t.name: numpy_helper.to_array(t) for t in trainer.export().graph.initializer}
    model.merge_adapter()
    for name in ("fc1", "fc2"):
        want = getattr(model.base_model.model, name).base_layer.weight.detach().numpy()
        np.testing.assert_allclose(merged[f"{name}.weight"], want, rtol=1e-5, atol=1e-6)
