"""The cleanup's onnxscript rewrite rules: the project's rule set, users' extra rules through
``cleanup_passes(rules=...)`` (gradients still those of finite differences), the index by op."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import make_model, rng
from onnx import helper
from onnxscript.rewriter import RewriteRule, RewriteRuleSet

from onnx_autodiff import autodiff_pass, cleanup_passes, cleanup_rules
from onnx_autodiff.conformance import fd_vjp
from onnx_autodiff.passes.rewrite_rules import RuleIndex

R = rng(5)


def double_negation(op, x):
    return op.Neg(op.Neg(x))


def itself(op, x):
    return op.Identity(x)


NEG_NEG = RewriteRule(double_negation, itself, name="neg_neg")


def neg_chain():
    """loss = Σ sin(−(−x)) · w: the backward negates dY twice too."""
    x = R.standard_normal((3, 4)).astype(np.float32)
    w = R.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Neg", ["x"], ["n1"]), helper.make_node("Neg", ["n1"], ["n2"]),
             helper.make_node("Sin", ["n2"], ["s"]), helper.make_node("Mul", ["s", "w"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    return make_model(nodes, {"x": x}, ["loss"], initializers={"w": w}), {"x": x}


def gradient_model(model: onnx.ModelProto, rules=()) -> tuple[onnx.ModelProto, str]:
    ir_model = ir.from_proto(model)
    grad = autodiff_pass(of="loss", wrt=["x"])
    ir.passes.PassManager([grad, *cleanup_passes(rules=rules)])(ir_model)
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, grad.gradient_names["x"]


def test_a_users_rule_applies_in_the_cleanup_and_keeps_the_gradient():
    model, feeds = neg_chain()
    plain, _ = gradient_model(model)
    ruled, name = gradient_model(model, rules=[NEG_NEG])
    count = [n.op_type for n in plain.graph.node].count("Neg")
    assert count >= 2 and [n.op_type for n in ruled.graph.node].count("Neg") == 0  # forward and backward pairs gone
    session = ort.InferenceSession(ruled.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))[name]
    expected = fd_vjp(model, feeds, ["x"], [np.ones((), np.float32)])["x"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_rule_sets_are_accepted_and_anything_else_is_refused():
    model, _ = neg_chain()
    ruled, _ = gradient_model(model, rules=[RewriteRuleSet([NEG_NEG])])
    assert "Neg" not in [n.op_type for n in ruled.graph.node]
    with pytest.raises(TypeError, match="onnxscript RewriteRule or RewriteRuleSet"):
        cleanup_passes(rules=[double_negation])


def test_the_projects_rules_are_an_onnxscript_rule_set_indexed_by_op():
    rules = cleanup_rules()
    assert isinstance(rules, RewriteRuleSet) and rules.rules
    index = RuleIndex([rules, NEG_NEG])
    cast = ir.Node("", "Cast", [ir.Value(name="x")], attributes=[ir.AttrInt64("to", 1)])
    neg = ir.Node("", "Neg", [ir.Value(name="y")])
    relu = ir.Node("", "Relu", [ir.Value(name="z")])
    assert {rule.name for rule in index.rules_for(cast)} >= {"cast_of_exact_widening"}
    assert [rule.name for rule in index.rules_for(neg)] == ["zero_neg", "neg_neg"]  # the project's first
    assert index.rules_for(relu) == []  # no pattern ends in Relu: nothing is tried there


# ------------------------------------------------------------------------- the project's families


def test_each_family_is_an_onnxscript_rule_set_of_named_rules():
    from onnx_autodiff.passes.rewrite_rules import FAMILIES, casts, noops, reshapes, transposes, zeros

    assert set(FAMILIES) == {noops, zeros, transposes, casts, reshapes}
    names = [rule.name for rule in cleanup_rules().rules]
    assert len(names) == len(set(names)) and all(names)
    for family, expected in [
        (noops, {"mul_by_neutral", "add_by_neutral", "sub_by_neutral", "div_by_neutral", "sum_without_zeros",
                 "identity", "no_op_reshape", "no_op_expand", "no_op_flatten", "no_op_tile", "no_op_reducesum",
                 "squeeze_of_unsqueeze", "unsqueeze_of_squeeze"}),
        (zeros, {"zero_neg", "zero_matmul", "zero_mul", "zero_add", "zero_concat", "zero_slice"}),
        (transposes, {"no_op_transpose", "transpose_of_transpose", "transpose_of_matmul", "transpose_of_einsum",
                      "einsum_of_transposes", "concat_of_transposes"}),
        (reshapes, {"reshape_of_reshape", "concat_of_merging_reshapes"}),
    ]:
        rules = RewriteRuleSet(family.rules()).rules
        assert all(isinstance(rule, RewriteRule) for rule in rules)
        assert expected <= {rule.name for rule in rules} <= set(names), family.__name__


def test_the_index_skips_only_rules_that_would_not_match():
    """The pre-checks (the ops of the root's input producers, the root's node check) are what the
    matcher finds wrong anyway: each rule they skip, on every node of a backward graph, fails
    onnxscript's own try_rewrite; and they do skip most attempts."""
    model, _ = neg_chain()
    ir_model = ir.from_proto(model)
    autodiff_pass(of="loss", wrt=["x"])(ir_model)
    ir.passes.common.ShapeInferencePass()(ir_model)
    index = RuleIndex([cleanup_rules()])
    skipped = tried = 0
    for node in list(ir_model.graph):
        passed = list(index.applicable(ir_model, ir_model.graph, node))
        for rule in index.rules_for(node):
            if rule in passed:
                tried += 1
                continue
            skipped += 1
            assert rule.try_rewrite(ir_model, ir_model.graph, node) is None, (rule.name, node.op_type)
    assert skipped > 2 * tried > 0


def test_a_no_op_leaves_no_reader_behind():
    """The Identity a no-op rule returns is read as its input and discarded: it must not stay a
    reader of that input (a dead reader keeps nodes alive until the model is saved and loaded)."""
    x = R.standard_normal((3,)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Cast", ["r"], ["c"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Mul", ["c", "ones"], ["m"]), helper.make_node("Neg", ["m"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": x}, ["y"], initializers={"ones": np.ones(3, np.float32)}))
    cleanup_passes()[0](model)
    assert [node.op_type for node in model.graph] == ["Relu", "Neg"]
    relu, neg = model.graph
    assert [use.node for use in relu.outputs[0].uses()] == [neg]


def test_an_output_replaced_by_a_value_keeps_its_name_without_an_identity_where_it_can():
    x = R.standard_normal((3,)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "ones"], ["y"]),
             helper.make_node("Mul", ["x", "ones"], ["z"])]  # x, a graph input, cannot be renamed
    model = make_model(nodes, {"x": x}, ["y", "z"], initializers={"ones": np.ones(3, np.float32)})
    result = ir.to_proto(ir.passes.PassManager(cleanup_passes())(ir.from_proto(model)).model)
    assert [(n.op_type, list(n.output)) for n in result.graph.node] == [("Relu", ["y"]), ("Identity", ["z"])]
    session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(["y", "z"], {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    np.testing.assert_array_equal(z, x)


def test_fills_are_read_through_constant_of_shape_expand_and_cast():
    from onnx_autodiff.passes.rewrite_rules.analysis import fill
    from onnx_autodiff.toolkit.shapes import constant

    three = ir.Value(name="three", shape=ir.Shape([3]), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(np.array([2, 3, 4], np.int64)))
    filled = ir.Node("", "ConstantOfShape", [three], attributes=[ir.AttrTensor("value", ir.tensor(np.array([2.5], np.float32)))])
    expanded = ir.Node("", "Expand", [filled.outputs[0], three])
    cast = ir.Node("", "Cast", [expanded.outputs[0]], attributes=[ir.AttrInt64("to", ir.DataType.INT32)])
    cast.outputs[0].dtype = ir.DataType.INT32
    scalar = ir.Node("", "Constant", [], attributes=[ir.AttrFloat32("value_float", 0.5)])
    assert [fill(v) for v in (filled.outputs[0], expanded.outputs[0], cast.outputs[0], three)] == [2.5, 2.5, 2.0, None]
    assert constant(scalar.outputs[0], computed=False).dtype == np.float32 and fill(scalar.outputs[0]) == 0.5
    assert fill(ir.Node("", "Relu", [three]).outputs[0]) is None
