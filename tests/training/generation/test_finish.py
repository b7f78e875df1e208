"""FinishPass and written: the model's signature set and cleaned up, its outputs typed, written once
and checked."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from training.generation.build_models import typed
from test_training import mlp

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training.generation.finish import FinishPass, checked, written
from onnx_autodiff.training.targets import ONNXRUNTIME


def test_the_signature_is_set_and_the_types_of_intermediate_values_not_written():
    _, model = typed(mlp())
    graph = model.graph
    x, h = graph.inputs[0], next(n for n in graph if n.op_type == "Tanh").outputs[0]
    FinishPass([x], [h], ONNXRUNTIME)(model)
    assert list(graph.inputs) == [x] and list(graph.outputs) == [h]
    assert [n.op_type for n in graph] == ["Gemm", "Tanh"]  # the second layer no output reads: removed
    proto = written(model, "test model", check_output=True)
    assert [v.name for v in proto.graph.output] == [h.name]
    computed = {name for node in proto.graph.node for name in node.output}
    assert not computed & {v.name for v in proto.graph.value_info}  # (inferred again by whoever reads it)


def test_an_output_of_unknown_shape_is_an_error():
    _, model = typed(mlp())
    graph = model.graph
    mystery = ir.node("Mystery", [graph.inputs[0]], domain="custom")
    graph.append(mystery)
    model.opset_imports["custom"] = 1
    with pytest.raises(TrainingError, match="the shapes of .* are unknown"):
        FinishPass([graph.inputs[0]], [mystery.outputs[0]], ONNXRUNTIME)(model)


def test_a_model_the_checker_refuses_is_a_bug_to_report():
    proto = mlp()
    proto.graph.node[0].input[0] = "nowhere"
    with pytest.raises(TrainingError, match="the generated train model fails the ONNX checker"):
        checked(proto, "train model", check_output=False)
    assert checked(mlp(), "train model", check_output=False).graph.node

