"""The cleanup's rewrites written as onnxscript rewrite rules (pattern, check, replacement), one
module per family (noops, transposes, reshapes, zeros, casts; what they know of values in
:mod:`.analysis`), and their index by the op of each pattern's output node.

``cleanup_rules()`` is the project's rule set; :class:`~onnx_autodiff.passes.cleanup.CleanupPass`
applies it, with any rules a user adds (``cleanup_passes(rules=[...])``), in every round of its
fixed point. onnxscript's own ``RewriteRuleSet.apply_to_model`` tries every rule on every node
(3.5 µs an attempt here: 17 rules take 3.9 s on a 66,000-node backward graph, and its patterns
with several output nodes grow quadratically); the cleanup tries on each node only the rules
whose pattern ends in that node's op, through :class:`RuleIndex`, and only those that pass its
pre-checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import onnx_ir as ir
from onnxscript.rewriter import MatchContext, MatchResult, RewriteRule, RewriteRuleSet

from onnx_autodiff.passes.rewrite_rules import casts, noops, reshapes, transposes, zeros
from onnx_autodiff.passes.rewrite_rules.lowering import lowering_rules  # noqa: F401 - public here
from onnx_autodiff.rules.registry import pattern_root
from onnx_autodiff.toolkit.onnxscript_compat import MatchFailureError, NodeOutputPattern, pattern_outputs

# In this order: on a node, the first rule that applies rewrites it.
FAMILIES = (noops, transposes, reshapes, zeros, casts)


def cleanup_rules() -> RewriteRuleSet:
    """The project's cleanup rewrites as one onnxscript RewriteRuleSet: every family's rules, in
    :data:`FAMILIES` order."""
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


_NOTHING_MATCHED = MatchResult()  # what the root's node check sees as the match (read-only there)

# A rule's pre-checks: (input index, op identifier) of the nodes its root's inputs come from,
# and the root's node check.
Prechecks = tuple[tuple[tuple[int, ir.OperatorIdentifier], ...], Callable | None]


class RuleIndex:
    """Rules by the (domain, op type) of their pattern's output node; a rule whose pattern has
    several output nodes, or another kind of root, is tried on every node.

    :meth:`applicable` first tests, for each rule, what onnxscript's matcher would find wrong at a
    fraction of its cost (an attempt takes microseconds even when it fails, on every node of a
    common op in every round): the ops of the nodes the root's inputs come from, and the root's
    own node check (``_check=`` in the pattern), which then sees a match still empty.
    """

    def __init__(self, rules: Iterable[RewriteRule | RewriteRuleSet]) -> None:
        self.by_op: dict[tuple[str, str], list[RewriteRule]] = {}
        self.anywhere: list[RewriteRule] = []
        self.prechecks: dict[RewriteRule, Prechecks] = {}
        for rule in flatten(rules):
            root = pattern_root(rule)
            (self.by_op.setdefault(root, []) if root else self.anywhere).append(rule)
            self.prechecks[rule] = _prechecks(rule)
        # (rule, pre-checks) in the order tried, by op: the sweep asks for every node of each round
        self._tried = {op: [(rule, *self.prechecks[rule]) for rule in [*found, *self.anywhere]]
                       for op, found in self.by_op.items()}
        self._tried_anywhere = [(rule, *self.prechecks[rule]) for rule in self.anywhere]

    def rules_for(self, node: ir.Node) -> list[RewriteRule]:
        found = self.by_op.get((node.domain, node.op_type))
        return found + self.anywhere if found else self.anywhere

    def applicable(self, model: ir.Model, graph: ir.Graph | ir.Function, node: ir.Node) -> Iterator[RewriteRule]:
        """The rules for ``node`` that pass their pre-checks, in order."""
        context = None
        for rule, producers, check in self._tried.get((node.domain, node.op_type), self._tried_anywhere):
            if producers and not all(_comes_from(node, i, op) for i, op in producers):
                continue
            if check is not None:
                context = context or MatchContext(model, graph, node, _NOTHING_MATCHED)
                try:
                    if not check(context, node):
                        continue
                except MatchFailureError:
                    continue
            yield rule


def _prechecks(rule: RewriteRule) -> Prechecks:
    outputs = pattern_outputs(rule)
    if len(outputs) != 1:
        return (), None
    root = outputs[0]
    producers = tuple((i, value.producer().op_identifier()) for i, value in enumerate(root.inputs)
                      if isinstance(value, NodeOutputPattern) and value.producer().op_identifier() is not None)
    return producers, root.check_method


def _comes_from(node: ir.Node, index: int, op: ir.OperatorIdentifier) -> bool:
    value = node.inputs[index] if index < len(node.inputs) else None
    producer = None if value is None else value.producer()
    return producer is not None and producer.op_identifier() == op
