import numpy as np
import pytest
from onnx import helper

from onnx_autodiff.rules import default_registry

from helpers import assert_gradients, make_model, op_model, rng

R = rng()
C = 4
IGNORE = 2


def _scores(shape):
    return (R.standard_normal(shape) * 2).astype(np.float32)


def _labels(shape, ignore_index=None, dtype=np.int64):
    labels = R.integers(0, C, shape).astype(dtype)
    flat = labels.reshape(-1)
    if ignore_index is not None:
        flat[::3] = ignore_index  # some labels ignored, most not
    # Two classes always counted: with one, a mean over weights would not depend on them.
    flat[1], flat[2] = [c for c in range(C) if c != ignore_index][:2]
    return labels


# Softmax and LogSoftmax


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, -2])
def test_softmax_opset13(op, axis):
    x = _scores((2, 3, 4))
    model = op_model(op, {"input": x}, axis=axis, opset=18)
    assert_gradients(model, {"input": x}, ["input"])


@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, -2])
def test_softmax_coerced_2d(op, axis, opset):
    x = _scores((2, 3, 4))
    model = op_model(op, {"input": x}, axis=axis, opset=opset)
    assert_gradients(model, {"input": x}, ["input"])


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_coerced_2d_unknown_rank(op):
    # Squeeze without axes over symbolic dims: shape inference loses the rank of S.
    x = _scores((2, 3, 4))
    nodes = [helper.make_node("Squeeze", ["X"], ["S"]),
             helper.make_node(op, ["S"], ["P"], axis=1),
             helper.make_node("Reshape", ["P", "shape"], ["Y"])]
    model = make_model(nodes, {"X": x}, ["Y"], opset=12, shapes={"X": ["A", "B", "D"]},
                       initializers={"shape": np.array([2, 3, 4], np.int64)})
    assert not model.graph.value_info[1].type.tensor_type.HasField("shape")
    # Local reshape rules keep this test independent of the tensor family.
    registry = default_registry().copy()
    for reshape_like in ("Squeeze", "Reshape"):
        registry.register(reshape_like, differentiable=("data",))(_reshape_back)
    assert_gradients(model, {"X": x}, ["X"], registry=registry)


def _reshape_back(op, node, dY):
    return {"data": op.Reshape(dY, op.Shape(node.inputs[0]))}


@pytest.mark.parametrize("opset", [12, 18])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_symbolic_batch(op, opset):
    x = _scores((3, 2, 4))
    model = op_model(op, {"input": x}, axis=1, opset=opset, shapes={"input": ["N", 2, 4]})
    assert_gradients(model, {"input": x}, ["input"])


def test_softmax_1d():
    x = _scores((5,))
    assert_gradients(op_model("Softmax", {"input": x}), {"input": x}, ["input"])


# Hardmax: zero gradient, not an error


def test_hardmax_gradient_is_zero():
    x = _scores((3, 4))
    nodes = [helper.make_node("Hardmax", ["X"], ["H"]), helper.make_node("Mul", ["H", "X"], ["Y"])]
    model = make_model(nodes, {"X": x}, ["Y"])
    result = assert_gradients(model, {"X": x}, ["X"])  # dX = dY * Hardmax(X): nothing through H
    assert np.count_nonzero(result.ad["X"]) == 3


def test_hardmax_alone():
    x = _scores((3, 4))
    result = assert_gradients(op_model("Hardmax", {"input": x}, axis=0), {"input": x}, ["input"])
    assert result.ad["input"].shape == x.shape and not np.any(result.ad["input"])


# SoftmaxCrossEntropyLoss


LABEL_SHAPES = [((5, C), (5,)), ((3, C, 2), (3, 2)), ((2, C, 2, 3), (2, 2, 3))]


def _sce_inputs(score_shape, label_shape, weights, ignore_index, label_dtype=np.int64):
    inputs = {"scores": _scores(score_shape),
              "labels": _labels(label_shape, ignore_index, label_dtype)}
    if weights:
        inputs["weights"] = R.uniform(0.5, 2.0, (C,)).astype(np.float32)
    return inputs


@pytest.mark.parametrize("n_outputs", [1, 2])
@pytest.mark.parametrize("score_shape,label_shape", LABEL_SHAPES)
@pytest.mark.parametrize("ignore_index", [None, IGNORE])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_softmax_cross_entropy(reduction, weights, ignore_index, score_shape, label_shape, n_outputs):
    inputs = _sce_inputs(score_shape, label_shape, weights, ignore_index)
    model = op_model("SoftmaxCrossEntropyLoss", inputs, n_outputs, reduction=reduction,
                     ignore_index=ignore_index, opset=13)
    wrt = ["scores", "weights"] if weights else ["scores"]
    assert_gradients(model, inputs, wrt)


@pytest.mark.parametrize("n_outputs", [1, 2])
@pytest.mark.parametrize("score_shape,label_shape", LABEL_SHAPES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softmax_cross_entropy_opset12(reduction, score_shape, label_shape, n_outputs):
    inputs = _sce_inputs(score_shape, label_shape, True, IGNORE)
    model = op_model("SoftmaxCrossEntropyLoss", inputs, n_outputs, reduction=reduction,
                     ignore_index=IGNORE, opset=12)
    assert_gradients(model, inputs, ["scores", "weights"])


@pytest.mark.parametrize("ignore_index", [-1, -100, C + 3])
@pytest.mark.parametrize("weights", [False, True])
def test_softmax_cross_entropy_out_of_range_ignore(ignore_index, weights):
    inputs = _sce_inputs((3, C, 2), (3, 2), weights, ignore_index)
    model = op_model("SoftmaxCrossEntropyLoss", inputs, reduction="mean", ignore_index=ignore_index)
    assert_gradients(model, inputs, ["scores", "weights"] if weights else ["scores"])


def test_softmax_cross_entropy_int32_labels():
    inputs = _sce_inputs((3, C, 2), (3, 2), True, IGNORE, np.int32)
    model = op_model("SoftmaxCrossEntropyLoss", inputs, reduction="mean", ignore_index=IGNORE)
    assert_gradients(model, inputs, ["scores", "weights"])


@pytest.mark.parametrize("opset", [12, 18])
def test_softmax_cross_entropy_log_prob_only(opset):
    inputs = _sce_inputs((3, C, 2), (3, 2), True, IGNORE)
    node = helper.make_node("SoftmaxCrossEntropyLoss", list(inputs), ["loss", "log_prob"],
                            ignore_index=IGNORE)
    model = make_model([node], inputs, ["log_prob"], opset=opset)
    result = assert_gradients(model, inputs, ["scores", "weights"])
    assert not np.any(result.ad["weights"])


@pytest.mark.parametrize("opset", [12, 18])
def test_softmax_cross_entropy_omitted_log_prob(opset):
    inputs = _sce_inputs((3, C, 2), (3, 2), True, IGNORE)
    node = helper.make_node("SoftmaxCrossEntropyLoss", list(inputs), ["loss", ""],
                            ignore_index=IGNORE)
    model = make_model([node], inputs, ["loss"], opset=opset)
    assert_gradients(model, inputs, ["scores", "weights"])


def test_softmax_cross_entropy_scores_from_upstream():
    inputs = _sce_inputs((3, C, 2), (3, 2), True, IGNORE)
    x = inputs.pop("scores")
    nodes = [helper.make_node("Mul", ["x", "x"], ["scores"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels", "weights"],
                              ["loss", "log_prob"], reduction="sum", ignore_index=IGNORE),
             helper.make_node("ReduceSum", ["log_prob"], ["lp_sum"], keepdims=0),
             helper.make_node("Add", ["loss", "lp_sum"], ["y"])]
    feeds = {"x": x, **inputs}
    model = make_model(nodes, feeds, ["y"])
    assert_gradients(model, feeds, ["x", "weights"])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("n_outputs", [1, 2])
def test_softmax_cross_entropy_symbolic_batch(reduction, n_outputs):
    inputs = _sce_inputs((3, C, 2), (3, 2), True, IGNORE)
    shapes = {"scores": ["N", C, 2], "labels": ["N", 2]}
    model = op_model("SoftmaxCrossEntropyLoss", inputs, n_outputs, reduction=reduction,
                     ignore_index=IGNORE, shapes=shapes)
    assert_gradients(model, inputs, ["scores", "weights"])


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softmax_cross_entropy_symbolic_classes(reduction):
    inputs = _sce_inputs((3, C, 2), (3, 2), True, IGNORE)
    shapes = {"scores": ["N", "C", "D"], "labels": ["N", "D"], "weights": ["C"]}
    model = op_model("SoftmaxCrossEntropyLoss", inputs, 2, reduction=reduction,
                     ignore_index=IGNORE, shapes=shapes)
    assert_gradients(model, inputs, ["scores", "weights"])


# NegativeLogLikelihoodLoss


def _nll_inputs(score_shape, label_shape, weights, ignore_index):
    inputs = {"input": _scores(score_shape), "target": _labels(label_shape, ignore_index)}
    if weights:
        inputs["weight"] = R.uniform(0.5, 2.0, (C,)).astype(np.float32)
    return inputs


@pytest.mark.parametrize("score_shape,label_shape", LABEL_SHAPES)
@pytest.mark.parametrize("ignore_index", [None, IGNORE])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_negative_log_likelihood(reduction, weights, ignore_index, score_shape, label_shape):
    inputs = _nll_inputs(score_shape, label_shape, weights, ignore_index)
    model = op_model("NegativeLogLikelihoodLoss", inputs, reduction=reduction,
                     ignore_index=ignore_index, opset=13)
    assert_gradients(model, inputs, ["input", "weight"] if weights else ["input"])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_negative_log_likelihood_opset12_symbolic_batch(reduction):
    inputs = _nll_inputs((3, C, 2), (3, 2), True, -100)
    model = op_model("NegativeLogLikelihoodLoss", inputs, reduction=reduction, ignore_index=-100,
                     opset=12, shapes={"input": ["N", C, 2], "target": ["N", 2]})
    assert_gradients(model, inputs, ["input", "weight"])


@pytest.mark.parametrize("op_type,opset", [("NegativeLogLikelihoodLoss", 13),
                                            ("SoftmaxCrossEntropyLoss", 12), ("SoftmaxCrossEntropyLoss", 13)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_with_scores_of_unknown_rank(op_type, opset, reduction):
    """Scores reshaped to a shape fed at run time have no rank: the labels' rank gives theirs."""
    inputs = _nll_inputs((3, C, 2), (3, 2), True, IGNORE)
    feeds = {"x": inputs.pop("input").reshape(-1), "s": np.array([3, C, 2], np.int64), **inputs}
    nodes = [helper.make_node("Reshape", ["x", "s"], ["scores"]),
             helper.make_node(op_type, ["scores", *inputs], ["loss"], reduction=reduction,
                              ignore_index=IGNORE)]
    model = make_model(nodes, feeds, ["loss"], shapes={"s": ["R"]}, opset=opset, output_shapes={"loss": []})
    assert all(v.name != "scores" or not v.type.tensor_type.HasField("shape") for v in model.graph.value_info)
    assert_gradients(model, feeds, ["x", "weight"])


@pytest.mark.parametrize("ignore_index", [-1, C + 3])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_negative_log_likelihood_out_of_range_ignore(reduction, ignore_index):
    inputs = _nll_inputs((5, C), (5,), False, ignore_index)
    model = op_model("NegativeLogLikelihoodLoss", inputs, reduction=reduction,
                     ignore_index=ignore_index)
    assert_gradients(model, inputs, ["input"])


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
def test_fully_masked_row_gives_zero_gradient_not_nan(op_type):
    """A row of -inf (a fully masked attention row) is NaN forward; Where then sends it no
    gradient, and the backward must keep that zero instead of making 0·NaN."""
    import onnxruntime as ort
    from onnx import helper

    from helpers import make_model
    from onnx_autodiff.conformance.check import backward_model

    x = np.array([[0.5, -1.0, 2.0], [-np.inf, -np.inf, -np.inf]], np.float32)
    nodes = [helper.make_node(op_type, ["x"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["bad"]),
             helper.make_node("Where", ["bad", "zero", "p"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], initializers={"zero": np.array(0.0, np.float32)})
    proto, autodiff = backward_model(model, "y", ["x"], seed="input")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    dy = np.ones_like(x)
    grad = dict(zip([o.name for o in proto.graph.output], session.run(None, {"x": x, autodiff.seed_name: dy})))["grad_x"]
    assert np.all(np.isfinite(grad)) and np.all(grad[1] == 0)


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
def test_where_masked_logits_skip_the_nan_guard_and_stay_finite(op_type):
    """Logits masked by a Where (as exporters write attention): no IsNaN guard is emitted, and a
    fully masked row still gets a zero gradient, since Where's gradient selects zero there."""
    import onnxruntime as ort
    from onnx import helper

    from helpers import make_model
    from onnx_autodiff.conformance.check import backward_model

    x = np.array([[0.5, -1.0, 2.0], [0.3, 0.1, -0.2]], np.float32)
    mask = np.array([[False, True, False], [True, True, True]])
    nodes = [helper.make_node("Where", ["mask", "ninf", "x"], ["s"]),
             helper.make_node(op_type, ["s"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["bad"]),
             helper.make_node("Where", ["bad", "zero", "p"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], initializers={
        "zero": np.array(0.0, np.float32), "ninf": np.array(-np.inf, np.float32), "mask": mask})
    proto, autodiff = backward_model(model, "y", ["x"], seed="input")
    assert sum(n.op_type == "IsNaN" for n in proto.graph.node) == 1  # the forward's own
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    dy = np.array([[1.0, 2.0, -1.0], [1.0, 1.0, 1.0]], np.float32)
    grad = dict(zip([o.name for o in proto.graph.output], session.run(None, {"x": x, autodiff.seed_name: dy})))["grad_x"]
    assert np.all(grad[1] == 0) and np.all(np.isfinite(grad)) and grad[0, 1] == 0
    # The unmasked row against central differences in float64.
    keep = [0, 2]
    z = x[0, keep].astype(np.float64)

    def f(v):  # the masked logit is -inf: its probability is 0, its log-probability -inf - lse(v)
        lse = v.max() + np.log(np.exp(v - v.max()).sum())
        if op_type == "Softmax":
            return float(dy[0, keep] @ np.exp(v - lse))
        return float(dy[0, keep] @ (v - lse) - dy[0, 1] * lse)

    fd = [(f(z + h) - f(z - h)) / 2e-6 for h in np.eye(2) * 1e-6]
    np.testing.assert_allclose(grad[0, keep], fd, rtol=1e-4, atol=1e-5)
