"""RewriteRulesPass: one sweep of the project's rules, or of the rules given."""

import numpy as np
import onnx
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


def test_values_made_in_a_branch_take_names_no_graph_holds():
    """A rewrite inside an If branch names its new values against every graph: the branch's own
    naming would give 'val_0', which the graph around it (a dynamo export's names) already holds,
    and the checker refuses a branch that redefines an outer name."""
    def double_negation(op, x):
        return op.Neg(op.Neg(x))

    def twice_copied(op, x):
        return op.Identity(op.Identity(x))

    branch = helper.make_graph([helper.make_node("Neg", ["val_0"], ["a"]), helper.make_node("Neg", ["a"], ["b"])],
                               "then", [], [helper.make_tensor_value_info("b", 1, [2, 3])])
    other = helper.make_graph([helper.make_node("Identity", ["val_0"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", 1, [2, 3])])
    nodes = [helper.make_node("Exp", ["x"], ["val_0"]),
             helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=other)]
    model = ir.from_proto(make_model(nodes, {"x": X, "flag": np.array(True)}, ["y"], output_shapes={"y": [2, 3]}))
    assert RewriteRulesPass(RuleIndex([RewriteRule(double_negation, twice_copied)]))(model).modified
    names = [v.name for g in model.graphs() for n in g for v in n.outputs]
    assert len(names) == len(set(names)), names
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
