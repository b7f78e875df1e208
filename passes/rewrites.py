"""The cleanup's sweep of its rewrite rules (:mod:`onnx_autodiff.passes.rewrite_rules`) over a
model's graphs, subgraphs and functions: each node rewritten by the first rule that applies, its
output replaced while graph outputs keep their names and the new nodes the provenance (GRAD_OF and its fields, :mod:`~onnx_autodiff.passes.metadata`).
:class:`RewriteRulesPass` is one sweep as a pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import onnx_ir as ir

from onnx_autodiff.toolkit import all_graphs, detach
from onnx_autodiff.passes.metadata import mark, provenance
from onnx_autodiff.passes.rewrite_rules import RuleIndex, cleanup_rules
from onnx_autodiff.passes.rewrite_rules.analysis import renamable


class RewriteRulesPass(ir.passes.InPlacePass):
    """One sweep of ``rules`` (default: the project's :func:`~onnx_autodiff.passes.rewrite_rules.cleanup_rules`)
    over the graphs that ``graphs`` lists (:func:`~onnx_autodiff.toolkit.all_graphs`; the cleanup
    passes one that lists them once); modified when a rule fired. The rules decide from shapes:
    run onnx's inference first where values lack them."""

    def __init__(self, rules: RuleIndex | None = None,
                 graphs: Callable[[ir.Model], list[ir.Graph]] = all_graphs) -> None:
        super().__init__()
        self.rules = rules if rules is not None else RuleIndex([cleanup_rules()])
        self.graphs = graphs

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=Rewriter(model, self.graphs(model), self.rules).run() > 0)


class Rewriter:
    """One sweep of the rules over a model's graphs, subgraphs and functions."""

    def __init__(self, model: ir.Model, graphs: list[ir.Graph] | None = None, rules: RuleIndex | None = None) -> None:
        self.model = model
        self.rules = rules if rules is not None else RuleIndex([cleanup_rules()])
        self.graphs = all_graphs(model) if graphs is None else graphs
        self._taken: set[str] | None = None
        self.captured = _captured_outputs(self.graphs)
        self.count = 0
        # Replaced nodes leave their graphs at the end of the sweep, all at once: each removal
        # copies the list of graph outputs. Until then they are detached and skipped.
        self.dropped: dict[ir.Graph, list[ir.Node]] = {}
        self._gone: set[ir.Node] = set()
        self._positions: dict[ir.Graph, dict[ir.Value, list[int]]] = {}

    # ------------------------------------------------------------------ helpers

    def fresh(self, base: str | None) -> str:
        """A value name used nowhere in the model, derived from ``base``."""
        if self._taken is None:
            self._taken = {v.name for v in _all_values(self.graphs) if v.name and v.producer() not in self._gone}
        base = f"{base or 'v'}_s"
        name, k = base, 0
        while name in self._taken:
            k += 1
            name = f"{base}{k}"
        self._taken.add(name)
        return name

    # ------------------------------------------------------------------ driver

    def run(self) -> int:
        """Apply the rules once to every node; return how many fired."""
        for graph in self.graphs:
            for node in list(graph):
                if node in self._gone or len(node.outputs) != 1 or node.outputs[0] in self.captured:
                    continue  # (a captured output: an inner graph's that it reads from outside)
                result = self.rewrite_by_rules(graph, node)
                if result is not None:
                    self.replace(node, *result)
        for graph, nodes in self.dropped.items():
            graph.remove(nodes, safe=True)
        self.dropped.clear()
        return self.count

    def rewrite_by_rules(self, graph: ir.Graph, node: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
        """The first rule of the index that rewrites ``node``: (the value its output equals, the
        new nodes that make it); no new nodes where the replacement is one Identity of a value."""
        for rule in self.rules.applicable(self.model, graph, node):
            delta = rule.try_rewrite(self.model, graph, node)
            if delta is None:
                continue
            value, made = delta.new_outputs[0], list(delta.new_nodes)
            if len(delta.match.outputs) != 1 or delta.match.outputs[0] is not node.outputs[0]:
                detach(*made)  # (a new node's inputs count as uses of what they read)
                continue
            for tensor in delta.new_initializers:
                graph.initializers.setdefault(tensor.name, tensor)
            if len(made) == 1 and made[0].op_type == "Identity" and made[0].domain == "" and value is made[0].outputs[0]:
                value = made[0].inputs[0]
                detach(*made)
                return value, []  # the node is a no-op: its readers read the input
            return value, made
        return None

    def drop(self, node: ir.Node) -> None:
        """Take ``node``, whose outputs nothing reads any more, out of the graph (at the end of the sweep)."""
        detach(node)
        self.dropped.setdefault(node.graph, []).append(node)
        self._gone.add(node)
        self.count += 1

    def output_positions(self, graph: ir.Graph, value: ir.Value) -> list[int]:
        """Where ``value`` stands among the graph's outputs (an index kept up to date by set_output)."""
        if not value.is_graph_output():
            return []
        if graph not in self._positions:
            positions: dict[ir.Value, list[int]] = {}
            for i, out in enumerate(graph.outputs):
                positions.setdefault(out, []).append(i)
            self._positions[graph] = positions
        return list(self._positions[graph].get(value, ()))

    def set_output(self, graph: ir.Graph, i: int, value: ir.Value) -> None:
        positions = self._positions.get(graph)
        if positions is not None:
            old = positions.get(graph.outputs[i])
            if old is not None and i in old:
                old.remove(i)
            positions.setdefault(value, []).append(i)
        graph.outputs[i:i + 1] = [value]  # (by index, onnx-ir tests i against typing.SupportsIndex: 9 µs)

    def replace(self, node: ir.Node, value: ir.Value, new_nodes: list[ir.Node]) -> None:
        """Make ``node``'s output ``value`` (an existing value or the last of ``new_nodes``). A
        graph output keeps its name: ``value`` takes it, or where it cannot (another graph's
        value, a graph input or output) an Identity of it does."""
        graph = node.graph
        old = node.outputs[0]
        if new_nodes:
            origin = provenance(node)
            for made in new_nodes:
                # named before they join the graph, whose own naming ("val_0") knows no other
                # graph's names: a subgraph's would repeat one of the graph around it
                for out in made.outputs:
                    out.name = out.name or self.fresh(old.name)
                mark(made, origin)
            graph.insert_before(node, new_nodes)
        if value.type is None:
            value.type = old.type
        if value.shape is None and old.shape is not None:
            value.shape = old.shape
        positions = self.output_positions(graph, old)
        if positions:
            if not renamable(value, graph):
                identity = ir.Node("", "Identity", [value], num_outputs=1)
                graph.insert_before(node, [identity])
                value = identity.outputs[0]
            name = old.name
            old.name = None
            value.name = name
            value.type = old.type or value.type
            value.shape = old.shape if old.shape is not None else value.shape
            for i in positions:
                self.set_output(graph, i, value)
        old.replace_all_uses_with(value)
        self.drop(node)


def _all_values(graphs: list[ir.Graph]) -> Iterator[ir.Value]:
    for graph in graphs:
        yield from graph.inputs
        if isinstance(graph, ir.Graph):
            yield from graph.initializers.values()
        for node in graph:
            yield from node.outputs


def _captured_outputs(graphs: list[ir.Graph]) -> set[ir.Value]:
    """Graph outputs produced outside their graph (an inner graph returning an outer value)."""
    found = set()
    for graph in graphs:
        for out in graph.outputs:
            producer = out.producer()
            if producer is not None and producer.graph is not graph:
                found.add(out)
    return found
