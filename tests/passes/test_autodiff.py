"""The engine: path selection, accumulation, broadcasting, seeds, names, errors, determinism."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from helpers import assert_gradients, make_model, rng
from onnx_autodiff import (
    AutodiffPass,
    GradRegistry,
    MissingRuleError,
    NotDifferentiableError,
    UnknownValueError,
    UnsupportedModelError,
    autodiff_pass,
    cleanup_passes,
    default_registry,
)
from onnx_autodiff.conformance import fd_vjp

R = rng(7)


def differentiate(model, **kw) -> tuple[onnx.ModelProto, AutodiffPass]:
    autodiff = autodiff_pass(**kw)
    result = autodiff(ir.from_proto(model))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, autodiff


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def affine_model():
    """y = sum(tanh(X @ W + b)) with a symbolic batch dimension."""
    W = R.standard_normal((4, 3)).astype(np.float32)
    b = R.standard_normal((3,)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["z"]),
        helper.make_node("Tanh", ["z"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["y"]),
    ]
    x = np.zeros((1, 4), np.float32)
    return make_model(nodes, {"X": x}, ["y"], initializers={"W": W, "b": b}, shapes={"X": ["N", 4]})


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_symbolic_batch_one_graph_many_sizes(batch):
    if "MatMul" not in default_registry():
        pytest.skip("MatMul rule not registered")
    model = affine_model()
    X = R.standard_normal((batch, 4)).astype(np.float32)
    assert_gradients(model, {"X": X}, ["X", "W", "b"])


def test_symbolic_broadcast_uses_one_graph_for_all_batches():
    a = np.zeros((1, 3), np.float32)
    nodes = [helper.make_node("Mul", ["A", "B"], ["y"])]
    model = make_model(nodes, {"A": a, "B": np.zeros((3,), np.float32)}, ["y"], shapes={"A": ["N", 3]})
    proto, autodiff = differentiate(model, of="y", wrt=["A", "B"])
    for batch in (1, 3, 64):
        A = R.standard_normal((batch, 3)).astype(np.float32)
        B = R.standard_normal((3,)).astype(np.float32)
        dy = R.standard_normal((batch, 3)).astype(np.float32)
        out = run(proto, {"A": A, "B": B, autodiff.seed_name: dy})
        np.testing.assert_allclose(out["grad_A"], dy * B, rtol=1e-6)
        np.testing.assert_allclose(out["grad_B"], (dy * A).sum(0), rtol=1e-5)


def test_runtime_broadcast_axes_when_dims_are_symbolic():
    """B's first dim is a different symbol than A's: the reduction axes are found at run time."""
    nodes = [helper.make_node("Mul", ["A", "B"], ["y"])]
    model = make_model(
        nodes,
        {"A": np.zeros((2, 3), np.float32), "B": np.zeros((1, 3), np.float32)},
        ["y"],
        shapes={"A": ["N", 3], "B": ["M", 3]},
    )
    proto, autodiff = differentiate(model, of="y", wrt=["B"])
    A = R.standard_normal((5, 3)).astype(np.float32)
    dy = R.standard_normal((5, 3)).astype(np.float32)
    for B in (R.standard_normal((1, 3)), R.standard_normal((5, 3))):
        B = B.astype(np.float32)
        out = run(proto, {"A": A, "B": B, autodiff.seed_name: dy})
        expected = (dy * A).sum(0, keepdims=True) if B.shape[0] == 1 else dy * A
        np.testing.assert_allclose(out["grad_B"], expected, rtol=1e-5)


def fan_out_model(uses: int):
    nodes = [helper.make_node("Tanh", ["x"], [f"t{i}"]) for i in range(uses)]
    nodes += [helper.make_node("Sum", [f"t{i}" for i in range(uses)], ["y"])] if uses > 1 else []
    outputs = ["y"] if uses > 1 else ["t0"]
    return make_model(nodes, {"x": np.zeros((3,), np.float32)}, outputs)


@pytest.mark.parametrize("uses,accumulator", [(1, None), (2, "Add"), (3, "Sum")])
def test_fan_out_accumulates_with_add_or_one_sum(uses, accumulator):
    if uses > 1 and "Sum" not in default_registry():
        pytest.skip("Sum rule not registered")
    model = fan_out_model(uses)
    proto, _ = differentiate(model, of=model.graph.output[0].name, wrt=["x"])
    backward = [n.op_type for n in proto.graph.node[len(model.graph.node):]]
    assert backward.count("Add") == (accumulator == "Add")
    assert backward.count("Sum") == (accumulator == "Sum")
    assert_gradients(model, {"x": R.standard_normal(3).astype(np.float32)}, ["x"])


def test_scalar_output_is_seeded_with_one_and_others_get_a_dy_input():
    x = np.zeros((3,), np.float32)
    scalar = make_model([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], {"x": x}, ["y"])
    if "ReduceSum" in default_registry():
        proto, autodiff = differentiate(scalar, of="y", wrt=["x"])
        assert autodiff.seed_name is None and [i.name for i in proto.graph.input] == ["x"]
        np.testing.assert_array_equal(run(proto, {"x": x})["grad_x"], np.ones(3, np.float32))
    vector = make_model([helper.make_node("Neg", ["x"], ["y"])], {"x": x}, ["y"])
    proto, autodiff = differentiate(vector, of="y", wrt=["x"])
    assert autodiff.seed_name == "dy"
    dy_input = proto.graph.input[-1]
    assert dy_input.name == "dy" and [d.dim_value for d in dy_input.type.tensor_type.shape.dim] == [3]


def test_outputs_keep_forward_outputs_then_gradients_in_wrt_order():
    model = make_model(
        [helper.make_node("Mul", ["a", "b"], ["y"])],
        {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)},
        ["y"],
    )
    proto, autodiff = differentiate(model, of="y", wrt=["b", "a"])
    assert [o.name for o in proto.graph.output] == ["y", "grad_b", "grad_a"]
    assert autodiff.gradient_names == {"b": "grad_b", "a": "grad_a"}


def test_fresh_names_avoid_existing_dy_and_grad_names():
    nodes = [helper.make_node("Mul", ["a", "dy"], ["grad_a"]), helper.make_node("Neg", ["grad_a"], ["y"])]
    model = make_model(nodes, {"a": np.zeros(2, np.float32), "dy": np.zeros(2, np.float32)}, ["y"])
    proto, autodiff = differentiate(model, of="y", wrt=["a"])
    names = [v.name for v in (*proto.graph.input, *proto.graph.output)]
    assert len(names) == len(set(names))
    assert autodiff.seed_name not in ("dy", None) and autodiff.gradient_names["a"] != "grad_a"
    a = R.standard_normal(2).astype(np.float32)
    d = R.standard_normal(2).astype(np.float32)
    seed = R.standard_normal(2).astype(np.float32)
    out = run(proto, {"a": a, "dy": d, autodiff.seed_name: seed})
    np.testing.assert_allclose(out[autodiff.gradient_names["a"]], -seed * d, rtol=1e-6)


def test_unreachable_variable_gets_zeros_or_raises():
    nodes = [helper.make_node("Neg", ["a"], ["y"]), helper.make_node("Neg", ["b"], ["z"])]
    inputs = {"a": np.zeros(2, np.float32), "b": np.ones((2, 2), np.float32)}
    model = make_model(nodes, inputs, ["y", "z"])
    proto, _ = differentiate(model, of="y", wrt=["a", "b"])
    out = run(proto, {**inputs, "dy": np.ones(2, np.float32)})
    np.testing.assert_array_equal(out["grad_b"], np.zeros((2, 2), np.float32))
    with pytest.raises(NotDifferentiableError, match="'y' does not depend on 'b'"):
        differentiate(model, of="y", wrt=["a", "b"], unreachable="raise")


def test_gradient_stops_at_non_differentiable_inputs():
    """y = x * float(Shape(x)[0]): Shape carries no gradient, so dy/dx = n (not n + x)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "sf"], ["y"]),
    ]
    model = make_model(nodes, {"x": np.zeros(3, np.float32)}, ["y"])
    proto, _ = differentiate(model, of="y", wrt=["x"])
    assert "Shape" in [n.op_type for n in proto.graph.node]
    out = run(proto, {"x": np.arange(3, dtype=np.float32), "dy": np.ones(3, np.float32)})
    np.testing.assert_array_equal(out["grad_x"], np.full(3, 3, np.float32))


def test_unsupported_op_off_the_path_is_not_an_error():
    nodes = [
        helper.make_node("Neg", ["x"], ["y"]),
        helper.make_node("MyOp", ["x"], ["unused"], domain="custom"),
    ]
    model = make_model(nodes, {"x": np.zeros(2, np.float32)}, ["y", "unused"], extra_opsets={"custom": 1})
    autodiff_pass(of="y", wrt=["x"])(ir.from_proto(model))


def test_unsupported_op_on_the_path_names_node_op_domain_opset():
    nodes = [helper.make_node("MyOp", ["x"], ["h"], domain="custom", name="mine"),
             helper.make_node("Neg", ["h"], ["y"])]
    model = make_model(nodes, {"x": np.zeros(2, np.float32)}, ["y"], extra_opsets={"custom": 3})
    with pytest.raises(MissingRuleError) as info:
        autodiff_pass(of="y", wrt=["x"])(ir.from_proto(model))
    message = str(info.value)
    for part in ("'mine'", "MyOp", "custom", "opset 3", "register_gradient"):
        assert part in message


def test_unknown_names_and_integer_variables_are_clear_errors():
    nodes = [helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT), helper.make_node("Neg", ["f"], ["y"])]
    model = make_model(nodes, {"i": np.zeros(2, np.int64)}, ["y"])
    with pytest.raises(UnknownValueError, match="of 'nope'"):
        autodiff_pass(of="nope", wrt=["i"])(ir.from_proto(model))
    with pytest.raises(UnknownValueError, match="wrt 'nope'"):
        autodiff_pass(of="y", wrt=["nope"])(ir.from_proto(model))
    with pytest.raises(NotDifferentiableError, match="INT64"):
        autodiff_pass(of="y", wrt=["i"])(ir.from_proto(model))


def test_cyclic_graph_is_rejected():
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 18})
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    graph.inputs.append(x)
    first = ir.node("Add", [x, x])
    second = ir.node("Neg", [first.outputs[0]])
    first.replace_input_with(1, second.outputs[0])
    graph.extend([first, second])
    second.outputs[0].name = "y"
    graph.outputs.append(second.outputs[0])
    with pytest.raises(UnsupportedModelError, match="cycle"):
        autodiff_pass(of="y", wrt=["x"])(ir.Model(graph, ir_version=10))


def test_wrt_intermediate_value_and_of_equal_to_wrt():
    nodes = [helper.make_node("Exp", ["x"], ["h"]), helper.make_node("Mul", ["h", "h"], ["y"])]
    model = make_model(nodes, {"x": np.zeros(2, np.float32)}, ["y"])
    proto, _ = differentiate(model, of="y", wrt=["h", "x"])
    x = np.array([0.1, -0.3], np.float32)
    out = run(proto, {"x": x, "dy": np.ones(2, np.float32)})
    np.testing.assert_allclose(out["grad_h"], 2 * np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(out["grad_x"], 2 * np.exp(2 * x), rtol=1e-6)
    proto, autodiff = differentiate(model, of="h", wrt=["h"])
    np.testing.assert_array_equal(run(proto, {"x": x, "dy": x})["grad_h"], x)


def test_same_model_in_gives_byte_identical_model_out():
    model = affine_model() if "MatMul" in default_registry() else fan_out_model(3)
    of = model.graph.output[0].name
    outputs = []
    for _ in range(2):
        result = ir.passes.PassManager([autodiff_pass(of=of), *cleanup_passes()])(ir.from_proto(model))
        outputs.append(ir.to_proto(result.model).SerializeToString(deterministic=True))
    assert outputs[0] == outputs[1]


def test_custom_op_with_registered_rule_in_own_registry():
    """A model-local function 'custom::Scale' (y = x * s) gets a user rule in a private registry."""
    body = onnx.helper.make_function(
        "custom", "Scale", ["X", "s"], ["Y"], [helper.make_node("Mul", ["X", "s"], ["Y"])],
        [helper.make_opsetid("", 18)],
    )
    nodes = [helper.make_node("Scale", ["x", "s"], ["y"], domain="custom")]
    model = make_model(nodes, {"x": np.zeros(3, np.float32), "s": np.zeros(3, np.float32)}, ["y"],
                       extra_opsets={"custom": 1})
    model.functions.append(body)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]))
    registry = default_registry().copy()

    @registry.register("Scale", "custom", differentiable=("X", "s"), inputs=("X", "s"))
    def scale(op, node, dY):
        X, s = node.inputs
        return {"X": op.Mul(dY, s), "s": op.Mul(dY, X)}

    with pytest.raises(MissingRuleError):
        autodiff_pass(of="y", wrt=["x"])(ir.from_proto(model))
    feeds = {"x": R.standard_normal(3).astype(np.float32), "s": R.standard_normal(3).astype(np.float32)}
    assert_gradients(model, feeds, ["x", "s"], registry=registry)


def test_registry_override_takes_precedence():
    registry = GradRegistry()

    @registry.register("Neg", differentiable=("X",))
    def wrong_neg(op, node, dY):
        return {"X": dY}

    model = make_model([helper.make_node("Neg", ["x"], ["y"])], {"x": np.zeros(2, np.float32)}, ["y"])
    proto, _ = differentiate(model, of="y", wrt=["x"], registry=registry)
    out = run(proto, {"x": np.zeros(2, np.float32), "dy": np.ones(2, np.float32)})
    np.testing.assert_array_equal(out["grad_x"], np.ones(2, np.float32))


def test_initializer_gradients_default_to_every_float_initializer():
    W = R.standard_normal((3,)).astype(np.float32)
    model = make_model(
        [helper.make_node("Mul", ["x", "W"], ["m"]), helper.make_node("Gather", ["m", "i"], ["y"])],
        {"x": np.zeros(3, np.float32)}, ["y"],
        initializers={"W": W, "i": np.array([0, 2], np.int64)},
    )
    if "Gather" not in default_registry():
        pytest.skip("Gather rule not registered")
    proto, autodiff = differentiate(model, of="y")
    assert list(autodiff.gradient_names) == ["W"]
    x = R.standard_normal(3).astype(np.float32)
    fd = fd_vjp(model, {"x": x}, ["W"], [np.ones(2)])
    out = run(proto, {"x": x, "dy": np.ones(2, np.float32)})
    np.testing.assert_allclose(out["grad_W"], fd["W"], atol=1e-5)


def test_pass_leaves_graph_valid_for_pass_manager_chaining():
    model = fan_out_model(2) if "Sum" in default_registry() else fan_out_model(1)
    of = model.graph.output[0].name
    result = ir.passes.PassManager([autodiff_pass(of=of, wrt=["x"]), *cleanup_passes()])(ir.from_proto(model))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.graph.output[-1].name == "grad_x"
