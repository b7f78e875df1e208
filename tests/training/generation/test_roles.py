"""analyse: parameters, buffers and constants of a forward model, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from training.generation.build_models import bn_dropout_model, typed
from onnx import TensorProto, helper, numpy_helper
from test_training import mlp

from onnx_autodiff.errors import TrainingError, TrainingOpsetError, UnknownValueError
from onnx_autodiff.training.generation.roles import analyse, proto_default_opset, quantized_weight_names


def roles_of(proto, requires_grad=None, frozen_params=None, freeze_batchnorm=False):
    inferred, model = typed(proto)
    return analyse(inferred, requires_grad, frozen_params, freeze_batchnorm, model=model)


def test_parameters_buffers_and_state():
    roles = roles_of(bn_dropout_model())
    assert roles.params == ["W", "gamma", "beta"] and roles.buffers == ["mean", "var"] and roles.opset == 18
    assert roles.state == {"W", "gamma", "beta", "mean", "var"}
    assert roles_of(bn_dropout_model(), frozen_params=["gamma"]).params == ["W", "beta"]
    assert roles_of(bn_dropout_model(), freeze_batchnorm=True).buffers == []


def test_refusals():
    with pytest.raises(UnknownValueError, match="frozen parameter 'nothing' is no initializer"):
        roles_of(mlp(), frozen_params=["nothing"])
    with pytest.raises(TrainingError, match="both a parameter to train and a frozen parameter"):
        roles_of(mlp(), requires_grad=["W1"], frozen_params=["W1"])
    with pytest.raises(TrainingError, match="running statistic"):
        roles_of(bn_dropout_model(), requires_grad=["mean"])
    with pytest.raises(TrainingOpsetError, match="needs opset >= 14"):
        roles_of(bn_dropout_model(opset=13))


def test_quantized_weights_are_constants():
    W = numpy_helper.from_array(np.ones((4, 4), np.int8), "Wq")
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    nodes = [helper.make_node("DequantizeLinear", ["Wq", "s"], ["W"]), helper.make_node("MatMul", ["X", "W"], ["Y"])]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 4])], [W, scale])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    assert quantized_weight_names(proto) == ["Wq"] and proto_default_opset(proto) == 18
