"""The default variables: parameters, not the exponents, epsilons, scales and masks stored beside them."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import AutodiffPass, UnknownValueError
from onnx_autodiff.passes.parameters import default_parameters
from onnx_autodiff.weights.recovery import EXPORTER_KIND
from onnx_autodiff.training import generate_artifacts


def _model(nodes, initializers, marks=None):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.asarray(v, np.float32), name) for name, v in initializers.items()],
    )
    for name, kind in (marks or {}).items():
        info = helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
        info.metadata_props.add(key=EXPORTER_KIND, value=kind)
        graph.value_info.append(info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


RNG = np.random.default_rng(0)
MASK = np.where(np.tri(2, 4) > 0, 0.0, np.finfo(np.float32).min)


def _rms_model(marks=None):
    """X·W + B, RMS-normalised with an epsilon and an exponent, masked, scaled, summed; a
    Dropout ratio (float, non-differentiable)."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "B"], ["h"]),
        helper.make_node("Pow", ["h", "two"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["h", "rms"], ["n"]),
        helper.make_node("Add", ["n", "mask"], ["masked"]),
        helper.make_node("Mul", ["masked", "scale"], ["s"]),
        helper.make_node("Dropout", ["s", "ratio"], ["d"]),
        helper.make_node("Softmax", ["d"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
    ]
    initializers = {"W": RNG.standard_normal((4, 4)), "B": RNG.standard_normal(4), "two": 2.0,
                    "eps": 1e-6, "mask": MASK, "scale": [0.5], "ratio": 0.1}
    return _model(nodes, initializers, marks)


def test_constants_of_any_model_are_left_out():
    default = default_parameters(ir.from_proto(_rms_model()))
    assert [v.name for v in default.parameters] == ["W", "B"]
    assert default.left_out == {
        "two": "one-element constant", "eps": "one-element constant",
        "mask": "mask (infinite or extreme values)", "scale": "one-element constant",
        "ratio": "read by no differentiable input",
    }


def test_exporter_marks_decide_in_exported_models():
    marks = {"W": "PARAMETER", "scale": "PARAMETER", "B": "BUFFER"}
    default = default_parameters(ir.from_proto(_rms_model(marks)))
    assert [v.name for v in default.parameters] == ["W", "scale"]  # a one-element parameter stays one
    assert default.left_out["B"] == "exporter buffer"
    assert default.left_out["eps"] == "exporter constant"


def test_autodiff_default_and_override():
    proto = _rms_model()
    autodiff = AutodiffPass(of="loss")
    autodiff(ir.from_proto(proto))
    assert list(autodiff.gradient_names) == ["W", "B"]
    assert autodiff.left_out == ["two", "eps", "mask", "scale", "ratio"]
    explicit = AutodiffPass(of="loss", wrt=["W", "two", "scale"])
    explicit(ir.from_proto(proto))
    assert list(explicit.gradient_names) == ["W", "two", "scale"] and explicit.left_out == []


def test_nothing_left_names_what_was_left_out():
    proto = _model([helper.make_node("Mul", ["X", "a"], ["xa"]), helper.make_node("ReduceSum", ["xa"], ["loss"], keepdims=0)],
                   {"a": 3.0})
    with pytest.raises(UnknownValueError, match=r"left out a\).*name the variables with wrt"):
        AutodiffPass(of="loss")(ir.from_proto(proto))


def test_artifacts_default_and_requires_grad_override():
    proto = _rms_model()
    onnx.checker.check_model(proto, full_check=True)
    artifacts = generate_artifacts(proto, loss=None, optimizer="sgd")
    assert artifacts.params == ["W", "B"]
    assert artifacts.left_out == ["two", "eps", "mask", "scale", "ratio"]
    assert generate_artifacts(proto, requires_grad=["W", "scale"], loss=None, optimizer="sgd").params == ["W", "scale"]


def _torchscript_conv(marks=None):
    """A TorchScript-named Conv (node path, weight and bias named after the op) with one output
    channel: a one-element bias."""
    graph = helper.make_graph(
        [helper.make_node("Conv", ["X", "onnx::Conv_12", "onnx::Conv_13"], ["c"], name="/conv/Conv"),
         helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0, name="/ReduceSum")],
        "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(RNG.standard_normal((1, 2, 2, 2)).astype(np.float32), "onnx::Conv_12"),
         numpy_helper.from_array(np.array([0.5], np.float32), "onnx::Conv_13")])
    for name, kind in (marks or {}).items():
        info = helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
        info.metadata_props.add(key=EXPORTER_KIND, value=kind)
        graph.value_info.append(info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_layer_weight_is_a_parameter_whatever_its_name():
    """Read as a Conv's W and B, TorchScript's onnx::Conv_NN tensors are trained (the bias of
    one element too); an exporter's buffer mark still decides."""
    default = default_parameters(ir.from_proto(_torchscript_conv()))
    assert [v.name for v in default.parameters] == ["onnx::Conv_12", "onnx::Conv_13"]
    marked = default_parameters(ir.from_proto(_torchscript_conv({"onnx::Conv_13": "BUFFER"})))
    assert [v.name for v in marked.parameters] == ["onnx::Conv_12"]
    assert marked.left_out == {"onnx::Conv_13": "exporter buffer"}
    proto = _torchscript_conv()
    for node in proto.graph.node:  # no exporter's node paths: the generic rule, a Conv bias all the same
        node.name = node.op_type
    assert [v.name for v in default_parameters(ir.from_proto(proto)).parameters] == ["onnx::Conv_12", "onnx::Conv_13"]


def test_a_weight_read_through_a_qdq_pair_is_a_parameter():
    """A float weight fake-quantized before its MatMul (QuantizeLinear → DequantizeLinear, whose
    pattern rule passes the gradient straight through) is a parameter by default; the pair's
    one-element scale is not, and the gradient the default gives the weight is the straight-through
    one (dy read through the MatMul, where the weight is inside the int8 range)."""
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("QuantizeLinear", ["W", "s", "z"], ["Wq"]),
             helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["Wd"]),
             helper.make_node("MatMul", ["X", "Wd"], ["Y"]),
             helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)]
    proto = _model(nodes, {"W": w, "s": np.float32(0.05)})
    proto.graph.initializer.append(numpy_helper.from_array(np.int8(0), "z"))
    chosen = default_parameters(ir.from_proto(proto))
    assert [v.name for v in chosen.parameters] == ["W"] and chosen.left_out == {"s": "one-element constant"}
    autodiff = AutodiffPass(of="loss")
    result = autodiff(ir.from_proto(proto))
    assert list(autodiff.gradient_names) == ["W"]
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    session = onnxruntime.InferenceSession(ir.to_proto(result.model).SerializeToString())
    grads = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"X": x})))
    inside = np.abs(np.round(w / 0.05)) <= 127
    np.testing.assert_allclose(grads[autodiff.gradient_names["W"]], np.where(inside, x.sum(axis=0)[:, None], 0), rtol=1e-5)
