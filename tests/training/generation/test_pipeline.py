"""build_artifacts: the input converted to onnx-ir once, each model written as a proto once."""

from __future__ import annotations

import sys

import onnx_ir as ir
import pytest
from training.generation.build_models import bn_dropout_model
from test_training import mlp

from onnx_autodiff import modelfile
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.pipeline import Built, build_artifacts
from onnx_autodiff.training.lora import LoraConfig

# the model-level conversions: onnx-autodiff's and onnx-ir's own
CONVERSIONS = {modelfile.from_proto.__code__: "from_proto", ir.serde.deserialize_model.__code__: "from_proto",
               modelfile.to_proto.__code__: "to_proto", ir.serde.serialize_model.__code__: "to_proto"}


def conversions(model, **options) -> dict[str, list[str]]:
    """The outermost conversions one build makes, by kind, each with the function that asked."""
    found: dict[str, list[str]] = {"from_proto": [], "to_proto": []}
    depth = [0]

    def profile(frame, event, arg):
        kind = CONVERSIONS.get(frame.f_code)
        if kind is not None and event == "call":
            if depth[0] == 0 and not frame.f_back.f_code.co_filename.endswith("inference.py"):
                # (onnx's shape inference, which the passes run, reads a proto of the model: no conversion)
                found[kind].append(frame.f_back.f_code.co_name)
            depth[0] += 1
        elif kind is not None and event == "return":
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        built = build_artifacts(model, ArtifactsConfig(**options))
    finally:
        sys.setprofile(None)
    assert isinstance(built, Built)
    return found


@pytest.mark.parametrize("model, options, written", [
    (mlp(), {}, 1),  # the eval model cut out of the written train model
    (bn_dropout_model(), {"gradient_accumulation": True}, 4),  # train, eval, accumulate, apply
    (mlp(), {"lora": LoraConfig(rank=2), "gradient_accumulation": True}, 4),  # and the forward read from the adapted one
], ids=["plain", "accumulation", "lora"])
def test_the_input_is_converted_once_and_each_model_written_once(model, options, written):
    found = conversions(model, **options)
    assert len(found["from_proto"]) == 1, found
    assert len(found["to_proto"]) == written, found
