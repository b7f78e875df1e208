"""The shipped pattern rules for what unoptimised exports spell out (SiLU, RMSNorm): their
gradients against float64 finite differences, each match one unit of backward nodes."""

import numpy as np
import onnx
import pytest
from helpers import assert_gradients, backward_model, make_model, rng
from onnx import helper

R = rng(13)


def rms_norm_model(exponent=2.0, axes=(-1,), weight=True):
    """y = w · x / √(mean(x^exponent) + ε), spelled as torch.onnx.export(optimize=False) writes it."""
    x = R.standard_normal((2, 3, 8)).astype(np.float32)
    const = lambda name, value: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))
    nodes = [const("two", np.float32(exponent)), const("axes", np.asarray(axes, np.int64)), const("eps", np.float32(1e-6)),
             helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
             helper.make_node("Add", ["mean", "eps"], ["shifted"]), helper.make_node("Sqrt", ["shifted"], ["root"]),
             helper.make_node("Reciprocal", ["root"], ["r"]), helper.make_node("Mul", ["x", "r"], ["normed"])]
    feeds = {"x": x}
    if weight:
        nodes.append(helper.make_node("Mul", ["w", "normed"], ["y"]))
        feeds["w"] = R.uniform(0.5, 1.5, 8).astype(np.float32)
    return make_model(nodes, feeds, ["y" if weight else "normed"]), feeds


def silu_model():
    x = R.standard_normal((4, 6)).astype(np.float32)
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"]), {"x": x}


def pattern_tags(model, wrt):
    proto = backward_model(model, model.graph.output[0].name, wrt, seed="input")[0]
    return [p.value.split(":")[0] for n in proto.graph.node for p in n.metadata_props if p.key == "onnx_autodiff.grad_of"]


@pytest.mark.parametrize("axes", [(-1,), (1, 2)])
def test_rms_norm(axes):
    model, feeds = rms_norm_model(axes=axes)
    assert_gradients(model, feeds, ["x", "w"])
    tags = pattern_tags(model, ["x", "w"])
    assert "rms_norm" in tags and not {"Pow", "Sqrt", "Reciprocal", "ReduceMean"} & set(tags)


def test_a_cube_mean_is_not_rms_norm():
    model, feeds = rms_norm_model(exponent=3.0, weight=False)
    assert_gradients(model, {"x": np.abs(feeds["x"]) + 0.5}, ["x"])
    assert "rms_norm" not in pattern_tags(model, ["x"])


def test_silu():
    model, feeds = silu_model()
    assert_gradients(model, feeds, ["x"])
    assert set(pattern_tags(model, ["x"])) == {"silu"}


def gelu_tanh_model(half=0.5):
    """GPT-2's gelu_new as torch.onnx.export(optimize=False) writes it."""
    x = (R.standard_normal((3, 7)) * 2).astype(np.float32)
    const = lambda name, value: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value, np.float32), name))
    nodes = [const("half", half), const("three", 3.0), const("k", 0.044715), const("c", (2 / np.pi) ** 0.5), const("one", 1.0),
             helper.make_node("Mul", ["x", "half"], ["hx"]), helper.make_node("Pow", ["x", "three"], ["cube"]),
             helper.make_node("Mul", ["cube", "k"], ["kc"]), helper.make_node("Add", ["x", "kc"], ["inner"]),
             helper.make_node("Mul", ["inner", "c"], ["u"]), helper.make_node("Tanh", ["u"], ["t"]),
             helper.make_node("Add", ["t", "one"], ["s"]), helper.make_node("Mul", ["hx", "s"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"]), {"x": x}


def test_gelu_tanh():
    model, feeds = gelu_tanh_model()
    assert_gradients(model, feeds, ["x"])
    assert set(pattern_tags(model, ["x"])) == {"gelu_tanh"}


def test_a_different_factor_is_not_gelu():
    model, feeds = gelu_tanh_model(half=0.25)
    assert_gradients(model, feeds, ["x"])
    assert "gelu_tanh" not in pattern_tags(model, ["x"])
