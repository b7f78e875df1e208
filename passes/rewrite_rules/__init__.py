"""The cleanup's rewrites written as onnxscript rewrite rules (pattern, check, replacement), one
module per family, and their index by the op of each pattern's output node.

``cleanup_rules()`` is the project's rule set; :class:`~onnx_autodiff.passes.cleanup.CleanupPass`
applies it, with any rules a user adds (``cleanup_passes(rules=[...])``), in every round of its
fixed point. onnxscript's own ``RewriteRuleSet.apply_to_model`` tries every rule on every node
(3.5 µs an attempt here: 17 rules take 3.9 s on a 66,000-node backward graph, and its patterns
with several output nodes grow quadratically); the cleanup tries on each node only the rules
whose pattern ends in that node's op, through :class:`RuleIndex`.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, RewriteRuleSet

from onnx_autodiff.passes.rewrite_rules import casts
from onnx_autodiff.rules.registry import pattern_root

FAMILIES = (casts,)


def cleanup_rules() -> RewriteRuleSet:
    """The project's cleanup rewrites as one onnxscript RewriteRuleSet (the families moved from
    the hand-written rewriter so far: casts)."""
    return RewriteRuleSet([rule for family in FAMILIES for rule in family.rules()])


def flatten(rules: Iterable[RewriteRule | RewriteRuleSet]) -> list[RewriteRule]:
    """The rules of ``rules``, where each item is a rule or a rule set."""
    found: list[RewriteRule] = []
    for item in rules:
        if isinstance(item, RewriteRuleSet):
            found.extend(item.rules)
        elif isinstance(item, RewriteRule):
            found.append(item)
        else:
            raise TypeError(f"rules: expected onnxscript RewriteRule or RewriteRuleSet objects, not {type(item).__name__}")
    return found


class RuleIndex:
    """Rules by the (domain, op type) of their pattern's output node; a rule whose pattern has
    several output nodes, or another kind of root, is tried on every node."""

    def __init__(self, rules: Iterable[RewriteRule | RewriteRuleSet]) -> None:
        self.by_op: dict[tuple[str, str], list[RewriteRule]] = {}
        self.anywhere: list[RewriteRule] = []
        for rule in flatten(rules):
            root = pattern_root(rule)
            (self.by_op.setdefault(root, []) if root else self.anywhere).append(rule)

    def rules_for(self, node: ir.Node) -> list[RewriteRule]:
        found = self.by_op.get((node.domain, node.op_type))
        return found + self.anywhere if found else self.anywhere
