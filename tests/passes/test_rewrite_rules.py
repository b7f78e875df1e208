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
    assert index.rules_for(neg) == [NEG_NEG]
    assert index.rules_for(relu) == []  # no pattern ends in Relu: nothing is tried there
