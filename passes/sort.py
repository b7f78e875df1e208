"""A topological sort where a graph is out of order."""

from __future__ import annotations

import onnx_ir as ir
from onnx_autodiff.toolkit import subgraphs
from onnx_ir.passes import common


class SortPass(ir.passes.InPlacePass):
    """onnx-ir's TopologicalSortPass, run only where the main graph or a function is out of order
    (or has subgraphs): a model already in order stays as it is, and checking the order costs
    less than sorting."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if all(in_order(g) for g in (model.graph, *model.functions.values())):
            return ir.passes.PassResult(model, modified=False)
        return common.TopologicalSortPass()(model)


def in_order(graph: ir.Graph | ir.Function) -> bool:
    """Whether every node follows the producers of its inputs (False for a graph with subgraphs,
    whose order also depends on what they read)."""
    seen: set[ir.Node] = set()
    for node in graph:
        if subgraphs(node):
            return False
        for value in node.inputs:
            producer = None if value is None else value.producer()
            if producer is not None and producer not in seen and producer.graph is node.graph:
                return False
        seen.add(node)
    return True
