"""The finite-difference oracle: agreement with analytic gradients, flags, backends, caps."""

import ast
import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from helpers import make_model, op_model, rng
from onnx_autodiff.conformance import check_vjp, compare, fd_vjp, random_cotangents
from onnx_autodiff.conformance.check import compare_elements
from onnx_autodiff.conformance.oracle import Evaluator, OracleError, to_float64

R = rng(11)


def oracle(model, feeds, wrt, **kw):
    cotangents = random_cotangents(model, feeds, seed=0)
    return cotangents, fd_vjp(model, feeds, wrt, cotangents, **kw)


# ----------------------------------------------------------------- agreement with analytic VJPs


def test_tanh_matches_analytic():
    x = R.standard_normal((3, 4)).astype(np.float32)
    (r,), fd = oracle(op_model("Tanh", {"X": x}), {"X": x}, ["X"])
    expected = r.astype(np.float64) * (1 - np.tanh(x.astype(np.float64)) ** 2)
    np.testing.assert_allclose(fd["X"], expected, rtol=1e-7, atol=1e-9)
    assert fd.backend == "onnxruntime-float64" and not fd.weak


def test_matmul_matches_analytic_both_inputs():
    a = R.standard_normal((2, 3)).astype(np.float32)
    b = R.standard_normal((3, 4)).astype(np.float32)
    (r,), fd = oracle(op_model("MatMul", {"A": a, "B": b}), {"A": a, "B": b}, ["A", "B"])
    r = r.astype(np.float64)
    np.testing.assert_allclose(fd["A"], r @ b.T.astype(np.float64), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(fd["B"], a.T.astype(np.float64) @ r, rtol=1e-7, atol=1e-9)


def test_softmax_large_logits_matches_analytic():
    x = (R.standard_normal((2, 5)) * 30).astype(np.float32)
    (r,), fd = oracle(op_model("Softmax", {"X": x}, axis=-1), {"X": x}, ["X"])
    z = x.astype(np.float64)
    s = np.exp(z - z.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    r = r.astype(np.float64)
    expected = s * (r - (r * s).sum(-1, keepdims=True))
    np.testing.assert_allclose(fd["X"], expected, rtol=1e-6, atol=1e-9)


def test_erf_uses_float64_reference_kernel():
    # onnxruntime has no float64 Erf, the stock reference kernel computes in float32
    x = R.standard_normal((3, 4)).astype(np.float32)
    (r,), fd = oracle(op_model("Erf", {"X": x}), {"X": x}, ["X"])
    expected = r * 2 / np.sqrt(np.pi) * np.exp(-x.astype(np.float64) ** 2)
    assert fd.backend == "reference-float64"
    np.testing.assert_allclose(fd["X"], expected, rtol=1e-7, atol=1e-9)


def test_initializer_as_variable():
    x = R.standard_normal((2, 3)).astype(np.float32)
    w = R.standard_normal((3,)).astype(np.float32)
    model = make_model([helper.make_node("Mul", ["X", "W"], ["Y"])], {"X": x}, ["Y"], initializers={"W": w})
    (r,), fd = oracle(model, {"X": x}, ["W"])
    np.testing.assert_allclose(fd["W"], (r.astype(np.float64) * x).sum(0), rtol=1e-7, atol=1e-9)


# ----------------------------------------------------------------- backends and the probe


class _Objective:
    """A stand-in for a backend: f = Σ sin(x), optionally rounded to float32 as a float32-inside kernel."""

    scale = 3.0

    def __init__(self, rounded):
        self.rounded = rounded

    def __call__(self, point):
        value = np.sum(np.sin(point["x"]))
        return float(np.float32(value)) if self.rounded else float(value), True


def test_probe_rejects_a_float32_inside_backend():
    from onnx_autodiff.conformance.differences import _probe

    base = {"x": np.array([0.3, -1.2, 2.0])}
    assert _probe(_Objective(rounded=False), base, ["x"], seed=0) is None
    assert "probe failed" in _probe(_Objective(rounded=True), base, ["x"], seed=0)


def test_backend_chain_falls_back_and_reports_why():
    # onnxruntime has no float64 Erf: the chain moves on to the reference evaluator
    x = R.standard_normal((2, 3)).astype(np.float32)
    model = op_model("Erf", {"X": x})
    _, fd = oracle(model, {"X": x}, ["X"])
    assert fd.backend == "reference-float64" and fd.notes[0].startswith("onnxruntime-float64")
    with pytest.raises(OracleError):
        oracle(model, {"X": x}, ["X"], backends=("onnxruntime-float64",))


def test_float32_fallback_is_weak_and_roughly_right():
    x = R.standard_normal((3, 3)).astype(np.float32)
    (r,), fd = oracle(op_model("Sigmoid", {"X": x}), {"X": x}, ["X"], backends=("float32",))
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    assert fd.weak and fd.backend == "float32"
    np.testing.assert_allclose(fd["X"], r * s * (1 - s), atol=3e-3)


def test_to_float64_widens_constants_and_casts():
    nodes = [
        helper.make_node("Constant", [], ["c"], value_float=0.1),
        helper.make_node("Cast", ["X"], ["x16"], to=onnx.TensorProto.FLOAT16),
        helper.make_node("Cast", ["x16"], ["x32"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", ["x32", "c"], ["Y"]),
    ]
    x = np.array([1 / 3], np.float32)
    wide = to_float64(make_model(nodes, {"X": x}, ["Y"]))
    casts = [a.i for n in wide.graph.node if n.op_type == "Cast" for a in n.attribute]
    assert casts == [onnx.TensorProto.DOUBLE] * 2
    out = __import__("onnxruntime").InferenceSession(wide.SerializeToString()).run(None, {"X": np.array([1 / 3])})
    assert out[0].dtype == np.float64  # no float16 rounding, the constant is the float32 0.1
    assert abs(out[0][0] - float(np.float32(0.1)) / 3) < 1e-16


# ----------------------------------------------------------------- kinks, ties, skipped elements


def test_relu_at_zero_is_a_kink_not_a_failure():
    x = np.array([[0.0, 1.0, -1.0], [0.5, 0.0, -0.3]], np.float32)
    model = op_model("Relu", {"X": x})
    (r,), fd = oracle(model, {"X": x}, ["X"])
    detail = fd.details["X"]
    np.testing.assert_array_equal(detail.kink, x == 0)
    at_zero = x == 0
    np.testing.assert_allclose(np.sort([detail.lower[at_zero], detail.upper[at_zero]], axis=0),
                               np.sort([np.zeros(2), r[at_zero]], axis=0), atol=1e-9)
    result = check_vjp(model, {"X": x}, ["X"])
    assert result.ok and result.counts["X"]["kinks"] == 2
    # a value outside [0, r] at the kink is still caught
    wrong = result.ad["X"].copy()
    wrong[0, 0] = 3 * r[0, 0]
    assert compare(wrong, detail, 1e-4, 1e-3) > 1


@pytest.mark.parametrize("subgradient", [0.0, 0.5, 1.0])
def test_max_tie_accepts_any_subgradient(subgradient):
    a = np.array([1.0, 2.0, 3.0, -0.5], np.float32)
    b = np.array([1.0, 0.0, 3.0, 0.7], np.float32)
    model = op_model("Max", {"A": a, "B": b})
    (r,), fd = oracle(model, {"A": a, "B": b}, ["A", "B"])
    tie = a == b
    for name in "AB":
        np.testing.assert_array_equal(fd.details[name].kink, tie)
    ad = np.where(tie, subgradient * r, np.where(a > b, r, 0))
    assert compare(ad, fd.details["A"], 1e-4, 1e-3) <= 1
    assert compare(np.where(tie, 2 * r, np.where(a > b, r, 0)), fd.details["A"], 1e-4, 1e-3) > 1


def test_near_kink_is_unstable_and_skipped():
    # 5e-5 lies between the two steps (1e-6, 1e-4): the central estimates disagree
    x = np.array([5e-5, 0.8, -0.4], np.float32)
    model = op_model("Relu", {"X": x})
    _, fd = oracle(model, {"X": x}, ["X"])
    detail = fd.details["X"]
    np.testing.assert_array_equal(detail.skipped, [True, False, False])
    assert np.isnan(compare_elements(np.zeros(3), detail, 1e-4, 1e-3)[0])
    assert detail.counts()["checked"] == 2


def test_non_finite_neighbourhood_is_skipped():
    x = np.array([1e-7, 2.0], np.float32)  # sqrt(x - h) is NaN
    _, fd = oracle(op_model("Sqrt", {"X": x}), {"X": x}, ["X"])
    np.testing.assert_array_equal(fd.details["X"].nonfinite, [True, False])


def test_length_change_on_one_side_gives_the_other_sides_slope():
    # limit - start = 3·delta exactly: the length grows on one side of start, limit and delta only
    feeds = {"start": np.array(0.0, np.float32), "limit": np.array(3.0, np.float32), "delta": np.array(1.0, np.float32)}
    model = op_model("Range", feeds)
    (r,), fd = oracle(model, feeds, ["limit", "start", "delta"])
    r = r.astype(np.float64)
    for name in ("limit", "start", "delta"):
        detail = fd.details[name]
        assert detail.one_sided.all() and not detail.shape_changed.any() and detail.checkable.all()
    np.testing.assert_allclose(fd["start"], r.sum(), rtol=1e-6)
    np.testing.assert_allclose(fd["delta"], (np.arange(3) * r).sum(), rtol=1e-6)
    np.testing.assert_allclose(fd["limit"], 0.0, atol=1e-6)


def test_length_change_on_both_sides_is_skipped():
    # delta far below the steps: moving start either way by 1e-4 adds or drops ten elements
    feeds = {"start": np.array(0.0, np.float32), "limit": np.array(1e-3, np.float32), "delta": np.array(1e-5, np.float32)}
    _, fd = oracle(op_model("Range", feeds), feeds, ["start"], step=1e-4, large_step=1e-3)
    detail = fd.details["start"]
    assert detail.shape_changed.all() and not detail.one_sided.any() and not detail.checkable.any()


def test_jump_is_discontinuous_and_skipped():
    x = np.array([2.0, 0.5, -1.0], np.float32)  # Floor jumps at 2 and -1
    _, fd = oracle(op_model("Floor", {"X": x}), {"X": x}, ["X"])
    detail = fd.details["X"]
    np.testing.assert_array_equal(detail.discontinuous, [True, False, True])
    np.testing.assert_array_equal(detail.checkable, [False, True, False])
    assert fd.backend == "onnxruntime-float64"  # the probe is not fooled by the jump


def test_a_jump_elsewhere_does_not_hide_a_kink():
    """The slopes' scale leaves the jumps out: Floor's jump at 2 estimates a slope of ~1e9, which
    as the scale hid the kink at ½ (the second-order DeformConv case at the padding border)."""
    x = np.array([2.0, 0.5, 0.7], np.float32)  # y = 1000·floor(x) + relu(x − ½)
    number = lambda name, v: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(v, np.float32)))
    nodes = [helper.make_node("Floor", ["X"], ["f"]), number("k", 1000.0), number("half", 0.5),
             helper.make_node("Mul", ["f", "k"], ["steps"]), helper.make_node("Sub", ["X", "half"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], ["r"]), helper.make_node("Add", ["steps", "r"], ["Y"])]
    model = make_model(nodes, {"X": x}, ["Y"])
    (r,), fd = oracle(model, {"X": x}, ["X"])
    detail = fd.details["X"]
    np.testing.assert_array_equal(detail.discontinuous, [True, False, False])
    np.testing.assert_array_equal(detail.kink, [False, True, False])
    relu_subgradient = np.array([0.0, 0.0, r[2]])  # Relu's AD takes 0 at its kink; Floor's is 0
    assert compare(relu_subgradient, detail, 1e-4, 1e-3) <= 1
    assert compare(np.array([0.0, 3 * r[1], r[2]]), detail, 1e-4, 1e-3) > 1


def test_gelu_float64_kernel_matches_analytic():
    x = np.array([-1.0, 0.0, 1.0, 2.5], np.float32)  # reference Gelu runs a float32 function body
    (r,), fd = oracle(op_model("Gelu", {"X": x}, opset=20), {"X": x}, ["X"])
    z = x.astype(np.float64)
    pdf = np.exp(-z * z / 2) / np.sqrt(2 * np.pi)
    cdf = 0.5 * (1 + np.vectorize(__import__("math").erf)(z / np.sqrt(2)))
    assert fd.backend == "reference-float64"
    np.testing.assert_allclose(fd["X"], r * (cdf + z * pdf), rtol=1e-7, atol=1e-9)


def test_check_vjp_is_not_vacuous_when_nothing_is_checkable():
    x = np.array([1e-7], np.float32)
    result = check_vjp(op_model("Sqrt", {"X": x}), {"X": x}, ["X"])
    assert not result.ok and result.counts["X"]["checked"] == 0


# ----------------------------------------------------------------- work caps and plain results


def test_sampling_cap_and_time_budget():
    x = R.standard_normal((50, 60)).astype(np.float32)
    model = op_model("Tanh", {"X": x})
    (r,), fd = oracle(model, {"X": x}, ["X"], max_coords=40)
    detail = fd.details["X"]
    assert detail.evaluated.sum() == 40 and np.isnan(fd["X"]).sum() == 3000 - 40
    expected = r.astype(np.float64) * (1 - np.tanh(x.astype(np.float64)) ** 2)
    assert compare(expected, detail, 1e-6, 1e-5) <= 1
    _, quick = oracle(model, {"X": x}, ["X"], max_coords=None, time_budget=0.05)
    assert 0 < quick.details["X"].evaluated.sum() < 3000


def test_compare_plain_arrays_keeps_its_meaning():
    fd = np.array([1.0, -2.0])
    assert compare(np.array([1.0, -2.0]), fd, 1e-4, 1e-3) == 0
    assert compare(np.array([1.1, -2.0]), fd, 1e-4, 1e-3) > 1
    assert compare(np.zeros(3), fd, 1e-4, 1e-3) == float("inf")
    assert compare(np.array([np.nan, -2.0]), fd, 1e-4, 1e-3) == float("inf")


def test_float32_fallback_widens_half_precision():
    # finite differences in float16 are rounding noise: the fallback evaluates in float32
    x = R.standard_normal((3, 4)).astype(np.float16)
    (r,), fd = oracle(op_model("Tanh", {"X": x}), {"X": x}, ["X"], backends=("float32",))
    expected = r.astype(np.float64) * (1 - np.tanh(x.astype(np.float64)) ** 2)
    assert fd.backend == "float32" and fd.weak
    np.testing.assert_allclose(fd["X"], expected, rtol=2e-3, atol=2e-3)


def test_cotangent_is_zero_on_masking_values():
    lowest = np.finfo(np.float32).min
    x = np.array([1.0, lowest, np.inf, -2.0], np.float32)
    (r,) = random_cotangents(op_model("Identity", {"X": x}), {"X": x})
    assert r[0] != 0 and r[3] != 0 and r[1] == 0 and r[2] == 0


def test_evaluator_does_not_let_a_runtime_move_the_feeds():
    # onnxruntime's training BatchNormalization writes running statistics that are not graph
    # outputs into its mean and var inputs
    feeds = {"x": R.standard_normal((2, 3, 4)).astype(np.float32), "s": np.ones(3, np.float32),
             "b": np.zeros(3, np.float32), "mean": np.full(3, 0.5, np.float32), "var": np.full(3, 2.0, np.float32)}
    node = helper.make_node("BatchNormalization", list(feeds), ["y", "running_mean", "running_var"], training_mode=1)
    model = make_model([node], feeds, ["y"], opset=15)
    before = {k: v.copy() for k, v in feeds.items()}
    Evaluator(model, backends=("onnxruntime",))(feeds)
    for name, value in before.items():
        np.testing.assert_array_equal(feeds[name], value, err_msg=name)


def test_reference_loop_without_cond_stacks_scan_outputs():
    # Loop with no cond input (runs M times) and a rank-2 scan output: (M, 3, 2)
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
         helper.make_node("Identity", ["acc_out"], ["scan"])],
        "body",
        [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", onnx.TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", onnx.TensorProto.FLOAT, [3, 2]),
         helper.make_tensor_value_info("scan", onnx.TensorProto.FLOAT, [3, 2])],
        [onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "one")],
    )
    loop = helper.make_node("Loop", ["M", "", "acc"], ["final", "scans"], body=body)
    feeds = {"M": np.array(2, np.int64), "acc": np.zeros((3, 2), np.float32)}
    model = make_model([loop], feeds, ["final", "scans"], output_shapes={"final": [3, 2], "scans": [2, 3, 2]})
    expected = Evaluator(model, backends=("onnxruntime",))(feeds)
    got = Evaluator(model, backends=("reference",))(feeds)
    assert got[1].shape == (2, 3, 2)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------- independence

ORACLE_MODULES = ("oracle", "widening", "kernels", "evaluator", "differences")


def imported_modules(module: str) -> set[str]:
    """Every module that ``onnx_autodiff.conformance.<module>`` imports, at the top or inside functions."""
    source = Path(importlib.util.find_spec(f"onnx_autodiff.conformance.{module}").origin).read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = ".".join("onnx_autodiff.conformance".split(".")[: 3 - node.level]) if node.level else ""
            names.add(".".join(p for p in (package, node.module) if p))
    return names


def test_the_oracle_imports_nothing_of_what_it_checks():
    # the reference values must not depend on the engine or the rules they judge
    allowed = {f"onnx_autodiff.conformance.{m}" for m in ORACLE_MODULES}
    for module in ORACLE_MODULES:
        foreign = sorted(n for n in imported_modules(module) if n.startswith("onnx_autodiff") and n not in allowed)
        assert not foreign, f"onnx_autodiff.conformance.{module} imports {foreign}"
    # the scan sees such imports: the gradient checks, which run the engine, have one
    assert any(n.startswith("onnx_autodiff.passes") for n in imported_modules("check"))
