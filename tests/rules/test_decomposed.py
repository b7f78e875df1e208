"""The shipped pattern rules for what unoptimised exports spell out (SiLU, RMSNorm, GELU, LayerNorm,
softmax): their gradients against float64 finite differences, each match one unit of backward nodes."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import assert_gradients, backward_model, make_model, rng
from onnx import helper

from onnx_autodiff import autodiff_pass, cleanup_passes, default_registry

R = rng(13)


def reduction(op_type, inputs, outputs, axes, opset):
    """A Reduce* node over ``axes`` as the opset has it: the axes input named ``axes`` (a str;
    ReduceSum from opset 13, the others from 18), else the attribute (a tuple)."""
    if isinstance(axes, str):
        return helper.make_node(op_type, [*inputs, axes], outputs, keepdims=1)
    return helper.make_node(op_type, inputs, outputs, keepdims=1, axes=list(axes))


def axes_by_opset(op_type, name, axes, opset):
    """(nodes, axes) for a Reduce* over ``axes`` at ``opset``: a Constant input or the attribute."""
    if opset >= (13 if op_type == "ReduceSum" else 18):
        return [const(name, axes, np.int64)], name
    return [], tuple(axes)


def rms_norm_model(exponent=2.0, axes=(-1,), weight=True, opset=18):
    """y = w · x / √(mean(x^exponent) + ε), spelled as torch.onnx.export(optimize=False) writes it
    (before opset 18 the mean's axes an attribute)."""
    x = R.standard_normal((2, 3, 8)).astype(np.float32)
    const = lambda name, value: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))
    axes_nodes_, axes_ = axes_by_opset("ReduceMean", "axes", axes, opset)
    nodes = [const("two", np.float32(exponent)), *axes_nodes_, const("eps", np.float32(1e-6)),
             helper.make_node("Pow", ["x", "two"], ["sq"]), reduction("ReduceMean", ["sq"], ["mean"], axes_, opset),
             helper.make_node("Add", ["mean", "eps"], ["shifted"]), helper.make_node("Sqrt", ["shifted"], ["root"]),
             helper.make_node("Reciprocal", ["root"], ["r"]), helper.make_node("Mul", ["x", "r"], ["normed"])]
    feeds = {"x": x}
    if weight:
        nodes.append(helper.make_node("Mul", ["w", "normed"], ["y"]))
        feeds["w"] = R.uniform(0.5, 1.5, 8).astype(np.float32)
    return make_model(nodes, feeds, ["y" if weight else "normed"], opset=opset), feeds


def silu_model():
    x = R.standard_normal((4, 6)).astype(np.float32)
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"]), {"x": x}


def pattern_tags(model, wrt):
    proto = backward_model(model, model.graph.output[0].name, wrt, seed="input")[0]
    return [p.value.split(":")[0] for n in proto.graph.node for p in n.metadata_props if p.key == "onnx_autodiff.grad_of"]


@pytest.mark.parametrize("opset", [18, 17, 11])
@pytest.mark.parametrize("axes", [(-1,), (1, 2)])
def test_rms_norm(axes, opset):
    model, feeds = rms_norm_model(axes=axes, opset=opset)
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


def const(name, value, dtype=np.float32):
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value, dtype), name))


def axes_nodes(name, axes):
    """Axes as torch.onnx.export(optimize=False) writes them: a Reshape of a constant."""
    return [const(f"{name}_raw", axes, np.int64), const(f"{name}_shape", [-1], np.int64),
            helper.make_node("Reshape", [f"{name}_raw", f"{name}_shape"], [name])]


def backward_nodes(model, wrt, patterns=True):
    """The nodes the pass and its cleanup add to ``model``."""
    registry = default_registry() if patterns else default_registry().copy(patterns=False)
    forward = {value for node in model.graph.node for value in node.output}
    result = ir.from_proto(model)
    ir.passes.PassManager([autodiff_pass(of=model.graph.output[0].name, wrt=wrt, registry=registry, seed="input"),
                           *cleanup_passes()])(result)
    return [n for n in ir.to_proto(result).graph.node if not forward & set(n.output)]


def assert_fewer_backward_nodes(model, wrt):
    assert len(backward_nodes(model, wrt)) < len(backward_nodes(model, wrt, patterns=False))


def layer_norm_model(square="pow", exponent=2.0, variance_axes=(-1,), affine=True, variance_read=False, opset=18):
    """(x − mean(x)) / √(mean((x − mean(x))²) + ε) · w + b, spelled as torch.onnx.export(optimize=False)
    writes it (``variance_read``: the output also reads the variance); before opset 18 the means'
    axes are attributes, as the TorchScript-based exporter wrote them."""
    x = R.standard_normal((2, 3, 8)).astype(np.float32)
    if opset >= 18:
        axes_, variance_axes_ = "axes", "variance_axes"
        nodes = [*axes_nodes("axes", [-1]), *axes_nodes("variance_axes", variance_axes)]
    else:
        axes_, variance_axes_, nodes = (-1,), tuple(variance_axes), []
    nodes += [const("two", exponent), const("eps", 1e-5), reduction("ReduceMean", ["x"], ["mean"], axes_, opset),
             helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "pow" else helper.make_node("Mul", ["d", "d"], ["sq"]),
             reduction("ReduceMean", ["sq"], ["variance"], variance_axes_, opset),
             helper.make_node("Add", ["variance", "eps"], ["shifted"]), helper.make_node("Sqrt", ["shifted"], ["root"]),
             helper.make_node("Div", ["d", "root"], ["normed"])]
    feeds, out = {"x": x}, "normed"
    if affine:
        nodes += [helper.make_node("Mul", ["normed", "w"], ["scaled"]), helper.make_node("Add", ["scaled", "b"], ["y"])]
        feeds |= {"w": R.uniform(0.5, 1.5, 8).astype(np.float32), "b": R.standard_normal(8).astype(np.float32)}
        out = "y"
    if variance_read:
        nodes.append(helper.make_node("Add", [out, "variance"], ["z"]))
        out = "z"
    return make_model(nodes, feeds, [out], opset=opset), feeds


@pytest.mark.parametrize("opset", [18, 17, 11])
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_layer_norm(square, opset):
    model, feeds = layer_norm_model(square, opset=opset)
    assert_gradients(model, feeds, ["x", "w", "b"])
    tags = pattern_tags(model, ["x", "w", "b"])
    assert "layer_norm" in tags
    assert not {"Pow", "Sqrt", "Div", "ReduceMean", "Sub"} & set(tags)
    assert_fewer_backward_nodes(model, ["x", "w", "b"])


@pytest.mark.parametrize("opset", [18, 13])
def test_layer_norm_axes_named_either_way(opset):
    """The centring over axis −1 and the variance over axis 2 of a rank-3 x reduce the same axis."""
    model, feeds = layer_norm_model(variance_axes=(2,), opset=opset)
    assert_gradients(model, feeds, ["x", "w", "b"])
    assert "layer_norm" in pattern_tags(model, ["x", "w", "b"])


@pytest.mark.parametrize("change", [{"exponent": 4.0}, {"variance_axes": (1, 2)}, {"variance_read": True},
                                    {"variance_axes": (1, 2), "opset": 13}],
                         ids=["fourth-power", "other-axes", "variance-read", "other-attribute-axes"])
def test_not_layer_norm(change):
    model, feeds = layer_norm_model(affine=False, **change)
    assert_gradients(model, feeds, ["x"])
    assert "layer_norm" not in pattern_tags(model, ["x"])


def gelu_erf_model(divisor=2**0.5, half_first=False, multiply=False, cdf_read=False, cast_one=False):
    """x·½(1 + erf(x/√2)) as torch.onnx.export(optimize=False) writes nn.GELU() at opset 18
    (``half_first``: (x·½)·(1 + erf) as it writes transformers' gelu_python; ``multiply``: x·(1/√2));
    ``cdf_read``: the output also reads ½(1 + erf), or 1 + erf with ``half_first``; ``cast_one``:
    the 1 an int64 constant cast to float."""
    x = (R.standard_normal((3, 7)) * 2).astype(np.float32)
    one = ([const("one_int", 1, np.int64), helper.make_node("Cast", ["one_int"], ["one"], to=onnx.TensorProto.FLOAT)]
           if cast_one else [const("one", 1.0)])
    nodes = [const("scale", 1 / divisor if multiply else divisor), *one, const("half", 0.5),
             helper.make_node("Mul" if multiply else "Div", ["x", "scale"], ["u"]), helper.make_node("Erf", ["u"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["s"])]
    if half_first:
        nodes += [helper.make_node("Mul", ["x", "half"], ["hx"]), helper.make_node("Mul", ["hx", "s"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["half", "s"], ["cdf"]), helper.make_node("Mul", ["x", "cdf"], ["y"])]
    if cdf_read:
        nodes.append(helper.make_node("Mul", ["y", "s" if half_first else "cdf"], ["z"]))
    return make_model(nodes, {"x": x}, ["z" if cdf_read else "y"]), {"x": x}


@pytest.mark.parametrize("cast_one", [False, True], ids=["float-one", "cast-one"])
@pytest.mark.parametrize("half_first", [False, True], ids=["half-last", "half-first"])
@pytest.mark.parametrize("multiply", [False, True], ids=["divided", "multiplied"])
def test_gelu_erf(half_first, multiply, cast_one):
    model, feeds = gelu_erf_model(half_first=half_first, multiply=multiply, cast_one=cast_one)
    assert_gradients(model, feeds, ["x"])
    assert set(pattern_tags(model, ["x"])) == {"gelu_erf_half_first" if half_first else "gelu_erf"}
    assert_fewer_backward_nodes(model, ["x"])


@pytest.mark.parametrize("change", [{"divisor": 2.0}, {"divisor": 2.0, "multiply": True}, {"cdf_read": True},
                                    {"cdf_read": True, "half_first": True}],
                         ids=["other-divisor", "other-factor", "cdf-read", "sum-read"])
def test_not_gelu_erf(change):
    model, feeds = gelu_erf_model(**change)
    assert_gradients(model, feeds, ["x"])
    assert not {"gelu_erf", "gelu_erf_half_first"} & set(pattern_tags(model, ["x"]))


def softmax_model(max_axes=(-1,), axes=(-1,), exp_read=False, opset=18):
    """exp(x − max(x)) / Σ exp(x − max(x)) over ``axes``, as torch.onnx.export(optimize=False) writes
    it (the axes attributes where the opset has no axes input: ReduceMax before 18, ReduceSum before 13)."""
    x = R.standard_normal((2, 3, 5)).astype(np.float32)
    max_nodes, max_axes_ = axes_by_opset("ReduceMax", "max_axes", max_axes, opset)
    sum_nodes, axes_ = axes_by_opset("ReduceSum", "axes", axes, opset)
    nodes = [*max_nodes, *sum_nodes, reduction("ReduceMax", ["x"], ["m"], max_axes_, opset),
             helper.make_node("Sub", ["x", "m"], ["d"]), helper.make_node("Exp", ["d"], ["e"]),
             reduction("ReduceSum", ["e"], ["total"], axes_, opset), helper.make_node("Div", ["e", "total"], ["y"])]
    if exp_read:
        nodes.append(helper.make_node("Add", ["y", "e"], ["z"]))
    return make_model(nodes, {"x": x}, ["z" if exp_read else "y"], opset=opset), {"x": x}


@pytest.mark.parametrize("opset", [18, 13, 11])
@pytest.mark.parametrize("axes", [(-1,), (1, 2)])
def test_softmax(axes, opset):
    model, feeds = softmax_model(axes, axes, opset=opset)
    assert_gradients(model, feeds, ["x"])
    assert set(pattern_tags(model, ["x"])) == {"softmax"}
    assert_fewer_backward_nodes(model, ["x"])


@pytest.mark.parametrize("change", [{"max_axes": (1,)}, {"exp_read": True}, {"max_axes": (1,), "opset": 13}],
                         ids=["other-axes", "exp-read", "other-attribute-axes"])
def test_not_softmax(change):
    model, feeds = softmax_model(**change)
    assert_gradients(model, feeds, ["x"])
    assert "softmax" not in pattern_tags(model, ["x"])


def exported(name):
    """A module spelling the decomposition, exported by torch.onnx.export(optimize=False) at opset 18
    (where Gelu is no op yet)."""
    torch = pytest.importorskip("torch")
    import warnings

    def layer_norm(x):
        d = x - x.mean(-1, keepdim=True)
        return d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5)

    def softmax(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def gelu_python(x):  # transformers' spelling
        return x * 0.5 * (1.0 + torch.erf(x / 2**0.5))

    modules = {"gelu_erf": torch.nn.GELU(), "gelu_erf_half_first": gelu_python, "layer_norm": layer_norm,
               "softmax": softmax}

    class Module(torch.nn.Module):
        def forward(self, x):
            return modules[name](x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(Module(), (torch.randn(2, 3, 8),), dynamo=True, optimize=False, opset_version=18,
                                 verbose=False).model_proto


@pytest.mark.parametrize("name", ["gelu_erf", "gelu_erf_half_first", "layer_norm", "softmax"])
def test_torch_exports_match(name):
    model = exported(name)
    x = model.graph.input[0].name
    assert_gradients(model, {x: R.standard_normal((2, 3, 8)).astype(np.float32)}, [x])
    assert name in pattern_tags(model, [x])


@pytest.mark.parametrize("opset", [11, 14])
def test_torchscript_exports_match(opset):
    """The TorchScript-based exporter (dynamo=False) writes the reductions' axes as attributes below
    opset 18 (ReduceSum's as an input from 13): LayerNorm and softmax spelled out still match."""
    torch = pytest.importorskip("torch")
    import io
    import warnings

    class Module(torch.nn.Module):
        def forward(self, x):
            d = x - x.mean(-1, keepdim=True)
            y = d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5)
            e = torch.exp(y - y.amax(-1, keepdim=True))
            return e / e.sum(-1, keepdim=True)

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Module(), (torch.randn(2, 3, 8),), buffer, dynamo=False, opset_version=opset)
    model = onnx.load_from_string(buffer.getvalue())
    assert not any(len(n.input) > 1 for n in model.graph.node if n.op_type == "ReduceMean")  # attribute axes
    x = model.graph.input[0].name
    assert_gradients(model, {x: R.standard_normal((2, 3, 8)).astype(np.float32)}, [x])
    assert {"layer_norm", "softmax"} <= set(pattern_tags(model, [x]))
