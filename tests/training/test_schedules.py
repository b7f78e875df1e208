"""The learning-rate schedules step the learning rates of transformers' get_scheduler (LambdaLR
over a torch optimiser), step by step."""

import pytest

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training.schedules import LRSchedule

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def torch_learning_rates(kind: str, warmup: int, total: int, lr: float, steps: int) -> list[float]:
    """The learning rate of each optimiser step of a transformers schedule, as a training loop
    reads it (optimizer.step() then scheduler.step())."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=lr)
    name = {"constant": "constant_with_warmup"}.get(kind, kind)
    scheduler = transformers.get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (4, 25), (10, 10)])
def test_learning_rates_equal_transformers(kind, warmup, total):
    lr = 3e-4
    schedule = LRSchedule(kind, warmup, total)
    ours = [lr * schedule.factor(step) for step in range(total + 3)]  # past the end too
    assert ours == pytest.approx(torch_learning_rates(kind, warmup, total, lr, total + 3), rel=1e-12, abs=1e-18)


def test_the_json_form_round_trips():
    for schedule in (LRSchedule(), LRSchedule("cosine", 5, 100), LRSchedule("linear", 0, 7)):
        assert LRSchedule.from_json(schedule.to_json()) == schedule


@pytest.mark.parametrize("options,message", [
    ({"kind": "step"}, "must be one of constant, linear, cosine"),
    ({"kind": "linear"}, "give total_steps"),
    ({"kind": "cosine", "total_steps": 0}, "total_steps must be a whole number > 0"),
    ({"warmup_steps": -1}, "warmup_steps must be a whole number >= 0"),
    ({"warmup_steps": 1.5}, "warmup_steps must be a whole number >= 0"),
])
def test_bad_schedules_are_refused(options, message):
    with pytest.raises(TrainingError, match=message):
        LRSchedule(**options)


def test_the_trainer_steps_the_manifest_schedule():
    """Artifacts whose manifest holds a schedule: the Trainer's learning rate of each step is
    transformers' (after the steps taken), and its steps equal steps given those rates."""
    import dataclasses

    import numpy as np

    from onnx_autodiff.demo import blobs, classifier_model
    from onnx_autodiff.training import Trainer, generate_artifacts

    artifacts = generate_artifacts(classifier_model(loss=False), loss="cross_entropy", optimizer="adamw",
                                   optimizer_options={"lr": 0.05})
    schedule = LRSchedule("cosine", 2, 6)
    scheduled = dataclasses.replace(artifacts, manifest=dataclasses.replace(artifacts.manifest, lr_schedule=schedule))
    X, labels = blobs(samples=32)
    batch = {"X": X, "labels": labels}
    ours, given = Trainer(scheduled), Trainer(artifacts)
    rates = []
    for _ in range(6):
        rates.append(ours.learning_rate)
        loss = ours.step(batch)
        assert loss == given.step(batch, lr=rates[-1])
    assert rates == pytest.approx(torch_learning_rates("cosine", 2, 6, 0.05, 6), rel=1e-12, abs=1e-18)
    assert rates[0] == 0 and ours.step_count == 6
    for key, value in given.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[key], value, err_msg=key)


def test_the_artifacts_command_and_the_api_record_a_schedule(tmp_path, capsys):
    import json

    import onnx

    from onnx_autodiff.cli import main
    from onnx_autodiff.demo import classifier_model
    from onnx_autodiff.training import generate_artifacts

    path = tmp_path / "model.onnx"
    onnx.save(classifier_model(loss=False), path)
    out = tmp_path / "artifacts"
    assert main(["artifacts", str(path), "-o", str(out), "--lr-schedule", "cosine", "--warmup-steps", "10",
                 "--total-steps", "100"]) == 0
    assert json.loads((out / "artifacts.json").read_text())["lr_schedule"] == {
        "kind": "cosine", "warmup_steps": 10, "total_steps": 100}
    assert main(["artifacts", str(path), "-o", str(out), "--lr-schedule", "linear"]) == 2
    assert "--lr-schedule linear decays to 0 at the run's last step: give --total-steps N" in capsys.readouterr().err
    schedule = LRSchedule("linear", 0, 7)
    assert generate_artifacts(path, lr_schedule=schedule).manifest.lr_schedule == schedule
    assert "lr_schedule" not in generate_artifacts(path).layout
