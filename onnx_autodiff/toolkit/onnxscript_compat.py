"""The one module that reads onnxscript's private API.

onnxscript's rewriter keeps private what the cleanup's indexed sweep and the pattern gradient rules
need: the pattern a rule matches (``_target_pattern``), the pattern's node outputs
(``_pattern_ir.NodeOutputPattern``) and the error a check raises to fail a match
(``_basics.MatchFailureError``), and the folder's pass class, its registry of partial evaluators and
its symbolic values (:class:`Folder`). Everything else uses its public names. A release that moves these
breaks here alone; :data:`SUPPORTED` says which releases are known to work, and
``tests/test_onnxscript_compat.py`` checks the installed one against it.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter._basics import MatchFailureError
from onnxscript.rewriter._pattern_ir import NodeOutputPattern

from onnx_autodiff.toolkit.graphs import all_graphs, fix_names

__all__ = ["SUPPORTED", "Folder", "MatchFailureError", "NodeOutputPattern", "pattern_nodes", "pattern_outputs"]

# onnxscript releases from the first up to, not including, the second: the full suite runs on 0.7.
# 0.5 lacks the folder's FOLDED_FROM_KEY; on 0.6.2 the passes' tests pass, but torch's exporter
# leaves some ops as onnxscript torch_lib functions (aten_special_erf) that no rule knows.
SUPPORTED = ((0, 7), (0, 8))


def pattern_outputs(rule) -> list:
    """The node patterns an onnxscript RewriteRule's pattern ends in (no public accessor in 0.7)."""
    return list(getattr(getattr(rule, "_target_pattern", None), "output_nodes", None) or [])


def pattern_nodes(rule) -> list:
    """Every node pattern of an onnxscript RewriteRule's pattern."""
    pattern = getattr(rule, "_target_pattern", None)
    return [] if pattern is None else list(pattern)


_SUBGRAPH_TYPES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


class Folder(_constant_folding.FoldConstantsPass):
    """onnxscript's ``fold_constants`` pass (its arguments are that function's, shape inference
    off), visiting only the nodes it could change: a node whose op has no partial evaluator, that
    holds no subgraph, reads some value not known as a constant and no value the folder forwards
    (an Identity's input) passes through its ``process_node`` unchanged, and a backward graph is
    mostly such nodes (nor does an Add unless each input is a constant or a symbolic value: its
    evaluator adds shape values). Its closing renaming pass (onnx-ir's NameFixPass as
    :func:`~onnx_autodiff.toolkit.graphs.fix_names` runs it) runs where a fold may have left a
    name to fix (onnxscript's runs after any fold; see :meth:`_named_anew`), and leaves absent
    optional outputs ("" in ONNX) absent: named, they would count as present (Attention's
    present_key with nonpad_kv_seqlen is invalid). ``graphs`` lists the model's graphs, subgraphs
    and functions; ``folded`` collects the values folds made, which carry the folder's provenance
    note (``FOLDED_FROM_KEY``)."""

    def __init__(self, graphs: Callable[[ir.Model], list[ir.Graph]] = all_graphs, **options) -> None:
        super().__init__(shape_inference=False, **options)
        self.graphs = graphs
        self.folded: list[ir.Value] = []
        self._made: list[ir.Node] = []  # the nodes this call's folds made
        self._evaluated = frozenset(_constant_folding.registry.op_evaluators)

    def visit_node(self, node: ir.Node, root) -> None:
        if self._may_change(node):
            super().visit_node(node, root)

    def _may_change(self, node: ir.Node) -> bool:
        inputs = node.inputs
        if node.op_type == "Add" and node.domain == "":
            # its evaluator adds shape values: it needs every input known (a backward graph's
            # Adds, which sum gradients, mostly read neither a constant nor a symbolic value)
            known = self._state.symbolic_value_map
            return all(v is None or v.const_value is not None or v in known for v in inputs)
        if (node.domain, node.op_type) in self._evaluated or node.op_type == "Constant":
            return True
        if all(v is None or v.const_value is not None for v in inputs):
            return True
        forwarded = self._state.symbolic_value_map
        if forwarded and any(v is not None and type(forwarded.get(v)) is ir.Value for v in inputs):
            return True
        return bool(node.attributes) and any(a.type in _SUBGRAPH_TYPES for a in node.attributes.values())

    def replace_node(self, node: ir.Node, replacement, root) -> None:
        self.folded.extend(v for v in replacement.new_outputs if v is not None)
        self._made.extend(replacement.new_nodes)
        super().replace_node(node, replacement, root)

    def call(self, model: ir.Model):
        self._reset()
        self._made = []
        self._opset_imports = model.opset_imports
        flat = not model.functions and len(self.graphs(model)) == 1
        outputs = list(model.graph.outputs)
        self.visit_graph(model.graph)
        for function in model.functions.values():
            self.visit_function(function)
        if self._modified and (not flat or self._named_anew(model.graph, outputs)):
            absent = [out for graph in self.graphs(model) for node in graph for out in node.outputs if not out.name]
            fix_names(model)
            for out in absent:
                if not out.uses() and not out.is_graph_output():
                    out.name = ""
        return ir.passes.PassResult(model, self._modified)

    def _named_anew(self, graph: ir.Graph, outputs: list[ir.Value]) -> bool:
        """Whether the folds of ``graph`` (a model's only graph) left a name to fix: a node or value
        they made (a Constant, a partial evaluator's nodes) without a name or with another's, or a
        graph output the folder replaced by a value of the graph (which takes the output's name).
        A fold's own values take the names of the values they replace, so mostly none: the
        renaming pass would then only name the nodes the model left unnamed, which the cleanup
        leaves as they are where nothing folds (its walk over a 55,000-node train model cost more
        than the folds)."""
        replaced = set(self.folded)  # (a fold's new value takes the name of the one it replaces)
        if any(new is not old and new not in replaced for new, old in zip(graph.outputs, outputs)):
            return True  # a value the folder forwards to an output takes its name, and may keep its own reader
        made = {node: None for node in self._made if node.graph is graph}  # (in the order made)
        values = {out: None for node in made for out in node.outputs}
        node_names = {node.name for node in graph if node not in made}
        value_names = {v.name for v in (*graph.inputs, *graph.initializers.values())}
        value_names.update(out.name for node in graph for out in node.outputs if out not in values)
        for node in made:
            if not node.name or node.name in node_names:
                return True
            node_names.add(node.name)
        for value in values:
            if not value.name or value.name in value_names:
                return True
            value_names.add(value.name)
        return False
