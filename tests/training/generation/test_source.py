"""read_forward: the model as given, read once; local functions inlined; LoRA's adapters the
parameters."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper
from test_training import mlp

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.modelfile import from_proto
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.source import as_proto, read_forward, source_dir
from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training.targets import ONNXRUNTIME


def test_a_model_in_any_form_is_a_proto_of_its_own(tmp_path):
    proto = mlp()
    path = tmp_path / "mlp.onnx"
    onnx.save(proto, path)
    for given in (proto, from_proto(proto), proto.SerializeToString(), str(path), path):
        read = as_proto(given)
        assert read is not proto and [n.op_type for n in read.graph.node] == ["Gemm", "Tanh", "Gemm"]
    assert source_dir(path) == str(tmp_path) and source_dir(proto) is None
    with pytest.raises(TrainingError, match="no such model file"):
        as_proto(str(tmp_path / "missing.onnx"))
    with pytest.raises(TrainingError, match="cannot use a list as a model"):
        as_proto([proto])


def test_local_functions_are_inlined():
    proto = mlp()
    function = helper.make_function("local", "Act", ["x"], ["y"], [helper.make_node("Tanh", ["x"], ["y"])],
                                    [helper.make_opsetid("", 18)])
    proto.functions.append(function)
    proto.opset_import.append(helper.make_opsetid("local", 1))
    proto.graph.node[1].op_type, proto.graph.node[1].domain = "Act", "local"
    forward = read_forward(proto, ArtifactsConfig(), ONNXRUNTIME)
    assert [n.op_type for n in forward.proto.graph.node] == ["Gemm", "Tanh", "Gemm"] and not forward.proto.functions
    assert forward.inference.functions  # (the inference model is the input model's)
    assert forward.lora is None and forward.modules is None and forward.constants is None


def test_lora_adapters_are_the_parameters_with_those_named():
    forward = read_forward(mlp(), ArtifactsConfig(lora=LoraConfig(rank=2), requires_grad=["b2"]), ONNXRUNTIME)
    assert forward.requires_grad == ["W1.lora_A", "W1.lora_B", "W2.lora_A", "W2.lora_B", "b2"]
    assert {"W1.lora_A", "W2.lora_B"} <= {t.name for t in forward.proto.graph.initializer}
    assert [a.weight for a in forward.lora.adapters] == ["W1", "W2"]
