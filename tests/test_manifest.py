"""The artifacts' manifest (onnx_autodiff.training.manifest): artifacts.json read and written through
its classes, valid against the JSON Schema generated from them (js/artifacts.schema.json), and the
older formats loading through its upgrade."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from test_constant_weights import paddle_cnn
from test_training import batches, bn_dropout_model, mlp

from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training import Trainer, TrainingArtifacts, TrainingError, generate_artifacts
from onnx_autodiff.training.manifest import FORMAT_VERSION, SEEDED_FORMAT, Manifest, json_schema, schema_text

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = Path(__file__).resolve().parents[1] / "js" / "artifacts.schema.json"

CONFIGURATIONS = {
    "sgd": lambda: generate_artifacts(mlp(), optimizer="sgd", optimizer_options={"lr": 0.1, "momentum": 0.9}),
    "adamw, accumulation, clipping": lambda: generate_artifacts(mlp(), optimizer="adamw", gradient_accumulation=True,
                                                                max_grad_norm=1.0),
    "adam amsgrad": lambda: generate_artifacts(mlp(), optimizer="adam", optimizer_options={"amsgrad": True}),
    "webgpu, hashed dropout": lambda: generate_artifacts(bn_dropout_model(), optimizer="adamw", target="webgpu",
                                                         gradient_accumulation=True),
    "canonical forms": lambda: generate_artifacts(bn_dropout_model(), optimizer="sgd", target=None),
    "constants, no classes": lambda: generate_artifacts(paddle_cnn(), loss="mse"),
    "lora, int4 base": lambda: generate_artifacts(mlp(), lora=LoraConfig(rank=2, dropout=0.1, quantize_base="int4",
                                                                        quantize_block=16)),
}


def validator():
    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


def test_the_committed_schema_is_the_generated_one():
    assert SCHEMA.read_text() == schema_text(), (
        "js/artifacts.schema.json is stale: python -c \"from onnx_autodiff.training.manifest import schema_text; "
        "print(schema_text(), end='')\" > js/artifacts.schema.json")
    jsonschema.Draft202012Validator.check_schema(json_schema())


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_artifacts_json_is_the_manifest_and_matches_the_schema(configuration, tmp_path):
    artifacts = CONFIGURATIONS[configuration]()
    artifacts.save(tmp_path)
    document = json.loads((tmp_path / "artifacts.json").read_text())
    assert not list(validator().iter_errors(document))
    assert Manifest.from_json(document) == artifacts.manifest
    assert artifacts.layout == artifacts.manifest.to_json() and json.loads(json.dumps(artifacts.layout)) == document
    loaded = TrainingArtifacts.load(tmp_path)
    assert loaded.manifest == artifacts.manifest
    assert loaded.manifest.format == (SEEDED_FORMAT if "hashed dropout" in configuration else FORMAT_VERSION)
    text = (tmp_path / "artifacts.json").read_bytes()
    loaded.save(tmp_path / "again")
    assert (tmp_path / "again" / "artifacts.json").read_bytes() == text  # byte for byte through the manifest


def test_external_data_is_recorded_as_the_schema_says(tmp_path):
    """Artifacts that read the input model's data file where it is record it; saved so over a copy
    with data files of its own, those go (they would be stale)."""
    source = tmp_path / "model" / "mlp.onnx"
    source.parent.mkdir()
    onnx.save_model(mlp(outputs=64), str(source), save_as_external_data=True, size_threshold=0, location="weights.bin")
    artifacts = generate_artifacts(str(source))
    artifacts.save(tmp_path / "artifacts", external_data=True)
    assert (tmp_path / "artifacts" / "inference_model.onnx.data").is_file()
    artifacts.save(tmp_path / "artifacts")
    assert not list((tmp_path / "artifacts").glob("*.data"))
    document = json.loads((tmp_path / "artifacts" / "artifacts.json").read_text())
    assert document["external_data"]["folder"] == "../model" and not list(validator().iter_errors(document))
    loaded = TrainingArtifacts.load(tmp_path / "artifacts")
    assert loaded.manifest.external_data.files == {"weights.bin": (source.parent / "weights.bin").stat().st_size}
    assert loaded.base_dir == str(tmp_path / "artifacts" / "../model")


def test_a_layout_dict_still_makes_artifacts():
    """TrainingArtifacts took the layout dict before it took the manifest."""
    artifacts = generate_artifacts(mlp(), optimizer="adam")
    again = TrainingArtifacts(artifacts.train_model, artifacts.eval_model, artifacts.inference_model,
                              artifacts.checkpoint, artifacts.layout)
    assert again.manifest == artifacts.manifest
    next_batch = next(batches(1))
    assert Trainer(again).step(next_batch) == Trainer(artifacts).step(next_batch)


def written_as_before(directory: Path, document: dict, drop_kept: bool = False) -> None:
    """``document`` as the older versions wrote artifacts.json (json.dumps, indent 1); with
    ``drop_kept``, the models and the document without the "kept" flag, as before the models had it."""
    if drop_kept:
        for kind, file in (("train", "training_model.onnx"), ("accumulate", "accumulate_model.onnx"),
                           ("apply", "apply_model.onnx")):
            if kind in document:
                flag = document[kind].pop("kept")
                model = onnx.load(directory / file)
                outputs = [o for o in model.graph.output if o.name != flag]
                del model.graph.output[:]
                model.graph.output.extend(outputs)
                onnx.save(model, directory / file)
    (directory / "artifacts.json").write_text(json.dumps(document, indent=1, sort_keys=True))


def trained(artifacts_or_directory, steps=3):
    trainer = Trainer(artifacts_or_directory if isinstance(artifacts_or_directory, TrainingArtifacts)
                      else str(artifacts_or_directory))
    losses = [trainer.step(batch) for batch in batches(steps)]
    return losses, trainer.state_dict()


@pytest.mark.parametrize("optimizer, options", [("sgd", {"lr": 0.1, "momentum": 0.9}), ("adamw", {"lr": 0.01})])
def test_format_2_loads_and_trains(optimizer, options, tmp_path):
    """Format 2 as it was first written: the coefficients as scalar inputs, no target, class axis,
    constants or external data."""
    artifacts = generate_artifacts(mlp(), optimizer=optimizer, optimizer_options=options)
    artifacts.save(tmp_path)
    document = artifacts.layout
    assert document["format"] == 2 and set(document) == {"format", "inputs", "labels", "params", "buffers",
                                                          "optimizer", "max_grad_norm", "train", "eval"}
    written_as_before(tmp_path, document)
    loaded = TrainingArtifacts.load(tmp_path)
    assert loaded.manifest == artifacts.manifest
    losses, state = trained(tmp_path)
    expected_losses, expected = trained(artifacts)
    assert losses == expected_losses and all(np.array_equal(state[k], expected[k]) for k in expected)


def test_format_1_loads_through_the_upgrade_and_trains(tmp_path):
    """Format 1 as it was first written: its models computed Adam's coefficients themselves and
    returned no "kept" flag (SGD's models are otherwise the same); it loads as format 2, and the
    trainer checks the new values itself."""
    artifacts = generate_artifacts(mlp(), optimizer="sgd", optimizer_options={"lr": 0.1, "momentum": 0.9},
                                   gradient_accumulation=True)
    artifacts.save(tmp_path)
    written_as_before(tmp_path, {**artifacts.layout, "format": 1}, drop_kept=True)
    loaded = TrainingArtifacts.load(tmp_path)
    assert loaded.manifest.format == FORMAT_VERSION
    assert loaded.manifest.train.kept is None and loaded.manifest.apply.kept is None
    assert dataclasses.replace(loaded.manifest, train=artifacts.manifest.train, accumulate=artifacts.manifest.accumulate,
                               apply=artifacts.manifest.apply) == artifacts.manifest
    losses, state = trained(tmp_path)
    expected_losses, expected = trained(artifacts)
    assert losses == expected_losses and all(np.array_equal(state[k], expected[k]) for k in expected)
    trainer = Trainer(str(tmp_path))
    for batch in batches(2):
        trainer.accumulate(batch)
    trainer.apply()
    assert trainer.step_count == 1


@pytest.mark.parametrize("damage, message", [
    (lambda d: {**d, "format": 99}, r"unsupported artifacts format 99 \(this version of onnx-autodiff reads formats 1, 2, 3\)"),
    (lambda d: {k: v for k, v in d.items() if k != "train"}, r"is no artifacts.json of format 2 \(KeyError: 'train'\)"),
    (lambda d: "[1, 2", r"is not JSON"),
])
def test_a_damaged_artifacts_json_is_one_clear_error(damage, message, tmp_path):
    artifacts = generate_artifacts(mlp())
    artifacts.save(tmp_path)
    damaged = damage(artifacts.layout)
    (tmp_path / "artifacts.json").write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(TrainingError, match=message):
        TrainingArtifacts.load(tmp_path)
