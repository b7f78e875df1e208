import math

import numpy as np
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, op_model, rng
from onnx_autodiff.conformance.check import backward_model

R = rng()
BROADCAST_SHAPES = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((4,), (2, 3, 4)), ((2, 1, 4), (3, 1))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shape_a,shape_b", BROADCAST_SHAPES)
def test_binary_broadcast(op, shape_a, shape_b):
    a = R.standard_normal(shape_a).astype(np.float32)
    b = R.uniform(0.5, 2.0, shape_b).astype(np.float32)
    model = op_model(op, {"A": a, "B": b})
    assert_gradients(model, {"A": a, "B": b}, ["A", "B"])


@pytest.mark.parametrize("op", ["Add", "Mul", "Div"])
def test_binary_symbolic_batch(op):
    a = R.standard_normal((5, 3, 4)).astype(np.float32)
    b = R.uniform(0.5, 2.0, (1, 3, 1)).astype(np.float32)
    model = op_model(op, {"A": a, "B": b}, shapes={"A": ["N", 3, 4], "B": [1, 3, 1]})
    assert_gradients(model, {"A": a, "B": b}, ["A", "B"])


def test_same_input_twice():
    x = R.standard_normal((3, 2)).astype(np.float32)
    model = make_model([helper.make_node("Mul", ["X", "X"], ["Y"])], {"X": x}, ["Y"])
    assert_gradients(model, {"X": x}, ["X"])


POSITIVE = {"Log", "Sqrt", "Reciprocal"}


@pytest.mark.parametrize(
    "op,input_name",
    [("Neg", "X"), ("Identity", "input"), ("Relu", "X"), ("Sigmoid", "X"), ("Tanh", "input"),
     ("Exp", "input"), ("Log", "input"), ("Sqrt", "X"), ("Reciprocal", "X")],
)
def test_unary(op, input_name):
    x = R.standard_normal((3, 5)).astype(np.float32)
    if op in POSITIVE:
        x = np.abs(x) + 0.5
    if op == "Relu":
        x = np.where(np.abs(x) < 0.05, 0.3, x).astype(np.float32)
    model = op_model(op, {input_name: x})
    assert_gradients(model, {input_name: x}, [input_name])


@pytest.mark.parametrize("to", [1, 11])
def test_cast_float_types(to):
    x = R.standard_normal((4,)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=to), helper.make_node("Mul", ["c", "c"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"])
    assert_gradients(model, {"x": x}, ["x"])


def away_from(x, points, gap=0.05):
    """x nudged so no element lies within ``gap`` of a kink."""
    x = x.copy()
    for p in points:
        x = np.where(np.abs(x - p) < gap, p + 2 * gap, x)
    return x.astype(np.float32)


UNARY_DOMAINS = {
    "Abs": ("X", lambda x: away_from(x, [0.0])),
    "Sin": ("input", lambda x: x),
    "Cos": ("input", lambda x: x),
    "Tan": ("input", lambda x: np.clip(x, -1.2, 1.2)),
    "Asin": ("input", lambda x: np.tanh(x) * 0.9),
    "Acos": ("input", lambda x: np.tanh(x) * 0.9),
    "Atan": ("input", lambda x: x),
    "Sinh": ("input", lambda x: x),
    "Cosh": ("input", lambda x: x),
    "Asinh": ("input", lambda x: x),
    "Acosh": ("input", lambda x: np.abs(x) + 1.2),
    "Atanh": ("input", lambda x: np.tanh(x) * 0.9),
    "Erf": ("input", lambda x: x),
}


@pytest.mark.parametrize("op", sorted(UNARY_DOMAINS))
def test_unary_smooth(op):
    name, domain = UNARY_DOMAINS[op]
    x = domain(R.standard_normal((3, 5))).astype(np.float32)
    model = op_model(op, {name: x}, opset=13 if op in ("Abs", "Erf") else 22)
    assert_gradients(model, {name: x}, [name])


def assert_matches_numpy(model, feeds, name, fn, h=1e-6):
    """AD (onnxruntime, float32) against central differences of a float64 numpy ``fn``.

    An independent second check for the Erf family (onnx.reference's own Erf computes in float32,
    which the oracle has to patch).
    """
    from onnx_autodiff.conformance.check import ad_vjp, compare

    x = feeds[name].astype(np.float64)
    r = np.random.default_rng(0).standard_normal(x.shape)
    ad = ad_vjp(model, feeds, [name], [r.astype(np.float32)])[name]
    fd = np.empty_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += h
        down[i] -= h
        fd[i] = np.sum(r * (fn(up) - fn(down))) / (2 * h)
    assert compare(ad, fd, 1e-4, 1e-3) <= 1.0, (ad, fd)


erf64 = np.vectorize(math.erf)


def test_erf():
    x = R.standard_normal((3, 5)).astype(np.float32)
    assert_matches_numpy(op_model("Erf", {"input": x}, opset=13), {"input": x}, "input", erf64)


@pytest.mark.parametrize("op,name", [("Sign", "input"), ("Floor", "X"), ("Ceil", "X"), ("Round", "X")])
def test_zero_gradient(op, name):
    # Mul(x, op(x)): the chain reaches Sign & co. and must carry on (zeros), giving d/dx = op(x).
    x = away_from(R.standard_normal((3, 4)) * 3, np.arange(-10, 11) * 0.5, gap=0.05)
    nodes = [helper.make_node(op, ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    assert_gradients(make_model(nodes, {"x": x}, ["y"]), {"x": x}, ["x"])


@pytest.mark.parametrize("shape_x,shape_e", BROADCAST_SHAPES)
def test_pow_both_inputs(shape_x, shape_e):
    x = R.uniform(0.5, 2.0, shape_x).astype(np.float32)
    e = R.uniform(-1.5, 2.5, shape_e).astype(np.float32)
    model = op_model("Pow", {"X": x, "Y": e})
    assert_gradients(model, {"X": x, "Y": e}, ["X", "Y"])


@pytest.mark.parametrize("opset", [7, 13])
def test_pow_negative_base_integer_exponent(opset):
    x = away_from(R.standard_normal((3, 4)), [0.0])
    e = np.array([2.0, 3.0, 1.0, 0.0], np.float32)
    model = op_model("Pow", {"X": x, "Y": e}, opset=opset)
    assert_gradients(model, {"X": x, "Y": e}, ["X"])


def test_pow_zero_base_is_finite():
    """d/dX at X = 0: E·X^(E-1) is 0 for E > 1, 1 for E = 1, and 0 (not NaN) for E = 0."""
    from onnx_autodiff.conformance.check import ad_vjp

    x = np.zeros((4,), np.float32)
    e = np.array([2.0, 1.0, 0.0, 3.0], np.float32)
    model = op_model("Pow", {"X": x, "Y": e})
    r = np.ones(4, np.float32)
    grad = ad_vjp(model, {"X": x, "Y": e}, ["X"], [r])["X"]
    np.testing.assert_array_equal(grad, [0.0, 1.0, 0.0, 0.0])


def test_pow_integer_exponent():
    x = R.uniform(0.5, 2.0, (3, 4)).astype(np.float32)
    e = np.array(3, np.int64)
    model = op_model("Pow", {"X": x, "Y": e}, opset=15)
    assert_gradients(model, {"X": x, "Y": e}, ["X"])


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("shape_a,shape_b", BROADCAST_SHAPES[:3])
def test_mod(fmod, shape_a, shape_b):
    # |A/B| in (1.2, 1.9): away from the integers where Mod jumps, and n != 0 so dB is not vacuous
    a = (R.uniform(1.2, 1.7, shape_a) * R.choice([-1, 1], shape_a)).astype(np.float32)
    b = (R.uniform(0.9, 1.0, shape_b) * R.choice([-1, 1], shape_b)).astype(np.float32)
    # onnxruntime runs float Mod with fmod=0 (floor semantics) only from opset 28.
    model = op_model("Mod", {"A": a, "B": b}, fmod=fmod, opset=28 if fmod == 0 else 13)
    assert_gradients(model, {"A": a, "B": b}, ["A", "B"])


VARIADIC_SHAPES = [[(3, 4)], [(2, 3, 4), (4,)], [(3, 1), (2, 1, 4), (4,)]]


def distinct(shapes, seed):
    """Inputs whose broadcast values are all distinct (no ties) and spread apart."""
    g = np.random.default_rng(seed)
    total = sum(int(np.prod(s)) for s in shapes)
    values = g.permutation(total).astype(np.float32) * 0.25 - total * 0.125
    out, start = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(values[start:start + n].reshape(s))
        start += n
    return out


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("in_shapes", VARIADIC_SHAPES)
def test_variadic(op, in_shapes):
    if op == "Mean" and len(in_shapes) == 3:
        # the oracle's float64 Mean (onnx.reference) adds in place into the first input
        in_shapes = [(2, 3, 4), (3, 1), (4,)]
    arrays = distinct(in_shapes, len(in_shapes))
    feeds = {f"x{i}": a for i, a in enumerate(arrays)}
    node = helper.make_node(op, list(feeds), ["y"])
    assert_gradients(make_model([node], feeds, ["y"]), feeds, list(feeds))


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_ties_go_to_first(op):
    from onnx_autodiff.conformance.check import ad_vjp

    a = np.array([1.0, 2.0, 3.0], np.float32)
    feeds = {"a": a, "b": a.copy(), "c": np.array([1.0, 0.0, 5.0], np.float32)}
    model = make_model([helper.make_node(op, list(feeds), ["y"])], feeds, ["y"])
    r = np.array([1.0, 2.0, 3.0], np.float32)
    grads = ad_vjp(model, feeds, list(feeds), [r])
    total = grads["a"] + grads["b"] + grads["c"]
    np.testing.assert_array_equal(total, r)
    np.testing.assert_array_equal(grads["b"], 0.0)
    expect_a = [1.0, 2.0, 0.0] if op == "Max" else [1.0, 0.0, 3.0]
    np.testing.assert_array_equal(grads["a"], expect_a)


def test_max_opset8_without_where():
    a, b = distinct([(2, 3), (3,)], 1)
    feeds = {"a": a, "b": b}
    model = make_model([helper.make_node("Max", ["a", "b"], ["y"])], feeds, ["y"], opset=8)
    assert_gradients(model, feeds, ["a", "b"])


def clip_input(shape=(3, 5), lo=-0.5, hi=0.6):
    x = R.uniform(-1.5, 1.5, shape)
    return away_from(x, [lo, hi]).astype(np.float32)


@pytest.mark.parametrize("which", ["both", "min", "max"])
def test_clip_inputs(which):
    x = clip_input()
    lo, hi = np.array(-0.5, np.float32), np.array(0.6, np.float32)
    inputs = {"input": x, "min": lo, "max": hi}
    if which == "min":
        inputs = {"input": x, "min": lo}
    if which == "max":
        inputs = {"input": x, "": None, "max": hi}
    feeds = {k: v for k, v in inputs.items() if k}
    model = op_model("Clip", inputs, opset=13)
    assert_gradients(model, feeds, list(feeds))


def test_clip_min_above_max():
    x = clip_input(lo=0.6, hi=-0.5)
    feeds = {"input": x, "min": np.array(0.6, np.float32), "max": np.array(-0.5, np.float32)}
    result = assert_gradients(op_model("Clip", feeds, opset=11), feeds, list(feeds))
    assert np.all(result.ad["input"] == 0) and result.ad["min"] == 0


def test_clip_symbolic_batch():
    x = clip_input((4, 3))
    feeds = {"input": x, "min": np.array(-0.5, np.float32), "max": np.array(0.6, np.float32)}
    model = op_model("Clip", feeds, shapes={"input": ["N", 3]})
    assert_gradients(model, feeds, list(feeds))


@pytest.mark.parametrize("opset", [6, 10])
def test_clip_attributes(opset):
    x = clip_input(lo=-0.5, hi=0.6)
    model = op_model("Clip", {"input": x}, opset=opset, min=-0.5, max=0.6)
    # onnxruntime has no Clip-6 kernel: at opset 6 the backward graph runs on the reference evaluator.
    assert_gradients(model, {"input": x}, ["input"], ad_backends=("onnxruntime", "reference"))


def test_binary_symbolic_batch_pow():
    x = R.uniform(0.5, 2.0, (5, 3)).astype(np.float32)
    e = R.uniform(-1.0, 2.0, (3,)).astype(np.float32)
    model = op_model("Pow", {"X": x, "Y": e}, shapes={"X": ["N", 3]})
    assert_gradients(model, {"X": x, "Y": e}, ["X", "Y"])


@pytest.mark.parametrize("opset", [7, 9])
def test_old_opsets(opset):
    """Relu and Abs before Where/Sign exist (7), and at the first opset with them (9)."""
    x = away_from(R.standard_normal((3, 4)), [0.0])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Abs", ["x"], ["a"]),
             helper.make_node("Mul", ["r", "a"], ["y"])]
    assert_gradients(make_model(nodes, {"x": x}, ["y"], opset=opset), {"x": x}, ["x"])


def test_legacy_broadcast_converted_or_refused():
    """Before opset 7 the model is converted (the templates emit numpy broadcasting only)."""
    from onnx_autodiff.conformance.check import backward_model
    from onnx_autodiff.errors import OpsetTooOldError

    x = R.standard_normal((3, 4)).astype(np.float32)
    model = op_model("Abs", {"X": x}, opset=6)
    assert_gradients(model, {"X": x}, ["X"])
    with pytest.raises(OpsetTooOldError, match="needs opset 7"):
        backward_model(model, "out0", ["X"], seed="input", upgrade_opset=False)


def test_pow_exponent_gradient_is_zero_where_the_base_is_zero():
    X = np.array([0.0, 0.5, 2.0], np.float32)
    E = np.array([2.0, 1.5, 3.0], np.float32)
    model = op_model("Pow", {"X": X, "Y": E})
    result = assert_gradients(model, {"X": X, "Y": E}, ["X", "Y"])
    assert np.all(np.isfinite(result.ad["Y"])) and result.ad["Y"][0] == 0


@pytest.mark.parametrize("lowered,expected", [(False, [0.0, 0.0, np.nan, 0.0, 3.0]),
                                                (True, [np.nan, np.nan, np.nan, 0.0, 3.0])])
def test_relu_multiplies_dy_by_the_mask(lowered, expected):
    """The documented convention: the rule passes dY where X > 0 and 0 elsewhere, even where dY is
    NaN or infinite (as PyTorch); the onnxruntime lowering's dY·[X > 0] gives NaN there (IEEE
    0·NaN, 0·inf). Finite values are gated exactly either way."""
    import onnx_ir as ir
    import onnxruntime as ort

    from onnx_autodiff import cleanup_passes

    x = np.array([-1.0, 0.0, 2.0, -3.0, 4.0], np.float32)
    model = op_model("Relu", {"X": x})
    grad, autodiff = backward_model(model, "out0", ["X"], seed="input")
    if lowered:
        cleaned = ir.from_proto(grad)
        ir.passes.PassManager(cleanup_passes())(cleaned)
        grad = ir.to_proto(cleaned)
    dy = np.array([np.nan, np.inf, np.nan, 5.0, 3.0], np.float32)
    session = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, {"X": x, autodiff.seed_name: dy})))
    np.testing.assert_array_equal(got[autodiff.gradient_names["X"]], expected)
