"""AttachLossPass: the loss appended to the nodes; the graph's signature left to each model."""

from __future__ import annotations

import onnx_ir as ir
from training.generation.build_models import forward
from test_training import mlp

from onnx_autodiff.training.generation.loss import AttachLossPass
from onnx_autodiff.training.generation.training_mode import TrainingModePass
from onnx_autodiff.training.losses import LossSpec


def test_the_loss_is_a_scalar_of_the_output_and_its_labels():
    model, roles = forward(mlp())
    mode = TrainingModePass(roles, training=True)(model)
    inputs, outputs = list(model.graph.inputs), list(model.graph.outputs)
    result = AttachLossPass(LossSpec("cross_entropy", None, None), mode.namer)(model)
    assert result.loss.shape == ir.Shape([]) and result.loss.dtype == ir.DataType.FLOAT
    assert [v.name for v in result.labels] == ["labels"] and result.labels[0].dtype == ir.DataType.INT64
    assert result.others == outputs
    assert list(model.graph.inputs) == inputs and list(model.graph.outputs) == outputs  # (each model sets them)
    assert result.loss.producer() in list(model.graph)


def test_a_model_output_as_the_loss():
    model, roles = forward(mlp(outputs=1))
    mode = TrainingModePass(roles, training=True)(model)
    logits = model.graph.outputs[0]
    logits.shape = ir.Shape([1])
    result = AttachLossPass(LossSpec(None, "logits", None), mode.namer)(model)
    assert result.loss is logits and result.labels == [] and result.others == []
