"""Built-in losses that fit the model's output: a Softmax/Sigmoid output's logits, the class axis
of [batch, sequence, classes] logits, transformers' causal LM loss and CTC, each against PyTorch
(loss values and the gradients a plain SGD step with lr 1 applies), and the command line's notes."""

from __future__ import annotations

import csv
import logging
import math

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx_autodiff.cli import main
from onnx_autodiff.training import Trainer, generate_artifacts
from onnx_autodiff.training.losses import BuiltinLoss, class_axis

torch = pytest.importorskip("torch")
F = torch.nn.functional


def linear_model(x_dims, features, classes, activation=None, axis=-1, opset=18, transpose=None, seed=0,
                 dtype=np.float64):
    """X [..., features] @ W [features, classes] (+ Transpose) (+ activation): the logits' maker."""
    W = np.random.default_rng(seed).standard_normal((features, classes)).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, out = [helper.make_node("MatMul", ["X", "W"], ["logits"])], "logits"
    if transpose is not None:
        nodes[0].output[0] = "scores"
        nodes.append(helper.make_node("Transpose", ["scores"], ["logits"], perm=transpose))
    if activation is not None:
        attributes = {} if activation == "Sigmoid" else {"axis": axis}
        nodes.append(helper.make_node(activation, ["logits"], ["out"], **attributes))
        out = "out"
    out_dims = [*x_dims[:-1], classes]
    if transpose is not None:
        out_dims = [out_dims[p] for p in transpose]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("X", elem, x_dims)],
                              [helper.make_tensor_value_info(out, elem, out_dims)], [numpy_helper.from_array(W, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), W


def sgd_gradient(model, W, batch, loss, **options):
    """(loss, ∂loss/∂W) from one step of SGD with lr 1 (W − W_new), in float64."""
    trainer = Trainer(generate_artifacts(model, loss=loss, optimizer="sgd", optimizer_options={"lr": 1.0},
                                         check_output=True, **options))
    value = trainer.step(batch)
    return value, W - trainer.parameters()["W"]


def torch_gradient(W, compute):
    weight = torch.tensor(W, requires_grad=True)
    value = compute(weight)
    value.backward()
    return value.item(), weight.grad.numpy()


def assert_matches(ours, reference, rtol=1e-9):
    assert ours[0] == pytest.approx(reference[0], rel=rtol)
    np.testing.assert_allclose(ours[1], reference[1], rtol=rtol, atol=rtol * np.abs(reference[1]).max())


# 1. A Softmax (LogSoftmax, Sigmoid) output: the loss reads the logits


@pytest.mark.parametrize("activation, opset, axis", [("Softmax", 18, -1), ("Softmax", 11, 1), ("LogSoftmax", 18, 1)])
def test_cross_entropy_of_softmax_output_reads_the_logits(activation, opset, axis, caplog):
    model, W = linear_model(["N", 6], 6, 5, activation, axis=axis, opset=opset)
    rng = np.random.default_rng(1)
    X, labels = rng.standard_normal((8, 6)), rng.integers(0, 5, 8)
    labels[3] = -100
    with caplog.at_level(logging.WARNING, logger="onnx_autodiff"):
        ours = sgd_gradient(model, W, {"X": X, "labels": labels}, "cross_entropy")
    reference = torch_gradient(W, lambda w: F.cross_entropy(torch.tensor(X) @ w, torch.tensor(labels)))
    assert_matches(ours, reference)
    notes = [r.getMessage() for r in caplog.records if "logits" in r.getMessage()]
    assert len(notes) == 1 and f"the logits that the {activation} making output 'out'" in notes[0]


def test_softmax_output_keeps_its_probabilities_in_eval_and_export():
    model, W = linear_model(["N", 4], 4, 3, "Softmax")
    trainer = Trainer(generate_artifacts(model, loss="cross_entropy", optimizer="sgd", optimizer_options={"lr": 0.1}))
    X = np.random.default_rng(2).standard_normal((5, 4))
    probabilities = trainer.evaluate({"X": X, "labels": np.zeros(5, np.int64)})["out"]
    np.testing.assert_allclose(probabilities, torch.softmax(torch.tensor(X @ W), 1).numpy(), rtol=1e-12)
    exported = trainer.export()
    assert [n.op_type for n in exported.graph.node] == ["MatMul", "Softmax"]


@pytest.mark.parametrize("opset", [18, 11])
def test_softmax_over_other_axes_is_left_as_the_output(opset, caplog):
    """Softmax over the sequence (opset 18) or, at opset 11, over sequence and classes together
    (its 2-D coercion from axis 1), not the classes alone: its output is what the loss reads."""
    model, W = linear_model(["N", 3, 4], 4, 5, "Softmax", axis=1, opset=opset)
    rng = np.random.default_rng(3)
    X, labels = rng.standard_normal((2, 3, 4)), rng.integers(0, 5, (2, 3))
    with caplog.at_level(logging.WARNING, logger="onnx_autodiff"):
        ours = sgd_gradient(model, W, {"X": X, "labels": labels}, "cross_entropy",
                            labels=[("labels", np.int64, [None, 3])])

    def probabilities(w):
        scores = torch.tensor(X) @ w
        return torch.softmax(scores, 1) if opset >= 13 else torch.softmax(scores.reshape(2, -1), 1).reshape(2, 3, 5)

    reference = torch_gradient(W, lambda w: F.cross_entropy(probabilities(w).reshape(-1, 5), torch.tensor(labels).reshape(-1)))
    assert_matches(ours, reference)
    assert not any("logits" in r.getMessage() for r in caplog.records)


def test_bce_with_logits_of_sigmoid_output_reads_the_logits(caplog):
    model, W = linear_model(["N", 6], 6, 3, "Sigmoid")
    rng = np.random.default_rng(4)
    X, labels = rng.standard_normal((7, 6)), (rng.random((7, 3)) > 0.5).astype(np.float64)
    with caplog.at_level(logging.WARNING, logger="onnx_autodiff"):
        ours = sgd_gradient(model, W, {"X": X, "labels": labels}, "bce_with_logits")
    reference = torch_gradient(W, lambda w: F.binary_cross_entropy_with_logits(torch.tensor(X) @ w, torch.tensor(labels)))
    assert_matches(ours, reference)
    assert any("the logits that the Sigmoid making output 'out'" in r.getMessage() for r in caplog.records)


# 2. The class axis of rank-3 logits


@pytest.mark.parametrize("dims, labels, normalised, axis, guessed", [
    ([4, 10], None, None, 1, False),
    (["batch", "sequence", 200], None, None, 2, True),          # transformers' logits
    (["batch", 5, "length"], None, None, 1, True),              # [N, C, d1] with a dynamic d1
    ([4, 7, 5], [None, 7], None, 2, False),                    # labels [N, S] decide: classes last
    ([4, 5, 7], [None, 7], None, 1, False),                    # labels [N, d1] decide: classes at 1
    ([4, 128, 9], None, None, 1, True),                        # fixed: the larger one (a guess)
    (["b", "s", "c"], None, 1, 1, False),                      # the Softmax's axis decides
    (["N", 21, "H", "W"], None, None, 1, False),               # images
])
def test_class_axis_rule(dims, labels, normalised, axis, guessed):
    chosen, why = class_axis(dims, labels, normalised)
    assert chosen == axis and (why is not None) == guessed


def test_cross_entropy_on_batch_sequence_classes_logits():
    model, W = linear_model(["batch", "sequence", 6], 6, 11, opset=18)
    rng = np.random.default_rng(5)
    X, labels = rng.standard_normal((3, 7, 6)), rng.integers(0, 11, (3, 7))
    labels[0, :2] = -100
    ours = sgd_gradient(model, W, {"X": X, "labels": labels}, "cross_entropy")
    reference = torch_gradient(W, lambda w: F.cross_entropy((torch.tensor(X) @ w).reshape(-1, 11),
                                                            torch.tensor(labels).reshape(-1)))
    assert_matches(ours, reference)


# 3. causal_lm


def test_causal_lm_matches_transformers_shifted_loss():
    model, W = linear_model(["batch", "sequence", 8], 8, 13)
    rng = np.random.default_rng(6)
    X, labels = rng.standard_normal((2, 9, 8)), rng.integers(0, 13, (2, 9))
    labels[1, 6:] = -100  # padding
    artifacts = generate_artifacts(model, loss="causal_lm", optimizer="sgd", optimizer_options={"lr": 1.0},
                                   check_output=True)
    assert "class_axis" in artifacts.layout and artifacts.layout["class_axis"] is None
    trainer = Trainer(artifacts)
    ours = trainer.step({"X": X, "labels": labels}), W - trainer.parameters()["W"]

    def shifted(w):  # what transformers' ForCausalLMLoss computes
        logits = torch.tensor(X) @ w
        return F.cross_entropy(logits[:, :-1].reshape(-1, 13), torch.tensor(labels)[:, 1:].reshape(-1), ignore_index=-100)

    assert_matches(ours, torch_gradient(W, shifted))


# 4. ctc


@pytest.mark.parametrize("layout, blank, zero_infinity", [("batch", 0, False), ("time", 0, True), ("batch", 4, True)])
def test_ctc_matches_torch(layout, blank, zero_infinity, caplog):
    N, T, features, C, S = 3, 12, 5, 6, 4
    model, W = linear_model(["N", "T", features], features, C, "Softmax",
                            transpose=[1, 0, 2] if layout == "time" else None)
    rng = np.random.default_rng(7)
    X = rng.standard_normal((N, T, features))
    targets = rng.integers(0, C - 1, (N, S))
    targets[targets >= blank] += 1  # no blank among the labels
    input_lengths, target_lengths = np.array([12, 10, 9]), np.array([4, 2, 3])
    targets[1, 2:] = -1  # padding after the target length: not read
    if zero_infinity:
        input_lengths[2] = 2  # 3 labels in 2 steps: impossible, zeroed
    batch = {"X": X, "labels": targets, "input_lengths": input_lengths, "target_lengths": target_lengths}
    with caplog.at_level(logging.WARNING, logger="onnx_autodiff"):
        ours = sgd_gradient(model, W, batch, BuiltinLoss("ctc", blank=blank, zero_infinity=zero_infinity))

    def ctc(w):
        log_probs = torch.log_softmax(torch.tensor(X) @ w, -1).transpose(0, 1)  # [T, N, C]
        return F.ctc_loss(log_probs, torch.tensor(targets).clamp(min=0), torch.tensor(input_lengths),
                          torch.tensor(target_lengths), blank=blank, zero_infinity=zero_infinity)

    assert_matches(ours, torch_gradient(W, ctc), rtol=1e-8)
    shown = "[batch, time, classes]" if layout == "batch" else "[time, batch, classes]"
    assert any("ctc reads output 'out'" in r.getMessage() and shown in r.getMessage() for r in caplog.records)


def test_ctc_impossible_alignment_is_infinite_without_zero_infinity():
    model, W = linear_model(["N", "T", 3], 3, 4)
    trainer = Trainer(generate_artifacts(model, loss="ctc", optimizer="sgd"))
    X = np.random.default_rng(8).standard_normal((2, 3, 3))
    batch = {"X": X, "labels": np.array([[1, 2, 3], [1, 1, 0]]), "input_lengths": np.array([2, 3]),
             "target_lengths": np.array([3, 2])}
    assert math.isinf(float(trainer.evaluate(batch)["loss"]))


# 5. The command line


def write_classifier(tmp_path, classes=20, features=8, examples=16):
    model, _ = linear_model(["N", features], features, classes, "Softmax", dtype=np.float32)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(9)
    data = tmp_path / "data.npz"
    np.savez(data, X=rng.standard_normal((examples, features)).astype(np.float32),
             labels=rng.integers(0, classes, examples))
    return str(path), str(data)


def test_train_softmax_classifier_note_and_loss_below_log_classes(tmp_path, capsys):
    classes = 20
    model, data = write_classifier(tmp_path, classes)
    out = tmp_path / "run"
    assert main(["train", model, "--data", data, "-o", str(out), "--batch-size", "16", "--epochs", "40",
                 "--lr", "0.1"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("onnx-autodiff: note: cross_entropy")]
    assert len(notes) == 1 and "the logits that the Softmax making output 'out'" in notes[0]
    with open(out / "metrics.csv", newline="") as stream:
        losses = [float(row["loss"]) for row in csv.DictReader(stream)]
    assert losses[0] > math.log(classes) - 1 > 3 * losses[-1]
    exported = onnx.load(out / "model.onnx")
    assert exported.graph.node[-1].op_type == "Softmax"


def test_train_sequence_labels_take_the_last_axis(tmp_path, capsys):
    """Logits [4, 7, 5] fixed: the data's labels [N, 7] choose the class axis (the last); the
    validation accuracy is read along it."""
    model, _ = linear_model([4, 7, 3], 3, 5, dtype=np.float32)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(10)
    arrays = {"X": rng.standard_normal((8, 7, 3)).astype(np.float32), "labels": rng.integers(0, 5, (8, 7))}
    np.savez(tmp_path / "data.npz", **arrays)
    out = tmp_path / "run"
    assert main(["train", str(path), "--data", str(tmp_path / "data.npz"), "--val-data", str(tmp_path / "data.npz"),
                 "-o", str(out), "--batch-size", "4", "--epochs", "1"]) == 0
    captured = capsys.readouterr()
    assert "val_accuracy" in captured.out and "note: cross_entropy" not in captured.err


def test_exported_language_model_cross_entropy_and_causal_lm():
    """A tiny torch LM exported with dynamic batch and sequence: logits [batch, sequence, 17], the
    class axis last for cross_entropy, and causal_lm; gradients of the parameters that stay as
    exported against PyTorch's."""
    import io
    import warnings

    vocabulary = 17

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = torch.nn.Embedding(vocabulary, 8), torch.nn.Linear(8, vocabulary)

        def forward(self, input_ids):
            return self.head(torch.tanh(self.emb(input_ids)))

    module, stream = LM(), io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(2, 6, dtype=torch.int64),), stream, input_names=["input_ids"],
                          output_names=["logits"], dynamo=False,
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}})
    proto = onnx.load_from_string(stream.getvalue())
    generator = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, vocabulary, (3, 5), generator=generator) for _ in range(2))
    labels[0, 0] = -100
    for loss in ("cross_entropy", "causal_lm"):
        trainer = Trainer(generate_artifacts(proto, loss=loss, optimizer="sgd", optimizer_options={"lr": 1.0}))
        before = trainer.parameters()
        value = trainer.step({"input_ids": ids.numpy(), "labels": labels.numpy()})
        after = trainer.parameters()
        module.zero_grad()
        logits = module(ids)
        if loss == "causal_lm":
            logits, wanted = logits[:, :-1], labels[:, 1:]
        else:
            wanted = labels
        reference = F.cross_entropy(logits.reshape(-1, vocabulary), wanted.reshape(-1))
        reference.backward()
        assert value == pytest.approx(reference.item(), rel=1e-6)
        for name in ("emb.weight", "head.bias"):
            grad = dict(module.named_parameters())[name].grad.numpy()
            np.testing.assert_allclose(before[name] - after[name], grad, atol=1e-6)


def test_train_ctc_and_causal_lm_from_the_command_line(tmp_path, capsys):
    """ctc's three label arrays and causal_lm's labels read from the data; the loss falls; no
    accuracy (their labels are not one class per output position)."""
    rng = np.random.default_rng(11)
    ctc_model, _ = linear_model(["N", "T", 4], 4, 5, "Softmax", dtype=np.float32)
    onnx.save(ctc_model, tmp_path / "ctc.onnx")
    np.savez(tmp_path / "ctc.npz", X=rng.standard_normal((6, 10, 4)).astype(np.float32),
             labels=rng.integers(1, 5, (6, 3)), input_lengths=np.full(6, 10), target_lengths=np.array([3, 2, 3, 1, 3, 2]))
    lm_model, _ = linear_model(["batch", "sequence", 4], 4, 9, dtype=np.float32)
    onnx.save(lm_model, tmp_path / "lm.onnx")
    np.savez(tmp_path / "lm.npz", X=rng.standard_normal((6, 5, 4)).astype(np.float32), labels=rng.integers(0, 9, (6, 5)))
    for loss, extra in (("ctc", ["--ctc-blank", "0", "--ctc-zero-infinity"]), ("causal_lm", [])):
        data, out = str(tmp_path / f"{'ctc' if loss == 'ctc' else 'lm'}.npz"), tmp_path / loss
        model = str(tmp_path / f"{'ctc' if loss == 'ctc' else 'lm'}.onnx")
        assert main(["train", model, "--data", data, "--val-data", data, "-o", str(out), "--loss", loss,
                     "--batch-size", "6", "--epochs", "12", "--lr", "0.1", *extra]) == 0
        captured = capsys.readouterr()
        with open(out / "metrics.csv", newline="") as stream:
            rows = list(csv.DictReader(stream))
        assert float(rows[-1]["loss"]) < 0.8 * float(rows[0]["loss"])
        assert "val_accuracy" not in rows[0]
        if loss == "ctc":
            assert "note: ctc reads output 'out' [N, T, 5] as [batch, time, classes]" in captured.err
    assert main(["artifacts", model, "-o", str(tmp_path / "bad"), "--loss", "causal_lm", "--ctc-blank", "1"]) == 2
    assert "--ctc-blank and --ctc-zero-infinity apply to --loss ctc only" in capsys.readouterr().err


def test_loss_configuration_errors():
    from onnx_autodiff.errors import TrainingError

    sequence, _ = linear_model(["N", "T", 3], 3, 4)
    flat, _ = linear_model(["N", 3], 3, 4)
    cases = [(sequence, BuiltinLoss("ctc", blnk=2), "does not take the options {'blnk': 2}"),
             (flat, "causal_lm", "causal_lm needs logits [batch, sequence, vocabulary]; output 'logits' has shape [N, 4]"),
             (flat, "ctc", "ctc needs scores [batch, time, classes] or [time, batch, classes]"),
             (sequence, "focal", "unknown loss 'focal': use one of cross_entropy, mse, l1, bce_with_logits, causal_lm, ctc")]
    for model, loss, message in cases:
        with pytest.raises(TrainingError) as error:
            generate_artifacts(model, loss=loss, optimizer="sgd")
        assert message in str(error.value)
