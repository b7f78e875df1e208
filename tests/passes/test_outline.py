"""OutlinePass: each rule's backward nodes become one call of a shared model-local function; the
model stays valid, computes the same values, is deterministic, and inlines back to plain ops."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import make_model, rng
from onnx import helper
from onnx_autodiff.passes.outline import DOMAIN
from onnx_autodiff.passes.metadata import GRAD_OF, PROVENANCE_KEYS
from onnx_ir.passes import common

from onnx_autodiff import OutlinePass, autodiff_pass, cleanup_passes

R = rng(5)
D = 8


def block_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Two LayerNorm → MatMul → Gelu blocks, a Softmax and a sum: repeated structures."""
    x = R.standard_normal((2, 3, D)).astype(np.float32)
    inits = {"g": np.ones(D, np.float32) + 0.1 * R.standard_normal(D).astype(np.float32),
             "b": 0.1 * R.standard_normal(D).astype(np.float32)}
    nodes, h = [], "x"
    for i in range(2):
        inits[f"w{i}"] = (R.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
        nodes += [helper.make_node("LayerNormalization", [h, "g", "b"], [f"n{i}"], axis=-1),
                  helper.make_node("MatMul", [f"n{i}", f"w{i}"], [f"m{i}"]),
                  helper.make_node("Gelu", [f"m{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes += [helper.make_node("Softmax", [h], ["p"], axis=-1),
              helper.make_node("Mul", ["p", h], ["q"]),
              helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0)]
    return make_model(nodes, {"x": x}, ["loss"], initializers=inits, opset=20), {"x": x}


def differentiate(model: onnx.ModelProto, outline: bool) -> onnx.ModelProto:
    ir_model = ir.from_proto(model)
    passes = [autodiff_pass(of="loss", wrt=["x", "g", "b", "w0", "w1"]), *cleanup_passes(outline=outline)]
    proto = ir.to_proto(ir.passes.PassManager(passes)(ir_model).model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def run(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_outlined_graph_computes_the_same_gradients_with_fewer_nodes():
    model, feeds = block_model()
    plain, outlined = differentiate(model, False), differentiate(model, True)
    expected, got = run(plain, feeds), run(outlined, feeds)
    assert list(got) == list(expected)  # the gradient outputs keep their names and order
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert len(outlined.graph.node) < len(plain.graph.node) - 10
    calls = [n for n in outlined.graph.node if n.domain == DOMAIN]
    names = {f.name for f in outlined.functions}
    # One function per structure, called once per forward node.
    assert [n.op_type for n in calls].count("LayerNormalizationGrad") == 2
    assert [n.op_type for n in calls].count("GeluGrad") == 2
    assert {"LayerNormalizationGrad", "GeluGrad", "SoftmaxGrad"} <= names
    for function in outlined.functions:
        assert all(node.domain in ("", "ai.onnx") for node in function.node)  # standard ops inside
    assert not any(p.key in PROVENANCE_KEYS for f in outlined.functions for n in f.node for p in n.metadata_props)


def test_outline_is_deterministic_and_idempotent():
    model, _ = block_model()
    first, second = differentiate(model, True), differentiate(model, True)
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    again = ir.from_proto(first)
    assert not OutlinePass()(again).modified


def test_inlining_gives_back_a_model_that_differentiates_again():
    """Inline the calls (onnx-ir's InlinePass), then take a second derivative: it matches the
    second derivative of the plain graph."""
    model, feeds = block_model()
    outlined = ir.from_proto(differentiate(model, True))
    common.InlinePass()(outlined)
    common.RemoveUnusedFunctionsPass()(outlined)
    assert not outlined.functions
    plain = ir.from_proto(differentiate(model, False))
    weights = R.standard_normal(feeds["x"].shape).astype(np.float32)
    results = []
    for m in (outlined, plain):
        m.graph.outputs[:] = [v for v in m.graph.outputs if v.name == "grad_x"]
        # d/dw0 of Σ c·grad_x: a mixed second derivative through every backward formula (c
        # random: Σ grad_x is 0 behind a LayerNormalization).
        c = ir.Value(name="c", const_value=ir.tensor(weights))
        m.graph.register_initializer(c)
        weighted = ir.node("Mul", [m.graph.outputs[0], c])
        m.graph.append(weighted)
        total = ir.node("ReduceSum", [weighted.outputs[0]], attributes={"keepdims": 0})
        total.outputs[0].name = "s"
        m.graph.append(total)
        m.graph.outputs[:] = [total.outputs[0]]
        autodiff_pass(of="s", wrt=["w0"])(m)
        proto = ir.to_proto(m)
        onnx.checker.check_model(proto, full_check=True)
        results.append(list(run(proto, feeds).values())[-1])  # the new gradient output
    assert np.abs(results[1]).max() > 1e-3  # a second derivative that is not trivially zero
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_a_group_with_a_path_back_into_it_stays_inline():
    """a → (untagged) b → c with a and c tagged alike: one call would read its own output."""
    x = np.ones((2, 2), np.float32)
    nodes = [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Abs", ["a"], ["b"]),
             helper.make_node("Add", ["b", "a"], ["c"]), helper.make_node("Exp", ["c"], ["d"])]
    model = ir.from_proto(make_model(nodes, {"x": x}, ["d"]))
    for node in model.graph:
        if node.op_type in ("Neg", "Add"):
            node.metadata_props[GRAD_OF] = "Test:n"
        if node.op_type == "Exp":
            node.metadata_props[GRAD_OF] = "Other:m"
    assert not OutlinePass()(model).modified  # Test:n is not convex, Other:m has one node
    assert [n.op_type for n in model.graph] == ["Neg", "Abs", "Add", "Exp"]


@pytest.mark.parametrize("tagged", [["Neg", "Abs"], ["Abs", "Add"]])
def test_outlined_call_takes_graph_inputs_and_initializers_and_may_be_a_graph_output(tagged):
    x = R.standard_normal((2, 2)).astype(np.float32)
    nodes = [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Abs", ["a"], ["b"]),
             helper.make_node("Add", ["b", "k"], ["c"])]
    proto = make_model(nodes, {"x": x}, ["c", "a"], initializers={"k": np.float32(2) * np.ones((2, 2), np.float32)})
    model = ir.from_proto(proto)
    for node in model.graph:
        if node.op_type in tagged:
            node.metadata_props[GRAD_OF] = "Test:n"
    assert OutlinePass()(model).modified
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    assert [o.name for o in out.graph.output] == ["c", "a"]
    expected, got = run(proto, {"x": x}), run(out, {"x": x})
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


def test_a_group_whose_value_an_if_branch_reads_stays_inline():
    """Neg → (If reading it in its branch) → Add, Neg and Add tagged alike: the path back runs
    through a subgraph, which the walk does not follow; such groups are kept inline."""
    x = np.ones((2,), np.float32)
    branch = helper.make_graph([helper.make_node("Exp", ["a"], ["e"])], "branch", [],
                               [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Neg", ["x"], ["a"]),
             helper.make_node("If", ["cond"], ["c"], then_branch=branch, else_branch=branch),
             helper.make_node("Add", ["a", "c"], ["d"])]
    model = ir.from_proto(make_model(nodes, {"x": x}, ["d"], initializers={"cond": np.array(True)}))
    for node in model.graph:
        if node.op_type in ("Neg", "Add"):
            node.metadata_props[GRAD_OF] = "Test:n"
    assert not OutlinePass()(model).modified
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
