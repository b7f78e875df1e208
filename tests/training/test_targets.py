"""Targets as objects: each carries its lowering rules and capabilities, and no code outside their
definition tests a runtime by its name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from onnx_autodiff.passes.cleanup import cleanup_passes
from onnx_autodiff.passes.rewrite_rules import lowering_rules
from onnx_autodiff.training.targets import CANONICAL, ONNXRUNTIME, TARGETS, WEBGPU, Target, resolve_target

ROOT = Path(__file__).resolve().parents[2]
# the targets and the cleanup's lowering rules by name (the passes, under the training layer, read
# the latter)
DEFINITIONS = {"onnx_autodiff/training/targets.py", "passes/rewrite_rules/lowering.py"}


def test_targets_by_name():
    assert resolve_target("onnxruntime") is ONNXRUNTIME and resolve_target("webgpu") is WEBGPU
    assert resolve_target(None) is CANONICAL and resolve_target(WEBGPU) is WEBGPU
    assert list(TARGETS) == ["onnxruntime", "webgpu"]
    with pytest.raises(ValueError, match="unknown lowering target 'tpu': the known targets are 'onnxruntime', 'webgpu'"):
        resolve_target("tpu")


def test_a_target_carries_the_cleanups_lowering():
    for target in (ONNXRUNTIME, WEBGPU):
        assert [r.name for r in target.lowering_rules().rules] == [r.name for r in lowering_rules(target.name).rules]
        assert [r.name for r in lowering_rules(target).rules] == [r.name for r in lowering_rules(target.name).rules]
    assert CANONICAL.lowering is None and WEBGPU.lowering is WEBGPU
    def rules(target):
        return {op: [r.name for r in found] for op, found in cleanup_passes(target=target)[0].rules.by_op.items()}

    assert rules(WEBGPU) == rules("webgpu")


def test_capabilities():
    assert ONNXRUNTIME.group_limit and WEBGPU.group_limit is None
    assert not ONNXRUNTIME.lowers_training_forward and WEBGPU.lowers_training_forward
    assert WEBGPU.nbits_kernel and not ONNXRUNTIME.nbits_kernel
    assert ONNXRUNTIME.frozen_base_reads and not CANONICAL.frozen_base_reads
    custom = dataclasses.replace(ONNXRUNTIME, name="ort-ungrouped", grouped_updates=False)
    assert isinstance(custom, Target) and custom.group_limit is None and custom.rules is ONNXRUNTIME.rules


def target_tests(source: str, names: set[str]) -> list[int]:
    """The lines of ``source`` that compare with a target's name or hold a set of names."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            return any(named(e) for e in node.elts)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("frozenset", "set"):
            return any(named(a) for a in node.args)
        return False

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(named(n) for n in (node.left, *node.comparators)):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("frozenset", "set") and named(node):
            found.append(node.lineno)
    return found


def places_testing_a_target_by_name(root: Path) -> dict[str, list[int]]:
    found = {}
    for folder in ("onnx_autodiff", "passes"):  # (conformance's backends are runtimes, no targets)
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            lines = [] if relative in DEFINITIONS else target_tests(path.read_text(), {"onnxruntime", "webgpu"})
            if lines:
                found[relative] = lines
    return found


def test_no_code_tests_a_target_by_name_outside_the_targets():
    assert target_tests('if target == "webgpu": pass\nLOWERED = frozenset({"webgpu"})\n', {"webgpu"}) == [1, 2]
    assert places_testing_a_target_by_name(ROOT) == {}
