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
from onnx_autodiff.toolkit.inference import _infer_model_shapes, infer_shapes

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


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul"])
def test_input_without_a_shape_gets_run_time_reductions(op):
    """X declares no shape, B is [4]: one graph serves every rank of X. ONNX requires main-graph
    inputs to declare a rank, so such a model fails the checker on X itself; the pass adds nothing
    else invalid (with X's and grad_X's ranks declared, the result passes)."""
    nodes = [helper.make_node(op, ["X", "B"], ["h"]), helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0)]
    model = make_model(nodes, {"X": np.zeros(1, np.float32), "B": np.zeros(4, np.float32)}, ["y"], shapes={"X": None},
                       output_shapes={"y": []})
    assert not model.graph.input[0].type.tensor_type.HasField("shape")
    for wrt in (["X"], ["B"], ["X", "B"]):
        proto = ir.to_proto(autodiff_pass(of="y", wrt=wrt)(ir.from_proto(model)).model)
        unshaped = [v.name for v in (*proto.graph.input, *proto.graph.output) if not v.type.tensor_type.HasField("shape")]
        assert unshaped == ["X"] + (["grad_X"] if "X" in wrt else [])
        for x_shape in ((2, 4), (4,), (3, 1, 4), ()):
            declared = onnx.ModelProto()
            declared.CopyFrom(proto)
            for value in (*declared.graph.input, *declared.graph.output):
                if value.name in unshaped:
                    value.type.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(1, x_shape).tensor_type.shape)
            onnx.checker.check_model(declared, full_check=True)
            onnx.shape_inference.infer_shapes(declared, check_type=True, strict_mode=True)
            feeds = {"X": R.uniform(0.5, 1.5, x_shape).astype(np.float32), "B": R.uniform(0.5, 1.5, 4).astype(np.float32)}
            out = run(proto, feeds)
            fd = fd_vjp(model, feeds, wrt, [np.ones((), np.float32)])
            for name in wrt:
                assert out[f"grad_{name}"].shape == feeds[name].shape
                np.testing.assert_allclose(out[f"grad_{name}"], fd[name], rtol=1e-4, atol=1e-4)


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
    assert info.value.nodes == [("mine", "MyOp", "custom", 3)]
    assert "\n" not in message


def test_every_unsupported_op_on_the_path_is_named_in_one_error():
    nodes = [
        helper.make_node("MyOp", ["x"], ["a"], domain="custom", name="first"),
        helper.make_node("Neg", ["a"], ["b"]),
        helper.make_node("Other", ["b", "x"], ["c"], domain="acme", name="second"),
        helper.make_node("MyOp", ["c"], ["y"], domain="custom", name="third"),
        helper.make_node("Unknown", ["x"], ["unused"], domain="acme", name="off_path"),
    ]
    model = make_model(nodes, {"x": np.zeros(2, np.float32)}, ["y", "unused"],
                       extra_opsets={"custom": 3, "acme": 1}, output_shapes={"y": [2], "unused": [2]})
    with pytest.raises(MissingRuleError) as info:
        autodiff_pass(of="y", wrt=["x"])(ir.from_proto(model))
    assert info.value.nodes == [
        ("first", "MyOp", "custom", 3), ("second", "Other", "acme", 1), ("third", "MyOp", "custom", 3)
    ]
    message = str(info.value)
    assert "\n" not in message and "3 nodes" in message and "off_path" not in message
    for part in ("op MyOp (domain custom, opset 3) at 'first', 'third'", "op Other (domain acme, opset 1) at 'second'",
                 "register_gradient"):
        assert part in message


def test_unsupported_ops_inside_and_outside_a_subgraph_are_named_in_one_error():
    then_branch = helper.make_graph(
        [helper.make_node("MyOp", ["x"], ["t"], domain="custom", name="in_then")], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    nodes = [
        helper.make_node("If", ["cond"], ["h"], name="choice", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Other", ["h"], ["y"], domain="acme", name="outside"),
    ]
    model = make_model(nodes, {"cond": np.array(True), "x": np.zeros(2, np.float32)}, ["y"],
                       extra_opsets={"custom": 3, "acme": 1}, output_shapes={"y": [2]})
    registry = default_registry().copy()
    registry.register("Other", "acme", differentiable=("x",), inputs=("x",))(lambda op, node, dY: {"x": dY})
    with pytest.raises(MissingRuleError) as info:
        autodiff_pass(of="y", wrt=["x"])(ir.from_proto(model))
    assert info.value.nodes == [("outside", "Other", "acme", 1), ("in_then", "MyOp", "custom", 3)]
    assert "'in_then' in a subgraph of 'choice' (If)" in str(info.value)
    with pytest.raises(MissingRuleError) as info:  # with a rule for the outer one, the inner one alone
        autodiff_pass(of="y", wrt=["x"], registry=registry)(ir.from_proto(model))
    assert info.value.nodes == [("in_then", "MyOp", "custom", 3)]


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


# --- Shapes onnx's inference leaves unknown, completed node by node -----------------------------


def test_ranks_inside_a_scan_body_reading_outer_constants():
    """Unsqueeze axes read from an outer-scope Constant leave onnx's inference of the body without
    ranks; MatMul's rule needs them, and the completion finds them."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Unsqueeze", ["k_t", "last"], ["col"]),
         helper.make_node("Unsqueeze", ["k_t", "first"], ["row"]),
         helper.make_node("MatMul", ["col", "row"], ["outer"]),
         helper.make_node("Add", ["s", "outer"], ["s_next"]),
         helper.make_node("MatMul", ["row", "s_next"], ["read"]),
         helper.make_node("Squeeze", ["read", "first"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("s", f, [3, 3]), helper.make_tensor_value_info("k_t", f, [3])],
        [helper.make_tensor_value_info("s_next", f, None), helper.make_tensor_value_info("y_t", f, None)],
    )
    nodes = [helper.make_node("Constant", [], ["last"], value_ints=[-1]),
             helper.make_node("Constant", [], ["first"], value_ints=[0]),
             helper.make_node("Scan", ["s0", "ks"], ["s_final", "ys"], body=body, num_scan_inputs=1),
             helper.make_node("Mul", ["ys", "ys"], ["y"])]
    model = make_model(nodes, {"s0": np.zeros((3, 3), np.float32), "ks": np.zeros((4, 3), np.float32)},
                       ["y"], output_shapes={"y": [4, 3]})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    scan = next(n for n in inferred.graph.node if n.op_type == "Scan")
    col = [v for v in scan.attribute[0].g.value_info if v.name == "col"]
    assert not col or not col[0].type.tensor_type.HasField("shape")  # the gap being filled

    graph = ir.from_proto(model)
    infer_shapes(graph)
    body_values = {v.name: v for n in graph.graph for v in n.outputs}
    values = {o.name: o for n in graph.graph.node(2).attributes["body"].value for o in n.outputs}
    assert [d for d in values["col"].shape] == [3, 1] and [d for d in values["y_t"].shape] == [3]
    assert body_values["ys"].shape is not None and len(body_values["ys"].shape) == 2
    feeds = {"s0": R.standard_normal((3, 3)).astype(np.float32), "ks": R.standard_normal((4, 3)).astype(np.float32)}
    assert_gradients(model, feeds, ["s0", "ks"])


def test_ranks_after_a_split_with_computed_sizes():
    """Split sizes computed from Shape: onnx's inference gives the parts no rank; Concat's rule
    needs it."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"], start=1),
             helper.make_node("Constant", [], ["two"], value_ints=[2]),
             helper.make_node("Sub", ["shape", "two"], ["rest"]),
             helper.make_node("Concat", ["two", "rest"], ["sizes"], axis=0),
             helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1),
             helper.make_node("Neg", ["a"], ["na"]),
             helper.make_node("Concat", ["b", "na"], ["y"], axis=-1)]
    model = make_model(nodes, {"x": np.zeros((2, 5), np.float32)}, ["y"], shapes={"x": ["N", 5]},
                       output_shapes={"y": ["N", 5]})
    for n in (1, 3):
        assert_gradients(model, {"x": R.standard_normal((n, 5)).astype(np.float32)}, ["x"])


def test_loop_carried_output_keeps_the_rank_the_body_keeps():
    """onnx gives a Loop's carried outputs no shape (they may change between iterations); where the
    body keeps a state's rank and dims, the output has them too."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Sin", ["h"], ["h_out"])],
        "body",
        [helper.make_tensor_value_info("i", i64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h", f, [2, 3])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_tensor_value_info("h_out", f, [2, 3])],
    )
    nodes = [helper.make_node("Loop", ["M", "go", "h0"], ["h_final"], body=body),
             helper.make_node("Mul", ["h_final", "w"], ["y"])]
    model = make_model(nodes, {"h0": np.zeros((2, 3), np.float32), "w": np.zeros((1, 3), np.float32)}, ["y"],
                       initializers={"M": np.array(3, np.int64), "go": np.array(True)}, opset=11,
                       shapes={"w": ["K", 3]}, output_shapes={"y": [2, 3]})
    graph = ir.from_proto(model)
    infer_shapes(graph)
    assert list(graph.graph.node(0).outputs[0].shape) == [2, 3]
    for k in (1, 2):  # w's first extent only known at run time: 1 broadcasts, 2 does not
        feeds = {"h0": R.standard_normal((2, 3)).astype(np.float32), "w": R.standard_normal((k, 3)).astype(np.float32)}
        assert_gradients(model, feeds, ["h0", "w"])


@pytest.mark.parametrize("opset", [11, 12, 18])
@pytest.mark.parametrize("b_shape", [["M", 3], ["L"], ["M", "L"]])
def test_runtime_broadcast_axes_at_every_opset(opset, b_shape):
    """Below opset 13 ReduceSum takes its axes as an attribute: the axes only known at run time are
    summed by viewing each axis as (x extent, y extent / x extent)."""
    nodes = [helper.make_node("Mul", ["A", "B"], ["y"])]
    b = np.zeros([2 if isinstance(d, str) else d for d in b_shape], np.float32)
    model = make_model(nodes, {"A": np.zeros((2, 3), np.float32), "B": b}, ["y"],
                       shapes={"A": ["N", 3], "B": b_shape}, opset=opset)
    for b_dims in ([1, 3], [4, 3], [3], [1], [4, 1], [1, 1]):
        if len(b_dims) != len(b_shape) or any(isinstance(s, int) and s != d for s, d in zip(b_shape, b_dims)):
            continue
        feeds = {"A": R.standard_normal((4, 3)).astype(np.float32), "B": R.standard_normal(b_dims).astype(np.float32)}
        assert_gradients(model, feeds, ["A", "B"])


def test_dims_onnx_leaves_unknown_are_refined_from_values_known_before_run_time():
    """Expand's target shape comes out of an If whose condition is known (Size of a static x):
    onnx's inference makes up unknown dims ("unk__0"), the completion finds the real ones."""
    def shape_of(name, dims):
        return helper.make_graph([helper.make_node("Constant", [], [name], value_ints=dims)], name, [],
                                 [helper.make_tensor_value_info(name, TensorProto.INT64, [len(dims)])])

    nodes = [helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Equal", ["n", "three"], ["cond"]),
             helper.make_node("If", ["cond"], ["target"], then_branch=shape_of("a", [2, 3]),
                              else_branch=shape_of("b", [4, 3])),
             helper.make_node("Expand", ["x", "target"], ["e"]),
             helper.make_node("Tanh", ["e"], ["y"])]
    model = make_model(nodes, {"x": np.zeros((1, 3), np.float32)}, ["y"],
                       initializers={"three": np.array(3, np.int64)}, output_shapes={"y": [2, 3]})
    graph = ir.from_proto(model)
    _infer_model_shapes(graph)
    assert not all(isinstance(d, int) for d in graph.graph.node(3).outputs[0].shape)
    infer_shapes(graph)
    assert list(graph.graph.node(3).outputs[0].shape) == [2, 3]
    assert_gradients(model, {"x": R.standard_normal((1, 3)).astype(np.float32)}, ["x"])


# Saved forward outputs (GradRule.saves) and tied parameters


def _layer_norms(count, x_shape=(4, 3, 6), extra_nodes=()):
    """``count`` chained LayerNormalizations (opset 17, output Y only, as the torch exporter
    leaves them) sharing one Scale and one B initializer; returns (model, feeds)."""
    d = x_shape[-1]
    scale = R.uniform(0.5, 1.5, d).astype(np.float32)
    bias = R.standard_normal(d).astype(np.float32)
    nodes, previous = [], "x"
    for i in range(count):
        nodes.append(helper.make_node("LayerNormalization", [previous, "s", "b"], [f"y{i}"], axis=-1))
        previous = f"y{i}"
    nodes.extend(extra_nodes)
    x = R.standard_normal(x_shape).astype(np.float32)
    model = make_model(nodes, {"x": x}, [previous], initializers={"s": scale, "b": bias}, opset=17)
    return model, {"x": x, "s": scale, "b": bias}


def _torch_layer_norms(count, feeds, dy):
    """The same chain in PyTorch autograd (float64): gradients of sum(dy * y) for x, s, b."""
    torch = pytest.importorskip("torch")
    x, s, b = (torch.tensor(feeds[k], dtype=torch.float64, requires_grad=True) for k in ("x", "s", "b"))
    y = x
    for _ in range(count):
        y = torch.nn.functional.layer_norm(y, (x.shape[-1],), s, b, eps=1e-5)
    (y * torch.from_numpy(dy.astype(np.float64))).sum().backward()
    return {"x": x.grad.numpy(), "s": s.grad.numpy(), "b": b.grad.numpy()}


def test_saved_outputs_reuse_forward_statistics():
    model, feeds = _layer_norms(1)
    proto, autodiff = differentiate(model, of="y0", wrt=["x", "s", "b"], seed="input")
    ln = next(n for n in proto.graph.node if n.op_type == "LayerNormalization")
    assert len(ln.output) == 3 and all(ln.output), "the forward node gained Mean and InvStdDev"
    names = [o for n in proto.graph.node for o in n.output]
    assert len(names) == len(set(names))
    backward = [n.op_type for n in proto.graph.node if n is not ln]
    assert "Sqrt" not in backward and "Reciprocal" not in backward  # not recomputed
    dy = R.standard_normal(feeds["x"].shape).astype(np.float32)
    out = run(proto, {"x": feeds["x"], autodiff.seed_name: dy})
    np.testing.assert_array_equal(out["y0"], run(model, {"x": feeds["x"]})["y0"])  # forward unchanged
    want = _torch_layer_norms(1, feeds, dy)
    for name in ("x", "s", "b"):
        np.testing.assert_allclose(out[autodiff.gradient_names[name]], want[name], rtol=1e-4, atol=1e-4)


def test_saved_outputs_get_fresh_names():
    # a value already named like the engine's first choice for the saved output
    taken = helper.make_node("Identity", ["y0"], ["y0_Mean"])
    model, feeds = _layer_norms(1, extra_nodes=[taken, helper.make_node("Add", ["y0_Mean", "y0"], ["z"])])
    proto, _ = differentiate(model, of="z", wrt=["x"], seed="ones")
    ln = next(n for n in proto.graph.node if n.op_type == "LayerNormalization")
    assert ln.output[1] != "y0_Mean" and ln.output[1] and ln.output[2]
    again, _ = differentiate(model, of="z", wrt=["x"], seed="ones")
    assert again.SerializeToString() == proto.SerializeToString()  # deterministic


def test_saved_outputs_through_gradient_of_function_leave_the_caller_model_alone():
    from onnx_autodiff import gradient_of_function

    model, feeds = _layer_norms(1)
    before = model.SerializeToString()
    function = gradient_of_function(model, ["x", "s", "b"], "y0")
    assert model.SerializeToString() == before
    ln = next(n for n in function.node if n.op_type == "LayerNormalization")
    assert len(ln.output) == 3 and all(ln.output)
    dy = R.standard_normal(feeds["x"].shape).astype(np.float32)
    inputs = {**feeds, "dy": dy}
    outs = [f"g{i}" for i in range(3)]
    graph = helper.make_graph(
        [helper.make_node(function.name, list(function.input), outs, domain=function.domain)],
        "caller",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, inputs[n].shape) for n in function.input],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, feeds[k].shape) for o, k in zip(outs, "xsb")],
    )
    opsets = [helper.make_opsetid(o.domain, o.version) for o in function.opset_import]
    caller = helper.make_model(graph, opset_imports=[*opsets, helper.make_opsetid(function.domain, 1)],
                               functions=[function], ir_version=8)
    onnx.checker.check_model(caller, full_check=True)
    got = run(caller, inputs)
    want = _torch_layer_norms(1, feeds, dy)
    for out, name in zip(outs, "xsb"):
        np.testing.assert_allclose(got[out], want[name], rtol=1e-4, atol=1e-4)


def test_saved_outputs_must_be_named_by_the_schema():
    registry = default_registry().copy()

    @registry.register("Relu", differentiable=("X",), saves=("Mask",))
    def relu(op, node, dY):
        return {"X": dY}

    x = R.standard_normal((2, 3)).astype(np.float32)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": x}, ["y"])
    from onnx_autodiff.errors import AutodiffError

    with pytest.raises(AutodiffError, match="saves outputs \\['Mask'\\]"):
        differentiate(model, of="y", wrt=["x"], registry=registry, seed="ones")


def test_register_gradient_passes_saves_on():
    from onnx_autodiff import register_gradient

    registry = default_registry().copy()
    seen = []

    @register_gradient("LayerNormalization", differentiable=("X",), saves=("InvStdDev",), registry=registry)
    def layer_norm(op, node, dY, *rest):
        seen.append([v.name for v in node.outputs])
        return {"X": op.Mul(dY, node.outputs[2])}  # a stand-in reading the saved output

    model, _ = _layer_norms(1)
    proto, _ = differentiate(model, of="y0", wrt=["x"], registry=registry, seed="ones")
    ln = next(n for n in proto.graph.node if n.op_type == "LayerNormalization")
    assert len(seen) == 1 and len(seen[0]) == 3 and seen[0][2] == ln.output[2] != ""


def _reductions(proto) -> int:
    """Sums over broadcast axes: ReduceSum, or a product with ones for a bias's column sums."""
    return sum(n.op_type in ("ReduceSum", "MatMul") for n in proto.graph.node)


def test_tied_layer_norm_parameters_are_reduced_once():
    # three LayerNormalizations share s and b: the unreduced contributions are summed first
    model, feeds = _layer_norms(3)
    proto, autodiff = differentiate(model, of="y2", wrt=["x", "s", "b"], seed="input")
    assert _reductions(proto) == 2  # one for s, one for b (not one per use)
    dy = R.standard_normal(feeds["x"].shape).astype(np.float32)
    out = run(proto, {"x": feeds["x"], autodiff.seed_name: dy})
    want = _torch_layer_norms(3, feeds, dy)
    for name in ("x", "s", "b"):
        np.testing.assert_allclose(out[autodiff.gradient_names[name]], want[name], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("limit,reduction", [(1 << 16, "MatMul"), (11, "ReduceSum")])
def test_bias_column_sums_by_ones_up_to_a_row_limit(monkeypatch, limit, reduction):
    # (3, 4) rows of a bias's gradient: the rule's ReduceSum, lowered for onnxruntime to a
    # product with a stored vector of ones, or beyond the limit (that vector would bloat the
    # model) left a ReduceSum; the same gradient either way
    from onnx_autodiff.passes.rewrite_rules import lowering

    monkeypatch.setattr(lowering, "COLUMN_SUM_ROWS", limit)
    x = R.standard_normal((3, 4, 5)).astype(np.float32)
    b = R.standard_normal(5).astype(np.float32)
    model = make_model([helper.make_node("Add", ["x", "b"], ["p"]), helper.make_node("Tanh", ["p"], ["y"])],
                       {"x": x, "b": b}, ["y"])
    proto, _ = differentiate(model, of="y", wrt=["b"], seed="ones")
    cleaned = ir.from_proto(proto)
    ir.passes.PassManager(cleanup_passes())(cleaned)
    proto = ir.to_proto(cleaned)
    ops = [n.op_type for n in proto.graph.node]
    assert reduction in ops and ({"MatMul", "ReduceSum"} - {reduction}).isdisjoint(ops)
    assert_gradients(model, {"x": x, "b": b}, ["b"])


def test_tied_bias_summed_before_one_reduction_per_broadcast_shape():
    # b is added to two (4, 6) tensors and to one (2, 4, 6) tensor: one ReduceSum for the two
    # uses of one shape, one for the other (different reductions are never mixed)
    x = R.standard_normal((4, 6)).astype(np.float32)
    w = R.standard_normal((2, 4, 6)).astype(np.float32)
    b = R.standard_normal(6).astype(np.float32)
    nodes = [
        helper.make_node("Add", ["x", "b"], ["p"]),
        helper.make_node("Tanh", ["p"], ["q"]),
        helper.make_node("Add", ["q", "b"], ["r"]),
        helper.make_node("Add", ["w", "b"], ["t"]),
        helper.make_node("Mul", ["r", "t"], ["y"]),
    ]
    model = make_model(nodes, {"x": x, "w": w, "b": b}, ["y"])
    proto, _ = differentiate(model, of="y", wrt=["b"], seed="ones")
    assert _reductions(proto) == 3  # + the Mul's own (2,4,6)->(4,6)
    assert_gradients(model, {"x": x, "w": w, "b": b}, ["x", "w", "b"])


@pytest.mark.parametrize("opset", [17, 18])
def test_register_gradient_since_until_bound_the_opsets(opset):
    from onnx_autodiff import register_gradient

    registry = default_registry().copy()
    used = []

    # a rule of one's own for opsets up to 17; the shipped rule stays for later ones
    @register_gradient("LayerNormalization", differentiable=("X",), until=17, registry=registry)
    def layer_norm_until_17(op, node, dY, *rest):
        used.append(opset)
        return {"X": op.Mul(dY, op.const(2.0, like=dY))}

    model, _ = _layer_norms(1)
    model.opset_import[0].version = opset
    differentiate(model, of="y0", wrt=["x"], registry=registry, seed="ones")
    assert used == ([17] if opset <= 17 else [])
    with pytest.raises(TypeError):  # one way to give the bounds: not both
        register_gradient("Relu", opsets=(1, 5), since=2, registry=registry)


def test_the_backward_makes_one_constant_per_number_and_axes():
    """Tanh's rule reads the number 1 and each bias sum the axes [0]: one Constant each for the
    whole backward (the cleanup would otherwise infer, fold and merge one per node); a builder
    that does not share (a LoRA site's) still makes its own."""
    from onnx import numpy_helper

    from onnx_autodiff.toolkit import Namer, OpBuilder

    nodes, x = [], "x"
    inits = {}
    for i in range(3):
        inits[f"b{i}"] = R.standard_normal(4).astype(np.float32)
        nodes += [helper.make_node("Add", [x, f"b{i}"], [f"a{i}"]), helper.make_node("Tanh", [f"a{i}"], [f"t{i}"])]
        x = f"t{i}"
    model = make_model(nodes, {"x": R.standard_normal((2, 4)).astype(np.float32)}, [x], initializers=inits)
    proto, _ = differentiate(model, of=x, wrt=list(inits))
    constants = [numpy_helper.to_array(n.attribute[0].t).tolist() for n in proto.graph.node if n.op_type == "Constant"]
    assert sorted(map(str, constants)) == ["1.0", "[0]"]
    assert_gradients(model, {"x": R.standard_normal((2, 4)).astype(np.float32)}, list(inits))
    op = OpBuilder(18, Namer(set()))
    y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT))
    op.Sub(1.0, y), op.Sub(1.0, y)
    assert [n.op_type for n in op.nodes].count("Constant") == 2


def _run_function(function: onnx.FunctionProto, feeds: dict) -> list[np.ndarray]:
    """Calls ``function`` from a model whose inputs have the feeds' shapes (the function itself
    carries no types), checked and run on onnxruntime."""
    graph = helper.make_graph(
        [helper.make_node(function.name, list(function.input), list(function.output), domain=function.domain)],
        "caller",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, feeds[n].shape) for n in function.input],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, feeds[x].shape)
         for n, x in zip(function.output, function.input)],
    )
    opsets = [helper.make_opsetid(o.domain, o.version) for o in function.opset_import]
    model = helper.make_model(graph, opset_imports=[*opsets, helper.make_opsetid(function.domain, 1)],
                              functions=[function], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 2)),
    ((4,), (4, 5)), ((2, 3, 4), (4,)), ((4,), (4,)),
])
def test_matmul_of_operands_of_unknown_rank_in_a_bare_node_list(a_shape, b_shape):
    """A FunctionProto carries no types: MatMul's gradient is rank-polymorphic, as Mul's and
    Gemm's are, and matches finite differences at every rank its forward takes."""
    from onnx_autodiff import gradient_of_nodes
    from onnx_autodiff.conformance.check import compare

    nodes = [helper.make_node("MatMul", ["A", "B"], ["C"]), helper.make_node("Tanh", ["C"], ["y"])]
    function = gradient_of_nodes(nodes, ["A", "B"], "y", opset_imports={"": 18})
    feeds = {"A": R.standard_normal(a_shape).astype(np.float32), "B": R.standard_normal(b_shape).astype(np.float32)}
    forward = make_model(nodes, feeds, ["y"])
    dy = R.standard_normal(np.tanh(np.matmul(feeds["A"], feeds["B"])).shape).astype(np.float32)
    grads = _run_function(function, {**feeds, "dy": dy})
    fd = fd_vjp(forward, feeds, ["A", "B"], [dy])
    for name, grad in zip(["A", "B"], grads):
        assert compare(grad, fd.details[name], 1e-4, 1e-3) <= 1.0, name


def test_reshape_to_a_computed_shape_before_opset_13_keeps_its_rank_and_opset():
    """An unoptimised export at opset 12 reshapes to a shape computed from Shape (Concat of
    Gathers): onnx's Reshape-5 inference gives no rank there, and the broadcast Add downstream then
    had no rank to undo its broadcast with before opset 13."""
    x = R.standard_normal((2, 3, 4)).astype(np.float32)
    b = R.standard_normal((1, 3, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Concat", ["n", "three", "m1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Add", ["r", "b"], ["z"]),
        helper.make_node("Tanh", ["z"], ["y"]),
    ]
    ints = {"i0": np.array([0], np.int64), "three": np.array([3], np.int64), "m1": np.array([-1], np.int64)}
    model = make_model(nodes, {"x": x}, ["y"], initializers={**ints, "b": b}, shapes={"x": ["N", "C", "L"]}, opset=12)
    assert_gradients(model, {"x": x}, ["x", "b"])
    out, _ = differentiate(model, of="y", wrt=["b"])
    assert {o.domain: o.version for o in out.opset_import}[""] == 12  # ranks found: no conversion


def test_matmul_inside_a_branch_on_a_value_of_unknown_rank():
    """A branch reshapes x to a shape fed at run time: the product there has an operand of no
    rank, which MatMul's gradient does without."""
    def branch(name, nodes, out):
        return helper.make_graph(nodes, name, [], [helper.make_value_info(out, onnx.TypeProto())])

    then_branch = branch("t", [helper.make_node("Reshape", ["x", "s"], ["xr"]),
                               helper.make_node("MatMul", ["xr", "W"], ["m"]),
                               helper.make_node("Tanh", ["m"], ["o"])], "o")
    else_branch = branch("e", [helper.make_node("Identity", ["zeros"], ["o2"])], "o2")
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    feeds = {"cond": np.array(True), "x": R.standard_normal((2, 6)).astype(np.float32),
             "s": np.array([2, 2, 3], np.int64)}
    model = make_model(nodes, feeds, ["y"], shapes={"s": ["R"]}, output_shapes={"y": [2, 2, 4]},
                       initializers={"W": R.standard_normal((3, 4)).astype(np.float32),
                                     "zeros": np.zeros((2, 2, 4), np.float32)})
    assert_gradients(model, feeds, ["x", "W"])


@pytest.mark.parametrize("opset", [11, 12])
def test_torchscript_export_with_dynamic_sizes_before_opset_13(opset):
    """A detection head's ``box.reshape(n, 4, 4, H*W).softmax(2)`` exported by TorchScript with
    dynamic N, H, W: the Reshape's target is computed from Shape, and the broadcasts after it are
    undone at the model's own opset; gradients equal PyTorch's at two input sizes."""
    torch = pytest.importorskip("torch")
    import io

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.d = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 1)

        def forward(self, x):
            n, _, h, w = x.shape
            features = torch.relu(self.c(x))
            box = self.d(features)
            p = box.reshape(n, 4, 4, h * w).softmax(2)
            return (p * box.reshape(n, 4, 4, h * w)).sum() + (features + box).mean()

    torch.manual_seed(0)
    net, buffer = Net(), io.BytesIO()
    torch.onnx.export(net, (torch.randn(2, 3, 5, 6),), buffer, dynamo=False, opset_version=opset,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    model = onnx.load_from_string(buffer.getvalue())
    names = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
    out, _ = differentiate(model, of="y", wrt=names)
    assert {o.domain: o.version for o in out.opset_import}[""] == opset
    onnx.checker.check_model(out, full_check=True)
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    parameters = dict(net.named_parameters())
    for shape in ((2, 3, 5, 6), (1, 3, 4, 7)):
        x = torch.randn(shape)
        net.zero_grad()
        net(x).backward()
        results = dict(zip([o.name for o in out.graph.output], session.run(None, {"x": x.numpy()})))
        for name in names:
            np.testing.assert_allclose(results[f"grad_{name}"], parameters[name].grad.numpy(), rtol=1e-4, atol=1e-5)


def test_an_if_whose_condition_is_known_has_the_types_of_the_branch_it_takes():
    """Branches of different ranks (a function body written for 2-D and 3-D inputs) give the If's
    output no shape in onnx's inference; the condition known before run time picks one, and
    MatMul's gradient after it takes its static form (no Einsum, no run-time shapes)."""
    def branch(name, source):
        return helper.make_graph([helper.make_node("Identity", [source], [f"{name}_out"])], name, [],
                                 [helper.make_value_info(f"{name}_out", onnx.TypeProto())])

    nodes = [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
             helper.make_node("If", ["cond"], ["t"], then_branch=branch("three", "x3"), else_branch=branch("two", "x2")),
             helper.make_node("MatMul", ["t", "W"], ["y"])]
    feeds = {"x3": R.standard_normal((2, 3, 4)).astype(np.float32), "x2": R.standard_normal((3, 4)).astype(np.float32)}
    model = make_model(nodes, feeds, ["y"], initializers={"W": R.standard_normal((4, 5)).astype(np.float32)},
                       output_shapes={"y": [2, 3, 5]})
    assert_gradients(model, feeds, ["x3", "W"])
    out, _ = differentiate(model, of="y", wrt=["x3", "W"])
    assert not {"Einsum", "Shape"} & {n.op_type for n in out.graph.node}


def test_stop_gradient_blocks_the_flow_through_a_value():
    # y = sum(x · stop(x)): dy/dx = stop(x), not 2x (torch's x * x.detach())
    from onnx_autodiff.passes.autodiff import stop_gradient

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    held = ir.node("Identity", [x])
    product = ir.node("Mul", [x, held.outputs[0]])
    total = ir.node("ReduceSum", [product.outputs[0]], attributes={"keepdims": 0})
    total.outputs[0].name = "y"
    graph = ir.Graph([x], [total.outputs[0]], nodes=[held, product, total], opset_imports={"": 18})
    stop_gradient(held.outputs[0])
    model = ir.Model(graph, ir_version=10)
    autodiff_pass(of="y", wrt=["x"])(model)
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    value = np.array([1.0, -2.0, 3.0], np.float32)
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": value})))
    np.testing.assert_allclose(outputs[[n for n in outputs if n != "y"][0]], value)
