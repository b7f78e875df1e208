"""DifferentiatePass: the loss's gradients as outputs; the autodiff pass's errors unwrapped."""

from __future__ import annotations

import numpy as np
import pytest
from training.generation.build_models import forward
from onnx import TensorProto, helper, numpy_helper
from test_training import mlp

from onnx_autodiff.errors import MissingRuleError, TrainingError
from onnx_autodiff.training.generation.differentiate import DifferentiatePass
from onnx_autodiff.training.generation.loss import AttachLossPass
from onnx_autodiff.training.generation.training_mode import TrainingModePass
from onnx_autodiff.training.losses import LossSpec


def differentiated(proto, **options):
    model, roles = forward(proto, **options)
    mode = TrainingModePass(roles, training=True)(model)
    attached = AttachLossPass(LossSpec("cross_entropy", None, None), mode.namer)(model)
    return model, roles, DifferentiatePass(attached.loss, attached.labels, roles.params)(model)


def test_the_outputs_are_the_loss_and_the_gradients_in_order():
    model, roles, result = differentiated(mlp())
    assert list(model.graph.outputs) == [result.loss, *result.grads]
    assert [g.shape for g in result.grads] == [model.graph.inputs[i + 1].shape for i in range(len(roles.params))]
    assert "labels" in [v.name for v in model.graph.inputs]


def test_a_parameter_the_loss_does_not_depend_on_says_what_to_do():
    unused = numpy_helper.from_array(np.ones(3, np.float32), "unused")
    with pytest.raises(TrainingError, match="'unused'.*list it in frozen_params"):
        differentiated(mlp(extra_inits=[unused]), requires_grad=["W1", "unused"])


def test_other_errors_are_the_autodiff_pass_own():
    custom = helper.make_node("Mystery", ["logits"], ["mystery"], domain="custom")
    proto = mlp(extra_nodes=[custom])
    proto.graph.output[0].CopyFrom(helper.make_tensor_value_info("mystery", TensorProto.FLOAT, ["N", 3]))
    proto.opset_import.append(helper.make_opsetid("custom", 1))
    with pytest.raises(MissingRuleError, match="Mystery"):
        differentiated(proto)
