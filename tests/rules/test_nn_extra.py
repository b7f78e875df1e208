"""Dropout, LRN, LpPool, GlobalLpPool, Col2Im and DeformConv gradients.

onnxruntime has no float64 LRN/LpPool/Col2Im/DeformConv kernels and onnx.reference's LRN (loops
over the batch instead of the channels), LpPool (divides by the in-bounds count when windows
touch the padding) and DeformConv (too slow for finite differences) are unusable as oracles, so
those ops are checked against float64 finite differences of a numpy forward written from the
spec; onnxruntime's own forward output is compared with that numpy forward first.
"""

import math

import numpy as np
import onnx
import onnx.utils
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from helpers import assert_valid_model, make_model, op_model, rng
from onnx_autodiff.conformance import check_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import RuleError

R = rng(7)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def away_from_zero(*shape):
    """|x| in [0.2, 1.2]: no kink of |x|^p inside a finite-difference step."""
    return (np.sign(R.standard_normal(shape)) * (0.2 + R.random(shape))).astype(np.float32)


def _ort(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_backward(model, feeds, wrt, dy, reference=False, built=None):
    """Forward output and gradients from the backward graph (``built``: the backward_model made
    already), run on onnxruntime (or reference)."""
    proto, autodiff = built or backward_model(model, "out0", wrt, seed="input")
    full = {**feeds, autodiff.seed_name: dy}
    if reference:
        results = ReferenceEvaluator(proto).run(None, full)
    else:
        results = _ort(proto).run(None, full)
    named = dict(zip([o.name for o in proto.graph.output], results))
    return named, [named[autodiff.gradient_names[x]] for x in wrt]


def check_numpy(model, feeds, wrt, forward, reference=False, h=1e-6, built=None):
    """AD (float32, onnxruntime) against central differences of ``forward`` in float64."""
    wide = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    y = forward(**wide)
    named, grads = run_backward(model, feeds, wrt, np.zeros(y.shape, np.float32), reference, built)
    np.testing.assert_allclose(named["out0"], y, rtol=1e-4, atol=1e-5)  # the spec's forward
    r = rng(1).standard_normal(y.shape)
    _, grads = run_backward(model, feeds, wrt, r.astype(np.float32), reference, built)
    for name, ad in zip(wrt, grads):
        fd = np.zeros(wide[name].shape)
        for i in np.ndindex(fd.shape):
            up, down = wide[name].copy(), wide[name].copy()
            up[i] += h
            down[i] -= h
            fd[i] = np.sum(r * (forward(**{**wide, name: up}) - forward(**{**wide, name: down})))
        fd /= 2 * h
        assert np.any(fd != 0)
        bound = 1e-4 * max(1.0, np.abs(fd).max()) + 1e-3 * np.abs(fd)
        assert np.all(np.abs(ad - fd) <= bound), f"{name}: AD\n{ad}\nFD\n{fd}"


def check(op_type, inputs, wrt=None, initializers=None, **kw):
    """The float64 oracle (onnx.reference where onnxruntime lacks float64), and the backward
    graph runs on onnxruntime."""
    model = op_model(op_type, inputs, initializers=initializers, **kw)
    feeds = {k: v for k, v in inputs.items() if k and k not in (initializers or {})}
    wrt = list(wrt or feeds)
    result = check_vjp(model, feeds, wrt)
    assert result.ok and not result.weak, f"{result}\nAD: {result.ad}\nFD: {result.fd}"
    for name in wrt:
        assert np.any(result.fd[name] != 0)
    y = _ort(model).run(None, feeds)[0]
    run_backward(model, feeds, wrt, np.ones_like(y))


# Dropout

def dropout_inputs(ratio=0.3, training=True, mode_input=False, ratio_input=False):
    inputs = {"X": f32(3, 8), "ratio": np.array(ratio, np.float32),
              "training_mode": np.array(training)}
    init = {}
    if not ratio_input:
        init["ratio"] = inputs["ratio"]
    if not mode_input:
        init["training_mode"] = inputs["training_mode"]
    return inputs, init


@pytest.mark.parametrize("opset", [7, 10])
def test_dropout_old_opsets_identity(opset):
    check("Dropout", {"X": f32(3, 4)}, ratio=0.4, opset=opset)


@pytest.mark.parametrize("n_outputs", [1, 2])
def test_dropout_inference_identity(n_outputs):
    check("Dropout", {"X": f32(3, 4)}, n_outputs=n_outputs, opset=13)
    inputs, init = dropout_inputs(training=False)
    check("Dropout", inputs, ["X"], initializers=init, n_outputs=n_outputs, seed=1, opset=13)


def test_dropout_ratio_zero_identity():
    inputs, init = dropout_inputs(ratio=0.0)
    check("Dropout", inputs, ["X"], initializers=init, seed=1, opset=13)


def test_dropout_opset6_is_test():
    # No runtime runs opset-6 Dropout: the backward graph must just pass dY through.
    model = typed_like_x(op_model("Dropout", {"X": f32(2, 3)}, n_outputs=2, is_test=1, opset=6))
    proto, _ = backward_model(model, "out0", ["X"], seed="input")
    assert [n.op_type for n in proto.graph.node if n.op_type != "Identity"] == ["Dropout"]


def typed_like_x(model):
    """Outputs typed like X (onnx shape inference leaves opset-6 Dropout's outputs untyped)."""
    for out in model.graph.output:
        out.type.CopyFrom(model.graph.input[0].type)
    return model


def _training_case(inputs, init, shapes=None, opset=13):
    model = op_model("Dropout", inputs, initializers=init, n_outputs=2, seed=5, opset=opset,
                     shapes=shapes)
    feeds = {k: v for k, v in inputs.items() if k not in init}
    return model, feeds


@pytest.mark.parametrize("opset", [12, 13, 22])
@pytest.mark.parametrize("ratio_input", [False, True])
def test_dropout_training(opset, ratio_input):
    inputs, init = dropout_inputs(ratio=0.3, ratio_input=ratio_input)
    model, feeds = _training_case(inputs, init, opset=opset)
    dy = f32(3, 8)
    named, (grad,) = run_backward(model, feeds, ["X"], dy)
    y, mask = named["out0"], named["out1"]
    assert mask.any() and not mask.all()
    np.testing.assert_allclose(y, inputs["X"] * mask / 0.7, rtol=1e-6)  # the mask's meaning
    np.testing.assert_allclose(grad, dy * mask / 0.7, rtol=1e-6)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_training_mode_input(training):
    inputs, init = dropout_inputs(ratio=0.5, training=training, mode_input=True)
    model, feeds = _training_case(inputs, init, shapes={"X": ["N", 8]})
    dy = f32(3, 8)
    named, (grad,) = run_backward(model, feeds, ["X"], dy)
    mask = named["out1"]
    scale = 2.0 if training else 1.0
    assert mask.any() and (mask.all() != training)
    np.testing.assert_allclose(named["out0"], inputs["X"] * mask * scale, rtol=1e-6)
    np.testing.assert_allclose(grad, dy * mask * scale, rtol=1e-6)


def test_dropout_opset6_training_uses_mask():
    model = typed_like_x(op_model("Dropout", {"X": f32(2, 3)}, n_outputs=2, ratio=0.25, opset=6))
    proto, _ = backward_model(model, "out0", ["X"], seed="input")
    assert "out1" in {i for n in proto.graph.node if n.op_type == "Mul" for i in n.input}


def test_dropout_training_without_mask_refused():
    """Before opset 12 the rule cannot give the node a mask output: it refuses."""
    model = typed_like_x(op_model("Dropout", {"X": f32(2, 3)}, opset=6))
    with pytest.raises(RuleError, match="mask output"):
        backward_model(model, "out0", ["X"], seed="input")


@pytest.mark.parametrize("opset", [13, 22])
def test_dropout_training_without_mask_gets_one(opset):
    """The exporter's training Dropout has one output: the engine gives it its mask output."""
    inputs, init = dropout_inputs(ratio=0.3)
    model = op_model("Dropout", inputs, initializers=init, seed=5, opset=opset)
    feeds = {k: v for k, v in inputs.items() if k not in init}
    dy = f32(3, 8)
    named, (grad,) = run_backward(model, feeds, ["X"], dy)
    kept = named["out0"] != 0  # X has no zeros: the output says which elements were kept
    assert kept.any() and not kept.all()
    np.testing.assert_allclose(grad, dy * kept / 0.7, rtol=1e-6)


# LRN

def lrn_np(X, size, alpha=1e-4, beta=0.75, bias=1.0):
    sq = np.pad(X * X, [(0, 0), ((size - 1) // 2, size // 2)] + [(0, 0)] * (X.ndim - 2))
    window = sum(sq[:, j:j + X.shape[1]] for j in range(size))
    return X / (bias + alpha / size * window) ** beta


LRN_CASES = [
    ((2, 5, 3, 2), dict(size=3)),
    ((1, 6, 2, 3), dict(size=5, alpha=0.5, beta=0.6, bias=2.0)),
    ((2, 4, 3, 3), dict(size=1, alpha=0.3, beta=1.2, bias=0.5)),
    ((1, 3, 2, 2), dict(size=7, alpha=2.0, beta=0.9, bias=1.5)),
]


@pytest.mark.parametrize("opset", [12, 13])  # LRN-1 and LRN-13
@pytest.mark.parametrize("shape,attrs", LRN_CASES)
def test_lrn(shape, attrs, opset):
    x = f32(*shape)
    model = op_model("LRN", {"X": x}, opset=opset, **attrs)
    check_numpy(model, {"X": x}, ["X"], lambda X: lrn_np(X, **attrs))


def test_lrn_even_size():
    # onnxruntime runs odd sizes only: the even window [c, c + 1] is checked on onnx.reference.
    x = f32(4, 4, 2, 2)  # the reference kernel is only right when N == C
    model = op_model("LRN", {"X": x}, size=2, alpha=0.8, beta=0.7)
    check_numpy(model, {"X": x}, ["X"], lambda X: lrn_np(X, 2, 0.8, 0.7), reference=True)


def test_lrn_symbolic_batch():
    x = f32(3, 4, 2, 3)
    model = op_model("LRN", {"X": x}, size=3, alpha=0.5, shapes={"X": ["N", 4, "H", "W"]})
    check_numpy(model, {"X": x}, ["X"], lambda X: lrn_np(X, 3, 0.5))


# LpPool, GlobalLpPool

def lp_pool_np(X, kernel_shape, p=2, strides=None, pads=None, dilations=None, ceil_mode=0,
               auto_pad="NOTSET"):
    ns = X.ndim - 2
    strides, dilations = strides or [1] * ns, dilations or [1] * ns
    pads = pads or [0] * (2 * ns)
    spatial = X.shape[2:]
    if auto_pad.startswith("SAME"):
        totals = [max(0, (math.ceil(s / st) - 1) * st + d * (k - 1) + 1 - s)
                  for s, st, d, k in zip(spatial, strides, dilations, kernel_shape)]
        small, big = [t // 2 for t in totals], [t - t // 2 for t in totals]
        pads = small + big if auto_pad == "SAME_UPPER" else big + small
    rounding = math.ceil if ceil_mode else math.floor
    out = []
    for i, (s, k, st, d) in enumerate(zip(spatial, kernel_shape, strides, dilations)):
        n = rounding((s + pads[i] + pads[ns + i] - d * (k - 1) - 1) / st) + 1
        out.append(n - 1 if ceil_mode and (n - 1) * st >= s + pads[i] else n)
    extra = [max(0, (o - 1) * st + d * (k - 1) + 1 - s - b - e) for o, st, d, k, s, b, e in
             zip(out, strides, dilations, kernel_shape, spatial, pads, pads[ns:])]
    widths = [(b, e + x) for b, e, x in zip(pads, pads[ns:], extra)]
    xp = np.pad(np.abs(X) ** p, [(0, 0)] * 2 + widths)
    y = np.zeros(X.shape[:2] + tuple(out))
    for o in np.ndindex(*out):
        for k in np.ndindex(*kernel_shape):
            y[(..., *o)] += xp[(..., *(oi * st + ki * d for oi, st, ki, d in
                                       zip(o, strides, k, dilations)))]
    return y ** (1.0 / p)


LP_POOL_CASES = {
    # name: (X shape, attributes, opset)
    "1d_p2": ((2, 2, 7), dict(kernel_shape=[3], strides=[2]), 11),
    "2d_p1": ((1, 2, 4, 4), dict(kernel_shape=[2, 2], p=1), 11),
    "2d_p3_pads": ((1, 2, 4, 5), dict(kernel_shape=[3, 2], p=3, pads=[1, 0, 2, 1]), 11),
    "2d_lppool2": ((1, 2, 4, 5), dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 1, 0, 0]), 10),
    "2d_same_upper": ((1, 2, 5, 5), dict(kernel_shape=[2, 3], strides=[2, 2], p=3,
                                         auto_pad="SAME_UPPER"), 11),
    "2d_same_lower": ((1, 2, 5, 5), dict(kernel_shape=[2, 3], strides=[2, 2],
                                         auto_pad="SAME_LOWER"), 18),
    "2d_valid": ((1, 1, 5, 5), dict(kernel_shape=[2, 2], strides=[2, 1], auto_pad="VALID"), 18),
    "2d_dilations": ((1, 1, 6, 5), dict(kernel_shape=[2, 2], dilations=[2, 1],
                                        pads=[1, 0, 0, 1], p=3), 18),
    "2d_ceil": ((1, 2, 6, 7), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), 18),
    "2d_ceil_dil_pads": ((1, 1, 5, 6), dict(kernel_shape=[2, 3], strides=[2, 2],
                                            dilations=[2, 1], pads=[1, 1, 0, 1], ceil_mode=1), 18),
    "3d": ((1, 1, 3, 4, 4), dict(kernel_shape=[2, 2, 2], strides=[1, 2, 2], p=1), 18),
}


@pytest.mark.parametrize("case", list(LP_POOL_CASES))
def test_lp_pool(case):
    shape, attrs, opset = LP_POOL_CASES[case]
    x = away_from_zero(*shape)
    model = op_model("LpPool", {"X": x}, opset=opset, **attrs)
    check_numpy(model, {"X": x}, ["X"], lambda X: lp_pool_np(X, **attrs))


@pytest.mark.parametrize("op_type", ["LpPool", "GlobalLpPool", "LRN"])
def test_before_opset7_refused(op_type):
    attrs = {"LpPool": dict(kernel_shape=[2, 2], p=3.0), "GlobalLpPool": dict(p=2.5),
             "LRN": dict(size=3)}[op_type]
    model = op_model(op_type, {"X": away_from_zero(1, 2, 4, 4)}, opset=1, **attrs)
    with pytest.raises(RuleError, match="needs opset 7"):
        backward_model(model, "out0", ["X"], seed="input", upgrade_opset=False)


def test_lp_pool_symbolic_batch():
    shape, attrs, _ = LP_POOL_CASES["2d_ceil_dil_pads"]
    x = away_from_zero(3, 2, *shape[2:])
    model = op_model("LpPool", {"X": x}, shapes={"X": ["N", "C", *shape[2:]]}, p=3, **attrs)
    check_numpy(model, {"X": x}, ["X"], lambda X: lp_pool_np(X, p=3, **attrs))


@pytest.mark.parametrize("op_type,case", [("LpPool", "2d_same_upper"), ("LpPool", "2d_ceil_dil_pads"),
                                          ("GlobalLpPool", "2d_p3_pads")])
def test_lp_pool_run_time_sizes(op_type, case):
    """X's spatial sizes known only at run time: one backward graph, valid, at two sizes."""
    shape, attrs, opset = LP_POOL_CASES[case]
    if op_type == "GlobalLpPool":
        attrs = {"p": attrs["p"]}
        forward = lambda X: (np.abs(X) ** attrs["p"]).sum(axis=(2, 3), keepdims=True) ** (1 / attrs["p"])  # noqa: E731
    else:
        forward = lambda X: lp_pool_np(X, **attrs)  # noqa: E731
    model = op_model(op_type, {"X": away_from_zero(*shape)}, shapes={"X": ["N", "C", "H", "W"]},
                     opset=opset, **attrs)
    built = backward_model(model, "out0", ["X"], seed="input")
    assert_valid_model(built[0])
    for size in (shape, (2, 1, shape[2] + 1, shape[3] - 1)):
        check_numpy(model, {"X": away_from_zero(*size)}, ["X"], forward, built=built)


@pytest.mark.parametrize("p,opset", [(1, 8), (1, 10), (2, 10), (3, 8), (3, 18)])
@pytest.mark.parametrize("shape,sym", [((2, 3, 4), None), ((1, 2, 3, 2), None),
                                       ((3, 2, 2, 3), ["N", 2, "H", "W"])])
def test_global_lp_pool(p, opset, shape, sym):
    x = away_from_zero(*shape)
    model = op_model("GlobalLpPool", {"X": x}, p=p, opset=opset, shapes={"X": sym} if sym else None)
    axes = tuple(range(2, x.ndim))
    forward = lambda X: (np.abs(X) ** p).sum(axis=axes, keepdims=True) ** (1.0 / p)  # noqa: E731
    check_numpy(model, {"X": x}, ["X"], forward)


# Col2Im

COL2IM_CASES = {
    # name: (image, block, attributes, channels)
    "2d": ([3, 4], [2, 2], {}, 2),
    "2d_strides_pads": ([4, 4], [3, 2], dict(strides=[2, 1], pads=[1, 0, 1, 1]), 1),
    "2d_dilations": ([5, 4], [2, 2], dict(dilations=[2, 1], strides=[1, 2]), 2),
    "1d": ([7], [3], dict(strides=[2], pads=[1, 1]), 2),
    "3d": ([3, 3, 4], [2, 2, 2], dict(strides=[1, 1, 2]), 1),
}


def col2im_case(case, batch=1):
    image, block, attrs, channels = COL2IM_CASES[case]
    ns = len(image)
    strides, dil = attrs.get("strides", [1] * ns), attrs.get("dilations", [1] * ns)
    pads = attrs.get("pads", [0] * 2 * ns)
    blocks = [(i + b + e - d * (k - 1) - 1) // s + 1
              for i, b, e, d, k, s in zip(image, pads, pads[ns:], dil, block, strides)]
    inputs = {"input": f32(batch, channels * int(np.prod(block)), int(np.prod(blocks))),
              "image_shape": np.array(image, np.int64), "block_shape": np.array(block, np.int64)}
    init = {k: inputs[k] for k in ("image_shape", "block_shape")}
    return inputs, init, attrs


@pytest.mark.parametrize("case", list(COL2IM_CASES))
def test_col2im(case):
    inputs, init, attrs = col2im_case(case)
    if len(inputs["image_shape"]) == 2:
        check("Col2Im", inputs, ["input"], initializers=init, **attrs)
        return
    # onnxruntime runs 2-D Col2Im only: the oracle and the forward use onnx.reference, and
    # onnxruntime runs the backward part of the graph alone.
    model = op_model("Col2Im", inputs, initializers=init, **attrs)
    feeds = {"input": inputs["input"]}
    result = check_vjp(model, feeds, ["input"])
    assert result.ok and not result.weak, str(result)
    proto, autodiff = backward_model(model, "out0", ["input"], seed="input")
    grad = autodiff.gradient_names["input"]
    backward = onnx.utils.Extractor(proto).extract_model(["input", autodiff.seed_name], [grad])
    assert all(n.op_type != "Col2Im" for n in backward.graph.node)
    dy = rng(2).standard_normal(ReferenceEvaluator(model).run(None, feeds)[0].shape)
    (ad,) = _ort(backward).run(None, {**feeds, autodiff.seed_name: dy.astype(np.float32)})
    (ref,) = ReferenceEvaluator(proto).run([grad], {**feeds, autodiff.seed_name: dy})
    np.testing.assert_allclose(ad, ref, rtol=1e-5, atol=1e-6)


def test_col2im_symbolic_batch():
    inputs, init, attrs = col2im_case("2d_strides_pads", batch=2)
    check("Col2Im", inputs, ["input"], initializers=init,
          shapes={"input": ["N", *inputs["input"].shape[1:]]}, **attrs)


def test_col2im_block_shape_input_refused():
    inputs, init, _ = col2im_case("2d")
    model = op_model("Col2Im", inputs, initializers={"image_shape": init["image_shape"]})
    with pytest.raises(RuleError, match="constant block_shape"):
        backward_model(model, "out0", ["input"], seed="input")


# DeformConv

def deform_conv_np(X, W, offset, B=None, mask=None, strides=(1, 1), pads=(0, 0, 0, 0),
                   dilations=(1, 1), group=1, offset_group=1):
    n, c, h, w = X.shape
    m, _, kh, kw = W.shape
    oh, ow = offset.shape[2:]
    G = offset_group
    off = offset.reshape(n, G, kh, kw, 2, oh, ow)
    py = (np.arange(kh) * dilations[0])[:, None, None, None] + \
        (np.arange(oh) * strides[0] - pads[0])[None, None, :, None] + off[:, :, :, :, 0]
    px = (np.arange(kw) * dilations[1])[None, :, None, None] + \
        (np.arange(ow) * strides[1] - pads[1])[None, None, None, :] + off[:, :, :, :, 1]
    planes = X.reshape(n, G, c // G, h, w)
    ni = np.arange(n)[:, None, None, None, None, None]
    gi = np.arange(G)[None, :, None, None, None, None]
    y0, x0 = np.floor(py), np.floor(px)
    sampled = 0
    for yc, wy in ((y0, y0 + 1 - py), (y0 + 1, py - y0)):
        for xc, wx in ((x0, x0 + 1 - px), (x0 + 1, px - x0)):
            inside = (yc >= 0) & (yc <= h - 1) & (xc >= 0) & (xc <= w - 1)
            # (N, G, kh, kw, oh, ow, C/G): the sliced channel axis goes last
            vals = planes[ni, gi, :, np.clip(yc, 0, h - 1).astype(int),
                          np.clip(xc, 0, w - 1).astype(int)]
            sampled = sampled + (wy * wx * inside)[..., None] * vals
    if mask is not None:
        sampled = sampled * mask.reshape(n, G, kh, kw, oh, ow)[..., None]
    cols = sampled.transpose(0, 1, 6, 2, 3, 4, 5).reshape(n, group, c // group, kh, kw, oh, ow)
    y = np.einsum("ngcijab,gmcij->ngmab", cols, W.reshape(group, m // group, c // group, kh, kw))
    y = y.reshape(n, m, oh, ow)
    return y if B is None else y + B[None, :, None, None]


DEFORM_CASES = {
    # name: (X shape, W shape, attributes, offset scale)
    "basic": ((1, 2, 4, 4), (2, 2, 2, 2), {}, 0.7),
    "groups": ((1, 4, 4, 3), (4, 2, 2, 2), dict(group=2, offset_group=2), 0.7),
    "offset_groups": ((1, 2, 3, 4), (2, 2, 2, 2), dict(offset_group=2, pads=[1, 0, 0, 1]), 0.7),
    "strides_dil_pads": ((1, 2, 5, 5), (2, 1, 2, 2), dict(group=2, strides=[2, 1],
                         dilations=[1, 2], pads=[1, 1, 0, 1]), 0.7),
    "far_out": ((1, 1, 4, 4), (2, 1, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), 2.5),
    "batch": ((2, 2, 3, 3), (2, 2, 2, 2), dict(kernel_shape=[2, 2]), 0.7),
}


def deform_inputs(case, bias=True, mask=True, sizes=None):
    """The case's inputs, or with ``sizes`` (X shape, W shape) its attributes at other sizes."""
    x_shape, w_shape, attrs, scale = DEFORM_CASES[case]
    x_shape, w_shape = sizes or (x_shape, w_shape)
    kh, kw = w_shape[2:]
    pads, st = attrs.get("pads", [0] * 4), attrs.get("strides", [1, 1])
    dil = attrs.get("dilations", [1, 1])
    out = [(x_shape[2 + i] + pads[i] + pads[2 + i] - dil[i] * (k - 1) - 1) // st[i] + 1
           for i, k in enumerate((kh, kw))]
    G = attrs.get("offset_group", 1)
    # Offsets away from integers: bilinear sampling has kinks at whole pixel positions.
    offset = R.integers(-3, 4, (x_shape[0], G * kh * kw * 2, *out)) * scale / 3
    offset += R.uniform(0.15, 0.85, offset.shape) * np.sign(offset + 0.01)
    offset = offset.astype(np.float32)
    inputs = {"X": f32(*x_shape), "W": f32(*w_shape), "offset": offset}
    if bias:
        inputs["B"] = f32(w_shape[0])
    elif mask:
        inputs[""] = None  # B omitted, mask given
    if mask:
        inputs["mask"] = R.uniform(0.2, 1.2, (x_shape[0], G * kh * kw, *out)).astype(np.float32)
    return inputs, attrs


def deform_check(inputs, attrs, shapes=None):
    feeds = {k: v for k, v in inputs.items() if k}
    model = op_model("DeformConv", inputs, opset=19, shapes=shapes, **attrs)
    np_attrs = {k: v for k, v in attrs.items() if k != "kernel_shape"}
    check_numpy(model, feeds, list(feeds), lambda **kw: deform_conv_np(**kw, **np_attrs))


@pytest.mark.parametrize("case", list(DEFORM_CASES))
def test_deform_conv(case):
    deform_check(*deform_inputs(case))


@pytest.mark.parametrize("bias,mask", [(False, True), (True, False), (False, False)])
def test_deform_conv_optional_inputs(bias, mask):
    deform_check(*deform_inputs("offset_groups", bias, mask))


def test_deform_conv_symbolic_batch():
    inputs, attrs = deform_inputs("batch")
    sym = {k: ["N", *v.shape[1:]] for k, v in inputs.items() if k in ("X", "offset", "mask")}
    deform_check(inputs, attrs, shapes=sym)


@pytest.mark.parametrize("case,sizes", [("strides_dil_pads", ((2, 2, 4, 6), (2, 1, 3, 1))),
                                        ("offset_groups", ((1, 2, 4, 3), (4, 2, 1, 2)))])
def test_deform_conv_run_time_sizes(case, sizes):
    """Every extent known only at run time (image, kernel, output): one backward graph, valid, at
    two sizes."""
    inputs, attrs = deform_inputs(case)
    feeds = {k: v for k, v in inputs.items() if k}
    symbolic = {k: [f"{k}{i}" for i in range(v.ndim)] for k, v in feeds.items()}
    node = onnx.helper.make_node("DeformConv", list(feeds), ["out0"], **attrs)
    # (onnx's inference leaves Y without a rank when it does not know the kernel's size)
    model = make_model([node], feeds, ["out0"], shapes=symbolic, opset=19,
                       output_shapes={"out0": ["N", "M", "OH", "OW"]})
    built = backward_model(model, "out0", list(feeds), seed="input")
    assert_valid_model(built[0])
    for given in (feeds, deform_inputs(case, sizes=sizes)[0]):
        check_numpy(model, given, list(given), lambda **kw: deform_conv_np(**kw, **attrs), built=built)


def test_deform_conv_numpy_forward_matches_reference():
    inputs, attrs = deform_inputs("strides_dil_pads")
    wide = {k: v.astype(np.float64) for k, v in inputs.items()}
    model = op_model("DeformConv", wide, opset=19, **attrs)
    (expected,) = ReferenceEvaluator(model).run(None, wide)
    # The reference kernel rounds to about float32 precision inside.
    np.testing.assert_allclose(deform_conv_np(**wide, **attrs), expected, rtol=1e-6, atol=1e-6)


def test_deform_conv_1d_refused():
    x, w, offset = f32(1, 2, 5), f32(2, 2, 2), f32(1, 4, 4)
    model = op_model("DeformConv", {"X": x, "W": w, "offset": offset}, opset=19)
    with pytest.raises(RuleError, match="2-D images"):
        backward_model(model, "out0", ["X"], seed="input")
