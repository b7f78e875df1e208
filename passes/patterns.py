"""Pattern gradient rules in the walk: the subgraphs their patterns match become one unit each."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import onnx_ir as ir

from onnx_autodiff.rules.registry import GradRule, PatternRule


@dataclasses.dataclass(frozen=True, eq=False)  # told apart by identity, as nodes are
class Match:
    """A subgraph a pattern rule matched: one unit of the walk, which its ``rule`` differentiates
    as a node's rule does the node. ``inputs`` are the values bound to the pattern's parameters,
    ``outputs`` the pattern's; ``match["x"]`` is the value bound to ``x`` (a parameter, or an
    interior value the pattern names with ``_outputs``). Messages and provenance name it by the
    rule (``op_type``, ``domain``) and by the node computing its output (``name``)."""

    rule: GradRule
    root: ir.Node
    nodes: list[ir.Node]
    inputs: list[ir.Value]
    outputs: list[ir.Value]
    bindings: dict[str, object]

    @classmethod
    def of(cls, rule: PatternRule, result, root: ir.Node) -> Match:
        """The match onnxscript's ``result`` of ``rule`` found, computing ``root``'s output."""
        bindings = dict(result.bindings)
        names = tuple(name for name in rule.parameters if isinstance(bindings.get(name), ir.Value))
        engine_rule = GradRule(rule.name, "", rule.opsets, rule.differentiable, rule.backward, rule.broadcast,
                               inputs=(names, False))
        return cls(engine_rule, root, list(result.nodes), [bindings[name] for name in names],
                   list(result.outputs), bindings)

    @property
    def name(self) -> str | None:
        return self.root.name

    @property
    def op_type(self) -> str:
        return self.rule.op_type

    @property
    def domain(self) -> str:
        return self.rule.domain

    def __getitem__(self, name: str):
        return self.bindings[name]


def grouped(order: Sequence[ir.Node], rules: Sequence[PatternRule], opset: int,
            reach: Callable[[], set[ir.Value]]) -> list[ir.Node | Match]:
    """``order`` with the nodes of each pattern match replaced by one :class:`Match` where the
    match's output node stood (still a topological order): matches of larger patterns first, each
    node in one match at most, and only where nothing else reads the match's interior values and
    no gradient reaches the values bound to its non-differentiable parameters (the rule would
    drop it, where the ops it replaces pass it on): ``reach()`` gives the values gradients reach
    in ``order``, asked for once a pattern has matched. Each node is tried only with the rules
    whose pattern ends in its op."""
    by_root: dict[tuple[str, str] | None, list[PatternRule]] = {}
    for rule in rules:
        if rule.opsets[0] <= opset <= rule.opsets[1]:
            by_root.setdefault(rule.root, []).append(rule)
    if not by_root:
        return list(order)
    position = {node: i for i, node in enumerate(order)}
    candidates, reached = [], None
    for node in order:
        if node.graph is None:
            continue
        for rule in by_root.get((node.domain, node.op_type), []) + by_root.get(None, []):
            result = rule.matcher.match(None, node.graph, node, check_nodes_are_removable=True)
            if not result or not all(n in position for n in result.nodes):
                continue
            reached = reach() if reached is None else reached  # the walk's reach, once a match is found
            fixed = [result.bindings.get(name) for name in rule.parameters if name not in rule.differentiable]
            if not any(isinstance(value, ir.Value) and value in reached for value in fixed):
                candidates.append((-rule.size, position[node], rule, result, node))
    taken: set[ir.Node] = set()
    roots: dict[ir.Node, Match] = {}
    for _, _, rule, result, root in sorted(candidates, key=lambda c: c[:2]):
        if any(n in taken for n in result.nodes):
            continue
        taken.update(result.nodes)
        roots[root] = Match.of(rule, result, root)
    return [roots[node] if node in roots else node for node in order if node in roots or node not in taken]
