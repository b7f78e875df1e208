"""CleanBackwardPass: the backward cleaned up and lowered; the buffers' lowered statistics, which no
node reads yet, survive it."""

from __future__ import annotations

from training.generation.build_models import bn_dropout_model, forward
from test_training import mlp

from onnx_autodiff.training.generation.batchnorm_in_standard_ops import BatchNormInStandardOpsPass
from onnx_autodiff.training.generation.clean_backward import CleanBackwardPass
from onnx_autodiff.training.generation.differentiate import DifferentiatePass
from onnx_autodiff.training.generation.loss import AttachLossPass
from onnx_autodiff.training.generation.training_mode import TrainingModePass
from onnx_autodiff.training.losses import LossSpec
from onnx_autodiff.training.targets import ONNXRUNTIME, WEBGPU


def differentiated(proto, target):
    model, roles = forward(proto)
    mode = TrainingModePass(roles, training=True)(model)
    updates = mode.updates
    if target.batchnorm_in_standard_ops:
        updates = BatchNormInStandardOpsPass(mode.namer, updates)(model).updates
    attached = AttachLossPass(LossSpec("cross_entropy", None, None), mode.namer)(model)
    DifferentiatePass(attached.loss, attached.labels, roles.params)(model)
    return model, updates


def test_lowered_statistics_survive_the_cleanup():
    model, updates = differentiated(bn_dropout_model(), WEBGPU)
    count = len(model.graph.outputs)
    result = CleanBackwardPass(WEBGPU, updates)(model)
    assert list(model.graph.outputs) == [result.loss, *result.grads] and len(model.graph.outputs) == count
    assert set(result.updates) == {"mean", "var"}
    nodes = set(model.graph)
    assert all(value.producer() in nodes for value in result.updates.values())


def test_the_cleanup_lowers_for_the_target():
    counts = {}
    for target in (ONNXRUNTIME, WEBGPU):
        model, updates = differentiated(mlp(), target)
        CleanBackwardPass(target, updates)(model)
        counts[target.name] = {n.op_type for n in model.graph}
    assert "LogSoftmax" in counts["onnxruntime"] and "LogSoftmax" not in counts["webgpu"]  # (webgpu's decomposed)
