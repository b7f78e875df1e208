"""Normalization rules against float64 finite differences.

LayerNormalization and GroupNormalization compute in float32 inside even for float64 inputs
(onnxruntime's kernels, the reference evaluator, and the spec's stash_type=1), which makes the
finite-difference oracle too noisy at h = 1e-6. For them the oracle differentiates the op's
decomposition into float64-exact ops instead (after checking it computes the same forward values),
while the AD side still differentiates the real op.
"""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from helpers import assert_gradients, make_model, op_model, rng
from onnx_autodiff.conformance.check import ad_vjp, backward_model, compare
from onnx_autodiff.conformance.oracle import Evaluator, fd_vjp, random_cotangents
from onnx_autodiff.errors import RuleError

R = rng()


@pytest.fixture(autouse=True)
def _reseed():
    """Each test draws the same inputs whether run alone or in the module (and not the
    oracle's cotangents, which come from seed 0)."""
    global R
    R = rng(1234)


def normal(*shape):
    return R.standard_normal(shape).astype(np.float32)


def positive(*shape):
    return R.uniform(0.5, 2.0, shape).astype(np.float32)


def assert_gradients_via(model, reference, feeds, wrt, atol=1e-4, rtol=1e-3):
    """AD of ``model`` matches finite differences of ``reference``, an equivalent model."""
    for got, want in zip(Evaluator(model)(feeds), Evaluator(reference)(feeds)):
        np.testing.assert_allclose(got, want, rtol=rtol / 10, atol=atol / 10)
    cotangents = random_cotangents(model, feeds)
    ad = ad_vjp(model, feeds, wrt, cotangents)
    fd = fd_vjp(reference, feeds, wrt, cotangents)
    for name in wrt:
        assert np.any(fd[name] != 0)
        error = compare(ad[name], fd[name], atol, rtol)
        assert error <= 1.0, f"{name}: scaled error {error:.3g}\nAD: {ad[name]}\nFD: {fd[name]}"


def typed(model, **shapes):
    """Types outputs as float tensors of the given shapes where onnx's shape inference does not
    (GroupNormalization; the optional outputs of BatchNormalization before opset 14)."""
    for output in model.graph.output:
        if output.name in shapes:
            output.CopyFrom(helper.make_tensor_value_info(output.name, 1, shapes[output.name]))
    return model


def node(op, inputs, outputs, **kw):
    return helper.make_node(op, inputs, outputs, **kw)


def standardize(x, axes, eps, prefix, dtype=np.float32):
    """Nodes computing (x - mean) / sqrt(var + eps) over ``axes``; names the results."""
    p = prefix
    return [
        node("Constant", [], [f"{p}axes"], value=helper.make_tensor("a", 7, [len(axes)], axes)),
        node("Constant", [], [f"{p}eps"], value=numpy_helper.from_array(np.array(eps, dtype))),
        node("ReduceMean", [x, f"{p}axes"], [f"{p}mean"]),
        node("Sub", [x, f"{p}mean"], [f"{p}xc"]),
        node("Mul", [f"{p}xc", f"{p}xc"], [f"{p}sq"]),
        node("ReduceMean", [f"{p}sq", f"{p}axes"], [f"{p}var"]),
        node("Add", [f"{p}var", f"{p}eps"], [f"{p}ve"]),
        node("Sqrt", [f"{p}ve"], [f"{p}std"]),
        node("Reciprocal", [f"{p}std"], [f"{p}inv"]),
        node("Mul", [f"{p}xc", f"{p}inv"], [f"{p}xhat"]),
    ]


# LayerNormalization


def layer_norm_models(x, scale, bias, axis, eps, outputs, shapes=None, exposed=None):
    """The op (node outputs ``outputs``, graph outputs ``exposed``) and its decomposition."""
    inputs = {"X": x, "Scale": scale, **({"B": bias} if bias is not None else {})}
    ln = node("LayerNormalization", list(inputs), outputs, axis=axis, epsilon=eps)
    wanted = exposed or [o for o in outputs if o]
    model = make_model([ln], inputs, wanted, shapes=shapes, opset=17)
    axes = list(range(axis % x.ndim, x.ndim))
    nodes = standardize("X", axes, eps, "s_", x.dtype)
    nodes.append(node("Mul", ["s_xhat", "Scale"], ["Y" if bias is None else "Ys"]))
    if bias is not None:
        nodes.append(node("Add", ["Ys", "B"], ["Y"]))
    named = {"Mean": "s_mean", "InvStdDev": "s_inv"}
    nodes += [node("Identity", [named[o]], [o]) for o in wanted if o != "Y"]
    reference = make_model(nodes, inputs, wanted, opset=18)
    return model, reference, inputs


@pytest.mark.parametrize(
    "x_shape,scale_shape,axis",
    [((4, 6), (6,), -1), ((2, 3, 4), (3, 4), 1), ((2, 3, 4), (4,), -2), ((3, 4), (3, 4), 0),
     ((2, 2, 2, 3), (1, 3), 2)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization(x_shape, scale_shape, axis, with_bias):
    bias = normal(*scale_shape) if with_bias else None
    model, reference, feeds = layer_norm_models(
        normal(*x_shape), normal(*scale_shape), bias, axis, 1e-5, ["Y"]
    )
    assert_gradients_via(model, reference, feeds, list(feeds))


@pytest.mark.parametrize(
    "outputs", [["Y", "Mean", "InvStdDev"], ["Y", "", "InvStdDev"], ["Y", "Mean"]]
)
def test_layer_normalization_statistics_outputs(outputs):
    model, reference, feeds = layer_norm_models(
        normal(2, 3, 4), normal(3, 4), normal(3, 4), -2, 1e-3, outputs
    )
    assert_gradients_via(model, reference, feeds, list(feeds))


@pytest.mark.parametrize("exposed", [["Mean"], ["InvStdDev"], ["Mean", "InvStdDev"]])
def test_layer_normalization_statistics_only(exposed):
    # Y carries no gradient: dY is None, the statistics' gradients alone give dX (none for Scale)
    model, reference, feeds = layer_norm_models(
        normal(3, 4), normal(4), normal(4), -1, 1e-5, ["Y", "Mean", "InvStdDev"], exposed=exposed
    )
    assert_gradients_via(model, reference, feeds, ["X"])


def test_layer_normalization_reuses_forward_statistics():
    model, _, _ = layer_norm_models(
        normal(2, 4), normal(4), None, -1, 1e-5, ["Y", "Mean", "InvStdDev"]
    )
    grad, _ = backward_model(model, "Y", ["X"])
    ops = [n.op_type for n in grad.graph.node]
    assert "Sqrt" not in ops and "Reciprocal" not in ops


def test_layer_normalization_symbolic_batch():
    model, reference, feeds = layer_norm_models(
        normal(3, 2, 4), normal(4), normal(4), -1, 1e-5, ["Y", "Mean", "InvStdDev"],
        shapes={"X": ["N", 2, 4]},
    )
    assert_gradients_via(model, reference, feeds, list(feeds))


def test_layer_normalization_symbolic_normalized_axis():
    # the statistics outputs' gradients need the element count at run time
    model, reference, feeds = layer_norm_models(
        normal(2, 5), normal(1), None, -1, 1e-5, ["Y", "Mean", "InvStdDev"], shapes={"X": [2, "D"]}
    )
    assert_gradients_via(model, reference, feeds, list(feeds))


@pytest.mark.parametrize("with_statistics", [False, True])
def test_layer_normalization_float16_stashes_float(with_statistics):
    # float16 X with float32 statistics (stash_type=1): the backward works in float32 and casts
    # back; loose tolerance for float16 outputs (eps 1e-3: about 3 significant digits)
    x, scale, bias = (normal(*s).astype(np.float16) for s in [(3, 4), (4,), (4,)])
    outputs = ["Y", "Mean", "InvStdDev"] if with_statistics else ["Y"]
    model, reference, feeds = layer_norm_models(x, scale, bias, -1, 1e-5, outputs)
    if with_statistics:  # the checker sums all outputs in one type: cast the float32 ones
        model.graph.node[0].output[1:] = ["Mean32", "InvStdDev32"]
        model.graph.node.extend(node("Cast", [f"{o}32"], [o], to=10) for o in outputs[1:])
        for out in model.graph.output[1:]:
            out.type.tensor_type.elem_type = 10
    grad, _ = backward_model(model, "Y", ["X"])
    assert "Cast" in [n.op_type for n in grad.graph.node]
    assert_gradients_via(model, reference, feeds, list(feeds), atol=1e-2, rtol=1e-2)


# BatchNormalization


def batch_norm_feeds(shape):
    c = shape[1]
    x = normal(*shape)
    return {"X": x, "scale": normal(c), "B": normal(c), "mean": normal(c), "var": positive(c)}


@pytest.mark.parametrize("opset", [9, 15])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2, 2)])
def test_batch_normalization_inference(opset, shape):
    feeds = batch_norm_feeds(shape)
    model = op_model("BatchNormalization", feeds, opset=opset, epsilon=1e-3)
    assert_gradients(model, feeds, list(feeds))


@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 2, 2)])
@pytest.mark.parametrize("outputs", [["Y"], ["Y", "rm", "rv"], ["rv"]])
def test_batch_normalization_training(shape, outputs):
    # the schema wants all three outputs in training mode; the graph exposes some of them
    feeds = batch_norm_feeds(shape)
    bn = node("BatchNormalization", list(feeds), ["Y", "rm", "rv"], training_mode=1, momentum=0.7)
    model = make_model([bn], feeds, outputs, opset=15)
    wrt = {"Y": ["X", "scale", "B"], "rv": ["X", "mean", "var"]}.get(outputs[-1], list(feeds))
    assert_gradients(model, feeds, wrt)


def test_batch_normalization_training_symbolic_batch():
    feeds = batch_norm_feeds((4, 2, 3))
    model = op_model(
        "BatchNormalization", feeds, 3, opset=15, training_mode=1, shapes={"X": ["N", 2, "L"]}
    )
    assert_gradients(model, feeds, list(feeds))


def test_batch_normalization_training_before_opset_14():
    # opset < 14: the optional outputs select training mode; saved_mean/saved_var stay internal
    feeds = batch_norm_feeds((3, 2, 2))
    bn = node("BatchNormalization", list(feeds), ["Y", "rm", "rv", "sm", "sv"], momentum=0.8)
    model = typed(make_model([bn], feeds, ["Y", "rm", "rv"], opset=13), rm=[2], rv=[2])
    assert_gradients(model, feeds, list(feeds))


def test_batch_normalization_refuses_saved_statistics():
    feeds = batch_norm_feeds((3, 2))
    model = op_model("BatchNormalization", feeds, 5, opset=12)
    with pytest.raises(RuleError, match="saved_mean"):
        backward_model(model, "out3", ["X"])


# InstanceNormalization (no float64 kernel in onnxruntime: the oracle uses the reference evaluator)


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 2, 2, 3), (1, 2, 5)])
def test_instance_normalization(shape):
    c = shape[1]
    feeds = {"input": normal(*shape), "scale": normal(c), "B": normal(c)}
    model = op_model("InstanceNormalization", feeds, epsilon=1e-3)
    assert_gradients(model, feeds, list(feeds))


def test_instance_normalization_symbolic_batch():
    feeds = {"input": normal(3, 2, 4), "scale": normal(2), "B": normal(2)}
    model = op_model("InstanceNormalization", feeds, shapes={"input": ["N", 2, "L"]}, opset=7)
    assert_gradients(model, feeds, list(feeds))


# GroupNormalization


def group_norm_models(shape, groups, opset, eps=1e-5, shapes=None):
    c = shape[1]
    n_params = groups if opset < 21 else c
    feeds = {"X": normal(*shape), "scale": normal(n_params), "bias": normal(n_params)}
    gn = node("GroupNormalization", list(feeds), ["Y"], num_groups=groups, epsilon=eps)
    model = make_model([gn], feeds, ["Y"], shapes=shapes, opset=opset)
    model = typed(model, Y=(shapes or {}).get("X", shape))
    view = [0, groups, c // groups, -1]
    param_view = [1, groups, 1 if opset < 21 else c // groups, 1]
    nodes = [
        node("Constant", [], ["view"], value=helper.make_tensor("v", 7, [4], view)),
        node("Constant", [], ["pview"], value=helper.make_tensor("p", 7, [4], param_view)),
        node("Reshape", ["X", "view"], ["Xg"]),
        *standardize("Xg", [2, 3], eps, "s_"),
        node("Reshape", ["scale", "pview"], ["sg"]),
        node("Reshape", ["bias", "pview"], ["bg"]),
        node("Mul", ["s_xhat", "sg"], ["Ys"]),
        node("Add", ["Ys", "bg"], ["Yg"]),
        node("Shape", ["X"], ["xshape"]),
        node("Reshape", ["Yg", "xshape"], ["Y"]),
    ]
    return model, make_model(nodes, feeds, ["Y"], opset=21), feeds


@pytest.fixture
def accept_deprecated_group_norm(monkeypatch):
    """onnx's checker rejects every GroupNormalization-18 node (the schema is deprecated since
    opset 21), so models using it, which exist, cannot pass check_model: let that error through."""
    check = onnx.checker.check_model

    def lenient(model, *args, **kwargs):
        try:
            check(model, *args, **kwargs)
        except onnx.checker.ValidationError as error:
            if "GroupNormalization is deprecated" not in str(error):
                raise

    monkeypatch.setattr(onnx.checker, "check_model", lenient)


@pytest.mark.usefixtures("accept_deprecated_group_norm")
@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize(
    "shape,groups", [((2, 4, 3), 2), ((1, 6, 2, 2), 3), ((3, 4), 2), ((2, 3, 4), 1)]
)
def test_group_normalization(opset, shape, groups):
    model, reference, feeds = group_norm_models(shape, groups, opset)
    assert_gradients_via(model, reference, feeds, list(feeds))


@pytest.mark.usefixtures("accept_deprecated_group_norm")
@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_symbolic_batch(opset):
    model, reference, feeds = group_norm_models(
        (3, 4, 3), 2, opset, eps=1e-3, shapes={"X": ["N", 4, "L"]}
    )
    assert_gradients_via(model, reference, feeds, list(feeds))


@pytest.mark.usefixtures("accept_deprecated_group_norm")
@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_symbolic_channels(opset):
    """No static channel count (X's nor, from opset 21, scale's): channels per group at run time."""
    params = ["G"] if opset < 21 else ["C"]
    model, reference, feeds = group_norm_models(
        (2, 6, 2, 2), 3, opset, shapes={"X": ["N", "C", "H", "W"], "scale": params, "bias": params}
    )
    assert_gradients_via(model, reference, feeds, list(feeds))


# LpNormalization


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize(
    "shape,axis", [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), -3), ((5,), 0)]
)
def test_lp_normalization(p, shape, axis):
    x = normal(*shape)
    x = np.where(np.abs(x) < 0.1, 0.3, x).astype(np.float32)  # away from |x|'s kink at 0
    model = op_model("LpNormalization", {"input": x}, p=p, axis=axis)
    assert_gradients(model, {"input": x}, ["input"])


def test_lp_normalization_symbolic_batch():
    x = normal(4, 3) + 3.0
    model = op_model(
        "LpNormalization", {"input": x}, p=2, axis=1, shapes={"input": ["N", 3]}, opset=13
    )
    assert_gradients(model, {"input": x}, ["input"])


# MeanVarianceNormalization


@pytest.mark.parametrize("opset", [9, 13, 18])
@pytest.mark.parametrize(
    "shape,axes",
    [((2, 3, 2, 2), [0, 2, 3]), ((2, 3, 4), [-1]), ((3, 2, 4), [0, 1]), ((4, 5), [0, -1])],
)
def test_mean_variance_normalization(opset, shape, axes):
    x = normal(*shape)
    model = op_model("MeanVarianceNormalization", {"X": x}, opset=opset, axes=axes)
    assert_gradients(model, {"X": x}, ["X"])


def test_mean_variance_normalization_default_axes():
    # opset 9 only: onnx 1.23 rejects MVN-13/18 without axes (its function body's Constant fails)
    x = normal(2, 3, 2, 2)
    model = op_model("MeanVarianceNormalization", {"X": x}, opset=9)
    assert_gradients(model, {"X": x}, ["X"])


def test_mean_variance_normalization_symbolic_batch():
    x = normal(3, 2, 4)
    model = op_model("MeanVarianceNormalization", {"X": x}, axes=[-1], shapes={"X": ["N", 2, 4]})
    assert_gradients(model, {"X": x}, ["X"])


# RMSNormalization


@pytest.mark.parametrize(
    "x_shape,scale_shape,axis",
    [((4, 6), (6,), -1), ((2, 3, 4), (3, 4), 1), ((2, 3, 4), (4,), -2), ((2, 2, 2, 3), (1, 3), 2)],
)
def test_rms_normalization(x_shape, scale_shape, axis):
    feeds = {"X": normal(*x_shape), "scale": normal(*scale_shape)}
    model = op_model("RMSNormalization", feeds, opset=23, axis=axis, epsilon=1e-3)
    assert_gradients(model, feeds, list(feeds))


def test_rms_normalization_symbolic_batch():
    feeds = {"X": normal(3, 2, 4), "scale": normal(4)}
    model = op_model("RMSNormalization", feeds, opset=23, shapes={"X": ["N", 2, 4]})
    assert_gradients(model, feeds, list(feeds))


# Second order: the backward templates are built from differentiable ops


def second_order_cases():
    feeds = batch_norm_feeds((4, 2))
    yield op_model("BatchNormalization", feeds, opset=15), feeds, "X"
    bn = node("BatchNormalization", list(feeds), ["out0", "rm", "rv"], training_mode=1)
    yield make_model([bn], feeds, ["out0"], opset=15), feeds, "X"
    feeds = {"X": normal(2, 4), "Scale": normal(4), "B": normal(4)}
    yield op_model("LayerNormalization", feeds, opset=17), feeds, "X"
    feeds = {"X": normal(2, 4, 2), "scale": normal(4), "bias": normal(4)}
    gn = op_model("GroupNormalization", feeds, opset=21, num_groups=2)
    yield typed(gn, out0=[2, 4, 2]), feeds, "X"
    feeds = {"X": normal(2, 4), "scale": normal(4)}
    yield op_model("RMSNormalization", feeds, opset=23), feeds, "X"
    feeds = {"input": normal(2, 2, 3), "scale": normal(2), "B": normal(2)}
    yield op_model("InstanceNormalization", feeds), feeds, "input"
    feeds = {"input": normal(2, 4) + 3.0}
    yield op_model("LpNormalization", feeds, p=1), feeds, "input"
    feeds = {"X": normal(3, 4)}
    yield op_model("MeanVarianceNormalization", feeds, axes=[1]), feeds, "X"


@pytest.mark.parametrize("case", range(8))
def test_second_order(case):
    """The backward graph, taken as a function of (x, dy), differentiates again."""
    model, feeds, x = list(second_order_cases())[case]
    grad, autodiff = backward_model(model, "out0", [x], seed="input")
    kept = onnx.ValueInfoProto()
    kept.CopyFrom(next(o for o in grad.graph.output if o.name == autodiff.gradient_names[x]))
    del grad.graph.output[:]
    grad.graph.output.append(kept)
    dy = normal(*feeds[x].shape)
    assert_gradients(grad, {**feeds, autodiff.seed_name: dy}, [x, autodiff.seed_name])


@pytest.mark.parametrize("opset", [7, 8])
def test_batch_norm_before_opset_9_converts(opset):
    """Opsets 7 and 8 (the 'spatial' attribute) take opset 9's rule on the converted model."""
    r = rng(21)
    x = r.standard_normal((2, 3, 4, 4)).astype(np.float32)
    stats = {"s": r.standard_normal(3), "b": r.standard_normal(3), "m": r.standard_normal(3), "v": r.random(3) + 0.5}
    model = make_model([helper.make_node("BatchNormalization", ["X", "s", "b", "m", "v"], ["y"])], {"X": x}, ["y"],
                       initializers={k: v.astype(np.float32) for k, v in stats.items()}, opset=opset)
    assert_gradients(model, {"X": x}, ["X", "s", "b", "m", "v"])
    grads, _ = backward_model(model, "y", ["X"], seed="input")
    assert next(o.version for o in grads.opset_import if o.domain == "") == 9
