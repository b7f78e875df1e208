"""TrainingModePass: BatchNormalization and Dropout in the mode asked for, state as graph inputs."""

from __future__ import annotations

from training.generation.build_models import bn_dropout_model, forward

from onnx_autodiff.toolkit import shapes
from onnx_autodiff.training.generation.training_mode import TrainingModePass


def test_training_mode_returns_the_new_statistics_and_feeds_the_state():
    model, roles = forward(bn_dropout_model())
    assert roles.params == ["W", "gamma", "beta"] and roles.buffers == ["mean", "var"]
    result = TrainingModePass(roles, training=True)(model)
    bn = next(n for n in model.graph if n.op_type == "BatchNormalization")
    dropout = next(n for n in model.graph if n.op_type == "Dropout")
    assert shapes.attr(bn, "training_mode", 0) == 1
    assert result.updates == {"mean": bn.outputs[1], "var": bn.outputs[2]}
    assert bool(shapes.constant(dropout.inputs[2])) and len(dropout.outputs) == 2  # with its mask
    assert [v.name for v in model.graph.inputs] == ["X", "W", "gamma", "beta", "mean", "var"]
    assert not any(name in model.graph.initializers for name in roles.state)


def test_evaluation_mode():
    model, roles = forward(bn_dropout_model())
    result = TrainingModePass(roles, training=False)(model)
    bn = next(n for n in model.graph if n.op_type == "BatchNormalization")
    dropout = next(n for n in model.graph if n.op_type == "Dropout")
    assert shapes.attr(bn, "training_mode", 0) == 0 and len(bn.outputs) == 1
    assert not bool(shapes.constant(dropout.inputs[2]))
    assert result.updates == {}


def test_frozen_statistics_stay_in_inference_mode():
    model, roles = forward(bn_dropout_model(), freeze_batchnorm=True)
    assert roles.buffers == []
    TrainingModePass(roles, training=True)(model)
    bn = next(n for n in model.graph if n.op_type == "BatchNormalization")
    assert "training_mode" not in bn.attributes
