"""RemoveUnusedPass: dead nodes, unused optional outputs, omitted trailing inputs and unused
initializers go, as in onnx-ir's RemoveUnusedNodesPass."""

import numpy as np
import onnx_ir as ir
from helpers import make_model, rng
from onnx import helper

from onnx_autodiff.passes.unused import RemoveUnusedPass, remove_unused

R = rng(11)


def test_a_dead_chain_and_an_unused_initializer_go():
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Neg", ["e"], ["dead"]),
             helper.make_node("Add", ["x", "w"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": np.ones(3, np.float32)}, ["y"],
                                     initializers={"w": np.ones(3, np.float32), "unused": np.ones(3, np.float32)}))
    assert RemoveUnusedPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Add"] and list(model.graph.initializers) == ["w"]
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
