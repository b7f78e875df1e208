"""ArtifactsConfig: the options as one value, or as keywords of generate_artifacts."""

from __future__ import annotations

import dataclasses

import pytest
from fingerprints import digests
from test_training import mlp

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training import ArtifactsConfig, generate_artifacts
from onnx_autodiff.training.targets import CANONICAL, WEBGPU


def test_keywords_and_a_config_build_the_same_artifacts():
    options = {"loss": "mse", "optimizer": "sgd", "optimizer_options": {"lr": 0.1}, "max_grad_norm": 1.0}
    config = ArtifactsConfig(**options)
    by_keywords = digests(generate_artifacts(mlp(), **options))
    assert digests(generate_artifacts(mlp(), config)) == by_keywords
    # keywords given with a config replace its fields
    assert digests(generate_artifacts(mlp(), ArtifactsConfig(loss="l1"), **options)) == by_keywords


def test_options_are_checked_where_they_are_given():
    with pytest.raises(TypeError, match="config is an ArtifactsConfig, not a list"):
        generate_artifacts(mlp(), ["W1"])  # requires_grad by position: no longer taken silently
    with pytest.raises(TypeError):
        generate_artifacts(mlp(), los="mse")
    with pytest.raises(ValueError, match="unknown lowering target 'tpu'.*'onnxruntime', 'webgpu'"):
        ArtifactsConfig(target="tpu")
    with pytest.raises(TrainingError, match="max_grad_norm must be > 0"):
        ArtifactsConfig(max_grad_norm=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ArtifactsConfig().loss = "mse"


def test_the_target_as_an_object():
    assert ArtifactsConfig().runtime.name == "onnxruntime"
    assert ArtifactsConfig(target="webgpu").runtime is WEBGPU
    assert ArtifactsConfig(target=None).runtime is CANONICAL
    artifacts = generate_artifacts(mlp(), target=dataclasses.replace(WEBGPU, name="my-webgpu"))
    assert artifacts.manifest.target == "my-webgpu"
