"""A new loss, optimiser or target is one definition and its registration, with no change to any
module of the package: each toy one here is registered, built into artifacts that a Trainer
steps, and unregistered. The readers of each table (the command line's choices, the manifest's
JSON and its schema, the errors' lists) see it while it is registered, and not after."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from test_training import mlp

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training import Trainer, TrainingArtifacts, generate_artifacts
from onnx_autodiff.training.cli import add_arguments
from onnx_autodiff.training.losses import BUILTIN_LOSSES, LOSSES, register_loss
from onnx_autodiff.training.manifest import json_schema, schema_text
from onnx_autodiff.training.optimizers import OPTIMIZER_CLASSES, OPTIMIZERS, Optimizer, register_optimizer
from onnx_autodiff.training.targets import ONNXRUNTIME, TARGETS, Target, register_target
from onnx_autodiff.training.values import dim_value

ROOT = Path(__file__).resolve().parents[2]
rng = np.random.default_rng(0)
X = rng.standard_normal((8, 5)).astype(np.float32)
CLASSES = rng.integers(0, 3, 8)


def parsed(*argv: str) -> argparse.Namespace:
    """The ``artifacts`` command's options, parsed by a parser made now."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(["model.onnx", "-o", "out", *argv])


def sum_of_squares(att, y):
    """A toy loss: Σ (y − t)², labels like the output."""
    labels = [att.label(att.label_name, y.dtype, [dim_value(d) for d in y.shape])]
    d = att.op.Sub(y, labels[0])
    return att.op.reduce("ReduceSum", att.op.Mul(d, d), None, keepdims=False), labels


@dataclasses.dataclass(frozen=True)
class SignSGD(Optimizer):
    """A toy optimiser: p −= lr·sign(g), no state."""

    lr: float = 1e-3
    name = "sign_sgd"

    def update(self, op, p, g, states, scalars):
        return [op.Sub(p, op.Mul(op.Sign(g), scalars.input("lr", p)))]


# A toy target: onnxruntime's lowering, one update per parameter.
UNGROUPED = Target("onnxruntime-ungrouped", rules=ONNXRUNTIME.rules, grouped_updates=False)


def test_a_loss_is_a_function_and_its_registration():
    register_loss("sum_of_squares")(sum_of_squares)
    try:
        assert LOSSES[-1] == "sum_of_squares" and parsed("--loss", "sum_of_squares").loss == "sum_of_squares"
        artifacts = generate_artifacts(mlp(), loss="sum_of_squares", optimizer="sgd")
        t = rng.standard_normal((8, 3)).astype(np.float32)
        loss = Trainer(artifacts).step({"X": X, "labels": t})
        session = ort.InferenceSession(mlp().SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(loss, ((session.run(None, {"X": X})[0] - t) ** 2).sum(), rtol=1e-5)
    finally:
        BUILTIN_LOSSES.unregister("sum_of_squares")
    assert "sum_of_squares" not in LOSSES
    with pytest.raises(TrainingError, match="unknown loss 'sum_of_squares'"):
        generate_artifacts(mlp(), loss="sum_of_squares")


def test_an_optimizer_is_a_class_and_its_registration(tmp_path):
    register_optimizer(SignSGD)
    try:
        assert OPTIMIZERS[-1] == "sign_sgd" and parsed("--optimizer", "sign_sgd").optimizer == "sign_sgd"
        artifacts = generate_artifacts(mlp(), optimizer="sign_sgd", optimizer_options={"lr": 0.1})
        assert artifacts.optimizer == SignSGD(lr=0.1)
        artifacts.save(tmp_path)
        document = json.loads((tmp_path / "artifacts.json").read_text())
        assert document["optimizer"] == {"name": "sign_sgd", "lr": 0.1}
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.Draft202012Validator(json_schema()).validate(document)  # (the schema lists it while registered)
        loaded = TrainingArtifacts.load(tmp_path)
        assert loaded.optimizer == SignSGD(lr=0.1)

        trainer = Trainer(loaded)
        before = trainer.state_dict()
        trainer.step({"X": X, "labels": CLASSES})
        sgd = Trainer(generate_artifacts(mlp(), optimizer="sgd", optimizer_options={"lr": 1.0}))
        sgd.step({"X": X, "labels": CLASSES})  # (its step by lr 1 is the gradient)
        after, stepped = trainer.state_dict(), sgd.state_dict()
        for name in loaded.params:
            sign = np.sign(before[name] - stepped[name])
            np.testing.assert_allclose(after[name], before[name] - np.float32(0.1) * sign, rtol=1e-6, atol=1e-7)
    finally:
        OPTIMIZER_CLASSES.unregister("sign_sgd")
    assert "sign_sgd" not in OPTIMIZERS
    assert schema_text() == (ROOT / "js" / "artifacts.schema.json").read_text()
    with pytest.raises(TrainingError, match="unknown optimizer 'sign_sgd'"):
        TrainingArtifacts.load(tmp_path)


def test_a_target_is_one_target_and_its_registration(tmp_path):
    register_target(UNGROUPED)
    try:
        assert parsed("--target", UNGROUPED.name).target == UNGROUPED.name
        artifacts = generate_artifacts(mlp(), optimizer="adamw", target=UNGROUPED.name)
        assert artifacts.manifest.target == UNGROUPED.name
        assert not any(node.op_type == "Concat" for node in artifacts.train_model.graph.node)
        artifacts.save(tmp_path)
        assert json.loads((tmp_path / "artifacts.json").read_text())["target"] == UNGROUPED.name
        trainer = Trainer(TrainingArtifacts.load(tmp_path))
        default = Trainer(generate_artifacts(mlp(), optimizer="adamw"))
        for _ in range(2):  # the default target's grouped steps, bit for bit (elementwise updates)
            assert trainer.step({"X": X, "labels": CLASSES}) == default.step({"X": X, "labels": CLASSES})
        for name, value in trainer.state_dict().items():
            np.testing.assert_array_equal(value, default.state_dict()[name])
    finally:
        TARGETS.unregister(UNGROUPED.name)
    with pytest.raises(ValueError, match="unknown lowering target 'onnxruntime-ungrouped'"):
        generate_artifacts(mlp(), target=UNGROUPED.name)


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="optimizer 'sgd' is registered already"):
        register_optimizer(dataclasses.make_dataclass("Other", [], bases=(Optimizer,), namespace={"name": "sgd"}))
    with pytest.raises(ValueError, match="loss 'mse' is registered already"):
        register_loss("mse")(sum_of_squares)


def test_the_docs_list_the_built_in_losses():
    """docs/training.md's list and table of losses name those registered."""
    text = (ROOT / "docs" / "training.md").read_text()
    listed = re.search(r"^losses ((?:`\w+`, )+`\w+`)", text, re.M).group(1)
    section = text.split("\n### Losses\n")[1].split("\n#")[0]
    tabled = [name for row in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \|", section, re.M) for name in re.findall(r"`(\w+)`", row)]
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(LOSSES) == sorted(tabled)
