"""RewriteRulesPass: one sweep of the project's rules, or of the rules given."""

import numpy as np
import onnx_ir as ir
from helpers import make_model
from onnx import helper
from onnxscript.rewriter import RewriteRule

from onnx_autodiff.passes.rewrite_rules import RuleIndex
from onnx_autodiff.passes.rewrites import RewriteRulesPass

X = np.ones((2, 3), np.float32)


def test_a_product_with_ones_goes():
    nodes = [helper.make_node("Mul", ["x", "ones"], ["m"]), helper.make_node("Exp", ["m"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": X}, ["y"], initializers={"ones": np.ones((2, 3), np.float32)}))
    assert RewriteRulesPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Exp"] and model.graph.node(0).inputs[0].name == "x"
    assert not RewriteRulesPass()(model).modified  # nothing left to rewrite


def test_the_rules_given_replace_the_projects():
    def double_negation(op, x):
        return op.Neg(op.Neg(x))

    def itself(op, x):
        return op.Identity(x)

    nodes = [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Exp", ["b"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": X}, ["y"]))
    assert RewriteRulesPass(RuleIndex([RewriteRule(double_negation, itself)]))(model).modified
    assert [n.op_type for n in model.graph] == ["Neg", "Exp"]  # the first Neg, unread, is the dead-node removal's
    assert model.graph.node(1).inputs[0].name == "x"
