import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, assert_valid_model, make_model, op_model, rng

from onnx_autodiff.conformance import check_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.conformance.differences import random_cotangents
from onnx_autodiff.errors import AutodiffError

R = rng()
I64 = np.int64


def randn(*shape):
    return R.standard_normal(shape).astype(np.float32)


def check(op_type, inputs, wrt, *, consts=(), batches=None, n_outputs=1, **kw):
    """One-node model; inputs named in ``consts`` become initializers. With ``batches``, the
    first input's first dimension is symbolic "N" and the same model is checked at each size."""
    initializers = {k: inputs[k] for k in consts}
    if batches is None:
        model = op_model(op_type, inputs, n_outputs, initializers=initializers or None, **kw)
        feeds = {k: v for k, v in inputs.items() if k and k not in consts}
        return assert_gradients(model, feeds, wrt)
    first = next(iter(inputs))
    shapes = {first: ["N", *inputs[first].shape[1:]]}
    model = op_model(op_type, inputs, n_outputs, initializers=initializers or None, shapes=shapes, **kw)
    for n in batches:
        feeds = {k: v for k, v in inputs.items() if k and k not in consts}
        feeds[first] = randn(n, *inputs[first].shape[1:])
        assert_gradients(model, feeds, wrt)


# --- Reshape, Flatten, Squeeze, Unsqueeze, Transpose -----------------------------------------


@pytest.mark.parametrize("shape", [[4, 6], [0, -1], [-1, 2, 3], [2, 0, -1]])
def test_reshape(shape):
    x = randn(2, 3, 4)
    check("Reshape", {"X": x, "s": np.array(shape, I64)}, ["X"], consts=["s"])


def test_reshape_runtime_shape_and_allowzero():
    x = randn(2, 3, 4)
    check("Reshape", {"X": x, "s": np.array([4, -1], I64)}, ["X"], allowzero=1)


def test_reshape_symbolic_batch():
    check("Reshape", {"X": randn(2, 3, 4), "s": np.array([0, -1], I64)}, ["X"], consts=["s"],
          batches=[2, 5])


@pytest.mark.parametrize("opset", [7, 9])
def test_reshape_opset5(opset):
    check("Reshape", {"X": randn(2, 6), "s": np.array([3, 4], I64)}, ["X"], consts=["s"], opset=opset)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_flatten(axis):
    check("Flatten", {"X": randn(2, 3, 4)}, ["X"], axis=axis)


def test_flatten_symbolic_batch():
    check("Flatten", {"X": randn(2, 3, 4)}, ["X"], axis=2, batches=[1, 3])


@pytest.mark.parametrize("axes", [[1], [-3, 3], None])
def test_squeeze_axes_input(axes):
    x = randn(2, 1, 3, 1)
    inputs = {"X": x} if axes is None else {"X": x, "a": np.array(axes, I64)}
    check("Squeeze", inputs, ["X"], consts=["a"] if axes else ())


def with_output_shape(model, shape):
    """Declare the output's shape (shape inference cannot when it depends on run-time values)."""
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("out0", 1, shape))
    return model


def test_squeeze_runtime_axes():
    inputs = {"X": randn(2, 1, 3), "a": np.array([-2], I64)}
    assert_gradients(with_output_shape(op_model("Squeeze", inputs), [2, 3]), inputs, ["X"])


def test_squeeze_without_axes_symbolic_batch():
    model = op_model("Squeeze", {"X": randn(2, 1, 3)}, shapes={"X": ["N", 1, 3]})
    model = with_output_shape(model, ["N", 3])
    for n in (2, 4):
        assert_gradients(model, {"X": randn(n, 1, 3)}, ["X"])


@pytest.mark.parametrize("opset", [11, 12])
def test_squeeze_unsqueeze_attribute(opset):
    check("Squeeze", {"X": randn(2, 1, 3, 1)}, ["X"], axes=[1, -1], opset=opset)
    check("Unsqueeze", {"X": randn(2, 3)}, ["X"], axes=[0, -1], opset=opset)


@pytest.mark.parametrize("axes", [[0], [1, -1], [-3]])
def test_unsqueeze(axes):
    check("Unsqueeze", {"X": randn(2, 3), "a": np.array(axes, I64)}, ["X"], consts=["a"])


def test_squeeze_unsqueeze_symbolic_batch():
    check("Unsqueeze", {"X": randn(2, 3), "a": np.array([1], I64)}, ["X"], consts=["a"], batches=[2, 4])
    check("Squeeze", {"X": randn(2, 1, 3), "a": np.array([1], I64)}, ["X"], consts=["a"], batches=[2, 4])


@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1], [1, 2, 0]])
def test_transpose(perm):
    kw = {} if perm is None else {"perm": perm}
    check("Transpose", {"X": randn(2, 3, 4)}, ["X"], **kw)


def test_transpose_symbolic_batch():
    check("Transpose", {"X": randn(2, 3, 4)}, ["X"], perm=[1, 2, 0], batches=[2, 3])


# --- Concat, Split ---------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis, opset):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    shapes[0][axis], shapes[2][axis] = 1, 3
    inputs = {k: randn(*s) for k, s in zip("ABC", shapes)}
    check("Concat", inputs, ["A", "B", "C"], axis=axis, opset=opset)


def test_concat_same_input_twice():
    a = randn(2, 3)
    model = make_model([helper.make_node("Concat", ["A", "A"], ["Y"], axis=1)], {"A": a}, ["Y"])
    assert_gradients(model, {"A": a}, ["A"])


def test_concat_symbolic_batch_along_batch_axis():
    a, b = randn(2, 3), randn(1, 3)
    model = op_model("Concat", {"A": a, "B": b}, axis=0, shapes={"A": ["N", 3], "B": ["M", 3]})
    for n, m in [(2, 1), (3, 4)]:
        assert_gradients(model, {"A": randn(n, 3), "B": randn(m, 3)}, ["A", "B"])


def test_concat_symbolic_batch_other_axis():
    model = op_model("Concat", {"A": randn(2, 3), "B": randn(2, 2)}, axis=-1,
                     shapes={"A": ["N", 3], "B": ["N", 2]})
    for n in (2, 3):
        assert_gradients(model, {"A": randn(n, 3), "B": randn(n, 2)}, ["A", "B"])


def test_concat_runtime_sizes_old_opset_refused():
    a, b = randn(2, 3), randn(1, 3)
    model = op_model("Concat", {"A": a, "B": b}, axis=0, opset=11, shapes={"A": ["N", 3], "B": ["M", 3]})
    with pytest.raises(AutodiffError, match="opset 13"):
        backward_model(model, "out0", ["A"], seed="input", upgrade_opset=False)


@pytest.mark.parametrize("opset,width,kw,split", [
    (11, 6, {"split": [1, 3, 2]}, None),   # split as an attribute
    (13, 6, {}, [2, 1, 3]),                # split as an input
    (13, 6, {}, None),                     # equal chunks
    (18, 6, {"num_outputs": 3}, None),
    (18, 7, {"num_outputs": 4}, None),     # 2, 2, 2 and an uneven last chunk of 1
])
def test_split(opset, width, kw, split):
    inputs = {"X": randn(2, width)}
    if split is not None:
        inputs["s"] = np.array(split, I64)
    n = len(split or kw.get("split", [])) or kw.get("num_outputs", 3)
    check("Split", inputs, ["X"], consts=["s"] if split else (), n_outputs=n, axis=-1, opset=opset, **kw)


def test_split_unused_outputs_get_zeros():
    x = randn(5, 2)
    nodes = [helper.make_node("Split", ["X"], ["a", "b", "c"], axis=0, num_outputs=3),
             helper.make_node("Mul", ["b", "b"], ["Y"])]
    model = make_model(nodes, {"X": x}, ["Y"])
    result = assert_gradients(model, {"X": x}, ["X"])
    assert np.all(result.ad["X"][:2] == 0) and np.all(result.ad["X"][4:] == 0)


def test_split_symbolic_batch():
    check("Split", {"X": randn(2, 6)}, ["X"], n_outputs=2, axis=1, num_outputs=2, batches=[2, 3])


# --- Slice -----------------------------------------------------------------------------------

SLICES = [
    ([1], [3], [0], None),                     # plain
    ([-3, 1], [-1, 100], [1, 2], None),        # negative indices, clamped end
    ([0, 2], [10, 5], [-1, 1], [1, 2]),        # clamped, step 2
    ([-1], [-100], [1], [-1]),                 # negative step to the start
    ([4, 3], [0, -10], [2, 0], [-2, -1]),      # negative steps > 1
    ([5], [1], [2], [1]),                      # empty
]


@pytest.mark.parametrize("starts,ends,axes,steps", SLICES)
def test_slice(starts, ends, axes, steps):
    inputs = {"X": randn(3, 4, 5), "s": np.array(starts, I64), "e": np.array(ends, I64),
              "a": np.array(axes, I64)}
    if steps is not None:
        inputs["t"] = np.array(steps, I64)
    check("Slice", inputs, ["X"], consts=[k for k in inputs if k != "X"])


@pytest.mark.parametrize("starts,ends,axes,steps", SLICES[:5])
def test_slice_symbolic_batch(starts, ends, axes, steps):
    axes = [0 if a == 1 else a for a in axes] if 0 not in axes else axes  # slice the batch axis
    inputs = {"X": randn(6, 4, 5), "s": np.array(starts, I64), "e": np.array(ends, I64),
              "a": np.array(axes, I64)}
    if steps is not None:
        inputs["t"] = np.array(steps, I64)
    check("Slice", inputs, ["X"], consts=[k for k in inputs if k != "X"], batches=[6, 3])


def test_slice_runtime_starts_no_axes():
    inputs = {"X": randn(4, 5), "s": np.array([1, -2], I64), "e": np.array([100, 0], I64)}
    model = op_model("Slice", inputs)
    assert_gradients(model, inputs, ["X"])


def test_slice_runtime_steps():
    inputs = {"X": randn(4, 5), "s": np.array([-1], I64), "e": np.array([-100], I64),
              "a": np.array([-1], I64), "t": np.array([-2], I64)}
    model = op_model("Slice", inputs, initializers={"a": inputs["a"]})
    inputs.pop("a")
    assert_gradients(model, inputs, ["X"])


@pytest.mark.parametrize("a,t", [([1], None), ([-1, 0], [-2, 1])])
def test_slice_runtime_axes(a, t):
    """Axes (and steps) fed at run time: the positions X's elements were read from, sliced alike."""
    inputs = {"X": randn(3, 4), "s": np.array([1, 0][: len(a)], I64), "e": np.array([3, 2][: len(a)], I64),
              "a": np.array(a, I64)}
    if t is not None:
        inputs["t"] = np.array(t, I64)
    assert_gradients(op_model("Slice", inputs), inputs, ["X"])


def test_slice_opset10_inputs():
    inputs = {"X": randn(3, 4), "s": np.array([1, -3], I64), "e": np.array([100, -1], I64)}
    check("Slice", inputs, ["X"], consts=["s", "e"], opset=10)


def test_slice_opset9_attributes():
    check("Slice", {"X": randn(3, 4)}, ["X"], starts=[1, -3], ends=[100, -1], axes=[0, 1], opset=9)


def test_slice_int32_params_symbolic():
    inputs = {"X": randn(3, 4), "s": np.array([1], np.int32), "e": np.array([-1], np.int32),
              "a": np.array([0], np.int32), "t": np.array([1], np.int32)}
    check("Slice", inputs, ["X"], consts=["s", "e", "a", "t"], batches=[3, 5])


# --- Expand, Tile, Pad -----------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,shape", [((3, 1), [2, 3, 4]), ((1, 4), [3, 1]), ((4,), [2, 4])])
def test_expand(x_shape, shape):
    check("Expand", {"X": randn(*x_shape), "s": np.array(shape, I64)}, ["X"], consts=["s"])


def test_expand_symbolic_batch():
    check("Expand", {"X": randn(2, 1, 3), "s": np.array([1, 4, 1], I64)}, ["X"], consts=["s"],
          batches=[2, 3])


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("repeats", [[2, 3], [1, 1], [3, 1]])
def test_tile(repeats, opset):
    check("Tile", {"X": randn(2, 3), "r": np.array(repeats, I64)}, ["X"], consts=["r"], opset=opset)


def test_tile_runtime_repeats_and_symbolic_batch():
    check("Tile", {"X": randn(2, 3), "r": np.array([2, 2], I64)}, ["X"], batches=[2, 3])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[1, 0, 2, 1], [0, 2, 1, 0], [2, -1, 0, 2]])
def test_pad_modes(mode, pads):
    inputs = {"X": randn(4, 5), "p": np.array(pads, I64)}
    check("Pad", inputs, ["X"], consts=["p"], mode=mode, opset=19)


def test_pad_constant_value_gradient():
    inputs = {"X": randn(3, 4), "p": np.array([1, 0, 2, -1], I64), "v": np.array(0.7, np.float32)}
    check("Pad", inputs, ["X", "v"], consts=["p"])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_axes_input(mode):
    inputs = {"X": randn(2, 4, 5), "p": np.array([1, 2, 2, 1], I64), "": None, "a": np.array([-1, 1], I64)}
    inputs.pop("")
    model = make_model([helper.make_node("Pad", ["X", "p", "", "a"], ["Y"], mode=mode)],
                       {"X": inputs["X"]}, ["Y"], initializers={"p": inputs["p"], "a": inputs["a"]},
                       opset=19)
    assert_gradients(model, {"X": inputs["X"]}, ["X"])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [9, 13, 18])
def test_pad_opsets(mode, opset):
    x = randn(3, 4)
    if opset < 11:
        check("Pad", {"X": x}, ["X"], pads=[1, 2, 2, 1], mode=mode, opset=opset)
    else:
        check("Pad", {"X": x, "p": np.array([1, 2, 2, 1], I64)}, ["X"], consts=["p"], mode=mode,
              opset=opset)


@pytest.mark.parametrize("mode", ["constant", "reflect", "wrap"])
def test_pad_runtime_pads_symbolic_batch(mode):
    check("Pad", {"X": randn(3, 4), "p": np.array([1, 2, 0, 1], I64)}, ["X"], mode=mode, opset=19,
          batches=[3, 4])


# --- Where, Trilu, CumSum, ReverseSequence, DepthToSpace, SpaceToDepth -----------------------


def test_where_broadcast():
    cond = R.random((3, 1)) > 0.5
    inputs = {"c": cond, "X": randn(3, 4), "Y": randn(4)}
    check("Where", inputs, ["X", "Y"])
    check("Where", {"c": cond, "X": randn(1), "Y": randn(2, 3, 1)}, ["X", "Y"])


def test_where_symbolic_batch():
    inputs = {"c": R.random(4) > 0.5, "X": randn(2, 4), "Y": randn(4)}
    model = op_model("Where", inputs, shapes={"X": ["N", 4]})
    for n in (2, 3):
        assert_gradients(model, {**inputs, "X": randn(n, 4)}, ["X", "Y"])


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2])
def test_trilu(upper, k):
    inputs = {"X": randn(2, 3, 4)}
    if k is not None:
        inputs["k"] = np.array(k, I64)
    check("Trilu", inputs, ["X"], consts=["k"] if k is not None else (), upper=upper)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [1, -3])
def test_cumsum(exclusive, reverse, axis):
    inputs = {"X": randn(3, 4, 2), "a": np.array(axis, I64)}
    check("CumSum", inputs, ["X"], consts=["a"], exclusive=exclusive, reverse=reverse)


@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence(batch_axis, time_axis):
    shape = (4, 3, 2) if batch_axis == 1 else (3, 4, 2)
    inputs = {"X": randn(*shape), "L": np.array([4, 1, 2], I64)}
    check("ReverseSequence", inputs, ["X"], batch_axis=batch_axis, time_axis=time_axis)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    check("DepthToSpace", {"X": randn(1, 8, 2, 3)}, ["X"], blocksize=2, mode=mode)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_symbolic(mode):
    x = randn(2, 4, 2, 3)
    model = op_model("DepthToSpace", {"X": x}, blocksize=2, mode=mode, shapes={"X": ["N", 4, "H", "W"]})
    for shape in [(2, 4, 2, 3), (1, 4, 3, 2)]:
        assert_gradients(model, {"X": randn(*shape)}, ["X"])


def test_depth_to_space_opset9():
    check("DepthToSpace", {"X": randn(1, 4, 2, 2)}, ["X"], blocksize=2, opset=9)


def test_space_to_depth():
    check("SpaceToDepth", {"X": randn(1, 2, 4, 6)}, ["X"], blocksize=2)
    check("SpaceToDepth", {"X": randn(2, 2, 2, 4)}, ["X"], blocksize=2, batches=[2, 1])


# --- Gather, GatherElements, GatherND, Compress ----------------------------------------------


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axis,indices", [
    (0, [[0, 2], [2, -1]]),   # repeated (2 and -1 are both the last row)
    (1, [1, 1, -4, 3]),
    (-1, -1),                 # scalar index
    (-2, [[-1], [0]]),
])
def test_gather(opset, axis, indices):
    inputs = {"X": randn(3, 4, 2), "i": np.array(indices, I64)}
    check("Gather", inputs, ["X"], consts=["i"], axis=axis, opset=opset)
    check("Gather", inputs, ["X"], axis=axis, opset=opset)  # indices fed at run time


def test_gather_repeated_indices_sum():
    x = randn(3, 2)
    result = check("Gather", {"X": x, "i": np.array([1, 1, 1], I64)}, ["X"], consts=["i"])
    assert np.all(result.ad["X"][[0, 2]] == 0) and np.any(result.ad["X"][1] != 0)


@pytest.mark.parametrize("opset", [11, 18])
def test_gather_symbolic_batch_int32(opset):
    inputs = {"X": randn(3, 4), "i": np.array([[-1, 0], [1, -1]], np.int32)}
    check("Gather", inputs, ["X"], axis=0, batches=[3, 5], opset=opset)
    check("Gather", inputs, ["X"], axis=1, batches=[3, 5], opset=opset)


@pytest.mark.parametrize("opset", [13, 18])  # 13: the one-hot form, before scatter-add exists
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(axis, opset):
    x = randn(3, 4)
    idx = R.integers(-3, 3, (2, 4) if axis == 0 else (3, 5))
    check("GatherElements", {"X": x, "i": idx.astype(I64)}, ["X"], axis=axis, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_gather_elements_indices_shorter_than_data(opset):
    # indices cover only part of X on the other axes: the rest of X gets zero gradient.
    idx = np.array([[2, -1], [0, 0]], np.int32)
    result = check("GatherElements", {"X": randn(4, 3), "i": idx}, ["X"], axis=0, opset=opset)
    assert np.all(result.ad["X"][:, 2] == 0)


@pytest.mark.parametrize("opset", [13, 18])
def test_gather_elements_symbolic_batch(opset):
    idx = np.array([[0, 0, 2], [1, -1, 0]], I64)
    check("GatherElements", {"X": randn(2, 3), "i": idx}, ["X"], axis=1, batches=[2],
          consts=["i"], opset=opset)
    inputs = {"X": randn(2, 3), "i": idx}
    model = op_model("GatherElements", inputs, axis=1, opset=opset, shapes={"X": ["N", 3], "i": ["M", 3]})
    for n, m in ((2, 2), (4, 3)):
        feeds = {"X": randn(n, 3), "i": R.integers(-3, 3, (m, 3)).astype(I64)}
        assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("batch_dims,x_shape,indices", [
    (0, (3, 4), [[0, 1], [2, -1], [0, 1]]),     # repeated tuples sum
    (0, (3, 4, 2), [[1], [-1], [1]]),           # slices
    (1, (2, 3, 4), [[[1], [2]], [[-1], [1]]]),  # batch_dims 1
    (2, (2, 3, 4), [[[1], [2], [0]], [[3], [3], [0]]]),
])
def test_gather_nd(batch_dims, x_shape, indices, opset):
    inputs = {"X": randn(*x_shape), "i": np.array(indices, I64)}
    check("GatherND", inputs, ["X"], batch_dims=batch_dims, opset=opset)
    check("GatherND", inputs, ["X"], consts=["i"], batch_dims=batch_dims, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_gather_nd_symbolic_batch(opset):
    inputs = {"X": randn(2, 3, 4), "i": np.array([[2, 1], [0, -1]], I64)}
    model = op_model("GatherND", inputs, batch_dims=1, shapes={"X": ["N", 3, 4], "i": ["N", 2]},
                     opset=opset)
    for n in (2, 4):
        feeds = {"X": randn(n, 3, 4), "i": R.integers(-3, 3, (n, 2)).astype(I64)}
        assert_gradients(model, feeds, ["X"])
    model = op_model("GatherND", {"X": randn(3, 4, 2), "i": np.array([[1], [-1]], I64)},
                     shapes={"X": [3, 4, "C"], "i": ["M", 1]}, opset=opset)
    for c, m in ((2, 2), (3, 5)):
        feeds = {"X": randn(3, 4, c), "i": R.integers(-3, 3, (m, 1)).astype(I64)}
        assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress(axis):
    x = randn(3, 4)
    cond = np.array([True, False, True, True] if axis not in (0,) else [False, True, True])
    kw = {} if axis is None else {"axis": axis}
    check("Compress", {"X": x, "c": cond}, ["X"], **kw)


def test_compress_short_condition_symbolic_batch():
    check("Compress", {"X": randn(4, 3), "c": np.array([True, False, True])}, ["X"], axis=0,
          batches=[4, 6])
    check("Compress", {"X": randn(2, 3), "c": np.array([False, True, True, False, True])}, ["X"],
          batches=[2, 3])


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_modes_opset_28(mode):
    x = rng(5).standard_normal((1, 2, 4, 4)).astype(np.float32)
    model = op_model("SpaceToDepth", {"input": x}, blocksize=2, mode=mode, opset=28)
    assert_gradients(model, {"input": x}, ["input"])


@pytest.mark.parametrize("op_type,kw", [("Slice", {}), ("Concat", {"axis": -2})])
def test_input_of_unknown_rank_takes_the_rank_of_the_gradient(op_type, kw):
    """X reshaped to a shape fed at run time has no rank; the output's gradient has it."""
    nodes = [helper.make_node("Reshape", ["flat", "s"], ["X"])]
    if op_type == "Slice":
        nodes.append(helper.make_node("Slice", ["X", "starts", "ends", "axes"], ["y"]))
        out_shape = [2, 2, 4]
    else:
        nodes.append(helper.make_node("Concat", ["X", "X"], ["y"], **kw))
        out_shape = [2, 6, 4]
    feeds = {"flat": randn(24), "s": np.array([2, 3, 4], I64)}
    model = make_model(nodes, feeds, ["y"], shapes={"s": ["R"]}, output_shapes={"y": out_shape},
                       initializers={"starts": np.array([1], I64), "ends": np.array([3], I64),
                                     "axes": np.array([-2], I64)})
    assert_gradients(model, feeds, ["flat"])


# --- Pad with pads (and axes) known only at run time, on inputs of run-time sizes ------------


@pytest.mark.parametrize("mode,opset", [("constant", 11), ("reflect", 11), ("edge", 11),
                                        ("constant", 18), ("reflect", 18), ("edge", 18), ("wrap", 19)])
def test_pad_run_time_pads_axes_and_sizes(mode, opset):
    """pads (and from opset 18 axes, one negative) fed as inputs, X's every dimension symbolic: one
    backward graph runs at two sizes and two paddings, each against finite differences."""
    given = [{"X": randn(2, 3, 4), "p": np.array([1, 2, 2, 1], I64)},
             {"X": randn(1, 4, 5), "p": np.array([0, 1, 3, 2], I64)}]
    inputs = dict(given[0])
    if opset >= 18:
        inputs.update({"": None, "a": np.array([-1, 1], I64)})
    else:  # pads of every axis
        given = [{**g, "p": np.concatenate([[0], g["p"][:2], [0], g["p"][2:]])[[0, 2, 1, 3, 5, 4]]}
                 for g in given]
        inputs["p"] = given[0]["p"]
    names = [n if n else "" for n in inputs]
    fed = {k: v for k, v in inputs.items() if k}
    # (onnx infers no rank for Pad with axes fed at run time: the output's is declared)
    model = make_model([helper.make_node("Pad", names, ["out0"], mode=mode)], fed, ["out0"],
                       shapes={"X": ["A", "B", "C"]}, opset=opset, output_shapes={"out0": ["P", "Q", "R"]})
    proto, autodiff = backward_model(model, "out0", ["X"], seed="input")
    assert_valid_model(proto)
    names = [o.name for o in proto.graph.output]
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in given:
        feeds = {**feeds, **({"a": inputs["a"]} if opset >= 18 else {})}
        # (check_vjp, not assert_gradients: every dimension is symbolic already, and a copy with
        # the outputs' shapes cleared would lose the rank onnx cannot infer)
        result = check_vjp(model, feeds, ["X"])
        assert result.ok and not result.weak, str(result)
        r = random_cotangents(model, feeds)[0]
        got = dict(zip(names, session.run(None, {**feeds, autodiff.seed_name: r})))
        np.testing.assert_allclose(got[autodiff.gradient_names["X"]], result.ad["X"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op_type,extra,kw,size", [
    ("Tile", {"reps": np.array([1, 2, 1], I64)}, {}, 48),
    ("Tile", {"reps": np.array([2, 1, 2], I64)}, {"fed": True}, 96),  # repeats' length unknown too
    ("Gather", {"idx": np.array([[2, 0], [1, 1]], I64)}, {"axis": 1}, 32),
    ("Gather", {"idx": np.array([1, 1, 0], I64)}, {"axis": 0}, 36),
    ("Gather", {"idx": np.array([3, -1], I64)}, {"axis": -1, "fed": True}, 12),
    ("Expand", {"to": np.array([2, 2, 1, 4], I64)}, {"fed": True}, 48),
    ("Slice", {"st": np.array([1], I64), "en": np.array([4], I64), "ax": np.array([2], I64)}, {"fed": True}, 18),
    ("Concat", {}, {"axis": 1}, 48),
    ("Unsqueeze", {"ax": np.array([-1, 1], I64)}, {"fed": True}, 24),
    ("Squeeze", {"ax": np.array([0], I64)}, {"fed": True, "reshape_to": [1, 6, 4]}, 24),
])
def test_op_on_a_value_of_unknown_rank_with_a_gradient_of_unknown_rank(op_type, extra, kw, size):
    """X reshaped to a shape fed at run time has no rank, nor has the op's output and so its
    gradient (flattened after it): the rule reads the rank elsewhere or at run time."""
    kw = dict(kw)
    fed, to = kw.pop("fed", False), kw.pop("reshape_to", [2, 3, 4])
    nodes = [helper.make_node("Reshape", ["flat", "s"], ["X"]),
             helper.make_node(op_type, ["X", *(extra or ["X"])], ["y"], **kw),
             helper.make_node("Reshape", ["y", "minus1"], ["z"])]
    feeds = {"flat": randn(24), "s": np.array(to, I64), **(extra if fed else {})}
    model = make_model(nodes, feeds, ["z"], shapes={"s": ["R"], **{k: [f"{k}_n"] for k in extra if fed}},
                       output_shapes={"z": [size]},
                       initializers={"minus1": np.array([-1], I64), **({} if fed else extra)})
    assert_gradients(model, feeds, ["flat"])
