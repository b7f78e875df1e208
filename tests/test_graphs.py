"""toolkit.graphs: fix_names renames as onnx-ir's NameFixPass does."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.toolkit.graphs import fix_names


def _names_case(with_subgraph: bool) -> ir.Model:
    """Unnamed nodes and values, a node and a value named twice, a node named as NameFixPass names
    one ("node", after an unnamed one), an unnamed output; a subgraph where asked."""
    nodes = [
        helper.make_node("Neg", ["x"], ["a"]),
        helper.make_node("Abs", ["a"], ["b"], name="node"),
        helper.make_node("Relu", ["b"], ["a_dup"], name="twice"),
        helper.make_node("Sigmoid", ["a_dup"], ["c"], name="twice"),
        helper.make_node("Split", ["c"], ["d", ""], axis=0, num_outputs=2),
        helper.make_node("Add", ["d", "w"], ["y"]),
    ]
    if with_subgraph:
        branch = helper.make_graph([helper.make_node("Neg", ["y"], ["z"])], "branch", [],
                                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])])
        nodes.append(helper.make_node("If", ["flag"], ["out"], then_branch=branch, else_branch=branch))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out" if with_subgraph else "y", TensorProto.FLOAT, [1])],
                              [helper.make_tensor(name="w", data_type=TensorProto.FLOAT, dims=[1], vals=[1.0])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    nodes = list(model.graph)
    nodes[3].outputs[0].name = "a"  # a value named as another
    nodes[4].outputs[1].name = ""
    return model


@pytest.mark.parametrize("with_subgraph", [False, True])
def test_fix_names_renames_as_onnx_irs_name_fix_pass(with_subgraph):
    ours, theirs = _names_case(with_subgraph), _names_case(with_subgraph)
    assert fix_names(ours) is ir.passes.common.NameFixPass()(theirs).modified is True
    assert ir.to_proto(ours).SerializeToString() == ir.to_proto(theirs).SerializeToString()
    names = [n.name for n in ours.graph]
    assert len(set(names)) == len(names) and all(names)
    assert not fix_names(ours)  # nothing left to rename
