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
