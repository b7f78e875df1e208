"""Resize/Upsample, GridSample, AffineGrid, RoiAlign.

Three oracles: the float64 finite differences of `assert_gradients`; for the ops linear in the
differentiated input (Resize, Upsample, AffineGrid, RoiAlign avg), the exact Jacobian of the
onnxruntime forward itself, one basis vector at a time (`assert_linear_vjp`), which also covers
the cases where onnx.reference's Resize disagrees with the spec and onnxruntime (align_corners
and tf_crop_and_resize with a non-integer in·scale, several nearest cases); and PyTorch autograd
for GridSample and AffineGrid.
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, op_model, rng
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import AutodiffError

R = rng(7)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def ort_vjp(model, feeds, wrt, r):
    """The backward graph, run on onnxruntime itself (no fallback), with seed r."""
    proto, autodiff = backward_model(model, model.graph.output[0].name, wrt, seed="input")
    names = [o.name for o in proto.graph.output]
    got = dict(zip(names, _session(proto).run(None, {**feeds, autodiff.seed_name: r})))
    return [got[autodiff.gradient_names[x]] for x in wrt]


def assert_linear_vjp(model, feeds, x, seed=0):
    """For y affine in x: the VJP equals rᵀ·J, J read off the onnxruntime forward: f(eᵢ) - f(0)."""
    session = _session(model)
    base = feeds[x]
    offset = session.run(None, {**feeds, x: np.zeros_like(base)})[0].astype(np.float64)
    r = np.random.default_rng(seed).standard_normal(offset.shape).astype(np.float32)
    (ad,) = ort_vjp(model, feeds, [x], r)
    want = np.zeros(base.shape)
    for i in np.ndindex(base.shape):
        e = np.zeros_like(base)
        e[i] = 1
        column = session.run(None, {**feeds, x: e})[0].astype(np.float64) - offset
        want[i] = np.sum(r * column)
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
    if opset < 13 and names[1] == "":
        inits["roi"], names[1] = np.zeros(0, np.float32), "roi"
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


def test_resize_refuses_runtime_scales():
    node = helper.make_node("Resize", ["X", "", "s"], ["Y"], mode="linear")
    x = R.standard_normal((1, 1, 2, 3)).astype(np.float32)
    s = np.array([1, 1, 2, 2], np.float32)
    model = make_model([node], {"X": x, "s": s}, ["Y"], opset=13)
    with pytest.raises(AutodiffError, match="constant"):
        backward_model(model, "Y", ["X"])


def test_resize_refuses_symbolic_resized_axis():
    model, _ = resize_model(dict(mode="linear"), scales=[1, 1, 2.0, 2.0], sym=[1, 2, "H", 5])
    with pytest.raises(AutodiffError, match="static"):
        backward_model(model, "Y", ["X"])


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
