"""Old and unknown opsets: a model whose rules need a newer opset is converted (or refused on
request) and differentiates like the same model converted by hand; an opset newer than onnx
knows is refused before anything is built."""

import logging
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, rng
from onnx_autodiff import (
    AutodiffPass,
    HvpPass,
    JvpPass,
    OpsetTooOldError,
    RuleError,
    UnsupportedModelError,
    default_registry,
    register_gradient,
)
from onnx_autodiff.toolkit import shapes
from onnx_autodiff.rules.math import cos
from onnx_autodiff.training import Trainer, TrainingError, generate_artifacts

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LOGGER = "onnx_autodiff.passes.opsets"


def cnn(opset=9, extra_nodes=(), extra_inputs=None):
    """Conv → Relu → MaxPool with overlapping 3×3 windows, stride 2 (opset 16's scatter-add)."""
    r = rng(3)
    x = r.standard_normal((2, 2, 6, 6)).astype(np.float32)
    weights = {"W": (r.standard_normal((3, 2, 3, 3)) * 0.5).astype(np.float32),
               "B": (r.standard_normal(3) * 0.1).astype(np.float32)}
    nodes = [
        helper.make_node("Conv", ["X", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        *extra_nodes,
    ]
    outputs = ["y", *(n.output[0] for n in extra_nodes)]
    model = make_model(nodes, {"X": x, **(extra_inputs or {})}, outputs, initializers=weights, opset=opset)
    return model, {"X": x, **(extra_inputs or {})}


def default_opset(proto):
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def differentiate(proto, of, wrt):
    autodiff = AutodiffPass(of=of, wrt=wrt, seed="input")
    result = ir.to_proto(autodiff(ir.from_proto(proto)).model)
    onnx.checker.check_model(result, full_check=True)
    onnx.shape_inference.infer_shapes(result, check_type=True, strict_mode=True)
    return result, autodiff


def gradients(proto, autodiff, feeds, dy):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = list(autodiff.gradient_names.values())
    return dict(zip(names, session.run(names, {**feeds, autodiff.seed_name: dy})))


def test_old_opset_converted_gradient_matches_finite_differences(caplog):
    model, feeds = cnn()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        proto, _ = differentiate(model, "y", ["X", "W", "B"])
    assert default_opset(proto) == 16
    # One line saying what was converted and which rule asked for it.
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    message = record.getMessage()
    assert "\n" not in message
    assert "from opset 9 to 16" in message and "MaxPool" in message and "needs opset 16" in message
    assert_gradients(model, feeds, ["X", "W", "B"])


def test_converted_in_place():
    model = ir.from_proto(cnn()[0])
    graph = model.graph
    result = AutodiffPass(of="y", wrt=["X"])(model)
    assert result.model is model and model.graph is graph
    assert graph.opset_imports[""] == 16 and graph.outputs[-1].name == "grad_X"
    assert graph.outputs[-1].producer().graph is graph


def test_gradient_equals_the_hand_converted_models():
    model, feeds = cnn()
    dy = rng(5).standard_normal((2, 3, 3, 3)).astype(np.float32)
    auto, a = differentiate(model, "y", ["X", "W", "B"])
    hand, h = differentiate(onnx.version_converter.convert_version(model, 16), "y", ["X", "W", "B"])
    got, want = gradients(auto, a, feeds, dy), gradients(hand, h, feeds, dy)
    assert list(got) == list(want)
    for name in got:
        np.testing.assert_array_equal(got[name], want[name])


def test_light_squeezenet_differentiates_like_its_hand_converted_copy():
    """A Caffe2-era zoo model at opset 9 (weights are ConstantOfShape fills: gradient wrt the input)."""
    model = onnx.load(os.path.join(LIGHT, "light_squeezenet.onnx"))
    x = model.graph.input[[i.name for i in model.graph.input].index("data_0")]
    feeds = {"data_0": rng(1).standard_normal([d.dim_value for d in x.type.tensor_type.shape.dim]).astype(np.float32)}
    dy = rng(2).standard_normal((1, 1000, 1, 1)).astype(np.float32)
    auto, a = differentiate(model, "softmaxout_1", ["data_0"])
    hand, h = differentiate(onnx.version_converter.convert_version(model, 16), "softmaxout_1", ["data_0"])
    assert default_opset(auto) == 16
    got, want = gradients(auto, a, feeds, dy), gradients(hand, h, feeds, dy)
    (grad,) = got.values()
    assert np.all(np.isfinite(grad)) and np.any(grad != 0)
    np.testing.assert_array_equal(grad, *want.values())


def test_refused_when_conversion_is_off():
    model, _ = cnn()
    before = ir.from_proto(model)
    autodiff = AutodiffPass(of="y", wrt=["X"], upgrade_opset=False)
    with pytest.raises(OpsetTooOldError, match=r"MaxPool.*needs opset 16.*convert_version\(model, 16\)"):
        autodiff(before)
    assert before.opset_imports[""] == 9
    assert "grad_X" not in [v.name for v in before.graph.outputs]


def test_jvp_of_an_old_opset_model():
    model, feeds = cnn()
    t = rng(7).standard_normal(feeds["X"].shape).astype(np.float32)

    def jvp_of(proto):
        jvp = JvpPass("y", ["X"])
        result = ir.to_proto(jvp(ir.from_proto(proto)).model)
        onnx.checker.check_model(result, full_check=True)
        session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
        return default_opset(result), session.run([jvp.output_names["y"]], {**feeds, jvp.input_names["X"]: t})[0]

    opset, got = jvp_of(model)
    _, want = jvp_of(onnx.version_converter.convert_version(model, 16))
    assert opset == 16
    np.testing.assert_array_equal(got, want)


def test_hvp_converts_the_model_as_it_was_before_the_first_sweep():
    """A rule of the second sweep (here a Cos that the first sweep emitted) asks for a newer
    opset: the model converted is the forward one, without the first sweep's nodes."""
    registry = default_registry().copy()

    @register_gradient("Cos", differentiable=("input",), registry=registry)
    def cos_from_14(op, node, dY):
        shapes.require_opset(op, 14, "this Cos gradient")
        return cos(op, node, dY)

    x = rng(4).standard_normal((3, 4)).astype(np.float32)
    v = rng(6).standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0)]
    model = make_model(nodes, {"x": x}, ["y"], opset=13)
    hvp = HvpPass("y", ["x"], registry)
    result = ir.to_proto(hvp(ir.from_proto(model)).model)
    onnx.checker.check_model(result, full_check=True)
    assert default_opset(result) == 14
    session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run([hvp.output_names["x"]], {"x": x, hvp.input_names["x"]: v})
    np.testing.assert_allclose(got, -np.sin(x) * v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("domain", ["", "ai.onnx.ml"])
def test_opset_newer_than_onnx_knows_refused_up_front(domain):
    model, _ = cnn(opset=99 if domain == "" else 18)
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 99))
    ir_model = ir.from_proto(model)
    nodes = len(ir_model.graph)
    with pytest.raises(UnsupportedModelError, match=f"opset 99 of domain {domain or 'ai.onnx'}.* knows opsets up to"):
        AutodiffPass(of="y", wrt=["X"])(ir_model)
    assert len(ir_model.graph) == nodes
    with pytest.raises(UnsupportedModelError, match="opset 99"):
        JvpPass("y", ["X"])(ir.from_proto(model))
    with pytest.raises(UnsupportedModelError, match="opset 99"):
        generate_artifacts(model, loss="mse", optimizer="sgd")


def test_converter_failure_is_a_clear_error():
    # ImageScaler (experimental, gone after opset 9) has no schema the converter can map.
    model, _ = cnn(extra_nodes=[helper.make_node("ImageScaler", ["Z"], ["scaled"], scale=2.0)],
                   extra_inputs={"Z": np.ones((1, 1, 2, 2), np.float32)})
    with pytest.raises(RuleError, match=r"MaxPool.*needs opset 16 or later \(the model has 9\), and onnx.version_converter could not convert the model "
                                         r"from opset 9 to 16 \(.*ImageScaler"):
        AutodiffPass(of="y", wrt=["X"])(ir.from_proto(model))


def test_training_artifacts_of_an_old_opset_model(caplog):
    model, feeds = cnn()
    labels = rng(9).standard_normal((2, 3, 3, 3)).astype(np.float32)

    def one_step(proto):
        artifacts = generate_artifacts(proto, loss="mse", optimizer="sgd", optimizer_options={"lr": 0.1})
        trainer = Trainer(artifacts, providers=["CPUExecutionProvider"])
        loss = trainer.step({"X": feeds["X"], "labels": labels})
        return artifacts, loss, trainer.parameters()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        artifacts, loss, params = one_step(model)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1
    assert default_opset(artifacts.train_model) == default_opset(artifacts.eval_model) == 16
    _, want_loss, want = one_step(onnx.version_converter.convert_version(model, 16))
    assert loss == want_loss
    assert sorted(params) == ["B", "W"]
    for name in params:
        np.testing.assert_array_equal(params[name], want[name])
    with pytest.raises(RuleError, match="needs opset 16"):
        generate_artifacts(model, loss="mse", optimizer="sgd", upgrade_opset=False)


def test_training_artifacts_converted_for_the_loss(caplog):
    """cross_entropy's SoftmaxCrossEntropyLoss needs opset 13: the train build asks for it as a
    rule does, and every model is built from the converted forward model."""
    from test_training import batches, mlp

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        artifacts = generate_artifacts(mlp(opset=12), loss="cross_entropy", optimizer="sgd")
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1
    assert default_opset(artifacts.train_model) == default_opset(artifacts.eval_model) == 13
    want = generate_artifacts(onnx.version_converter.convert_version(mlp(opset=12), 13), loss="cross_entropy",
                              optimizer="sgd")
    X, y = next(batches(1))
    trainers = [Trainer(a, providers=["CPUExecutionProvider"]) for a in (artifacts, want)]
    assert trainers[0].step({"X": X, "labels": y}) == trainers[1].step({"X": X, "labels": y})
    with pytest.raises(TrainingError, match="needs opset >= 13"):
        generate_artifacts(mlp(opset=12), loss="cross_entropy", optimizer="sgd", upgrade_opset=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(LIGHT) if f.endswith(".onnx")))
def test_light_zoo_model_differentiates_like_its_hand_converted_copy(name):
    model = onnx.load(os.path.join(LIGHT, f"{name}.onnx"))
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    r = rng(1)
    feeds = {i.name: r.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in inputs}
    y = model.graph.output[0]
    dy = r.standard_normal([d.dim_value for d in y.type.tensor_type.shape.dim]).astype(np.float32)
    auto, a = differentiate(model, y.name, [inputs[0].name])
    hand, h = differentiate(onnx.version_converter.convert_version(model, 16), y.name, [inputs[0].name])
    (got,), (want,) = gradients(auto, a, feeds, dy).values(), gradients(hand, h, feeds, dy).values()
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, want)


def test_cast_like_of_a_known_dtype_is_a_cast_before_opset_15():
    """GlobalAveragePool over run-time spatial sizes divides by a count cast to dY's type: at
    opset 11 that is a Cast (CastLike came in opset 15), the model keeps its opset, and one
    backward model runs at two image sizes."""
    x = rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    nodes = [helper.make_node("GlobalAveragePool", ["X"], ["p"]), helper.make_node("Tanh", ["p"], ["y"])]
    model = make_model(nodes, {"X": x}, ["y"], shapes={"X": ["N", 3, "H", "W"]}, opset=11)
    result, _ = differentiate(model, "y", ["X"])
    assert default_opset(result) == 11
    assert "CastLike" not in {n.op_type for n in result.graph.node}
    for size in ((4, 5), (6, 3)):
        assert_gradients(model, {"X": rng(6).standard_normal((2, 3, *size)).astype(np.float32)}, ["X"])


def test_an_op_newer_than_the_model_converts_it():
    """A rule emitting an op the model's opset lacks (Where, opset 9, for a model at 8) converts
    the model, as a rule asking with require_opset does, instead of writing an invalid model."""
    registry = default_registry().copy()

    @register_gradient("Relu", differentiable=("X",), registry=registry)
    def relu(op, node, dY):
        X = node.inputs[0]
        return {"X": op.Where(op.Greater(X, 0.0), dY, op.Sub(dY, dY))}

    x = rng(7).standard_normal((3, 4)).astype(np.float32)
    model = make_model([helper.make_node("Relu", ["X"], ["y"])], {"X": x}, ["y"], opset=8)
    autodiff = AutodiffPass(of="y", wrt=["X"], seed="input", registry=registry)
    result = ir.to_proto(autodiff(ir.from_proto(model)).model)
    onnx.checker.check_model(result, full_check=True)
    assert default_opset(result) >= 9
    assert_gradients(model, {"X": x}, ["X"], registry=registry)


def test_an_op_in_a_newer_form_converts_the_model():
    """Slice with starts and ends as inputs is opset 10's form: a rule emitting it (as
    shapes.extent does for a run-time extent) at opset 9 converts the model, instead of writing a
    Slice the checker refuses."""
    registry = default_registry().copy()

    @register_gradient("Neg", differentiable=("X",), registry=registry)
    def neg(op, node, dY):
        whole = op.Slice(dY, [0], [1 << 62], [0])
        return {"X": op.Neg(whole)}

    x = rng(8).standard_normal((3, 4)).astype(np.float32)
    model = make_model([helper.make_node("Neg", ["X"], ["y"])], {"X": x}, ["y"], opset=9)
    autodiff = AutodiffPass(of="y", wrt=["X"], seed="input", registry=registry)
    result = ir.to_proto(autodiff(ir.from_proto(model)).model)
    onnx.checker.check_model(result, full_check=True)
    assert default_opset(result) == 10
    assert_gradients(model, {"X": x}, ["X"], registry=registry)


def test_conversion_takes_the_ir_version_the_new_opset_needs():
    """An IR version 3 model (opset 7) converted to opset 11: the converter writes Pad-11's pads as
    an initializer, which IR version 3 would also need as a graph input; the converted model takes
    the IR version its opset needs instead of failing the checker."""
    x = rng(9).standard_normal((1, 2, 5, 5)).astype(np.float32)
    nodes = [helper.make_node("Pad", ["X"], ["p"], pads=[0, 0, 1, 1, 0, 0, 1, 1]),
             helper.make_node("MaxPool", ["p"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    model = make_model(nodes, {"X": x}, ["y"], opset=7)
    model.ir_version = 3
    result, _ = differentiate(model, "y", ["X"])
    assert default_opset(result) >= 8 and result.ir_version >= 4
    assert_gradients(model, {"X": x}, ["X"])
