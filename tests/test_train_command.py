"""``onnx-autodiff train``: the metrics against a loop over the Trainer written here, exact resume
(after whole epochs and after Ctrl-C), bad data, both data formats, the progress bar, the model."""

from __future__ import annotations

import csv
import io
import json
import signal
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.cli import main
from onnx_autodiff.demo import blobs, classifier_model
from onnx_autodiff.training import Trainer, generate_artifacts
from onnx_autodiff.files import write_atomically
from onnx_autodiff.training.values import load_arrays, safetensors_writer

EXAMPLES, VALIDATION, BATCH, SEED, LR = 120, 50, 50, 3, 0.01  # 120 = 2 batches of 50 and one of 20


def save(path, arrays) -> str:
    """``arrays`` written to ``path``: safetensors by the project's writer, npz by numpy's."""
    if str(path).endswith(".safetensors"):
        write_atomically(path, safetensors_writer(arrays))
    else:
        np.savez(path, **arrays)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The forward classifier (logits) and its training and validation data, in both formats."""
    root = tmp_path_factory.mktemp("train")
    model = root / "model.onnx"
    onnx.save(classifier_model(loss=False), model)
    X, labels = blobs(seed=1, samples=EXAMPLES + VALIDATION)
    paths = {"model": str(model), "X": X[:EXAMPLES], "labels": labels[:EXAMPLES], "val_X": X[EXAMPLES:],
             "val_labels": labels[EXAMPLES:]}
    for suffix in (".npz", ".safetensors"):
        paths["data" + suffix] = save(root / f"train{suffix}", {"X": X[:EXAMPLES], "labels": labels[:EXAMPLES]})
        paths["val" + suffix] = save(root / f"val{suffix}", {"X": X[EXAMPLES:], "labels": labels[EXAMPLES:]})
    return paths


def train(files, out, *extra, data=".npz", val=".npz") -> int:
    command = ["train", files["model"], "--data", files["data" + data], "-o", str(out), "--batch-size", str(BATCH),
               "--seed", str(SEED), "--lr", str(LR), *extra]
    if val:
        command += ["--val-data", files["val" + val]]
    return main(command)


def reference_loop(files, epochs: int, batch_size: int = BATCH):
    """The documented schedule, run here with the Trainer: per epoch the size-weighted mean batch
    loss, and the validation loss and accuracy from the eval model's logits."""
    trainer = Trainer(generate_artifacts(files["model"], loss="cross_entropy", optimizer="adamw",
                                         optimizer_options={"lr": LR}))
    X, labels, rows = files["X"], files["labels"], []
    for epoch in range(epochs):
        order = np.random.default_rng([SEED, epoch]).permutation(len(X))
        total = 0.0
        for start in range(0, len(X), batch_size):
            picked = order[start:start + batch_size]
            total += trainer.step({"X": X[picked], "labels": labels[picked]}) * len(picked)
        val_total, correct = 0.0, 0
        for start in range(0, VALIDATION, batch_size):
            vX, vy = files["val_X"][start:start + batch_size], files["val_labels"][start:start + batch_size]
            result = trainer.evaluate({"X": vX, "labels": vy})
            val_total += float(result["loss"]) * len(vX)
            correct += int(np.sum(result["logits"].argmax(1) == vy))
        rows.append({"epoch": epoch + 1, "loss": total / len(X), "val_loss": val_total / VALIDATION,
                     "val_accuracy": correct / VALIDATION})
    return rows, trainer


def metrics(out) -> list[dict]:
    with open(out / "metrics.csv", newline="") as stream:
        return list(csv.DictReader(stream))


def cross_entropy(model_path, X, labels) -> float:
    """The mean cross-entropy of a model's logits, computed in numpy (float64)."""
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"X": X})[0].astype(np.float64)
    logits -= logits.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(logits).sum(1)) - logits[np.arange(len(labels)), labels]))


@pytest.fixture(scope="module")
def uninterrupted(files, tmp_path_factory):
    """Three epochs in one go: the run that resumed runs must end as."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert train(files, out, "--epochs", "3") == 0
    return out


def assert_same_run(out, expected) -> None:
    """The same parameters, optimiser state and step (bit for bit), metrics and exported model."""
    ours, theirs = load_arrays(out / "checkpoint"), load_arrays(expected / "checkpoint")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert (out / "metrics.csv").read_bytes() == (expected / "metrics.csv").read_bytes()
    assert (out / "model.onnx").read_bytes() == (expected / "model.onnx").read_bytes()


@pytest.mark.parametrize("data, val", [(".npz", ".npz"), (".safetensors", ".safetensors"), (".npz", ".safetensors")])
def test_metrics_follow_the_documented_schedule(files, tmp_path, capsys, data, val):
    out = tmp_path / "run"
    assert train(files, out, "--epochs", "2", data=data, val=val) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1/2", "epoch 2/2"] and len(lines) == 3
    rows = metrics(out)
    assert list(rows[0]) == ["epoch", "loss", "lr", "val_loss", "val_accuracy"] and len(rows) == 2
    assert all(float(row["lr"]) == LR for row in rows)
    expected, trainer = reference_loop(files, 2)
    for row, want in zip(rows, expected):
        assert int(row["epoch"]) == want["epoch"]
        for column in ("loss", "val_loss", "val_accuracy"):
            assert float(row[column]) == pytest.approx(want[column], rel=1e-9, abs=1e-12), column
    state = load_arrays(out / "checkpoint")
    assert int(state["__step__"]) == 2 * 3 == trainer.step_count  # the partial batch is kept
    for name, value in trainer.parameters().items():  # the same steps on the same models: the same bits
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_trained_model_runs_and_its_loss_is_lower(files, uninterrupted):
    model = onnx.load(uninterrupted / "model.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["X"]  # the inference model: no labels, no optimiser state
    before = cross_entropy(files["model"], files["X"], files["labels"])
    after = cross_entropy(uninterrupted / "model.onnx", files["X"], files["labels"])
    assert after < 0.5 * before
    assert (uninterrupted / "artifacts" / "artifacts.json").is_file()


def test_resume_after_whole_epochs_is_exact(files, uninterrupted, tmp_path):
    out = tmp_path / "run"
    assert train(files, out, "--epochs", "1") == 0
    assert len(metrics(out)) == 1
    assert train(files, out, "--epochs", "3", "--resume") == 0
    assert_same_run(out, uninterrupted)


def test_ctrl_c_saves_the_run_and_resume_is_exact(files, uninterrupted, tmp_path, capsys, monkeypatch):
    step, calls = Trainer.step, []

    def step_then_ctrl_c(self, batch, lr=None):
        loss = step(self, batch, lr)
        calls.append(loss)
        if len(calls) == 4:  # the second batch of epoch 2: SIGINT reaches the handler in place
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        return loss

    monkeypatch.setattr(Trainer, "step", step_then_ctrl_c)
    out = tmp_path / "run"
    assert train(files, out, "--epochs", "3") == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "after 1 of 3 batches of epoch 2" in err[0] and str(out / "checkpoint") in err[0]
    assert not (out / "model.onnx").exists()
    assert int(load_arrays(out / "checkpoint")["__step__"]) == 4
    monkeypatch.setattr(Trainer, "step", step)
    assert train(files, out, "--epochs", "3", "--resume") == 0
    assert_same_run(out, uninterrupted)


def test_a_batch_larger_than_the_data_is_one_batch(files, tmp_path):
    out = tmp_path / "run"
    assert train(files, out, "--epochs", "2", "--batch-size", "1000", val=None) == 0
    assert int(load_arrays(out / "checkpoint")["__step__"]) == 2
    rows = metrics(out)
    assert list(rows[0]) == ["epoch", "loss", "lr"]
    expected, _ = reference_loop(files, 2, batch_size=1000)
    assert [float(r["loss"]) for r in rows] == pytest.approx([e["loss"] for e in expected], rel=1e-9)


@pytest.fixture(scope="module")
def artifacts_dir(files, tmp_path_factory):
    directory = tmp_path_factory.mktemp("artifacts") / "artifacts"
    generate_artifacts(files["model"], loss="cross_entropy").save(directory)
    return str(directory)


X_GOOD, LABELS_GOOD = np.zeros((6, 16), np.float32), np.arange(6) % 4


@pytest.mark.parametrize("arrays, message", [
    ({"X": X_GOOD}, "has no array 'labels'"),
    ({"X": np.zeros((6, 15), np.float32), "labels": LABELS_GOOD}, "'X' has shape [6, 15]; the model takes X [N, 16]"),
    ({"X": np.zeros(6, np.float32), "labels": LABELS_GOOD}, "'X' has shape [6]"),
    ({"X": X_GOOD, "labels": LABELS_GOOD.astype(np.float64)}, "'labels' is float64; the model takes int64"),
    ({"X": X_GOOD, "labels": np.array([0, 1, 2, 3, 4, -1])}, "'labels' holds 2 values outside the 4 classes"),
    ({"X": X_GOOD, "labels": LABELS_GOOD[:5]}, "the arrays differ in length (X 6, labels 5)"),
    ({"X": X_GOOD[:0], "labels": LABELS_GOOD[:0]}, "holds no examples"),
], ids=["missing", "features", "rank", "dtype", "range", "lengths", "empty"])
@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_bad_data_is_one_line_and_exit_1(artifacts_dir, tmp_path, capsys, arrays, message, suffix):
    data = save(tmp_path / f"bad{suffix}", arrays)
    assert main(["train", artifacts_dir, "--data", data, "-o", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and data in err[0], err
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_ignored_labels_are_accepted(artifacts_dir, tmp_path):
    data = save(tmp_path / "d.npz", {"X": X_GOOD, "labels": np.array([0, 1, -100, 3, 2, 1])})
    assert main(["train", artifacts_dir, "--data", data, "-o", str(tmp_path / "run"), "--val-data", data]) == 0
    assert float(metrics(tmp_path / "run")[0]["val_accuracy"]) in {k / 5 for k in range(6)}  # of the 5 kept


@pytest.mark.parametrize("name, content, code, message", [
    ("garbage.npz", b"not an archive at all", 1, "neither an npz nor a safetensors"),
    ("short.safetensors", b"\x10" + bytes(7) + b'{"X":', 1, "not a valid safetensors file"),
    ("data.csv", b"1,2\n", 2, "give an .npz or .safetensors file"),
    ("absent.npz", None, 2, "no such file"),
])
def test_unreadable_data(artifacts_dir, tmp_path, capsys, name, content, code, message):
    data = tmp_path / name
    if content is not None:
        data.write_bytes(content)
    assert main(["train", artifacts_dir, "--data", str(data), "-o", str(tmp_path / "run")]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_run_options_are_checked(files, artifacts_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(files, out, "--resume") == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert train(files, out, "--epochs", "2", val=None) == 0
    capsys.readouterr()
    for extra, message in [
        ((), "holds a run already"),
        (("--resume", "--batch-size", "20"), "started with --batch-size 50, not --batch-size 20"),
        (("--resume", "--optimizer", "sgd"), "started with no --optimizer, not --optimizer sgd"),
        (("--resume", "--epochs", "1"), "has trained 2 epochs already"),
    ]:
        assert main(["train", files["model"], "--data", files["data.npz"], "-o", str(out), "--seed", str(SEED),
                     "--lr", str(LR), "--batch-size", str(BATCH), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert main(["train", artifacts_dir, "--data", files["data.npz"], "-o", str(tmp_path / "b"), "--loss", "mse"]) == 2
    assert "holds training artifacts" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_on_a_terminal_only(artifacts_dir, files, tmp_path, capsys, monkeypatch, terminal):
    from onnx_autodiff import commands

    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(commands, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr("sys.stderr", stderr)
    assert main(["train", artifacts_dir, "--data", files["data.npz"], "-o", str(tmp_path / "run"), "--epochs", "2"]) == 0
    assert ("%|" in stderr.getvalue()) == terminal
    if not terminal:  # (a note where matplotlib is missing, the plot's)
        assert stderr.getvalue().replace(MATPLOTLIB_NOTE, "") == ""
    lines = capsys.readouterr().out.splitlines()  # one line per epoch, then what was written
    assert len(lines) == 3 and lines[0].startswith("epoch 1/2: loss ") and lines[1].startswith("epoch 2/2: loss ")
    assert lines[2].startswith(f"wrote {tmp_path / 'run' / 'model.onnx'}, ")


MATPLOTLIB_NOTE = ("onnx-autodiff: note: loss.png is not written: matplotlib is not installed "
                   "(pip install 'onnx-autodiff[examples]' brings it)\n")


def test_a_missing_matplotlib_is_one_note(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    out = tmp_path / "run"
    assert train(files, out, "--epochs", "1", val=None) == 0
    assert capsys.readouterr().err == MATPLOTLIB_NOTE and not (out / "loss.png").exists()


def test_loss_plot_written_with_matplotlib(files, uninterrupted):
    pytest.importorskip("matplotlib")
    assert (uninterrupted / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_learning_rate_schedule_is_recorded_and_stepped(files, tmp_path):
    """--lr-schedule cosine --warmup-steps 2 over 2 epochs of 3 batches: the run's artifacts record
    the schedule over its 6 steps, metrics.csv gives each epoch's last learning rate, and the
    state is the one of steps at transformers' learning rates."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    out = tmp_path / "run"
    assert train(files, out, "--epochs", "2", "--lr-schedule", "cosine", "--warmup-steps", "2") == 0
    layout = json.loads((out / "artifacts" / "artifacts.json").read_text())
    assert layout["lr_schedule"] == {"kind": "cosine", "warmup_steps": 2, "total_steps": 6}
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=LR)
    scheduler = transformers.get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=6)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [float(row["lr"]) for row in metrics(out)] == pytest.approx([rates[2], rates[5]], rel=1e-12)
    trainer = Trainer(generate_artifacts(files["model"], loss="cross_entropy", optimizer="adamw",
                                         optimizer_options={"lr": LR}))
    X, labels = files["X"], files["labels"]
    for epoch in range(2):
        order = np.random.default_rng([SEED, epoch]).permutation(len(X))
        for start in range(0, len(X), BATCH):
            picked = order[start:start + BATCH]
            trainer.step({"X": X[picked], "labels": labels[picked]}, lr=rates[trainer.step_count])
    state = load_arrays(out / "checkpoint")
    for name, value in trainer.parameters().items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert train(files, out, "--epochs", "3", "--lr-schedule", "cosine", "--warmup-steps", "2", "--resume") == 2


def test_keep_best_exports_the_epoch_of_the_lowest_validation_loss(files, tmp_path, capsys):
    """At a learning rate that overshoots, the validation loss rises after some epoch: --keep-best
    exports that epoch's model (its loss on the validation data is the minimum of metrics.csv), and
    --early-stopping 1 ends the run after the first epoch without a lower validation loss."""
    val_X, val_labels = files["val_X"], files["val_labels"]
    kept, stopped = tmp_path / "kept", tmp_path / "stopped"
    options = ("--epochs", "12", "--lr", "0.5", "--batch-size", "20")
    assert main(["train", files["model"], "--data", files["data.npz"], "-o", str(kept), "--seed", str(SEED),
                 "--val-data", files["val.npz"], "--keep-best", *options]) == 0
    rows = metrics(kept)
    losses = [float(row["val_loss"]) for row in rows]
    best = int(np.argmin(losses))
    assert best < len(rows) - 1, losses  # the last epoch is not the best one: the choice matters
    assert cross_entropy(kept / "model.onnx", val_X, val_labels) == pytest.approx(losses[best], rel=1e-5)
    assert f"is epoch {best + 1}'s, of the lowest validation loss" in capsys.readouterr().err
    assert main(["train", files["model"], "--data", files["data.npz"], "-o", str(stopped), "--seed", str(SEED),
                 "--val-data", files["val.npz"], "--early-stopping", "1", *options]) == 0
    stopped_rows = metrics(stopped)
    first_rise = next(i for i in range(1, len(losses)) if losses[i] >= min(losses[:i]))
    assert len(stopped_rows) == first_rise + 1 < 12
    assert "stopped after epoch" in capsys.readouterr().err
    assert main(["train", files["model"], "--data", files["data.npz"], "-o", str(tmp_path / "x"), "--keep-best"]) == 2
    assert "--keep-best compares the validation losses of the epochs: give --val-data" in capsys.readouterr().err


def test_qat_run_exports_a_quantized_model_that_onnxruntime_runs(tmp_path, capsys, monkeypatch):
    """train --qat int8: model.onnx is the QDQ model (integer weights read by DequantizeLinear,
    BatchNormalization folded), computing what the eval model does; the run resumes exactly (the
    observers' ranges are scalars of the checkpoint)."""
    from helpers import small_cnn, small_cnn_data

    from onnx_autodiff.training import distributed

    model, data = tmp_path / "cnn.onnx", small_cnn_data()
    onnx.save(small_cnn(), model)
    save(tmp_path / "data.npz", data)
    out, resumed = tmp_path / "run", tmp_path / "resumed"

    def run(directory, epochs, *extra):
        return main(["train", str(model), "--data", str(tmp_path / "data.npz"), "-o", str(directory),
                     "--qat", "int8", "--qat-calibration-steps", "2", "--batch-size", "8", "--lr", "0.01",
                     "--epochs", str(epochs), *extra])

    assert run(out, 2) == 0
    assert "2 epochs, 6 steps" in capsys.readouterr().out
    exported = onnx.load(str(out / "model.onnx"))
    ops = [node.op_type for node in exported.graph.node]
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"} <= set(ops) and "BatchNormalization" not in ops
    initializers = {t.name: t for t in exported.graph.initializer}
    weights = [initializers[node.input[0]] for node in exported.graph.node
               if node.op_type == "DequantizeLinear" and node.input[0] in initializers]
    assert sorted(len(w.dims) for w in weights) == [2, 4]  # fc's and conv's
    assert all(w.data_type == onnx.TensorProto.INT8 for w in weights)
    trainer = Trainer(str(out / "artifacts"))
    trainer.load_checkpoint(out / "checkpoint")
    expected = trainer.evaluate(data)["logits"]
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for options in (plain, None):  # as written, and with onnxruntime's quantized kernels where it fuses them
        session = ort.InferenceSession(exported.SerializeToString(), options, providers=["CPUExecutionProvider"])
        atol = 1e-5 if options is plain else 1e-2
        np.testing.assert_allclose(session.run(None, {"X": data["X"]})[0], expected, atol=atol)
    assert run(resumed, 1) == 0 and run(resumed, 2, "--resume") == 0
    assert (resumed / "model.onnx").read_bytes() == (out / "model.onnx").read_bytes()
    assert main(["train", str(model), "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / "y"),
                 "--qat-asymmetric"]) == 2
    assert "--qat-asymmetric needs --qat SCHEME" in capsys.readouterr().err
    two_ranks = type("World", (), {"Get_size": lambda self: 2, "Get_rank": lambda self: 0})()
    monkeypatch.setattr(distributed, "world", lambda: two_ranks)  # as under mpiexec -n 2
    assert run(tmp_path / "z", 1) == 2
    assert "--qat int8 does not combine with data-parallel training" in capsys.readouterr().err
