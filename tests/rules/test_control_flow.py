import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_gradients, assert_valid_model, make_model, rng
from onnx_autodiff import autodiff_pass, cleanup_passes
from onnx_autodiff.conformance import fd_vjp
from onnx_autodiff.conformance.check import backward_model, compare
from onnx_autodiff.errors import RuleError

R = rng(11)


def branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])


def if_model():
    then_branch = branch("then", [helper.make_node("Mul", ["x", "W"], ["t1"]), helper.make_node("Tanh", ["t1"], ["t2"])], "t2")
    else_branch = branch("else", [helper.make_node("Sin", ["x"], ["e1"])], "e1")
    nodes = [
        helper.make_node("If", ["cond"], ["h"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["h", "x"], ["y"]),
    ]
    x = np.zeros((2, 3), np.float32)
    return make_model(nodes, {"cond": np.array(True), "x": x, "W": x}, ["y"], output_shapes={"y": [2, 3]})


@pytest.mark.parametrize("cond", [True, False])
def test_if_captured_values(cond):
    feeds = {"cond": np.array(cond), "x": R.standard_normal((2, 3)).astype(np.float32),
             "W": R.standard_normal((2, 3)).astype(np.float32)}
    result = assert_gradients(if_model(), feeds, ["x", "W"])
    if not cond:
        assert np.all(result.ad["W"] == 0)


def test_nested_if():
    inner = helper.make_node(
        "If", ["c2"], ["i"],
        then_branch=branch("t", [helper.make_node("Exp", ["x"], ["ti"])], "ti"),
        else_branch=branch("e", [helper.make_node("Neg", ["x"], ["ei"])], "ei"),
    )
    outer_then = branch("ot", [inner, helper.make_node("Mul", ["i", "x"], ["o"])], "o")
    outer_else = branch("oe", [helper.make_node("Cos", ["x"], ["c"])], "c")
    nodes = [helper.make_node("If", ["c1"], ["y"], then_branch=outer_then, else_branch=outer_else)]
    x = R.standard_normal(4).astype(np.float32)
    model = make_model(nodes, {"c1": np.array(True), "c2": np.array(True), "x": x}, ["y"], output_shapes={"y": [4]})
    for c1 in (True, False):
        for c2 in (True, False):
            assert_gradients(model, {"c1": np.array(c1), "c2": np.array(c2), "x": x}, ["x"])


def loop_model(trip_count=4, with_scan=True):
    """h_{i+1} = tanh(h_i * W + x * i); scan output s_i = h_{i+1} * h_{i+1}; y = h_final (+ scans)."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["i_f"], to=f),
            helper.make_node("Mul", ["h", "W"], ["hw"]),
            helper.make_node("Mul", ["x", "i_f"], ["xi"]),
            helper.make_node("Add", ["hw", "xi"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_next"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Mul", ["h_next", "h_next"], ["s"]),
        ],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h", f, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_next", f, [3])]
        + ([helper.make_tensor_value_info("s", f, [3])] if with_scan else []),
    )
    outputs = ["h_final", "scans"] if with_scan else ["h_final"]
    nodes = [helper.make_node("Loop", ["M", "", "h0"], outputs, body=body)]
    shapes = {"h_final": [3], "scans": [trip_count, 3]}
    model = make_model(
        nodes,
        {"h0": np.zeros(3, np.float32), "x": np.zeros(3, np.float32), "W": np.zeros(3, np.float32)},
        outputs,
        initializers={"M": np.array(trip_count, np.int64)},
        output_shapes={k: shapes[k] for k in outputs},
    )
    return model


@pytest.mark.parametrize("with_scan", [True, False])
def test_loop_carried_scan_and_captured(with_scan):
    feeds = {k: (R.standard_normal(3) * 0.7).astype(np.float32) for k in ("h0", "x", "W")}
    assert_gradients(loop_model(with_scan=with_scan), feeds, ["h0", "x", "W"])


def test_loop_stopped_by_condition_with_integer_carried_value():
    """Carries (k: int64, h: float); stops when k reaches 3 although M = 10."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    body = helper.make_graph(
        [
            helper.make_node("Add", ["k", "one"], ["k_next"]),
            helper.make_node("Less", ["k_next", "three"], ["cond_out"]),
            helper.make_node("Sin", ["h"], ["s"]),
            helper.make_node("Mul", ["s", "W"], ["h_next"]),
        ],
        "body",
        [helper.make_tensor_value_info("i", i64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("k", i64, []), helper.make_tensor_value_info("h", f, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("k_next", i64, []), helper.make_tensor_value_info("h_next", f, [2])],
    )
    nodes = [helper.make_node("Loop", ["M", "go", "k0", "h0"], ["k_final", "h_final"], body=body),
             helper.make_node("Mul", ["h_final", "h_final"], ["y"])]
    model = make_model(
        nodes, {"h0": np.zeros(2, np.float32), "W": np.zeros(2, np.float32)}, ["y"],
        initializers={"M": np.array(10, np.int64), "go": np.array(True), "k0": np.array(0, np.int64),
                      "one": np.array(1, np.int64), "three": np.array(3, np.int64)},
        output_shapes={"y": [2]},
    )
    feeds = {"h0": np.array([0.4, -0.9], np.float32), "W": np.array([1.3, 0.7], np.float32)}
    assert_gradients(model, feeds, ["h0", "W"])


def scan_model(in_axis=0, in_dir=0, out_axis=0, out_dir=0):
    """state' = tanh(state * W + x_t); y_t = state' * x_t over a (T=4, 3) sequence (axes permuted)."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "W"], ["sw"]), helper.make_node("Add", ["sw", "x_t"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["s_next"]), helper.make_node("Mul", ["s_next", "x_t"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("s", f, [3]), helper.make_tensor_value_info("x_t", f, [3])],
        [helper.make_tensor_value_info("s_next", f, [3]), helper.make_tensor_value_info("y_t", f, [3])],
    )
    node = helper.make_node("Scan", ["s0", "xs"], ["s_final", "ys"], body=body, num_scan_inputs=1,
                            scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                            scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    xs_shape = [4, 3] if in_axis == 0 else [3, 4]
    ys_shape = [4, 3] if out_axis == 0 else [3, 4]
    return make_model([node], {"s0": np.zeros(3, np.float32), "xs": np.zeros(xs_shape, np.float32),
                               "W": np.zeros(3, np.float32)}, ["s_final", "ys"],
                      output_shapes={"s_final": [3], "ys": ys_shape}), xs_shape


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, 0, 0), (0, 0, 1, 1), (-1, 0, -1, 0)])
def test_scan_states_inputs_and_captured(in_axis, in_dir, out_axis, out_dir):
    model, xs_shape = scan_model(in_axis, in_dir, out_axis, out_dir)
    feeds = {"s0": R.standard_normal(3).astype(np.float32), "xs": R.standard_normal(xs_shape).astype(np.float32),
             "W": R.standard_normal(3).astype(np.float32)}
    assert_gradients(model, feeds, ["s0", "xs", "W"])


@pytest.mark.parametrize("directions", [[0, 0], [1, 0], [0, 1]])
def test_scan_opset8_batch_axis(directions):
    """Scan-8: a leading batch axis on every input and output, the sequence on axis 1, input
    directions; state' = tanh(state * W + x_t) + u_t, y_t = state' * x_t."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "W"], ["sw"]), helper.make_node("Add", ["sw", "x_t"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["t"]), helper.make_node("Add", ["t", "u_t"], ["s_next"]),
         helper.make_node("Mul", ["s_next", "x_t"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info(n, f, [3]) for n in ("s", "x_t", "u_t")],
        [helper.make_tensor_value_info("s_next", f, [3]), helper.make_tensor_value_info("y_t", f, [3])],
    )
    node = helper.make_node("Scan", ["", "s0", "xs", "us"], ["s_final", "ys"], body=body,
                            num_scan_inputs=2, directions=directions)
    model = make_model([node], {"s0": np.zeros((2, 3), np.float32), "xs": np.zeros((2, 4, 3), np.float32),
                                "us": np.zeros((2, 4, 3), np.float32), "W": np.zeros(3, np.float32)},
                       ["s_final", "ys"], opset=8, output_shapes={"s_final": [2, 3], "ys": [2, 4, 3]})
    feeds = {"s0": R.standard_normal((2, 3)), "xs": R.standard_normal((2, 4, 3)),
             "us": R.standard_normal((2, 4, 3)), "W": R.standard_normal(3)}
    # symbolic=False: the backward Scan-8 body's outputs get no shape from symbolic inputs, which
    # onnxruntime requires of an opset-8 Scan ("Subgraph must have the shape set for all outputs")
    assert_gradients(model, {k: v.astype(np.float32) for k, v in feeds.items()}, ["s0", "xs", "us", "W"],
                     symbolic=False)


def test_scan_opset8_sequence_lens_refused():
    body = helper.make_graph([helper.make_node("Add", ["s", "x_t"], ["s_next"])], "body",
                             [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("s", "x_t")],
                             [helper.make_tensor_value_info("s_next", TensorProto.FLOAT, [2])])
    node = helper.make_node("Scan", ["lens", "s0", "xs"], ["s_final"], body=body, num_scan_inputs=1)
    model = make_model([node], {"lens": np.array([3], np.int32), "s0": np.zeros((1, 2), np.float32),
                                "xs": np.zeros((1, 3, 2), np.float32)}, ["s_final"], opset=8,
                       output_shapes={"s_final": [1, 2]})
    with pytest.raises(RuleError, match="sequence_lens"):
        backward_model(model, "s_final", ["s0"], seed="input")


def test_if_with_a_condition_known_before_run_time_differentiates_the_branch_taken():
    """cond = (Size(x) == 6) is known from x's static shape: only the branch taken is
    differentiated, the other one (of another rank here, as in function bodies written for several
    ranks) is left alone."""
    then_branch = branch("then", [helper.make_node("Mul", ["x", "W"], ["t1"]), helper.make_node("Tanh", ["t1"], ["t2"])], "t2")
    else_branch = branch("else", [helper.make_node("Unsqueeze", ["x", "zero"], ["e1"])], "e1")
    nodes = [
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Equal", ["n", "six"], ["cond"]),
        helper.make_node("If", ["cond"], ["h"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["h", "x"], ["y"]),
    ]
    x = np.zeros((2, 3), np.float32)
    model = make_model(nodes, {"x": x, "W": x}, ["y"], output_shapes={"y": [2, 3]},
                       initializers={"six": np.array(6, np.int64), "zero": np.array([0], np.int64)})
    feeds = {"x": R.standard_normal((2, 3)).astype(np.float32), "W": R.standard_normal((2, 3)).astype(np.float32)}
    assert_gradients(model, feeds, ["x", "W"])
    proto, _ = backward_model(model, "y", ["x"], seed="input")
    assert sum(n.op_type == "If" for n in proto.graph.node) == 1  # the forward one only


@pytest.mark.parametrize("cleanup", [False, True])
@pytest.mark.parametrize("w_initializer", [False, True])
def test_if_reading_differentiated_outer_values_through_the_pass(w_initializer, cleanup):
    """Both branches read x and W from the outer graph; W a graph input or an initializer; the
    condition picks the branch at run time."""
    then_branch = branch("then", [helper.make_node("Mul", ["x", "W"], ["t1"]), helper.make_node("Tanh", ["t1"], ["t2"])], "t2")
    else_branch = branch("else", [helper.make_node("Sin", ["W"], ["e1"]), helper.make_node("Mul", ["e1", "x"], ["e2"])], "e2")
    nodes = [helper.make_node("If", ["cond"], ["h"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0)]
    W = R.standard_normal(3).astype(np.float32)
    inputs = {"cond": np.array(True), "x": np.zeros(3, np.float32)}
    model = make_model(nodes, inputs if w_initializer else {**inputs, "W": W}, ["y"], output_shapes={"y": []},
                       initializers={"W": W} if w_initializer else None)
    passes = [autodiff_pass(of="y", wrt=["W", "x"]), *(cleanup_passes() if cleanup else ())]
    proto = ir.to_proto(ir.passes.PassManager(passes)(ir.from_proto(model)).model)
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": R.standard_normal(3).astype(np.float32)}
        if not w_initializer:
            feeds["W"] = W
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        fd = fd_vjp(model, feeds, ["W", "x"], [np.ones((), np.float32)])
        for name in ("W", "x"):
            assert compare(outputs[f"grad_{name}"], fd.details[name], atol=1e-4, rtol=1e-3) <= 1.0, (cond, name)


# An If branch holding an initializer of its own (a constant of the branch) while reading the
# differentiated outer X: each entry point gives the branch VJP that constant, which the graph
# receiving the copied branch nodes does not hold.

BRANCH_CONSTANT = np.array([2.0, -3.0, 0.5], np.float32)


def _if_with_a_branch_initializer(x_initializer: bool = False) -> onnx.ModelProto:
    """loss = sum(tanh(X · c) if sum(X) > 0 else -X), c an initializer of the then-branch."""
    f = TensorProto.FLOAT
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["X", "c"], ["t1"]), helper.make_node("Tanh", ["t1"], ["t2"])], "then", [],
        [helper.make_tensor_value_info("t2", f, [3])], [numpy_helper.from_array(BRANCH_CONSTANT, "c")])
    else_branch = helper.make_graph([helper.make_node("Neg", ["X"], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", f, [3])])
    nodes = [helper.make_node("ReduceSum", ["X"], ["s"], keepdims=0), helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["h"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    initializers = [numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    inputs = [] if x_initializer else [helper.make_tensor_value_info("X", f, [3])]
    if x_initializer:
        initializers.append(numpy_helper.from_array(np.array([0.3, -0.2, 0.4], np.float32), "X"))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", f, [])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _expected_gradient(x: np.ndarray) -> np.ndarray:
    """d loss / dX by hand, in float64."""
    x, c = x.astype(np.float64), BRANCH_CONSTANT.astype(np.float64)
    return c * (1 - np.tanh(x * c) ** 2) if x.sum() > 0 else -np.ones_like(x)


def _expected_hvp(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    x, c = x.astype(np.float64), BRANCH_CONSTANT.astype(np.float64)
    t = np.tanh(x * c)
    return v * c * c * (-2 * t * (1 - t * t)) if x.sum() > 0 else np.zeros_like(x)


BRANCH_POINTS = [np.array([0.3, -0.2, 0.4], np.float32), np.array([-1.0, 0.5, -0.25], np.float32)]


def _run(model: onnx.ModelProto, feeds: dict, outputs: list[str]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


@pytest.mark.parametrize("cleanup", [True, False])
def test_if_branch_initializer_through_the_command_line(tmp_path, cleanup):
    from onnx_autodiff.cli import main

    source, out = tmp_path / "if.onnx", tmp_path / "grad.onnx"
    onnx.save(_if_with_a_branch_initializer(), str(source))
    assert main(["grad", str(source), "-o", str(out), "--wrt", "X", *([] if cleanup else ["--no-cleanup"])]) == 0
    model = assert_valid_model(onnx.load(str(out)))
    for x in BRANCH_POINTS:
        (grad,) = _run(model, {"X": x}, ["grad_X"])
        np.testing.assert_allclose(grad, _expected_gradient(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", ["vjp", "jvp", "hvp", "jacobian"])
def test_if_branch_initializer_through_the_transforms(transform):
    import onnx_autodiff

    model = _if_with_a_branch_initializer()
    result = assert_valid_model(getattr(onnx_autodiff, transform)(model, "loss", ["X"]))
    v = np.array([0.5, 1.0, -2.0], np.float32)
    for x in BRANCH_POINTS:
        expected = _expected_gradient(x)
        if transform == "vjp":
            (got,) = _run(result, {"X": x}, ["grad_X"])
        elif transform == "jvp":
            (got,), expected = _run(result, {"X": x, "t_X": v}, ["jvp_loss"]), expected @ v
        elif transform == "hvp":
            (got,), expected = _run(result, {"X": x, "v_X": v}, ["hvp_X"]), _expected_hvp(x, v)
        else:
            (got,) = _run(result, {"X": x}, ["jac_X"])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_if_branch_initializer_through_the_pass_and_the_function_entry_points():
    from onnx_autodiff import gradient_of_function, gradient_of_nodes

    model = _if_with_a_branch_initializer()
    passed = ir.passes.PassManager([autodiff_pass(of="loss", wrt=["X"]), *cleanup_passes()])(ir.from_proto(model)).model
    as_pass = assert_valid_model(ir.to_proto(passed))
    function = gradient_of_function(model, ["X"], "loss")
    nodes = gradient_of_nodes(list(model.graph.node), ["X"], "loss", zs=["zero"], opset_imports={"": 18})
    for fn, feeds in ((function, {}), (nodes, {"zero": np.array(0.0, np.float32)})):
        inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [3] if name == "X" else []) for name in fn.input]
        call = helper.make_graph([helper.make_node(fn.name, list(fn.input), list(fn.output), domain=fn.domain)], "call",
                                 inputs, [helper.make_tensor_value_info(fn.output[0], TensorProto.FLOAT, [3])])
        wrapped = helper.make_model(call, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(fn.domain, 1)],
                                    functions=[fn], ir_version=8)
        onnx.checker.check_model(wrapped, full_check=True)
        for x in BRANCH_POINTS:
            (grad,) = _run(wrapped, {"X": x, "dy": np.array(1.0, np.float32), **feeds}, [fn.output[0]])
            np.testing.assert_allclose(grad, _expected_gradient(x), rtol=1e-5, atol=1e-6)
    for x in BRANCH_POINTS:
        (grad,) = _run(as_pass, {"X": x}, ["grad_X"])
        np.testing.assert_allclose(grad, _expected_gradient(x), rtol=1e-5, atol=1e-6)


def test_if_branch_initializer_through_the_gradient_op():
    """The Gradient node of ai.onnx.preview.training, lowered, differentiates the If alike."""
    from onnx_autodiff import GradientOpLoweringPass

    model = _if_with_a_branch_initializer()
    model.graph.node.append(helper.make_node("Gradient", ["X"], ["dX"], domain="ai.onnx.preview.training",
                                             xs=["X"], y="loss"))
    model.graph.output.append(helper.make_tensor_value_info("dX", TensorProto.FLOAT, [3]))
    model.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    lowered = ir.from_proto(model)
    GradientOpLoweringPass()(lowered)
    proto = assert_valid_model(ir.to_proto(lowered))
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    for x in BRANCH_POINTS:
        (grad,) = _run(proto, {"X": x}, ["dX"])
        np.testing.assert_allclose(grad, _expected_gradient(x), rtol=1e-5, atol=1e-6)


def test_if_branch_initializer_through_the_training_artifacts(tmp_path):
    from onnx_autodiff.training import Trainer, generate_artifacts

    model = _if_with_a_branch_initializer(x_initializer=True)
    artifacts = generate_artifacts(model, requires_grad=["X"], loss=None, optimizer="sgd")
    for m in (artifacts.train_model, artifacts.eval_model):
        assert_valid_model(m)
    x = np.array([0.3, -0.2, 0.4], np.float32)
    trainer = Trainer(artifacts, lr=0.1, providers=["CPUExecutionProvider"])
    trainer.step({})
    np.testing.assert_allclose(trainer.state_dict()["X"], x - 0.1 * _expected_gradient(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_scan", [True, False])
def test_backward_loops_run_on_the_reference_evaluator(with_scan):
    """The reverse Loop of a Loop's gradient gives its condition: onnx.reference runs no iteration
    of a Loop whose optional cond is omitted (and then fails on the empty scan outputs), so a
    train model holding a Scan (ctc's loss, an LSTM's) could not run there."""
    from onnx.reference import ReferenceEvaluator

    feeds = {k: (R.standard_normal(3) * 0.7).astype(np.float32) for k in ("h0", "x", "W")}
    model = loop_model(with_scan=with_scan)
    model.graph.node[0].input[1] = "go"  # (the forward's own Loop with its cond, for the same reason)
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "go"))
    grads, _ = backward_model(model, model.graph.output[0].name, ["h0", "x", "W"], seed="input")
    names = [o.name for o in grads.graph.output]
    feeds["dy"] = np.ones(3, np.float32) if "dy" in {i.name for i in grads.graph.input} else None
    feeds = {k: v for k, v in feeds.items() if v is not None}
    expected = ort.InferenceSession(grads.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for name, got, want in zip(names, ReferenceEvaluator(grads).run(None, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
