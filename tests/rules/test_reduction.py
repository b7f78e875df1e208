import numpy as np
import onnx_ir as ir
import pytest

from helpers import assert_gradients, op_model, rng
from onnx_autodiff import autodiff_pass
from onnx_autodiff.conformance.check import ad_vjp, backward_model
from onnx_autodiff.errors import OpsetTooOldError

OPS = ["ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
       "ReduceLogSumExp", "ReduceProd", "ReduceMax", "ReduceMin"]
AXES = {"single": [1], "several": [0, 2], "negative": [-1, -2], "all": None}


def axes_as_input(op, opset):
    return opset >= (13 if op == "ReduceSum" else 18)


def data(op, shape, seed=0):
    """Inputs away from kinks and ties: positive for ReduceLogSum, distinct for max/min."""
    r = rng(seed)
    size = int(np.prod(shape))
    if op == "ReduceLogSum":
        x = r.uniform(0.5, 2.0, size)
    elif op in ("ReduceMax", "ReduceMin"):
        x = (r.permutation(size) - size / 2) * 0.2 + 0.05
    elif op == "ReduceProd":
        x = r.choice([-1.0, 1.0], size) * r.uniform(0.6, 1.4, size)
    else:
        x = r.standard_normal(size)
        x = np.where(np.abs(x) < 0.05, 0.3, x)
    return x.reshape(shape).astype(np.float32)


def reduce_model(op, x, axes, keepdims, opset, noop=None, shapes=None, runtime_axes=False):
    """One reduction node; axes as attribute or input (an initializer, or a graph input if runtime)."""
    attrs = {"keepdims": keepdims, "opset": opset, "shapes": shapes}
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    inputs = {"X": x}
    if not axes_as_input(op, opset):
        if axes is not None:
            attrs["axes"] = axes
    elif axes is not None:
        inputs["axes"] = np.array(axes, np.int64)
        if not runtime_axes:
            attrs["initializers"] = {"axes": inputs["axes"]}
    model = op_model(op, inputs, **attrs)
    if runtime_axes:
        # Shape inference cannot give the output's rank here, and full_check needs one.
        out_rank = x.ndim if keepdims or (noop and not axes) else x.ndim - (len(axes) or x.ndim)
        out_shape = model.graph.output[0].type.tensor_type.shape
        out_shape.Clear()
        for i in range(out_rank):
            out_shape.dim.add().dim_param = f"d{i}"
        return model, inputs
    return model, {"X": x}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", list(AXES))
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", OPS)
def test_reduce(op, keepdims, case, opset):
    x = data(op, (2, 3, 4))
    model, feeds = reduce_model(op, x, AXES[case], keepdims, opset)
    assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("case", list(AXES))
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_sum_axes_attribute(keepdims, case):
    x = data("ReduceSum", (2, 3, 4))
    model, feeds = reduce_model("ReduceSum", x, AXES[case], keepdims, opset=11)
    assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("op", OPS)
def test_reduce_opset11(op):
    x = data(op, (2, 3, 4))
    model, feeds = reduce_model(op, x, [0, -1], 0, opset=11)
    assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceProd", "ReduceL2"])
def test_old_opset_converted_or_refused(op):
    # Their gradients compare floats with Equal (opset 11 on): the pass converts an opset-10 model,
    # whose gradients then match finite differences; without conversion it names the opset needed
    x = data(op, (2, 3))
    model, feeds = reduce_model(op, x, [1], 0, opset=10)
    assert_gradients(model, feeds, ["X"])
    with pytest.raises(OpsetTooOldError, match="opset 11") as refused:
        autodiff_pass(of=model.graph.output[0].name, wrt=["X"], upgrade_opset=False)(ir.from_proto(model))
    assert refused.value.needed == 11


@pytest.mark.parametrize("axes", [[], None], ids=["empty", "omitted"])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", OPS)
def test_noop_with_empty_axes(op, keepdims, axes):
    x = data(op, (2, 3, 4))
    model, feeds = reduce_model(op, x, axes, keepdims, opset=18, noop=1)
    assert_gradients(model, feeds, ["X"])


def test_reduce_sum_noop_opset13():
    x = data("ReduceSum", (3, 4))
    model, feeds = reduce_model("ReduceSum", x, [], 0, opset=13, noop=1)
    assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("axes,keepdims", [([0], 0), ([-1], 1), ([0, -1], 1), (None, 0)])
@pytest.mark.parametrize("op", OPS)
def test_symbolic_batch(op, axes, keepdims):
    """One graph for every batch size, including reductions over the batch axis."""
    x = data(op, (2, 3, 4), seed=1)
    model, _ = reduce_model(op, x, axes, keepdims, opset=18, shapes={"X": ["N", 3, 4]})
    for batch in (2, 3):
        assert_gradients(model, {"X": data(op, (batch, 3, 4), seed=batch)}, ["X"])


@pytest.mark.parametrize("axes", [[1], [-1, 0], []], ids=["single", "negative", "empty"])
@pytest.mark.parametrize("noop", [0, 1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_sum_runtime_axes(opset, keepdims, noop, axes):
    x = data("ReduceSum", (2, 3, 4))
    model, feeds = reduce_model("ReduceSum", x, axes, keepdims, opset, noop=noop,
                                runtime_axes=True)
    assert "axes" in feeds
    assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("axes,noop", [([0, -1], 0), ([], 0), ([], 1)],
                         ids=["negative", "empty-all", "empty-noop"])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", OPS[1:])
def test_runtime_axes_opset18(op, keepdims, axes, noop):
    x = data(op, (2, 3, 4))
    model, feeds = reduce_model(op, x, axes, keepdims, 18, noop=noop, runtime_axes=True,
                                shapes={"X": ["N", 3, 4]})
    assert_gradients(model, feeds, ["X"])


def ad_gradient(model, feeds, dy):
    return ad_vjp(model, feeds, ["X"], [dy])["X"]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes", [[1], None])
def test_prod_with_zeros(opset, axes):
    """Exact products of the others: a lone zero gets a finite gradient, two zeros give none."""
    x = data("ReduceProd", (3, 4), seed=2)
    x[0, 1] = 0.0
    x[1, 0] = x[1, 3] = 0.0
    model, feeds = reduce_model("ReduceProd", x, axes, 0, opset)
    assert_gradients(model, feeds, ["X"])
    grad = ad_gradient(model, feeds, np.ones((3,) if axes else (), np.float32))
    if axes:
        others = np.prod(np.delete(x[0], 1))
        np.testing.assert_allclose(grad[0], [0, others, 0, 0], rtol=1e-5)
        np.testing.assert_array_equal(grad[1], 0)
    else:
        np.testing.assert_array_equal(grad, 0)


@pytest.mark.parametrize("op,expected", [
    ("ReduceMax", [[0, 0.5, 0.5], [0.5, 0, 0.5]]),
    ("ReduceMin", [[1, 0, 0], [0, 1, 0]]),
])
@pytest.mark.parametrize("opset", [13, 18])
def test_extremum_ties_share_evenly(op, expected, opset):
    x = np.array([[1, 3, 3], [2, 0, 2]], np.float32)
    model, feeds = reduce_model(op, x, [1], 0, opset)
    grad = ad_gradient(model, feeds, np.array([2.0, 4.0], np.float32))
    np.testing.assert_allclose(grad, np.array(expected) * [[2.0], [4.0]])


def test_max_all_ties():
    x = np.array([[5, 1], [5, 5]], np.float32)
    model, feeds = reduce_model("ReduceMax", x, None, 0, 18)
    grad = ad_gradient(model, feeds, np.array(3.0, np.float32))
    np.testing.assert_allclose(grad, [[1, 0], [1, 1]])


@pytest.mark.parametrize("opset", [13, 18])
def test_l2_zero_slice(opset):
    """An all-zero slice gets a zero (not NaN) gradient; the others are X / ‖X‖."""
    x = data("ReduceL2", (3, 4), seed=3)
    x[1] = 0.0
    model, feeds = reduce_model("ReduceL2", x, [-1], 1, opset)
    grad = ad_gradient(model, feeds, np.ones((3, 1), np.float32))
    expected = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", OPS)
def test_second_order(op):
    """The backward graph differentiates again (with the tensor/math families' rules)."""
    x = data(op, (2, 3, 4))
    model, feeds = reduce_model(op, x, [0, -1], 0, 18)
    first, autodiff = backward_model(model, "out0", ["X"], seed="input")
    dy = rng(1).standard_normal(3).astype(np.float32)
    assert_gradients(first, {**feeds, autodiff.seed_name: dy}, ["X"])
