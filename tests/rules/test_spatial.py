"""Resize/Upsample, GridSample, AffineGrid, RoiAlign.

Three oracles: the float64 finite differences of `assert_gradients`; for the ops linear in the
differentiated input (Resize, Upsample, AffineGrid, RoiAlign avg), the exact Jacobian of the
onnxruntime forward itself, one basis vector at a time (`assert_linear_vjp`), which also covers
the cases where onnx.reference's Resize disagrees with the spec and onnxruntime (align_corners
and tf_crop_and_resize with a non-integer in·scale, several nearest cases); and PyTorch autograd
for GridSample and AffineGrid.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from helpers import assert_gradients, assert_valid_model, make_model, op_model, rng
from onnx_autodiff.conformance import compare, fd_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import AutodiffError
from onnx_autodiff.rules.spatial import resize_matrix

R = rng(7)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def ort_vjp(model, feeds, wrt, r):
    """The backward graph, run on onnxruntime itself (no fallback), with seed r."""
    proto, autodiff = backward_model(model, model.graph.output[0].name, wrt, seed="input")
    names = [o.name for o in proto.graph.output]
    got = dict(zip(names, _session(proto).run(None, {**feeds, autodiff.seed_name: r})))
    return [got[autodiff.gradient_names[x]] for x in wrt]


def jacobian_vjp(session, feeds, x, r):
    """rᵀ·J for y affine in x, J read off the onnxruntime forward: f(eᵢ) - f(0)."""
    base = feeds[x]
    offset = session.run(None, {**feeds, x: np.zeros_like(base)})[0].astype(np.float64)
    want = np.zeros(base.shape)
    for i in np.ndindex(base.shape):
        e = np.zeros_like(base)
        e[i] = 1
        column = session.run(None, {**feeds, x: e})[0].astype(np.float64) - offset
        want[i] = np.sum(r * column)
    return want


def assert_linear_vjp(model, feeds, x, seed=0):
    """For y affine in x: the VJP equals rᵀ·J (:func:`jacobian_vjp`)."""
    session = _session(model)
    shape = session.run(None, feeds)[0].shape
    r = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    (ad,) = ort_vjp(model, feeds, [x], r)
    want = jacobian_vjp(session, feeds, x, r)
    scale = max(1.0, np.abs(want).max())
    np.testing.assert_allclose(ad, want, atol=1e-5 * scale, rtol=1e-4)
    assert np.any(want != 0)


# Resize


def resize_model(attrs, scales=None, sizes=None, roi=None, shape=(1, 2, 4, 5), opset=19, sym=None):
    inits, names = {}, ["X", "", "", ""]
    for slot, name, value, dtype in ((1, "roi", roi, np.float32), (2, "scales", scales, np.float32),
                                     (3, "sizes", sizes, np.int64)):
        if value is not None:
            inits[name] = np.array(value, dtype)
            names[slot] = name
    while names[-1] == "":
        names.pop()
    if opset < 13 and len(names) < 3:
        names += [""] * (3 - len(names))
    for slot, name in ((1, "roi"), (2, "scales")):  # required before opset 13, empty when unused
        if opset < 13 and names[slot] == "":
            inits[name], names[slot] = np.zeros(0, np.float32), name
    node = helper.make_node("Resize", names, ["Y"], **attrs)
    x = R.standard_normal(shape).astype(np.float32)
    model = make_model([node], {"X": x}, ["Y"], initializers=inits, opset=opset,
                       shapes={"X": sym} if sym else None)
    return model, {"X": x}


SCALES = [dict(scales=[1, 1, 1.7, 0.6]), dict(sizes=[1, 2, 7, 3]), dict(scales=[1, 1, 0.5, 2.0])]
CTMS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
        "tf_crop_and_resize"]
ROI = [0, 0, 0.15, 0.2, 1, 1, 0.85, 1.13]  # no source coordinate on the [0, n-1] edge


@pytest.mark.parametrize("size", range(len(SCALES)))
@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_linear_cubic(mode, ctm, size):
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm)
    roi = None
    if ctm == "tf_crop_and_resize":
        roi, attrs["extrapolation_value"] = ROI, 10.0
    model, feeds = resize_model(attrs, roi=roi, **SCALES[size])
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("ctm", CTMS)
def test_resize_nearest(ctm, nearest_mode):
    # Output sizes from (4, 5) that put no source coordinate near a rounding tie (x.0 or x.5).
    out = {"align_corners": (6, 4), "asymmetric": (3, 7), "tf_crop_and_resize": (6, 3)}.get(ctm, (8, 4))
    attrs = dict(mode="nearest", coordinate_transformation_mode=ctm, nearest_mode=nearest_mode)
    roi = ROI if ctm == "tf_crop_and_resize" else None
    model, feeds = resize_model(attrs, roi=roi, sizes=[1, 2, *out])
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("exclude_outside", [0, 1])
@pytest.mark.parametrize("scales", [[1, 1, 0.5, 0.4], [1, 1, 0.7, 1.6]])
def test_resize_antialias_exclude_outside(mode, exclude_outside, scales):
    attrs = dict(mode=mode, antialias=1, exclude_outside=exclude_outside, cubic_coeff_a=-0.5)
    model, feeds = resize_model(attrs, scales=scales, shape=(1, 1, 6, 5))
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize(
    "policy,axes",
    [("stretch", [2, 3]), ("stretch", [-1, -2]), ("not_larger", [2, 3]), ("not_smaller", [3, 2])],
)
def test_resize_axes_keep_aspect_ratio(policy, axes):
    # onnxruntime 1.32 ignores keep_aspect_ratio_policy's resize when axes are negative (returns X).
    attrs = dict(mode="linear", axes=axes, keep_aspect_ratio_policy=policy)
    model, feeds = resize_model(attrs, sizes=[7, 3])
    assert_linear_vjp(model, feeds, "X")


def test_resize_axes_scales_3d_middle_axis():
    """A resized axis that is neither of the last two (Transpose, MatMul, Transpose)."""
    attrs = dict(mode="linear", axes=[1])
    model, feeds = resize_model(attrs, scales=[1.5], shape=(2, 3, 4))
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_finite_differences(mode):
    """The float64 oracle too (onnx.reference agrees with onnxruntime on half_pixel)."""
    attrs = dict(mode=mode, coordinate_transformation_mode="half_pixel")
    model, feeds = resize_model(attrs, scales=[1, 1, 1.5, 0.8])
    assert_gradients(model, feeds, ["X"])


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_resize_opsets(opset):
    attrs = dict(mode="linear", coordinate_transformation_mode="align_corners")
    model, feeds = resize_model(attrs, scales=[1, 1, 2.0, 1.5], opset=opset)
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 1.7, 0.6], [1, 1, 2, 3]])
def test_resize_opset10(mode, scales):
    node = helper.make_node("Resize", ["X", "scales"], ["Y"], mode=mode)
    x = R.standard_normal((1, 2, 4, 5)).astype(np.float32)
    model = make_model([node], {"X": x}, ["Y"], opset=10,
                       initializers={"scales": np.array(scales, np.float32)})
    assert_linear_vjp(model, {"X": x}, "X")


def test_resize_symbolic_batch():
    """Batch and channels symbolic: only the resized axes need static sizes."""
    model, feeds = resize_model(dict(mode="cubic"), scales=[1, 1, 1.5, 0.8], sym=["N", "C", 4, 5])
    x = R.standard_normal((3, 2, 4, 5)).astype(np.float32)
    assert_linear_vjp(model, {"X": x}, "X")
    assert_linear_vjp(model, {"X": x[:1, :1]}, "X")


# Resize and Upsample over lengths, scales and sizes known only at run time: one backward graph,
# run at two input sizes, each against its own oracle.

NCHW = ["N", "C", "H", "W"]


def assert_vjp_at_sizes(model, feeds_list, oracle="fd", wrt=("X",)):
    """ONE backward graph of ``model``, run on onnxruntime at each of ``feeds_list``, against float64
    finite differences (``oracle="fd"``) or the onnxruntime forward's own Jacobian ("jacobian", for
    one input the output is linear in: where onnx.reference's Resize, the float64 evaluator,
    departs from the spec and onnxruntime)."""
    proto, autodiff = backward_model(model, model.graph.output[0].name, list(wrt), seed="input")
    assert_valid_model(proto)
    backward, forward = _session(proto), _session(model)
    names = [o.name for o in proto.graph.output]
    shapes = set()
    for k, feeds in enumerate(feeds_list):
        y = forward.run(None, feeds)[0]
        r = np.random.default_rng(k).standard_normal(y.shape).astype(np.float32)
        got = dict(zip(names, backward.run(None, {**feeds, autodiff.seed_name: r})))
        fd = fd_vjp(model, feeds, list(wrt), [r]) if oracle == "fd" else None
        assert fd is None or not fd.weak, f"no float64 oracle: {fd.notes}"
        for x in wrt:
            ad = got[autodiff.gradient_names[x]]
            if oracle == "fd":
                fd_x = fd.details[x]
                assert compare(ad, fd_x, 1e-4, 1e-3) <= 1, f"{x} at {feeds[x].shape}: AD {ad} FD {fd_x.value}"
                assert np.any(fd_x.value != 0)
            else:
                want = jacobian_vjp(forward, feeds, x, r)
                np.testing.assert_allclose(ad, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=1e-4)
                assert np.any(want != 0)
        shapes.add(tuple(feeds[x].shape for x in feeds))
    assert len(shapes) == len(feeds_list)
    return proto


def _x(*shape):
    return R.standard_normal(shape).astype(np.float32)


def _shape_sizes(sizes, opset):
    """Nodes computing Resize's sizes at run time as TorchScript exports do: Concat(Slice(Shape(X),
    0, 2), Cast(Concat(Unsqueeze(Gather(Shape(Z), 2)), Unsqueeze(Gather(Shape(Z), 3))))): N and C
    kept, H and W those of another input Z."""
    def const(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64)))

    def unsqueeze(a, b):
        if opset < 13:
            return [helper.make_node("Unsqueeze", [a], [b], axes=[0])]
        return [helper.make_node("Unsqueeze", [a, "zero"], [b])]

    return [helper.make_node("Shape", ["Z"], ["z_shape"]), const("two", 2), const("three", 3), const("zero", [0]),
            helper.make_node("Gather", ["z_shape", "two"], ["z_h"]),
            helper.make_node("Gather", ["z_shape", "three"], ["z_w"]),
            *unsqueeze("z_h", "z_h1"), *unsqueeze("z_w", "z_w1"),
            helper.make_node("Concat", ["z_h1", "z_w1"], ["z_hw"], axis=0),
            helper.make_node("Cast", ["z_hw"], ["hw"], to=onnx.TensorProto.INT64),
            helper.make_node("Shape", ["X"], ["x_shape"]), const("two1", [2]),
            helper.make_node("Slice", ["x_shape", "zero", "two1", "zero"], ["nc"]),
            helper.make_node("Concat", ["nc", "hw"], [sizes], axis=0)]


# (opset, attributes, how: "scales" | "sizes" | "shape" (sizes from Shape), oracle)
SYMBOLIC_CASES = [
    (10, dict(mode="nearest"), "scales", "jacobian"),  # (onnx.reference runs no float64 Resize-10)
    (10, dict(mode="linear"), "scales", "jacobian"),
    (11, dict(mode="linear", coordinate_transformation_mode="align_corners"), "shape", "jacobian"),
    (11, dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"), "scales", "fd"),
    (11, dict(mode="cubic", coordinate_transformation_mode="pytorch_half_pixel"), "sizes", "fd"),
    (11, dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.0), "scales",
     "jacobian"),
    (13, dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"), "shape",
     "fd"),
    (13, dict(mode="cubic", coordinate_transformation_mode="asymmetric"), "scales", "fd"),
    (13, dict(mode="linear", coordinate_transformation_mode="half_pixel"), "sizes", "fd"),
    (18, dict(mode="linear", antialias=1, axes=[3, 2]), "scales", "jacobian"),
    (18, dict(mode="nearest", coordinate_transformation_mode="tf_crop_and_resize", nearest_mode="ceil"), "sizes",
     "jacobian"),
    (19, dict(mode="linear", coordinate_transformation_mode="half_pixel_symmetric"), "scales", "fd"),
    (19, dict(mode="nearest", coordinate_transformation_mode="half_pixel_symmetric",
              nearest_mode="round_prefer_floor"), "shape", "jacobian"),
    (19, dict(mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5), "sizes", "fd"),
]


@pytest.mark.parametrize("opset,attrs,how,oracle", SYMBOLIC_CASES)
def test_resize_symbolic_sizes(opset, attrs, how, oracle):
    """Every input dimension symbolic; H, W resized (by constant scales or sizes, or sizes computed
    from Shape); one backward graph checked at two input sizes."""
    tf_crop = attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize"
    roi = [0, 0, 0.15, 0.2, 1, 1, 0.85, 1.13] if tf_crop else None
    feeds = [{"X": _x(1, 2, 4, 5)}, {"X": _x(2, 1, 3, 6)}]
    if how == "shape":
        nodes = _shape_sizes("sizes", opset)
        names = ["X", "roi", "scales", "sizes"] if opset < 13 else ["X", "", "", "sizes"]
        inits = {"roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32)} if opset < 13 else {}
        node = helper.make_node("Resize", names, ["Y"], **attrs)
        model = make_model([*nodes, node], {"X": feeds[0]["X"], "Z": np.zeros((1, 1, 7, 3), np.float32)}, ["Y"],
                           initializers=inits, opset=opset, shapes={"X": NCHW, "Z": ["n", "c", "h", "w"]})
        feeds[0]["Z"], feeds[1]["Z"] = np.zeros((1, 1, 7, 3), np.float32), np.zeros((1, 1, 2, 9), np.float32)
    elif opset == 10:
        node = helper.make_node("Resize", ["X", "scales"], ["Y"], **attrs)
        model = make_model([node], {"X": feeds[0]["X"]}, ["Y"], opset=10, shapes={"X": NCHW},
                           initializers={"scales": np.array([1, 1, 1.7, 0.6], np.float32)})
    else:
        given = [0.6, 1.7] if "axes" in attrs else [1, 1, 1.7, 0.6]
        kind = dict(scales=given) if how == "scales" else dict(sizes=[1, 2, 7, 3])
        model, _ = resize_model(attrs, roi=roi, opset=opset, sym=NCHW, **kind)
        if how == "sizes":  # N and C: the sizes' 1 and 2 (onnxruntime's linear and cubic resize no others)
            feeds[1]["X"] = _x(1, 2, 3, 6)
    proto = assert_vjp_at_sizes(model, feeds, oracle)
    if how == "shape":  # N and C keep their lengths: no matrix for them
        assert sum(n.op_type == "EyeLike" for n in proto.graph.node) == 2


@pytest.mark.parametrize("opset", [7, 9])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_symbolic_sizes(opset, mode):
    """Upsample-7's gradient over run-time lengths needs EyeLike (opset 9): the model is converted."""
    x = _x(1, 2, 2, 3)
    if opset == 7:
        model = op_model("Upsample", {"X": x}, mode=mode, scales=[1.0, 1.0, 2.0, 1.5], opset=7, shapes={"X": NCHW})
    else:
        model = op_model("Upsample", {"X": x, "scales": np.array([1, 1, 2, 1.5], np.float32)}, mode=mode, opset=9,
                         shapes={"X": NCHW}, initializers={"scales": np.array([1, 1, 2, 1.5], np.float32)})
    if opset == 7:  # onnxruntime does not run Upsample-7: the forward of the converted model is the oracle
        model = onnx.version_converter.convert_version(model, 9)
    # (onnx.reference runs no float64 Upsample: the oracle is onnxruntime's forward Jacobian)
    assert_vjp_at_sizes(model, [{"X": x}, {"X": _x(2, 1, 3, 2)}], "jacobian")


def test_resize_runtime_scales_and_roi():
    """scales and roi graph inputs: every axis gets a matrix built in the graph (none is known to be
    kept); checked at two sizes and two scales."""
    node = helper.make_node("Resize", ["X", "roi", "s"], ["Y"], mode="nearest",
                            coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=3.0)
    model = make_model([node], {"X": _x(1, 2, 4, 5), "roi": np.zeros(8, np.float32), "s": np.ones(4, np.float32)},
                       ["Y"], opset=13, shapes={"X": NCHW})
    roi = np.array([0, 0, 0.15, 0.2, 1, 1, 0.85, 1.13], np.float32)
    assert_vjp_at_sizes(model, [{"X": _x(1, 2, 4, 5), "roi": roi, "s": np.array([1, 1, 1.7, 0.6], np.float32)},
                                {"X": _x(2, 1, 3, 6), "roi": roi, "s": np.array([1, 2, 2, 0.5], np.float32)}],
                        "jacobian")


# Per coordinate transform: scales or sizes, and two input sizes that put no source coordinate
# near a rounding tie (where float32 and float64 may round apart).
MATRIX_CASES = {
    "half_pixel": (dict(scales=[1.6, 0.7]), [(4, 5), (3, 4)]),
    "half_pixel_symmetric": (dict(scales=[1.6, 0.7]), [(4, 4), (5, 7)]),
    "pytorch_half_pixel": (dict(sizes=[6, 4]), [(3, 5), (5, 7)]),
    "align_corners": (dict(sizes=[6, 4]), [(4, 5), (3, 7)]),
    "asymmetric": (dict(scales=[1.7, 0.6]), [(4, 5), (3, 7)]),
    "tf_crop_and_resize": (dict(sizes=[6, 4]), [(2, 5), (3, 7)]),
}


@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("mode", ["nearest", "nearest-ceil", "nearest-floor", "nearest-round_prefer_floor",
                                  "linear", "cubic"])
def test_runtime_matrix_is_resize_matrix(mode, ctm):
    """The matrix computed in the graph (the forward's Resize applied to an identity) equals the
    static path's resize_matrix: 2-D X of symbolic H and W, dX = W_hᵀ·dY·W_w at two sizes."""
    mode, _, nearest = mode.partition("-")
    nearest = nearest or "round_prefer_ceil"
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm, nearest_mode=nearest)
    roi = (0.15, 0.2, 0.85, 1.13) if ctm == "tf_crop_and_resize" else None
    given, sizes_in = MATRIX_CASES[ctm]
    scales, sizes = given.get("scales"), given.get("sizes")
    model, _ = resize_model(attrs, roi=roi, shape=sizes_in[0], sym=["H", "W"], **given)
    proto, autodiff = backward_model(model, "Y", ["X"], seed="input")
    session = _session(proto)
    for h, w in sizes_in:
        outs = [int(np.float32(s) * np.float32(n)) for s, n in zip(scales, (h, w))] if scales else sizes
        ratios = scales or [o / n for o, n in zip(outs, (h, w))]
        W = [resize_matrix(n, o, s, mode, ctm, nearest, roi=(roi[i], roi[2 + i]) if roi else (0.0, 1.0))
             for i, (n, o, s) in enumerate(zip((h, w), outs, ratios))]
        r = R.standard_normal(outs).astype(np.float32)
        feeds = {"X": _x(h, w), autodiff.seed_name: r}
        got = dict(zip([o.name for o in proto.graph.output], session.run(None, feeds)))
        np.testing.assert_allclose(got[autodiff.gradient_names["X"]], W[0].T @ r @ W[1], atol=1e-5)


def test_resize_symbolic_backward_differentiates_again():
    """The run-time matrices depend on shapes only: differentiating the backward graph with respect
    to its seed gives the forward itself (a JVP), v ↦ Resize(v), at two sizes."""
    model, _ = resize_model(dict(mode="linear"), scales=[1, 1, 1.7, 0.6], opset=13, sym=NCHW)
    proto, first = backward_model(model, "Y", ["X"], seed="input")
    twice, second = backward_model(proto, first.gradient_names["X"], [first.seed_name], seed="input")
    session, forward = _session(twice), _session(model)
    for shape in [(1, 2, 4, 5), (2, 1, 3, 6)]:
        x, v = _x(*shape), _x(*shape)
        dy = np.zeros_like(forward.run(None, {"X": x})[0])
        outputs = session.run(None, {"X": x, first.seed_name: dy, second.seed_name: v})
        got = dict(zip([o.name for o in twice.graph.output], outputs))[second.gradient_names[first.seed_name]]
        np.testing.assert_allclose(got, forward.run(None, {"X": v})[0], atol=1e-5)


@pytest.mark.parametrize("policy,mode,ctm,extra", [
    ("not_smaller", "nearest", "half_pixel", {}),  # W rounds 4·1.75 up to 9: one row more than floor
    ("not_larger", "linear", "asymmetric", {}),
    ("not_smaller", "cubic", "half_pixel", {}),
    ("not_larger", "nearest", "align_corners", {}),
    ("not_larger", "cubic", "align_corners", {"exclude_outside": 1}),
    ("not_smaller", "linear", "tf_crop_and_resize", {}),
])
def test_resize_symbolic_keep_aspect_ratio(policy, mode, ctm, extra):
    """One scale for all resized axes, from their run-time lengths: computed in the graph (or, for
    coordinates from the lengths alone, the output's lengths read); one graph at two sizes."""
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm, axes=[2, 3], keep_aspect_ratio_policy=policy, **extra)
    roi = [0.15, 0.2, 0.85, 1.13] if ctm == "tf_crop_and_resize" else None
    model, _ = resize_model(attrs, sizes=[7, 3], roi=roi, sym=NCHW)
    assert_vjp_at_sizes(model, [{"X": _x(1, 2, 4, 5)}, {"X": _x(2, 1, 3, 6)}], "jacobian")


@pytest.mark.parametrize("attrs", [dict(coordinate_transformation_mode="half_pixel_symmetric"),
                                   dict(antialias=1), dict(mode="cubic", exclude_outside=1)])
def test_resize_symbolic_keep_aspect_ratio_refused(attrs):
    """Coordinates that need both the common scale and the output's length (or a filter clipped at
    the input's edge) over run-time lengths: refused with what it needs."""
    attrs = dict(dict(mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_larger"), **attrs)
    model, _ = resize_model(attrs, sizes=[7, 3], sym=["N", "C", "H", 5])
    with pytest.raises(AutodiffError, match="keep_aspect_ratio_policy.*static"):
        backward_model(model, "Y", ["X"])


def test_resize_static_graph_has_no_shape_computation():
    """Static lengths and constant scales keep the numpy matrices: no Shape, EyeLike or Resize."""
    model, _ = resize_model(dict(mode="cubic"), scales=[1, 1, 1.5, 0.8], sym=["N", "C", 4, 5])
    proto, _ = backward_model(model, "Y", ["X"])
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Resize") == 1 and not {"Shape", "EyeLike"} & set(ops)


@pytest.mark.parametrize("opset", [11, 17])
def test_torch_export_dynamic_hw(tmp_path, opset):
    """A TorchScript export with dynamic N, H, W (conv, then nearest and bilinear upsampling by 2):
    `onnx-autodiff grad --wrt x` succeeds and its one graph matches PyTorch autograd at two sizes."""
    torch = _torch()
    from onnx_autodiff.cli import main

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            interpolate = torch.nn.functional.interpolate
            return interpolate(y, scale_factor=2, mode="nearest") * interpolate(
                y, scale_factor=2, mode="bilinear", align_corners=False)

    net = Net()
    source, out = tmp_path / "net.onnx", tmp_path / "grad.onnx"
    torch.onnx.export(net, torch.randn(1, 2, 5, 6), str(source), dynamo=False, opset_version=opset,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}})
    assert main(["grad", str(source), "-o", str(out), "--wrt", "x"]) == 0
    model = onnx.load(out)
    assert_valid_model(model)
    session = _session(model)
    for shape in [(1, 2, 5, 6), (2, 2, 3, 7)]:
        x = torch.randn(shape, requires_grad=True)
        y = net(x)
        dy = torch.randn(y.shape)
        (y * dy).sum().backward()
        outputs = session.run(None, {"x": x.detach().numpy(), "dy": dy.numpy()})
        got = dict(zip([o.name for o in model.graph.output], outputs))
        np.testing.assert_allclose(got["grad_x"], x.grad.numpy(), atol=1e-5, rtol=1e-4)


# Upsample


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample9(mode):
    node = helper.make_node("Upsample", ["X", "scales"], ["Y"], mode=mode)
    x = R.standard_normal((1, 2, 3, 4)).astype(np.float32)
    model = make_model([node], {"X": x}, ["Y"], opset=9,
                       initializers={"scales": np.array([1, 1, 2, 1.5], np.float32)})
    assert_linear_vjp(model, {"X": x}, "X")


def test_upsample7_nearest():
    """onnxruntime no longer runs Upsample-7: the oracle and the backward run on onnx.reference."""
    x = R.standard_normal((1, 1, 2, 3)).astype(np.float32)
    model = op_model("Upsample", {"X": x}, mode="nearest", scales=[1.0, 1.0, 2.0, 3.0], opset=7)
    assert_gradients(model, {"X": x}, ["X"])


# GridSample

def _torch():
    return pytest.importorskip("torch")


def grid_case(mode, padding, align, shape, out, opset):
    x = R.standard_normal(shape).astype(np.float32)
    d = len(shape) - 2
    grid = R.uniform(-1.15, 1.15, (shape[0], *out, d)).astype(np.float32)
    model = op_model("GridSample", {"X": x, "grid": grid}, mode=mode, padding_mode=padding,
                     align_corners=align, opset=opset)
    return model, {"X": x, "grid": grid}


def assert_matches_torch(model, feeds, mode, padding, align):
    torch = _torch()
    y = _session(model).run(None, feeds)[0]
    r = R.standard_normal(y.shape).astype(np.float32)
    gx, gg = ort_vjp(model, feeds, ["X", "grid"], r)
    tx = torch.tensor(feeds["X"], dtype=torch.float64, requires_grad=True)
    tg = torch.tensor(feeds["grid"], dtype=torch.float64, requires_grad=True)
    mode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode)
    ty = torch.nn.functional.grid_sample(tx, tg, mode=mode, padding_mode=padding, align_corners=bool(align))
    (ty * torch.tensor(r, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(gx, tx.grad.numpy(), atol=1e-5)
    np.testing.assert_allclose(gg, tg.grad.numpy(), atol=3e-5, rtol=1e-4)
    if mode != "nearest":
        assert np.abs(gg).max() > 0.1


PADDINGS = ["zeros", "border", "reflection"]


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_4d_torch(mode, padding, align):
    model, feeds = grid_case(mode, padding, align, (2, 2, 4, 5), (3, 2), 16)
    assert_matches_torch(model, feeds, mode, padding, align)


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_5d_torch(mode, padding):
    model, feeds = grid_case(mode, padding, 0, (1, 2, 3, 4, 3), (2, 2, 2), 20)
    assert_matches_torch(model, feeds, mode, padding, 0)


@pytest.mark.parametrize("mode,padding,align", [("bilinear", "zeros", 0), ("bicubic", "border", 1),
                                                ("bilinear", "reflection", 1), ("nearest", "zeros", 0)])
def test_grid_sample_finite_differences(mode, padding, align):
    model, feeds = grid_case(mode, padding, align, (1, 2, 3, 4), (2, 3), 16)
    assert_gradients(model, feeds, ["X", "grid"] if mode != "nearest" else ["X"])


def test_grid_sample_nearest_grid_gets_zeros():
    model, feeds = grid_case("nearest", "zeros", 0, (1, 1, 3, 3), (2, 2), 16)
    y = _session(model).run(None, feeds)[0]
    _, gg = ort_vjp(model, feeds, ["X", "grid"], np.ones_like(y))
    assert gg.shape == feeds["grid"].shape and not gg.any()


def test_grid_sample_symbolic_batch():
    x = R.standard_normal((3, 2, 3, 4)).astype(np.float32)
    grid = R.uniform(-1, 1, (3, 2, 2, 2)).astype(np.float32)
    model = op_model("GridSample", {"X": x, "grid": grid}, opset=16,
                     shapes={"X": ["N", "C", 3, 4], "grid": ["N", "h", "w", 2]})
    assert_matches_torch(model, {"X": x, "grid": grid}, "linear", "zeros", 0)
    assert_matches_torch(model, {"X": x[:1], "grid": grid[:1, :1]}, "linear", "zeros", 0)


@pytest.mark.parametrize("mode,padding,align", [("linear", "reflection", 0), ("cubic", "zeros", 1),
                                                ("nearest", "border", 0), ("linear", "border", 1)])
def test_grid_sample_symbolic_sizes(mode, padding, align):
    """X's spatial lengths symbolic too: one backward graph checked at two sizes (opset 20, whose
    mode names onnx.reference, the float64 oracle, knows)."""
    model, _ = grid_case(mode, padding, align, (1, 2, 3, 4), (2, 3), 20)
    model = make_model(model.graph.node, {"X": _x(1, 2, 3, 4), "grid": _x(1, 2, 3, 2)}, ["out0"], opset=20,
                       shapes={"X": NCHW, "grid": ["N", "h", "w", 2]})
    feeds = [{"X": _x(1, 2, 3, 4), "grid": R.uniform(-1.15, 1.15, (1, 2, 3, 2)).astype(np.float32)},
             {"X": _x(2, 1, 4, 2), "grid": R.uniform(-1.15, 1.15, (2, 3, 1, 2)).astype(np.float32)}]
    assert_vjp_at_sizes(model, feeds, wrt=("X", "grid") if mode != "nearest" else ("X",))


def test_grid_sample_refuses_bicubic_3d():
    model, _ = grid_case("cubic", "zeros", 0, (1, 1, 2, 3, 3), (2, 2, 2), 20)
    with pytest.raises(AutodiffError, match="cubic"):
        backward_model(model, "out0", ["X"])


# AffineGrid


@pytest.mark.parametrize(
    "size,align",
    [([2, 3, 4, 5], 0), ([2, 3, 4, 5], 1), ([2, 3, 1, 4], 0), ([2, 2, 3, 4, 2], 0), ([2, 2, 3, 4, 2], 1)],
)
def test_affine_grid(size, align):
    torch = _torch()
    d = len(size) - 2
    theta = R.standard_normal((2, d, d + 1)).astype(np.float32)
    sz = np.array(size, np.int64)
    model = op_model("AffineGrid", {"theta": theta, "size": sz}, align_corners=align, opset=20,
                     initializers={"size": sz})
    assert_linear_vjp(model, {"theta": theta}, "theta")
    y = _session(model).run(None, {"theta": theta})[0]
    r = R.standard_normal(y.shape).astype(np.float32)
    (g,) = ort_vjp(model, {"theta": theta}, ["theta"], r)
    t = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    ty = torch.nn.functional.affine_grid(t, size, align_corners=bool(align))
    (ty * torch.tensor(r, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(g, t.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_affine_grid_symbolic_batch():
    theta = R.standard_normal((3, 2, 3)).astype(np.float32)
    sz = np.array([3, 1, 3, 2], np.int64)
    model = op_model("AffineGrid", {"theta": theta, "size": sz}, opset=20, initializers={"size": sz},
                     shapes={"theta": ["N", 2, 3]})
    assert_linear_vjp(model, {"theta": theta}, "theta")


@pytest.mark.parametrize("d,align", [(2, 0), (2, 1), (3, 1)])
def test_affine_grid_runtime_size(d, align):
    """size = Shape(X) of a symbolic X (as F.affine_grid(theta, x.size()) exports): the base
    coordinates are built in the graph; one backward graph checked at two sizes."""
    nodes = [helper.make_node("Shape", ["X"], ["size"]),
             helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align)]
    theta = R.standard_normal((2, d, d + 1)).astype(np.float32)
    model = make_model(nodes, {"theta": theta, "X": _x(2, 1, *range(3, 3 + d))}, ["grid"], opset=20,
                       shapes={"theta": ["N", d, d + 1], "X": ["N", "C", *"DHW"[-d:]]})
    feeds = [{"theta": theta, "X": _x(2, 1, *range(3, 3 + d))},
             {"theta": theta[:1], "X": _x(1, 1, *range(4, 2, -1), *[2] * (d - 2))}]
    assert_vjp_at_sizes(model, feeds, wrt=("theta",))


@pytest.mark.parametrize("size,align", [([2, 3, 4, 5], 0), ([2, 2, 3, 4, 2], 1)])
def test_affine_grid_size_fed(size, align):
    """'size' fed at run time (as the backend cases feed it); on symbolic dimensions, where neither
    its length nor theta's shape is known, the grid's rank gives the number of spatial axes."""
    d = len(size) - 2
    feeds = {"theta": R.standard_normal((2, d, d + 1)).astype(np.float32), "size": np.array(size, np.int64)}
    model = op_model("AffineGrid", feeds, align_corners=align, opset=20)
    assert_gradients(model, feeds, ["theta"])


def test_affine_grid_refuses_degenerate():
    theta = R.standard_normal((1, 2, 3)).astype(np.float32)
    sz = np.array([1, 1, 1, 3], np.int64)
    model = op_model("AffineGrid", {"theta": theta, "size": sz}, align_corners=1, opset=20,
                     initializers={"size": sz})
    with pytest.raises(AutodiffError, match="ill-defined"):
        backward_model(model, "out0", ["theta"])


# RoiAlign

ROIS = np.array([[0.3, 0.2, 3.6, 2.9], [1.1, 0.4, 2.2, 3.7], [-0.6, -0.8, 4.9, 4.4]], np.float32)
BATCH = np.array([1, 0, 1], np.int64)


def roi_model(opset, rois_const, **attrs):
    x = R.standard_normal((2, 2, 4, 5)).astype(np.float32)
    inputs = {"X": x, "rois": ROIS, "batch_indices": BATCH}
    inits = {"rois": ROIS, "batch_indices": BATCH} if rois_const else {"batch_indices": BATCH}
    model = op_model("RoiAlign", inputs, opset=opset, initializers=inits, output_height=2,
                     output_width=3, **attrs)
    feeds = {"X": x} if rois_const else {"X": x, "rois": ROIS}
    return model, feeds


@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
@pytest.mark.parametrize("spatial_scale", [1.0, 0.7])
def test_roi_align(ctm, sampling_ratio, spatial_scale):
    model, feeds = roi_model(16, True, coordinate_transformation_mode=ctm,
                             sampling_ratio=sampling_ratio, spatial_scale=spatial_scale)
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize("opset", [11, 16, 20])  # onnxruntime has no RoiAlign-22 kernel
def test_roi_align_runtime_rois(opset):
    model, feeds = roi_model(opset, False, sampling_ratio=2)
    assert_linear_vjp(model, feeds, "X")


@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
def test_roi_align_symbolic_sizes(ctm):
    """X's every dimension and the number of boxes symbolic: one backward graph at two sizes."""
    x = _x(2, 2, 4, 5)
    model = op_model("RoiAlign", {"X": x, "rois": ROIS, "batch_indices": BATCH}, opset=16, output_height=2,
                     output_width=3, sampling_ratio=2, coordinate_transformation_mode=ctm,
                     shapes={"X": NCHW, "rois": ["R", 4], "batch_indices": ["R"]})
    feeds = [{"X": x, "rois": ROIS, "batch_indices": BATCH},
             {"X": _x(1, 1, 6, 3), "rois": (ROIS[:2] * [1.2, 0.5, 1.2, 0.5]).astype(np.float32),
              "batch_indices": BATCH[:2] * 0}]
    assert_vjp_at_sizes(model, feeds)


def test_roi_align_finite_differences():
    model, feeds = roi_model(16, True, sampling_ratio=0)
    assert_gradients(model, feeds, ["X"])


def test_roi_align_refuses():
    model, _ = roi_model(16, False, sampling_ratio=0)
    with pytest.raises(AutodiffError, match="sampling_ratio"):
        backward_model(model, "out0", ["X"])
    model, _ = roi_model(16, True, mode="max", sampling_ratio=2)
    with pytest.raises(AutodiffError, match="max"):
        backward_model(model, "out0", ["X"])
