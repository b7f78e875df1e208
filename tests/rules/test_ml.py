import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, rng
from onnx_autodiff.conformance.check import backward_model

R = rng(3)
ML = {"ai.onnx.ml": 3}


def ml_model(node, inputs, **kw):
    return make_model([node], inputs, ["Y"], extra_opsets=ML, **kw)


def runs_on_onnxruntime(model, wrt):
    proto, _ = backward_model(model, "Y", wrt, seed="input")
    ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("indices", [[0, 2], [3, 1, 3]])
def test_array_feature_extractor(indices):
    X = R.standard_normal((2, 3, 4)).astype(np.float32)
    node = helper.make_node("ArrayFeatureExtractor", ["X", "idx"], ["Y"], domain="ai.onnx.ml")
    model = ml_model(node, {"X": X}, initializers={"idx": np.array(indices, np.int64)})
    assert_gradients(model, {"X": X}, ["X"])
    runs_on_onnxruntime(model, ["X"])


@pytest.mark.parametrize("scale", [[2.0], [0.5, -1.0, 3.0]])
def test_scaler(scale):
    X = R.standard_normal((4, 3)).astype(np.float32)
    node = helper.make_node("Scaler", ["X"], ["Y"], domain="ai.onnx.ml", scale=scale, offset=[0.1] * len(scale))
    model = ml_model(node, {"X": X}, output_shapes={"Y": [4, 3]})
    assert_gradients(model, {"X": X}, ["X"])
    runs_on_onnxruntime(model, ["X"])


@pytest.mark.parametrize("targets", [1, 2])
def test_linear_regressor(targets):
    X = R.standard_normal((5, 3)).astype(np.float32)
    coefficients = R.standard_normal(3 * targets).astype(np.float32).tolist()
    node = helper.make_node("LinearRegressor", ["X"], ["Y"], domain="ai.onnx.ml", targets=targets,
                            coefficients=coefficients, intercepts=[0.5] * targets)
    model = ml_model(node, {"X": X}, output_shapes={"Y": [5, targets]})
    assert_gradients(model, {"X": X}, ["X"])
    runs_on_onnxruntime(model, ["X"])


def test_binarizer_and_tree_ensemble_have_zero_gradient():
    X = R.standard_normal((4, 2)).astype(np.float32)
    nodes = [
        helper.make_node("Binarizer", ["X"], ["b"], domain="ai.onnx.ml", threshold=0.0),
        helper.make_node("TreeEnsembleRegressor", ["X"], ["t"], domain="ai.onnx.ml", n_targets=1,
                         nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0],
                         nodes_values=[0.0, 0.0, 0.0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
                         nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
                         target_treeids=[0, 0], target_nodeids=[1, 2], target_ids=[0, 0],
                         target_weights=[1.0, 2.0]),
        helper.make_node("Sum", ["b", "X"], ["s"]),
        helper.make_node("Mul", ["s", "t"], ["Y"]),
    ]
    model = make_model(nodes, {"X": X}, ["Y"], extra_opsets=ML)
    result = assert_gradients(model, {"X": X}, ["X"])
    assert np.any(result.ad["X"] != 0)


def test_model_importing_only_the_ml_domain():
    """No default-domain import: the backward nodes still come out as standard ops."""
    X = R.standard_normal((2, 3)).astype(np.float32)
    node = helper.make_node("Scaler", ["X"], ["Y"], domain="ai.onnx.ml", scale=[2.0, 3.0, 4.0], offset=[0.0] * 3)
    graph = helper.make_graph([node], "ml", [helper.make_tensor_value_info("X", 1, [2, 3])],
                              [helper.make_tensor_value_info("Y", 1, [2, 3])])
    import onnx

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 3)])
    onnx.checker.check_model(model, full_check=True)
    result = assert_gradients(model, {"X": X}, ["X"])
    assert result.ok
