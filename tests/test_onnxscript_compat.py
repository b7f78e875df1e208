"""onnxscript's private API is read in one module (onnx_autodiff.toolkit.onnxscript_compat): the
installed release is one it supports, the requirement says the same range, and what it reads is
there."""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import version
from pathlib import Path

import onnx_ir as ir
from onnx import TensorProto, helper
from onnxscript.rewriter import RewriteRule
from packaging.requirements import Requirement

from onnx_autodiff.toolkit import onnxscript_compat
from onnx_autodiff.toolkit.onnxscript_compat import SUPPORTED, MatchFailureError, NodeOutputPattern

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_onnxscript_is_a_supported_release_and_the_requirement_says_the_same():
    low, high = SUPPORTED
    installed = tuple(int(part) for part in version("onnxscript").split(".")[:2])
    assert low <= installed < high
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(Requirement(r).specifier for r in requirements if Requirement(r).name == "onnxscript")
    assert {str(s) for s in spec} == {f">={low[0]}.{low[1]}", f"<{high[0]}.{high[1]}"}


def test_no_other_module_reads_onnxscripts_private_names():
    private = []
    for folder in ("onnx_autodiff", "passes", "rules", "conformance"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "onnxscript_compat.py":
                continue
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onnxscript") and (
                        any(part.startswith("_") for part in node.module.split(".")) or
                        any(alias.name.startswith("_") for alias in node.names)):
                    private.append(f"{path.name}: from {node.module} import ...")
            if "_target_pattern" in text:
                private.append(f"{path.name}: _target_pattern")
    assert private == []


def test_what_the_compatibility_module_reads_is_there():
    def mul_by_one(op, x):
        return op.Mul(x, op.Constant())

    rule = RewriteRule(mul_by_one, lambda op, x: op.Identity(x))
    outputs = onnxscript_compat.pattern_outputs(rule)
    assert [node.op_identifier()[:2] for node in outputs] == [("", "Mul")]
    assert len(onnxscript_compat.pattern_nodes(rule)) == 2
    assert any(isinstance(value, NodeOutputPattern) for value in outputs[0].inputs)
    # a check that raises the error fails the match, as the cleanup's sweep takes it to
    def refuse(context, x):
        raise MatchFailureError("refused")

    model = ir.from_proto(helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["one"], value_float=1.0), helper.make_node("Mul", ["x", "one"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 18)]))
    assert RewriteRule(mul_by_one, lambda op, x: op.Identity(x), refuse).apply_to_model(model) == 0
    assert rule.apply_to_model(model) == 1


def _folding_case() -> ir.Model:
    """Nodes of every kind the folder treats apart: folded whole (a Constant chain), forwarded
    (Identity), partly evaluated (Shape, Gather, Concat, Reshape), evaluated into new nodes
    (CastLike), a subgraph (If on a known condition), and plain nodes it leaves alone."""
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])])
    nodes = [
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Constant", [], ["three"], value_float=3.0),
        helper.make_node("Mul", ["two", "three"], ["six"]),
        helper.make_node("Identity", ["x"], ["x_same"]),
        helper.make_node("Tanh", ["x_same"], ["t0"]),
        helper.make_node("Mul", ["t0", "six"], ["t1"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Constant", [], ["last"], value_ints=[1]),
        helper.make_node("Gather", ["shape", "last"], ["width"]),
        helper.make_node("Constant", [], ["minus_one"], value_ints=[-1]),
        helper.make_node("Concat", ["minus_one", "width"], ["flat"], axis=0),
        helper.make_node("Reshape", ["t1", "flat"], ["t2"]),
        helper.make_node("CastLike", ["t2", "two"], ["t3"]),
        helper.make_node("Constant", [], ["yes"], value_int=1),
        helper.make_node("Cast", ["yes"], ["cond"], to=TensorProto.BOOL),
        helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=other),
        helper.make_node("Add", ["t3", "branch"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_the_folder_visiting_fewer_nodes_folds_as_onnxscripts_fold_constants():
    from onnxscript.optimizer import fold_constants

    ours, theirs = _folding_case(), _folding_case()
    folder = onnxscript_compat.Folder(input_size_limit=1024, output_size_limit=1024)
    assert folder(ours).modified
    assert fold_constants(theirs, input_size_limit=1024, output_size_limit=1024).modified
    assert ir.to_proto(ours).SerializeToString(deterministic=True) == ir.to_proto(theirs).SerializeToString(deterministic=True)
    assert [n.op_type for n in ours.graph] == [n.op_type for n in theirs.graph]
    by_output = {n.outputs[0].name: n for n in ours.graph}
    assert "six" in ours.graph.initializers and "flat" in ours.graph.initializers
    assert by_output["t0"].inputs[0].name == "x"  # through the Identity
    assert by_output["t3"].op_type == "Cast" and by_output["branch"].op_type == "Neg"  # nodes the folds inserted
    # the folder's pass class, its evaluators' registry and its symbolic values are where Folder reads them
    assert ("", "Identity") in folder._evaluated and isinstance(folder._state.symbolic_value_map, dict)


def test_the_folder_adds_shape_values_as_onnxscripts_and_skips_adds_of_unknown_tensors():
    from onnxscript.optimizer import fold_constants

    def case() -> ir.Model:
        nodes = [helper.make_node("Shape", ["z"], ["dims"]), helper.make_node("Constant", [], ["one"], value_ints=[1]),
                 helper.make_node("Add", ["dims", "one"], ["longer"]), helper.make_node("Add", ["z", "z"], ["y"]),
                 helper.make_node("Expand", ["y", "longer"], ["w"])]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N"])],
                                  [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)])
        return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))

    ours, theirs = case(), case()
    folder = onnxscript_compat.Folder(input_size_limit=1024, output_size_limit=1024)
    folder(ours)
    expected = fold_constants(theirs, input_size_limit=1024, output_size_limit=1024).symbolic_value_map
    found = folder._state.symbolic_value_map
    assert {v.name: str(s) for v, s in found.items()} == {v.name: str(s) for v, s in expected.items()}
    assert "N+1" in str(found[next(n for n in ours.graph if n.outputs[0].name == "longer").outputs[0]])
    adds = [n for n in ours.graph if n.op_type == "Add"]
    assert [folder._may_change(n) for n in adds] == [True, False]  # the Add of two unknown tensors is not visited


def _flat_folding_case(clashing: bool) -> ir.Model:
    """A graph without subgraphs whose folds make an initializer (Mul of constants) and a node
    (CastLike evaluated into a Cast), its other nodes unnamed; ``clashing``: one of them named, after
    it joined the graph, as onnx-ir names the Cast."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Constant", [], ["three"], value_float=3.0),
        helper.make_node("Mul", ["two", "three"], ["six"]),
        helper.make_node("Tanh", ["x"], ["t0"]),
        helper.make_node("Mul", ["t0", "six"], ["t1"]),
        helper.make_node("CastLike", ["t1", "two"], ["t2"]),
        helper.make_node("Neg", ["t2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    if clashing:
        next(n for n in model.graph if n.op_type == "Tanh").name = "node_Cast_0"
    return model


def test_the_folder_renames_only_where_its_folds_made_a_name_clash():
    model = _flat_folding_case(clashing=False)
    assert onnxscript_compat.Folder(input_size_limit=1024, output_size_limit=1024)(model).modified
    assert "six" in model.graph.initializers
    assert [n.op_type for n in model.graph] == ["Constant", "Constant", "Tanh", "Mul", "Cast", "Neg"]
    made = next(n for n in model.graph if n.op_type == "Cast")
    assert made.name and made.outputs[0].name == "t2"  # the fold's node named, its value named as the one it replaced
    assert [n.name for n in model.graph if n is not made] == [""] * 5  # the model's own nodes as they were

    model = _flat_folding_case(clashing=True)
    onnxscript_compat.Folder(input_size_limit=1024, output_size_limit=1024)(model)
    node_names = [n.name for n in model.graph]
    assert all(node_names) and len(set(node_names)) == len(node_names)  # a clash: every name fixed, as before
