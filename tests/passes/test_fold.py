"""FoldPass: bounded folding that keeps fills as nodes; inside the cleanup, never through a
protected (differentiated or kept) initializer."""

import json

import numpy as np
import onnx_ir as ir
from helpers import make_model
from onnx import helper

from onnx_autodiff.passes.cleanup import CleanupPass
from onnx_autodiff.passes.fold import FoldPass
from onnx_autodiff.passes.metadata import DIFFERENTIATED_KEY
from onnxscript.optimizer import FOLDED_FROM_KEY

W = np.arange(6, dtype=np.float32).reshape(2, 3)


def transposed_weight(opset=18):
    """y = x · Wᵀ, Wᵀ a Transpose of the initializer W."""
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["y"])]
    return ir.from_proto(make_model(nodes, {"x": np.ones((4, 3), np.float32)}, ["y"], initializers={"W": W}, opset=opset))


def op_types(model):
    return [node.op_type for node in model.graph]


def test_a_transpose_of_an_initializer_folds():
    model = transposed_weight()
    assert FoldPass()(model).modified
    assert op_types(model) == ["MatMul"]
    np.testing.assert_array_equal(model.graph.node(0).inputs[1].const_value.numpy(), W.T)


def test_folding_notes_are_left_for_drop_notes():
    model = transposed_weight()
    fold = FoldPass()
    fold(model)
    folded = model.graph.node(0).inputs[1]
    assert FOLDED_FROM_KEY in folded.metadata_props and fold.folded == [folded]
    fold.drop_notes([model.graph])
    assert FOLDED_FROM_KEY not in folded.metadata_props and FOLDED_FROM_KEY not in folded.meta


def test_the_cleanup_drops_the_notes_of_its_folds_and_those_an_exporter_left_on_inputs_and_initializers():
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": np.ones((4, 3), np.float32)}, ["y"],
                                     initializers={"W": W, "b": np.ones(2, np.float32)}))
    exported = model.graph.initializers["b"]
    exported.metadata_props[FOLDED_FROM_KEY] = "['b_before']"  # as an exporter's folder leaves them
    model.graph.inputs[0].metadata_props[FOLDED_FROM_KEY] = "['x']"
    CleanupPass()(model)
    folded = model.graph.node(0).inputs[1]
    assert op_types(model) == ["MatMul", "Add"] and folded.const_value is not None
    for value in (folded, exported, model.graph.inputs[0]):
        assert FOLDED_FROM_KEY not in value.metadata_props and FOLDED_FROM_KEY not in value.meta


def test_nothing_to_fold_below_opset_12_or_past_the_limit():
    assert not FoldPass()(transposed_weight(opset=11)).modified
    assert not FoldPass(limit=4)(transposed_weight()).modified  # 6 elements


def test_a_fill_stays_a_node():
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"]), helper.make_node("Add", ["x", "zeros"], ["y"])]
    model = ir.from_proto(make_model(nodes, {"x": np.ones((4, 3), np.float32)}, ["y"],
                                     initializers={"shape": np.array([4, 3], np.int64)}))
    FoldPass()(model)
    assert "ConstantOfShape" in op_types(model)


def test_the_cleanup_never_folds_through_a_protected_initializer():
    kept = transposed_weight()
    CleanupPass(keep=["W"], target=None)(kept)  # (onnxruntime's lowering: a Gemm)
    assert op_types(kept) == ["Transpose", "MatMul"]
    assert kept.graph.initializers["W"].const_value is not None  # shown again afterwards
    differentiated = transposed_weight()
    differentiated.metadata_props[DIFFERENTIATED_KEY] = json.dumps(["W"])
    CleanupPass(target=None)(differentiated)
    assert op_types(differentiated) == ["Transpose", "MatMul"]
    free = transposed_weight()
    CleanupPass(target=None)(free)
    assert op_types(free) == ["MatMul"]


def test_an_if_folded_to_its_branch_leaves_the_other_branchs_reads():
    """An If on a constant condition becomes the branch it takes; the other branch's reads of outer
    values no longer count, so what only that branch read goes in the same cleanup (it stayed, and
    a second cleanup removed it: the cleanup was not idempotent)."""
    from onnx_autodiff.passes.unused import RemoveUnusedPass

    def branch(name, read):
        return helper.make_graph([helper.make_node("Mul", ["x", read], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", 1, [3])])
    nodes = [helper.make_node("Constant", [], ["flag"], value=helper.make_tensor("t", 9, [], [True])),
             helper.make_node("If", ["flag"], ["y"], then_branch=branch("then", "kept"), else_branch=branch("else", "gone"))]
    model = ir.from_proto(make_model(nodes, {"x": np.ones(3, np.float32)}, ["y"], output_shapes={"y": [3]},
                                     initializers={"kept": np.full(3, 2, np.float32), "gone": np.full(3, 3, np.float32)}))
    FoldPass()(model)
    RemoveUnusedPass()(model)
    assert "If" not in [n.op_type for n in model.graph] and list(model.graph.initializers) == ["kept"]
