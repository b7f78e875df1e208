"""Training artifacts: optimisers against torch.optim, losses, accumulation, BN/Dropout modes, errors."""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import AutodiffError, NotDifferentiableError, UnknownValueError
from onnx_autodiff.errors import TrainingOpsetError
from onnx_autodiff.training import (
    SGD,
    AdamW,
    BatchError,
    Trainer,
    TrainingArtifacts,
    TrainingError,
    add_arguments,
    generate_artifacts,
    run,
    run_training_demo,
)

IN, HIDDEN, OUT, BATCH = 5, 7, 3, 6


def mlp(outputs=OUT, opset=18, extra_nodes=(), extra_inits=(), seed=0) -> onnx.ModelProto:
    """X[N, 5] -> Gemm -> Tanh -> Gemm -> logits[N, outputs], Xavier-ish random weights."""
    rng = np.random.default_rng(seed)
    inits = {
        "W1": rng.standard_normal((HIDDEN, IN)) * 0.5,
        "b1": rng.standard_normal(HIDDEN) * 0.1,
        "W2": rng.standard_normal((outputs, HIDDEN)) * 0.5,
        "b2": rng.standard_normal(outputs) * 0.1,
    }
    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1),
        *extra_nodes,
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", IN])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", outputs])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()] + list(extra_inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def batches(count=3, outputs=OUT, classes=True, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        X = rng.standard_normal((BATCH, IN)).astype(np.float32)
        y = rng.integers(0, outputs, BATCH) if classes else rng.standard_normal((BATCH, outputs)).astype(np.float32)
        yield X, y


def torch_mlp(model: onnx.ModelProto):
    torch = pytest.importorskip("torch")
    params = {t.name: torch.tensor(numpy_helper.to_array(t).copy(), requires_grad=True) for t in model.graph.initializer}

    def forward(X):
        h = torch.from_numpy(X) @ params["W1"].T + params["b1"]
        return torch.tanh(h) @ params["W2"].T + params["b2"]

    return torch, params, forward


def assert_close_relative(ours: dict, reference: dict, rtol=1e-6):
    """Every parameter within ``rtol`` of the reference, relative to the parameter's magnitude."""
    for name, want in reference.items():
        got = ours[name]
        error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        assert error <= rtol, f"{name}: relative error {error:.2e} > {rtol}"


def steps_beside_torch(trainer, optimizer, forward, torch, dtype=np.float32, rtol=1e-6):
    """Three steps of ``trainer`` and of the torch ``optimizer`` on the same batches (in ``dtype``),
    the losses equal to ``rtol`` relative."""
    for X, y in batches(3):
        X = X.astype(dtype)
        ours = trainer.step({"X": X, "labels": y})
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(X), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        assert abs(ours - loss.item()) <= rtol * abs(loss.item())


OPTIMIZERS = [
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1}),
    ("sgd", {"lr": 0.1}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}),
    ("adam", {"lr": 0.01, "amsgrad": True}),
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.02, "weight_decay": 0.3, "betas": (0.85, 0.95)}),
]


@pytest.mark.parametrize("name,options", OPTIMIZERS, ids=[f"{n}-{'-'.join(o)}" for n, o in OPTIMIZERS])
def test_optimizer_matches_torch(name, options):
    model = mlp()
    torch, params, forward = torch_mlp(model)
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    optimizer = cls(list(params.values()), **options)
    trainer = Trainer(generate_artifacts(model, optimizer=name, optimizer_options=options))
    steps_beside_torch(trainer, optimizer, forward, torch)
    assert_close_relative(trainer.parameters(), {k: v.detach().numpy() for k, v in params.items()})
    state = trainer.state_dict()
    for k, v in params.items():
        for key, buf in optimizer.state[v].items():
            if key != "step":
                assert_close_relative({key: state[f"{k}.{key}"]}, {key: buf.numpy()}, rtol=1e-5)
    assert int(state["__step__"]) == 3


def float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its weights, input and output in float64."""
    for tensor in model.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    return model


@pytest.mark.parametrize("name,options", [("adamw", {"lr": 0.01}), ("sgd", {"lr": 0.1, "momentum": 0.9})])
def test_float64_model_trains_and_matches_torch(name, options):
    """A float64 model's loss comes back in float64 (the trainer bound it as float32 and every
    step failed), and its steps match torch.optim in float64. The artifacts take lr as a float32
    input, so torch gets the same rounded lr."""
    model = float64(mlp())
    torch, params, forward = torch_mlp(model)
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    optimizer = cls(list(params.values()), **{**options, "lr": float(np.float32(options["lr"]))})
    trainer = Trainer(generate_artifacts(model, optimizer=name, optimizer_options=options))
    steps_beside_torch(trainer, optimizer, forward, torch, np.float64, rtol=1e-12)
    assert all(v.dtype == np.float64 for v in trainer.parameters().values())
    assert_close_relative(trainer.parameters(), {k: v.detach().numpy() for k, v in params.items()}, rtol=1e-12)


@pytest.mark.parametrize("loss", ["mse", "l1", "bce_with_logits"])
def test_losses_match_torch(loss):
    model = mlp()
    torch, params, forward = torch_mlp(model)
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1)
    trainer = Trainer(generate_artifacts(model, loss=loss, optimizer="sgd", optimizer_options={"lr": 0.1}))
    fn = {"mse": torch.nn.functional.mse_loss, "l1": torch.nn.functional.l1_loss,
          "bce_with_logits": torch.nn.functional.binary_cross_entropy_with_logits}[loss]
    for X, y in batches(2, classes=False):
        if loss == "bce_with_logits":
            y = (y > 0).astype(np.float32)
        ours = trainer.step((X, y))
        optimizer.zero_grad()
        reference = fn(forward(X), torch.from_numpy(y))
        reference.backward()
        optimizer.step()
        assert ours == pytest.approx(reference.item(), rel=1e-6)
    assert_close_relative(trainer.parameters(), {k: v.detach().numpy() for k, v in params.items()})


def test_gradient_clipping_matches_torch():
    model = mlp()
    torch, params, forward = torch_mlp(model)
    optimizer = torch.optim.SGD(list(params.values()), lr=0.5, momentum=0.5)
    trainer = Trainer(generate_artifacts(model, optimizer="sgd", optimizer_options={"lr": 0.5, "momentum": 0.5}, max_grad_norm=0.3))
    for X, y in batches(2):
        trainer.step((X, y))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(forward(X), torch.from_numpy(y)).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 0.3)
        assert norm.item() > 0.3  # the clipping is active, so the test can fail
        optimizer.step()
    assert_close_relative(trainer.parameters(), {k: v.detach().numpy() for k, v in params.items()})


def test_gradient_accumulation_equals_one_big_batch():
    artifacts = generate_artifacts(mlp(), optimizer="adamw", optimizer_options={"lr": 0.01}, gradient_accumulation=True, max_grad_norm=1.0)
    big, accumulated = Trainer(artifacts), Trainer(artifacts)
    for X, y in batches(2):
        big.step((X, y))
        accumulated.accumulate((X[:3], y[:3]))
        accumulated.accumulate((X[3:], y[3:]))
        accumulated.apply()
    assert accumulated.step_count == big.step_count == 2
    assert_close_relative(accumulated.parameters(), big.parameters(), rtol=1e-5)
    with pytest.raises(TrainingError, match="accumulate"):
        accumulated.apply()
    no_accumulation = Trainer(generate_artifacts(mlp()))
    with pytest.raises(TrainingError, match="gradient_accumulation=True"):
        no_accumulation.accumulate(next(batches(1)))


def bn_dropout_model(opset=18):
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["hn"], momentum=0.8),
        helper.make_node("Dropout", ["hn", "ratio"], ["d"]),
        helper.make_node("Gemm", ["d", "W2", "b2"], ["logits"], transB=1),
    ]
    inits = {
        "W1": rng.standard_normal((HIDDEN, IN)), "b1": np.zeros(HIDDEN), "gamma": np.ones(HIDDEN),
        "beta": np.zeros(HIDDEN), "mean": rng.standard_normal(HIDDEN) * 0.1, "var": np.ones(HIDDEN),
        "ratio": np.array(0.5), "W2": rng.standard_normal((OUT, HIDDEN)), "b2": np.zeros(OUT),
    }
    graph = helper.make_graph(
        nodes, "bn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", IN])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", OUT])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_batchnorm_statistics_and_dropout_modes():
    model = bn_dropout_model()
    artifacts = generate_artifacts(model, optimizer="sgd", optimizer_options={"lr": 0.0})
    assert artifacts.params == ["W1", "b1", "gamma", "beta", "W2", "b2"]  # not ratio, not the statistics
    assert artifacts.layout["buffers"] == ["mean", "var"]
    bn = next(n for n in artifacts.train_model.graph.node if n.op_type == "BatchNormalization")
    assert helper.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 1
    trainer = Trainer(artifacts)
    X, y = next(batches(1))
    trainer.step((X, y))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    h = X @ inits["W1"].T + inits["b1"]
    state = trainer.state_dict()
    np.testing.assert_allclose(state["mean"], 0.8 * inits["mean"] + 0.2 * h.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["var"], 0.8 * inits["var"] + 0.2 * h.var(0), rtol=1e-5, atol=1e-6)
    # eval: inference mode, deterministic; training mode: dropout draws a new mask each step
    first, second = trainer.evaluate((X, y)), trainer.evaluate((X, y))
    np.testing.assert_array_equal(first["logits"], second["logits"])
    h_eval = (h - state["mean"]) / np.sqrt(state["var"] + 1e-5)
    np.testing.assert_allclose(first["logits"], h_eval @ inits["W2"].T + inits["b2"], rtol=1e-4, atol=1e-5)
    losses = {round(trainer.step((X, y)), 6) for _ in range(4)}
    assert len(losses) > 1
    exported = trainer.export()
    logits = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
    np.testing.assert_allclose(logits, trainer.evaluate((X, y))["logits"], rtol=1e-5, atol=1e-6)


def bn_model(opset, dropout_ratio=None):
    """Gemm, BatchNormalization (and a Dropout of the opset's form) at an old opset."""
    model = bn_dropout_model(opset=opset)
    graph = model.graph
    dropout = next(n for n in graph.node if n.op_type == "Dropout")
    if dropout_ratio is None:
        graph.node.remove(dropout)
        graph.node[-1].input[0] = "hn"
    else:
        del dropout.input[1:]
        dropout.attribute.append(helper.make_attribute("ratio", dropout_ratio))
    graph.initializer.remove(next(t for t in graph.initializer if t.name == "ratio"))
    return model


@pytest.mark.parametrize("opset", [9, 11, 13])
def test_batchnorm_training_converts_old_opsets(opset):
    """BatchNormalization's training mode needs opset 14: an older model is converted, as a rule's
    gradient converts it, and trains its statistics as the opset-14 model does."""
    with pytest.raises(TrainingOpsetError, match="opset >= 14"):
        generate_artifacts(bn_model(opset), upgrade_opset=False)
    X, y = next(batches(1))
    trainers = [Trainer(generate_artifacts(bn_model(o), optimizer="sgd", optimizer_options={"lr": 0.05}))
                for o in (opset, 14)]
    losses = [[t.step((X, y)) for _ in range(3)] for t in trainers]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert losses[0][-1] < losses[0][0]
    for name in ("mean", "var"):
        np.testing.assert_allclose(trainers[0].state_dict()[name], trainers[1].state_dict()[name], rtol=1e-6)


def test_dropout_without_training_mode_converts():
    """Dropout at opset 10 (ratio an attribute, no training mode) is converted to its opset-12 form."""
    artifacts = generate_artifacts(bn_model(10, dropout_ratio=0.5))
    assert next(o.version for o in artifacts.train_model.opset_import if o.domain == "") >= 14
    dropout = next(n for n in artifacts.train_model.graph.node if n.op_type == "Dropout")
    assert len(dropout.input) == 3  # ratio and training_mode as inputs
    X, y = next(batches(1))
    losses = [Trainer(artifacts).step((X, y)) for _ in range(2)]
    assert all(np.isfinite(losses))


def test_frozen_batchnorm_and_old_opset():
    artifacts = generate_artifacts(bn_dropout_model(), freeze_batchnorm=True, frozen_params=["gamma", "beta"])
    assert artifacts.layout["buffers"] == [] and artifacts.params == ["W1", "b1", "W2", "b2"]


def test_save_load_export_round_trip(tmp_path):
    artifacts = generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.05})
    written = artifacts.save(tmp_path / "artifacts")
    assert set(written) == {"train_model", "eval_model", "inference_model", "checkpoint", "layout"}
    loaded = TrainingArtifacts.load(tmp_path / "artifacts")
    a, b = Trainer(artifacts), Trainer(tmp_path / "artifacts")
    for X, y in batches(2):
        assert a.step((X, y)) == b.step((X, y))
    np.testing.assert_array_equal(a.parameters()["W1"], b.parameters()["W1"])
    assert loaded.optimizer.lr == 0.05
    a.save_checkpoint(tmp_path / "ckpt.npz")
    c = Trainer(loaded)
    c.load_checkpoint(tmp_path / "ckpt.npz")
    assert c.step_count == 2
    X, y = next(batches(1, seed=9))
    assert c.step((X, y)) == a.step((X, y))
    exported = a.export(tmp_path / "trained.onnx")
    onnx.checker.check_model(exported, full_check=True)
    session = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"X": X})[0], a.evaluate((X, y))["logits"], rtol=1e-6)
    assert not np.array_equal(numpy_helper.to_array(exported.graph.initializer[0]),
                              numpy_helper.to_array(mlp().graph.initializer[0]))


def test_model_loss_custom_callable_and_function():
    own = mlp(extra_nodes=[
        helper.make_node("ReduceSumSquare", ["logits"], ["total"], keepdims=0),
    ])
    own.graph.output.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    X, _ = next(batches(1))
    with pytest.raises(TrainingError, match="output="):
        generate_artifacts(own, loss=None)
    by_output = Trainer(generate_artifacts(own, loss=None, output="total", optimizer="sgd", optimizer_options={"lr": 0.01}))
    callable_loss = Trainer(generate_artifacts(
        mlp(), loss=lambda op, y, t: op.ReduceSumSquare(op.Sub(y, t), keepdims=0),
        optimizer="sgd", optimizer_options={"lr": 0.01}))
    fn = helper.make_function(
        "custom", "SumSquare", ["y", "t"], ["l"],
        [helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("ReduceSumSquare", ["d"], ["l"], keepdims=0)],
        [helper.make_opsetid("", 18)],
    )
    function_loss = Trainer(generate_artifacts(mlp(), loss=fn, optimizer="sgd", optimizer_options={"lr": 0.01}))
    zeros = np.zeros((BATCH, OUT), np.float32)
    expected = by_output.step({"X": X})
    assert callable_loss.step((X, zeros)) == pytest.approx(expected, rel=1e-6)
    assert function_loss.step((X, zeros)) == pytest.approx(expected, rel=1e-6)
    assert_close_relative(callable_loss.parameters(), by_output.parameters())
    assert_close_relative(function_loss.parameters(), by_output.parameters())
    assert set(by_output.evaluate({"X": X})) == {"loss", "logits"}
    with pytest.raises(TrainingError, match="shape \\[N, 3\\]: a loss must be a scalar"):
        generate_artifacts(own, loss=None, output="logits")


def test_configuration_errors():
    model = mlp(extra_inits=[numpy_helper.from_array(np.array([1, 2], np.int64), "shape_const")])
    with pytest.raises(TrainingError, match="unknown loss 'hinge'"):
        generate_artifacts(model, loss="hinge")
    with pytest.raises(TrainingError, match="unknown optimizer 'rmsprop'"):
        generate_artifacts(model, optimizer="rmsprop")
    with pytest.raises(TrainingError, match="has no option"):
        generate_artifacts(model, optimizer="adam", optimizer_options={"momentum": 0.9})
    with pytest.raises(TrainingError, match="nesterov"):
        SGD(nesterov=True)
    with pytest.raises(NotDifferentiableError, match="'shape_const' is a INT64 initializer"):
        generate_artifacts(model, requires_grad=["W1", "shape_const"])
    with pytest.raises(UnknownValueError, match="'X' is a graph input"):
        generate_artifacts(model, requires_grad=["X"])
    with pytest.raises(UnknownValueError, match="'W9'"):
        generate_artifacts(model, frozen_params=["W9"])
    with pytest.raises(TrainingError, match="both"):
        generate_artifacts(model, requires_grad=["W1"], frozen_params=["W1"])
    with pytest.raises(UnknownValueError, match="output 'nope'"):
        generate_artifacts(model, output="nope")
    unused = mlp(extra_inits=[numpy_helper.from_array(np.ones(3, np.float32), "unused")])
    with pytest.raises(TrainingError, match="does not depend on 'unused'.*frozen_params"):
        generate_artifacts(unused, requires_grad=["W1", "unused"])
    assert "unused" not in generate_artifacts(unused, optimizer=AdamW()).params
    assert all(issubclass(e, AutodiffError) for e in (TrainingError, BatchError))


def test_bad_batches_and_failed_step_change_nothing():
    trainer = Trainer(generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.1}))
    X, y = next(batches(1))
    before = trainer.state_dict()
    with pytest.raises(BatchError, match="'labels' has shape \\(4,\\).*must match 'X', where N = 6"):
        trainer.step({"X": X, "labels": y[:4]})
    with pytest.raises(BatchError, match="'X' has shape \\(6, 4\\).*axis 1 must be 5"):
        trainer.step((X[:, :4], y))
    with pytest.raises(BatchError, match="'labels' is float64; the model expects int64"):
        trainer.step((X, y.astype(np.float64)))
    with pytest.raises(BatchError, match="missing \\['labels'\\]"):
        trainer.step({"X": X})
    with pytest.raises(BatchError, match="takes 2 batch inputs"):
        trainer.step((X,))
    # passes the checks, fails inside onnxruntime (class 7 of 3): nothing may change
    with pytest.raises(TrainingError, match="nothing was updated"):
        trainer.step((X, np.full(BATCH, 7)))
    after = trainer.state_dict()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])
    trainer.step((X, y))
    assert trainer.step_count == 1
    assert not np.array_equal(trainer.parameters()["W1"], before["W1"])


def test_artifacts_models_pass_checker_and_have_documented_interface():
    artifacts = generate_artifacts(mlp(), optimizer="adamw", gradient_accumulation=True)
    for proto in (artifacts.train_model, artifacts.eval_model, artifacts.accumulate_model, artifacts.apply_model):
        onnx.checker.check_model(proto, full_check=True)
        assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    train = artifacts.train_model.graph
    assert [v.name for v in train.input] == [
        "X", "labels", "W1", "b1", "W2", "b2", "W1.exp_avg", "W1.exp_avg_sq", "b1.exp_avg", "b1.exp_avg_sq",
        "W2.exp_avg", "W2.exp_avg_sq", "b2.exp_avg", "b2.exp_avg_sq", "lr", "step", "step_size", "eps_scaled", "decay"]
    assert [v.name for v in train.output][:3] == ["loss", "W1.new", "b1.new"]
    assert set(artifacts.checkpoint) == {v.name for v in train.input[2:-5]}
    # the scalars the runner feeds: lr, step and the coefficients it computes from them (float32 here)
    layout = artifacts.layout["train"]
    assert layout["scalars"] == {k: k for k in ("lr", "step", "step_size", "eps_scaled", "decay")}
    assert sorted(layout["coefficients"]) == ["decay", "eps_scaled", "step_size"]
    assert all(v.type.tensor_type.elem_type == TensorProto.FLOAT for v in train.input[-5:] if v.name != "step")


def test_cli_run_writes_artifacts(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(path), "-o", str(tmp_path / "out"), "--optimizer", "sgd", "--momentum", "0.9",
                              "--frozen", "b1", "--max-grad-norm", "1"])
    assert run(args) == 0
    assert "3 parameters (W1, W2, b2), sgd" in capsys.readouterr().out
    loaded = TrainingArtifacts.load(tmp_path / "out")
    assert loaded.params == ["W1", "W2", "b2"] and loaded.optimizer.momentum == 0.9
    bad = parser.parse_args([str(path), "-o", str(tmp_path / "x"), "--loss", "mse", "--optimizer", "adam", "--momentum", "0.9"])
    with pytest.raises(TrainingError, match="sgd only"):
        run(bad)


def test_training_demo_runs():
    lines = []
    assert run_training_demo(steps=60, out=lines.append) == 0
    assert lines[-1].endswith("ok")
