"""RemoveUnusedPass: dead nodes, unused optional outputs, omitted trailing inputs and unused
initializers go, as in onnx-ir's RemoveUnusedNodesPass."""

import numpy as np
import onnx_ir as ir
from helpers import make_model, rng
from onnx import helper

from onnx_autodiff.passes.unused import RemoveUnusedPass, remove_unused, remove_unused_after

R = rng(11)


def test_a_dead_chain_and_an_unused_initializer_go():
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Neg", ["e"], ["dead"]),
             helper.make_node("Add", ["x", "w"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": np.ones(3, np.float32)}, ["y"],
                                     initializers={"w": np.ones(3, np.float32), "unused": np.ones(3, np.float32)}))
    assert RemoveUnusedPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Add"] and list(model.graph.initializers) == ["w"]
    assert not RemoveUnusedPass()(model).modified


def test_an_unused_initializer_of_a_branch_goes():
    """A branch's own initializers (a backward If's) are dropped when nothing reads them, as the main
    graph's are: onnxruntime warns of each it finds at load."""
    def branch(name, read):
        graph = helper.make_graph([helper.make_node("Add", ["x", read], [f"{name}_out"])], name, [],
                                  [helper.make_tensor_value_info(f"{name}_out", 1, [3])],
                                  [helper.make_tensor(n, 1, [3], [1.0, 2.0, 3.0]) for n in (f"{name}_w", f"{name}_unused")])
        return graph
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch("then", "then_w"), else_branch=branch("else", "x"))]
    model = ir.from_proto(make_model(nodes, {"c": np.array(True), "x": np.ones(3, np.float32)}, ["y"]))
    assert RemoveUnusedPass()(model).modified
    kept = {g.name: list(g.initializers) for g in model.graphs() if g is not model.graph}
    assert kept == {"then": ["then_w"], "else": []}
    assert not RemoveUnusedPass()(model).modified


def test_removing_unused_parts_matches_onnx_ir():
    """The cleanup's own removal of unused optional outputs, omitted trailing inputs and
    initializers does what onnx-ir's RemoveUnusedNodesPass does (reading fewer schemas)."""
    x = R.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1),
        helper.make_node("Dropout", ["y", "", ""], ["d", "mask"]),
        helper.make_node("Split", ["d"], ["p", "q"], axis=-1, num_outputs=2),
        helper.make_node("Clip", ["p", "lo", ""], ["c"]),
        helper.make_node("Mul", ["c", "q"], ["z"]),
        helper.make_node("Identity", ["inv"], ["inv_out"]),
    ]
    model = make_model(nodes, {"x": x}, ["z", "inv_out"], opset=18,
                       initializers={"s": np.ones(4, np.float32), "b": np.zeros(4, np.float32),
                                     "lo": np.array(0, np.float32), "unused": np.ones(2, np.float32)})
    ours, theirs = ir.from_proto(model), ir.from_proto(model)
    assert remove_unused(ours) is True  # the unused initializer went
    ir.passes.common.RemoveUnusedNodesPass()(theirs)
    assert ir.to_proto(ours).SerializeToString() == ir.to_proto(theirs).SerializeToString()
    assert [len(n.outputs) for n in ours.graph] == [3, 1, 2, 1, 1, 1]  # mean lost its name, mask went


def test_removing_after_appended_nodes_matches_removing_everywhere():
    """remove_unused_after looks only at the nodes appended to a graph that had nothing to remove
    and at the producers of what left its outputs, and ends where remove_unused ends: appended
    nodes dead or alive, a chain that dies with a released output, an optional output that a dead
    appended node read, an omitted trailing input, an If whose branch holds a dead node."""
    x = R.standard_normal((2, 4)).astype(np.float32)
    dead_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["unread"]), helper.make_node("Abs", ["x"], ["t"])],
                                    "then", [], [helper.make_tensor_value_info("t", 1, [2, 4])])
    other = helper.make_graph([helper.make_node("Exp", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, [2, 4])])
    before = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1),
        helper.make_node("Tanh", ["y"], ["kept"]),
        helper.make_node("Sigmoid", ["y"], ["released"]),  # an output until the nodes are appended
        helper.make_node("Exp", ["released"], ["released_too"]),
    ]
    appended = [
        helper.make_node("Relu", ["kept"], ["z"]),
        helper.make_node("Identity", ["inv"], ["reads_inv"]),  # dead: inv is then unused
        helper.make_node("Clip", ["z", "lo", ""], ["c"]),
        helper.make_node("ReduceSum", ["c"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "lo"], ["flag"]),
        helper.make_node("If", ["flag"], ["chosen"], then_branch=dead_branch, else_branch=other),
        helper.make_node("Add", ["c", "chosen"], ["out"]),
    ]
    model = make_model(before + appended, {"x": x}, ["out", "released_too", "mean", "inv"], opset=18,
                       initializers={"s": np.ones(4, np.float32), "b": np.zeros(4, np.float32),
                                     "lo": np.array(0, np.float32)})
    ours, theirs = ir.from_proto(model), ir.from_proto(model)
    for m in (ours, theirs):
        del m.graph.outputs[1:]
    added = list(ours.graph)[len(before):]
    released = [v for n in list(ours.graph)[:len(before)] for v in n.outputs if v.name in ("released_too", "mean", "inv")]
    assert remove_unused_after(ours.graph, added, released) is True
    assert remove_unused(theirs) is True
    assert ir.to_proto(ours).SerializeToString() == ir.to_proto(theirs).SerializeToString()
    assert [n.op_type for n in ours.graph] == ["LayerNormalization", "Tanh", "Relu", "Clip", "ReduceSum", "Greater", "If", "Add"]
    assert len(list(ours.graph)[0].outputs) == 1 and len(list(ours.graph)[3].inputs) == 2
    then_branch = list(ours.graph)[6].attributes["then_branch"].as_graph()
    assert [n.op_type for n in then_branch] == ["Abs"]
    assert not remove_unused_after(ours.graph, list(ours.graph)[2:], [])
