import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, op_model, rng

from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.conformance.oracle import random_cotangents
from onnx_autodiff.errors import AutodiffError

R = rng()
I64 = np.int64


def randn(*shape):
    return R.standard_normal(shape).astype(np.float32)


def distinct(*shape):
    """Well-separated values in random order (no ties, |x| >= 0.5)."""
    n = int(np.prod(shape))
    values = (np.arange(n) - n // 2 + 0.5) * 0.7
    return R.permutation(values).reshape(shape).astype(np.float32)


def on_ort(model, feeds, wrt, expected):
    """The backward graph itself runs on onnxruntime and gives the checked VJP."""
    cotangents = random_cotangents(model, feeds, 0)
    k = next(i for i, c in enumerate(cotangents) if c is not None)
    proto, autodiff = backward_model(model, model.graph.output[k].name, wrt, seed="input")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {i.name for i in proto.graph.input}
    fed = {name: v for name, v in feeds.items() if name in inputs}
    names = [autodiff.gradient_names[x] for x in wrt]
    got = session.run(names, {**fed, autodiff.seed_name: cotangents[k]})
    for name, value in zip(wrt, got):
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def check(op_type, inputs, wrt, *, consts=(), symbolic=(), batches=(2,), n_outputs=1, outputs=None,
          **kw):
    """One-node model over ``inputs``; ``consts`` become initializers; inputs in ``symbolic`` get a
    symbolic first dimension "N" and the one model is checked at each size in ``batches`` (the
    arrays are tiled or cut to that size). ``outputs`` declares output shapes inference misses."""
    initializers = {k: inputs[k] for k in consts}
    shapes = {k: ["N", *inputs[k].shape[1:]] for k in symbolic}
    model = op_model(op_type, inputs, n_outputs, initializers=initializers or None,
                     shapes=shapes or None, **kw)
    if outputs is not None:
        del model.graph.output[:]
        model.graph.output.extend(helper.make_tensor_value_info(f"out{i}", t, s) for i, (t, s) in
                                  enumerate(outputs))
    results = []
    for n in batches if symbolic else (None,):
        feeds = {k: v for k, v in inputs.items() if k and k not in consts}
        for k in symbolic:
            feeds[k] = np.resize(feeds[k], (n, *feeds[k].shape[1:])).astype(feeds[k].dtype)
            if feeds[k].dtype == np.float32:
                feeds[k] = feeds[k] + distinct(*feeds[k].shape) * 0.01
        result = assert_gradients(model, feeds, wrt)
        assert not result.weak, result.backend
        on_ort(model, feeds, wrt, result.ad)
        results.append(result)
    return results[0]


# --- ScatterElements, Scatter -----------------------------------------------------------------

IDX_ROWS = np.array([[0, 3], [-1, 1], [2, -4]], I64)  # distinct per row, negatives included


@pytest.mark.parametrize("opset", [11, 13, 16, 18])
def test_scatter_elements_none(opset):
    inputs = {"D": randn(3, 4), "I": IDX_ROWS, "U": randn(3, 2)}
    r = check("ScatterElements", inputs, ["D", "U"], consts=["I"], axis=1, opset=opset)
    assert np.all(r.ad["D"][[0, 0, 1, 1, 2, 2], [0, 3, 3, 1, 2, 0]] == 0)  # overwritten positions


@pytest.mark.parametrize("axis", [0, -2])
def test_scatter_elements_axis0_fed_indices(axis):
    # indices smaller than data on the other axis; fed at run time
    inputs = {"D": randn(4, 3), "I": np.array([[3, -4], [1, 2]], I64), "U": randn(2, 2)}
    check("ScatterElements", inputs, ["D", "U"], axis=axis)


@pytest.mark.parametrize("opset", [16, 18])
def test_scatter_elements_add_duplicates(opset):
    inputs = {"D": randn(3, 4), "I": np.array([[1, 1, -3], [0, 2, 0], [3, 3, 3]], I64),
              "U": randn(3, 3)}
    check("ScatterElements", inputs, ["D", "U"], consts=["I"], axis=1, reduction="add", opset=opset)


@pytest.mark.parametrize("opset", [16, 18])
def test_scatter_elements_mul(opset):
    u = randn(3, 3)
    u[0, 2] = 0.0  # a zero update written alone: exact
    inputs = {"D": randn(3, 4), "I": np.array([[1, -3, 2], [0, 2, 0], [3, 3, 3]], I64), "U": u}
    check("ScatterElements", inputs, ["D", "U"], consts=["I"], axis=1, reduction="mul", opset=opset)


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_elements_max_min(reduction):
    inputs = {"D": distinct(3, 4), "I": np.array([[1, 1, 2], [0, -2, 0], [3, 3, 3]], I64),
              "U": distinct(3, 3) + 0.3}
    check("ScatterElements", inputs, ["D", "U"], consts=["I"], axis=1, reduction=reduction)


def test_scatter_elements_max_tie_is_shared():
    d = distinct(2, 3)
    # an update-update tie at [0, 1], a data-update tie at [1, 2]
    u = np.array([[d[0, 1] + 5, d[0, 1] + 5], [d[1, 2], -9]], np.float32)
    inputs = {"D": d, "I": np.array([[1, 1], [2, 2]], I64), "U": u}
    r = check("ScatterElements", inputs, ["D", "U"], consts=["I"], axis=1, reduction="max")
    counts = r.counts["U"]
    assert counts["kinks"] > 0, counts
    # each tied element alone may take anything in [0, dY]; together they must take dY once
    dy = random_cotangents(op_model("ScatterElements", inputs, axis=1, reduction="max"),
                           inputs, 0)[0]
    assert r.ad["U"][0, 0] == r.ad["U"][0, 1] == pytest.approx(dy[0, 1] / 2)
    assert r.ad["D"][0, 1] == 0 and r.ad["U"][1, 1] == 0
    assert r.ad["D"][1, 2] == r.ad["U"][1, 0] == pytest.approx(dy[1, 2] / 2)


def test_scatter_elements_symbolic_batch():
    inputs = {"D": randn(3, 4), "I": np.array([[0, 3], [2, 1], [1, -1]], I64), "U": randn(3, 2)}
    check("ScatterElements", inputs, ["D", "U"], symbolic=["D", "I", "U"], batches=[2, 5], axis=1)


def test_scatter_elements_max_symbolic_batch():
    inputs = {"D": distinct(3, 4), "I": np.array([[0, 0], [2, 1], [1, -1]], I64),
              "U": distinct(3, 2) + 0.2}
    check("ScatterElements", inputs, ["D", "U"], symbolic=["D", "I", "U"], batches=[2, 4], axis=1,
          reduction="max")


@pytest.mark.parametrize("opset", [9, 10])
@pytest.mark.parametrize("axis", [1, -2])
def test_scatter_legacy(opset, axis):
    # indices narrower than data on the non-scatter axis: exercises the one-hot gather's slice
    inputs = {"D": randn(3, 4), "I": np.array([[0, -1, 2], [2, 0, -3]], I64), "U": randn(2, 3)}
    if axis == 1:
        inputs["I"] = np.array([[0, -1], [3, 1]], I64)
        inputs["U"] = randn(2, 2)
    check("Scatter", inputs, ["D", "U"], consts=["I"], axis=axis, opset=opset)


def test_scatter_legacy_fed_indices_symbolic_batch():
    inputs = {"D": randn(3, 4), "I": np.array([[0, 3], [2, 1], [1, -1]], I64), "U": randn(3, 2)}
    check("Scatter", inputs, ["D", "U"], symbolic=["D", "I", "U"], batches=[2, 3], axis=1, opset=10)


def test_scatter_elements_duplicates_without_reduction_convention():
    # ill-defined in ONNX (onnxruntime keeps the last write): each duplicate update gets the
    # gradient of its target, data gets none there
    inputs = {"D": randn(2, 3), "I": np.array([[1, 1]], I64), "U": randn(1, 2)}
    model = op_model("ScatterElements", inputs, axis=1)
    proto, autodiff = backward_model(model, "out0", ["D", "U"], seed="input")
    dy = randn(2, 3)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [autodiff.gradient_names[x] for x in ("D", "U")]
    d_data, d_updates = session.run(names, {**inputs, autodiff.seed_name: dy})
    np.testing.assert_array_equal(d_data, np.where([[0, 1, 0], [0, 0, 0]], 0, dy))
    np.testing.assert_array_equal(d_updates, [[dy[0, 1], dy[0, 1]]])


# --- ScatterND --------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [11, 13, 16, 18])
def test_scatter_nd_none_slices(opset):
    inputs = {"D": randn(4, 3), "I": np.array([[-1], [1]], I64), "U": randn(2, 3)}
    r = check("ScatterND", inputs, ["D", "U"], consts=["I"], opset=opset)
    assert np.all(r.ad["D"][[3, 1]] == 0)


def test_scatter_nd_none_elements_fed_indices():
    inputs = {"D": randn(2, 3, 2), "I": np.array([[[0, -1], [1, 2]], [[1, 0], [0, 0]]], I64),
              "U": randn(2, 2, 2)}
    check("ScatterND", inputs, ["D", "U"])


@pytest.mark.parametrize("opset", [16, 18])
def test_scatter_nd_add_duplicates(opset):
    inputs = {"D": randn(3, 4), "I": np.array([[0, 1], [0, 1], [-1, 3], [2, 0]], I64),
              "U": randn(4)}
    check("ScatterND", inputs, ["D", "U"], consts=["I"], reduction="add", opset=opset)


@pytest.mark.parametrize("opset", [16, 18])
def test_scatter_nd_mul(opset):
    u = randn(4, 3)
    u[3, 1] = 0.0
    inputs = {"D": randn(4, 3), "I": np.array([[1], [1], [-4], [2]], I64), "U": u}
    check("ScatterND", inputs, ["D", "U"], consts=["I"], reduction="mul", opset=opset)


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_nd_max_min(reduction):
    inputs = {"D": distinct(3, 4), "I": np.array([[1], [1], [-1]], I64), "U": distinct(3, 4) + 0.3}
    check("ScatterND", inputs, ["D", "U"], consts=["I"], reduction=reduction)


def test_scatter_nd_symbolic_batch():
    inputs = {"D": randn(3, 4), "I": np.array([[0, 1], [1, -1]], I64), "U": randn(2)}
    check("ScatterND", inputs, ["D", "U"], consts=["I"], symbolic=["D"], batches=[2, 5],
          reduction="add")


def test_scatter_unknown_reduction_refused():
    model = op_model("ScatterElements", {"D": randn(2, 2), "I": np.zeros((1, 1), I64),
                                         "U": randn(1, 1)})
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("reduction", "mean"))
    with pytest.raises(AutodiffError, match="reduction 'mean'"):
        backward_model(model, "out0", ["U"], seed="input")


# --- TensorScatter, MaxUnpool -----------------------------------------------------------------


@pytest.mark.parametrize("mode, write",
                         [("linear", [0, 2]), ("circular", [3, 4]), ("linear", None)])
def test_tensor_scatter(mode, write):
    inputs = {"P": randn(2, 5, 3), "U": randn(2, 2, 3)}
    if write is not None:
        inputs["W"] = np.array(write, I64)
    r = check("TensorScatter", inputs, ["P", "U"], mode=mode, opset=24)
    w = write or [0, 0]
    for b in range(2):
        rows = [(w[b] + s) % 5 for s in range(2)]
        assert np.all(r.ad["P"][b, rows] == 0)


def test_tensor_scatter_axis_symbolic_batch():
    inputs = {"P": randn(2, 4, 2, 3), "U": randn(2, 3, 2, 3), "W": np.array([1, 3], I64)}
    check("TensorScatter", inputs, ["P", "U"], symbolic=["P", "U", "W"], batches=[2, 3], axis=1,
          mode="circular", opset=24)


def test_tensor_scatter_dynamic_update_length():
    inputs = {"P": randn(2, 5, 3), "U": randn(2, 2, 3), "W": np.array([1, 0], I64)}
    model = op_model("TensorScatter", inputs, shapes={"U": [2, "L", 3]}, opset=24)
    for length in (1, 3):
        feeds = {**inputs, "U": randn(2, length, 3)}
        r = assert_gradients(model, feeds, ["P", "U"])
        on_ort(model, feeds, ["P", "U"], r.ad)


MAXPOOL_I = np.array([[[[5, 3], [8, 15]], [[16, 23], [25, 30]]]], I64)  # flat over N·C·H·W


@pytest.mark.parametrize("opset", [9, 11, 22])
def test_max_unpool(opset):
    inputs = {"X": randn(1, 2, 2, 2), "I": MAXPOOL_I}
    r = check("MaxUnpool", inputs, ["X"], consts=["I"], kernel_shape=[2, 2], strides=[2, 2],
              opset=opset)
    assert r.ad["X"].shape == (1, 2, 2, 2)


def test_max_unpool_output_shape_symbolic_batch():
    # output_shape equal to the inferred one; indices flat over N·C·H·W as MaxPool gives them
    x = randn(2, 1, 2, 2)
    pool_i = np.array([0, 3, 9, 14, 16, 19, 25, 30], I64).reshape(2, 1, 2, 2)
    inputs = {"X": x, "I": pool_i, "S": np.array([2, 1, 4, 4], I64)}
    check("MaxUnpool", inputs, ["X"], consts=["S"], symbolic=["X", "I"], batches=[2],
          kernel_shape=[2, 2], strides=[2, 2], outputs=[(1, ["N", 1, 4, 4])])


def test_max_unpool_padding_output_shape_follows_onnxruntime():
    # onnxruntime reads I as flat over output_shape; onnx.reference (and the backend test data)
    # over the inferred 4x4 shape placed top-left. The rule follows onnxruntime: check it against
    # finite differences of a NumPy forward with those semantics.
    x = randn(2, 1, 2, 2)
    indices = np.array([0, 3, 11, 13, 25, 28, 36, 38], I64).reshape(2, 1, 2, 2)
    shape = np.array([2, 1, 5, 5], I64)
    model = op_model("MaxUnpool", {"X": x, "I": indices, "S": shape}, initializers={"S": shape},
                     kernel_shape=[2, 2], strides=[2, 2])
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("out0", 1, [2, 1, 5, 5]))

    def forward(v):
        y = np.zeros(shape, np.float64)
        y.flat[indices.reshape(-1)] = v.reshape(-1)
        return y

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"X": x, "I": indices})[0], forward(x))
    r = R.standard_normal(tuple(shape))
    proto, autodiff = backward_model(model, "out0", ["X"], seed="input")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run([autodiff.gradient_names["X"]],
                      {"X": x, "I": indices, autodiff.seed_name: r.astype(np.float32)})[0]
    fd = np.zeros(x.size)
    for k in range(x.size):
        e = np.zeros(x.size)
        e[k] = 1e-3
        step = e.reshape(x.shape)
        fd[k] = np.sum(r * (forward(x + step) - forward(x - step))) / 2e-3
    np.testing.assert_allclose(got.reshape(-1), fd, rtol=1e-5, atol=1e-5)


def test_max_pool_then_unpool():
    x = distinct(2, 1, 4, 4)
    pool = helper.make_node("MaxPool", ["X"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2])
    unpool = helper.make_node("MaxUnpool", ["p", "i"], ["out0"], kernel_shape=[2, 2],
                              strides=[2, 2])
    model = make_model([pool, unpool], {"X": x}, ["out0"], shapes={"X": ["N", 1, 4, 4]})
    for n in (1, 2):
        feeds = {"X": x[:n]}
        r = assert_gradients(model, feeds, ["X"])
        on_ort(model, feeds, ["X"], r.ad)


# --- TopK, Unique -----------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [9, 10, 11, 18, 24])
def test_topk_opsets(opset):
    inputs = {"X": distinct(3, 5)}
    kw = {"k": 2} if opset < 10 else {}
    if opset >= 10:
        inputs["K"] = np.array([2], I64)
    r = check("TopK", inputs, ["X"], consts=["K"] if opset >= 10 else (), n_outputs=2, opset=opset,
              **kw)
    assert np.count_nonzero(r.ad["X"]) == 6


@pytest.mark.parametrize("largest, sorted_, axis", [(0, 1, 0), (1, 0, -2), (0, 0, 1)])
def test_topk_attributes(largest, sorted_, axis):
    inputs = {"X": distinct(4, 3, 2), "K": np.array([2], I64)}
    check("TopK", inputs, ["X"], consts=["K"], n_outputs=2, largest=largest, sorted=sorted_,
          axis=axis)


def test_topk_k_fed_at_run_time_symbolic_batch():
    inputs = {"X": distinct(3, 5), "K": np.array([3], I64)}
    check("TopK", inputs, ["X"], symbolic=["X"], batches=[1, 4], n_outputs=2,
          outputs=[(1, ["N", "k"]), (7, ["N", "k"])])


def test_topk_ties_follow_runtime_indices():
    x = np.array([[1.0, 3.0, 3.0, 0.5]], np.float32)
    inputs = {"X": x, "K": np.array([1], I64)}
    r = check("TopK", inputs, ["X"], consts=["K"], n_outputs=2)
    assert r.ad["X"][0, 1] != 0 and r.ad["X"][0, 2] == 0  # onnxruntime returns the lower index


def test_topk_before_opset9_refused():
    model = op_model("TopK", {"X": distinct(2, 3)}, 2, k=1, opset=8)
    with pytest.raises(AutodiffError, match="opset 9"):
        backward_model(model, "out0", ["X"], seed="input")


@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_flat(sorted_):
    x = distinct(2, 3)
    x[1, 2] = x[0, 0]  # a repeated value: its elements are skipped by the oracle (shape changes)
    r = check("Unique", {"X": x}, ["X"], sorted=sorted_, outputs=[(1, ["u"])])
    assert r.ad["X"][1, 2] == 0 and r.ad["X"][0, 0] != 0  # the first occurrence takes it
    assert r.counts["X"]["checked"] >= 4


def test_unique_axis_reuses_indices_output():
    x = distinct(3, 2)
    x[2] = x[0]
    inputs = {"X": x}
    model = op_model("Unique", inputs, 2, axis=-2)
    del model.graph.output[:]
    model.graph.output.extend([helper.make_tensor_value_info("out0", 1, ["u", 2]),
                               helper.make_tensor_value_info("out1", 7, ["u"])])
    r = assert_gradients(model, inputs, ["X"])
    on_ort(model, inputs, ["X"], r.ad)
    assert np.all(r.ad["X"][2] == 0) and np.all(r.ad["X"][0] != 0)
    proto, _ = backward_model(model, "out0", ["X"], seed="input")
    assert sum(n.op_type == "Unique" for n in proto.graph.node) == 1


# --- OneHot, Range, CumProd, CenterCropPad ----------------------------------------------------


@pytest.mark.parametrize("opset, axis", [(9, -1), (11, 0), (11, 1), (28, -2)])
def test_one_hot(opset, axis):
    indices = np.array([[0, 2, 3], [1, 4, 2]], I64)  # 4 is out of range: all off
    if opset >= 11:
        indices[1, 0] = -3
    inputs = {"I": indices, "d": np.array(4, I64), "V": np.array([-0.5, 2.0], np.float32)}
    check("OneHot", inputs, ["V"], consts=["d"], axis=axis, opset=opset)


def test_one_hot_symbolic_batch():
    # depth of shape [1] trips onnx.reference's OneHot (np.arange of an array): scalar depth here
    inputs = {"I": np.array([[0, 2], [1, 1], [2, 0]], I64), "d": np.array(3, I64),
              "V": np.array([0.25, 1.5], np.float32)}
    check("OneHot", inputs, ["V"], consts=["d"], symbolic=["I"], batches=[1, 3])


@pytest.mark.parametrize("opset", [11, 27])
@pytest.mark.parametrize("start, limit, delta", [(0.3, 4.1, 0.7), (2.2, -1.5, -0.45)])
def test_range(opset, start, limit, delta):
    f = np.float32
    inputs = {"s": np.array(start, f), "l": np.array(limit, f), "d": np.array(delta, f)}
    r = check("Range", inputs, ["s", "d"], opset=opset)
    n = int(np.ceil((limit - start) / delta))
    assert r.fd["d"] != 0 and n > 3


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod(exclusive, reverse):
    x = randn(2, 5) * 0.5 + np.sign(randn(2, 5))
    inputs = {"X": x, "a": np.array(1, I64)}
    check("CumProd", inputs, ["X"], consts=["a"], exclusive=exclusive, reverse=reverse, opset=26)


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_zeros(exclusive, reverse):
    x = randn(3, 5) * 0.5 + np.sign(randn(3, 5))
    x[0, 2] = 0.0        # one zero
    x[1, [1, 2]] = 0.0   # two zeros in a row
    x[2, [0, 4]] = 0.0   # zeros at both ends
    inputs = {"X": x, "a": np.array(-1, np.int32)}
    r = check("CumProd", inputs, ["X"], consts=["a"], exclusive=exclusive, reverse=reverse,
              opset=26)
    assert np.all(np.isfinite(r.ad["X"]))


def test_cumprod_axis0_fed_symbolic_batch():
    x = randn(3, 2) * 0.5 + np.sign(randn(3, 2))
    inputs = {"X": x, "a": np.array(0, I64)}
    check("CumProd", inputs, ["X"], symbolic=["X"], batches=[2, 4], opset=26)


@pytest.mark.parametrize("shape, axes", [
    ([2, 3, 2], None),        # crop by 1, keep, pad by 1... mixed
    ([5, 2], [-2, 2]),        # pad odd, crop odd
    ([1], [1]),
    ([6, 1], [1, -1]),
])
def test_center_crop_pad(shape, axes):
    inputs = {"X": randn(3, 3, 4), "s": np.array(shape, I64)}
    kw = {} if axes is None else {"axes": axes}
    check("CenterCropPad", inputs, ["X"], consts=["s"], **kw)


def test_center_crop_pad_symbolic_batch():
    inputs = {"X": randn(2, 5, 2), "s": np.array([3, 4], I64)}
    check("CenterCropPad", inputs, ["X"], consts=["s"], symbolic=["X"], batches=[1, 3], axes=[1, 2])
