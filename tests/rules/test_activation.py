import math

import numpy as np
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, op_model, rng, symbolic_model
from onnx_autodiff.conformance import fd_vjp
from onnx_autodiff.conformance.check import ad_vjp, compare
from test_math import assert_matches_numpy, away_from, erf64

R = rng(1)


def x_away(points, shape=(3, 5), scale=2.0):
    return away_from(R.standard_normal(shape) * scale, points)


# op -> (input name, kinks to avoid, attribute sets, opsets); each opset is one schema version.
UNARY = {
    "LeakyRelu": ("X", [0.0], [{}, {"alpha": 0.3}], [7, 16]),
    "Elu": ("X", [0.0], [{}, {"alpha": 0.7}], [7, 22]),
    "Selu": ("X", [0.0], [{}, {"alpha": 1.2, "gamma": 0.8}], [7, 22]),
    "Celu": ("X", [0.0], [{}, {"alpha": 0.6}], [12]),
    "ThresholdedRelu": ("X", [1.0, 0.4], [{}, {"alpha": 0.4}], [10, 22]),
    "Shrink": ("input", [-0.5, 0.5, -1.5, 1.5], [{}, {"bias": 0.3, "lambd": 1.5}], [9]),
    "Softplus": ("X", [], [{}], [7, 22]),
    "Softsign": ("input", [], [{}], [7, 22]),
    "HardSigmoid": ("X", [-2.5, 2.5, -1.25, 0.75], [{}, {"alpha": 0.4, "beta": 0.5}], [7, 22]),
    "HardSwish": ("X", [-3.0, 3.0], [{}], [14, 22]),
    "Mish": ("X", [], [{}], [18, 22]),
    "Swish": ("X", [], [{}, {"alpha": 1.7}], [24]),
}
CASES = [
    (op, attrs, opset)
    for op, (_, _, attr_sets, opsets) in UNARY.items()
    for attrs in attr_sets
    for opset in opsets
]


@pytest.mark.parametrize("op,attrs,opset", CASES, ids=lambda v: str(v))
def test_unary(op, attrs, opset):
    name, kinks, _, _ = UNARY[op]
    x = x_away(kinks, scale=3.0 if op in ("HardSwish", "HardSigmoid") else 2.0)
    model = op_model(op, {name: x}, opset=opset, **attrs)
    assert_gradients(model, {name: x}, [name])


def test_hard_swish_all_pieces_exercised():
    x = np.array([-4.0, -2.0, 0.5, 2.5, 4.0], np.float32)
    result = assert_gradients(op_model("HardSwish", {"X": x}), {"X": x}, ["X"])
    assert result.ad["X"][0] == 0


@pytest.mark.parametrize("opset", [7, 9, 16])
@pytest.mark.parametrize("shape_x,shape_s", [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (4,)), ((2, 3, 4), (3, 1)),
                                             ((2, 3, 4), (1,))])
def test_prelu(opset, shape_x, shape_s):
    x = x_away([0.0], shape_x)
    slope = R.uniform(0.1, 0.5, shape_s).astype(np.float32)
    model = op_model("PRelu", {"X": x, "slope": slope}, opset=opset)
    assert_gradients(model, {"X": x, "slope": slope}, ["X", "slope"])


def test_prelu_symbolic_batch():
    x = x_away([0.0], (5, 3, 2))
    slope = R.uniform(0.1, 0.5, (3, 1)).astype(np.float32)
    model = op_model("PRelu", {"X": x, "slope": slope}, shapes={"X": ["N", 3, 2]})
    assert_gradients(model, {"X": x, "slope": slope}, ["X", "slope"])


@pytest.mark.parametrize("shape_x", [(2, 3, 4), (4, 3, 4)])
def test_prelu_slope_held_on_symbolic_extents(shape_x):
    """A slope [4] held as an initializer against X of symbolic extents: the rule finds at run time
    that it broadcasts along X's last axis (numpy's broadcast, as onnxruntime runs it), even where
    another axis has its extent too."""
    x = x_away([0.0], shape_x)
    slope = R.uniform(0.1, 0.5, (4,)).astype(np.float32)
    model = op_model("PRelu", {"X": x, "slope": slope}, opset=13, initializers={"slope": slope})
    assert_gradients(model, {"X": x}, ["X", "slope"])


@pytest.mark.parametrize("opset", [7, 13])
@pytest.mark.parametrize("shape_x", [(2, 3, 4), (2, 3), (2, 3, 4, 5)])
def test_prelu_per_channel_slope_of_converted_opset6_models(opset, shape_x):
    """A slope [C] against X [N, C, ...] that does not broadcast: the per-channel PRelu of opset
    6, kept by models converted to newer opsets; the reference evaluator runs it, onnxruntime not."""
    x = x_away([0.0], shape_x)
    slope = R.uniform(0.1, 0.5, (3,)).astype(np.float32)
    model = op_model("PRelu", {"X": x, "slope": slope}, opset=opset)
    feeds = {"X": x, "slope": slope}
    cotangents = [R.standard_normal(shape_x).astype(np.float32)]
    ad = ad_vjp(model, feeds, ["X", "slope"], cotangents, backends=("reference",))
    fd = fd_vjp(model, feeds, ["X", "slope"], cotangents, backends=("reference-float64",))
    for name in ("X", "slope"):
        assert fd.details[name].counts()["checked"] > 0
        assert compare(ad[name], fd.details[name], 1e-4, 1e-3) <= 1, (name, ad[name], fd[name])
    # X's extents symbolic, the slope an initializer (as converted models hold it): the slope's axis
    # is found at run time
    held = op_model("PRelu", feeds, opset=opset, initializers={"slope": slope})
    symbolic = ad_vjp(symbolic_model(held), {"X": x}, ["X", "slope"], cotangents, backends=("reference",))
    for name in ("X", "slope"):
        np.testing.assert_allclose(symbolic[name], ad[name], rtol=1e-6, atol=1e-6, err_msg=name)


def gelu64(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + erf64(x / math.sqrt(2)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    x = R.standard_normal((3, 5)).astype(np.float32) * 2
    model = op_model("Gelu", {"X": x}, opset=20, approximate=approximate)
    assert_gradients(model, {"X": x}, ["X"])
    assert_matches_numpy(model, {"X": x}, "X", lambda v: gelu64(v, approximate))


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_swiglu(alpha):
    a = R.standard_normal((3, 4)).astype(np.float32)
    b = R.standard_normal((3, 4)).astype(np.float32)
    model = op_model("SwiGLU", {"A": a, "B": b}, opset=28, alpha=alpha)
    # onnxruntime 1.32 cannot load SwiGLU-28 (its function body needs Swish-24 kernels).
    assert_gradients(model, {"A": a, "B": b}, ["A", "B"], ad_backends=("onnxruntime", "reference"))


def test_chain_of_activations():
    """Gradients flow through several activations in a row (rules compose)."""
    x = x_away([0.0, 0.25], (2, 6))
    nodes = [
        helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.2),
        helper.make_node("Softplus", ["a"], ["b"]),
        helper.make_node("Elu", ["b"], ["c"]),
        helper.make_node("Mul", ["c", "x"], ["y"]),
    ]
    assert_gradients(make_model(nodes, {"x": x}, ["y"]), {"x": x}, ["x"])


def test_legacy_opset_converted_or_refused():
    from onnx_autodiff.conformance.check import backward_model
    from onnx_autodiff.errors import OpsetTooOldError

    x = x_away([0.0])
    model = op_model("LeakyRelu", {"X": x}, opset=6)
    assert_gradients(model, {"X": x}, ["X"])
    with pytest.raises(OpsetTooOldError, match="opset 7"):
        backward_model(model, "out0", ["X"], seed="input", upgrade_opset=False)
