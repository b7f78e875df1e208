"""Bounded constant folding: onnxscript's folder, kept from the folds that only grow a model.

A value whose data is hidden (``const_value`` None, as :class:`~onnx_autodiff.passes.cleanup.CleanupPass`
does to the initializers being differentiated) counts as unknown: nothing folds through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import onnx_ir as ir
from onnx_autodiff.passes.rewrite_rules import analysis
from onnx_autodiff.toolkit import all_graphs, detach_whole, shapes, subgraphs
from onnx_autodiff.toolkit.onnxscript_compat import Folder
from onnxscript.optimizer import FOLDED_FROM_KEY

FOLD_LIMIT = 1024  # elements: larger folded tensors stay computed (a seed Expand(1, Shape(y)) stays a node)


class FoldPass(ir.passes.InPlacePass):
    """onnxscript's ``fold_constants`` (as :class:`~onnx_autodiff.toolkit.onnxscript_compat.Folder`
    runs it) with inputs and outputs of at most ``limit`` elements, fills (ConstantOfShape, Expand
    of one number) and large Transposes kept as nodes (see :meth:`should_fold`), absent optional
    outputs left absent. ``graphs`` lists the model's graphs, subgraphs and functions
    (:func:`~onnx_autodiff.toolkit.all_graphs`; the cleanup passes one that lists them once). The
    folder's provenance notes stay on the folded values, which ``folded`` collects over the pass's
    calls: :meth:`drop_notes` removes them."""

    def __init__(self, limit: int = FOLD_LIMIT, graphs: Callable[[ir.Model], list[ir.Graph]] = all_graphs) -> None:
        super().__init__()
        self.limit = limit
        self.graphs = graphs
        self.folded: list[ir.Value] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # The folder writes Constant(value_ints=...) (opset 12 on) and initializers that are not
        # graph inputs (IR version 4 on): older models are left as they are.
        if analysis.opset(model) < 12 or (model.ir_version or 0) < 4:
            return ir.passes.PassResult(model, modified=False)
        folder = Folder(input_size_limit=self.limit, output_size_limit=self.limit, should_fold=self.should_fold,
                        graphs=self.graphs)
        graphs = self.graphs(model)
        nested = len(graphs) > 1 + len(model.functions)  # (else no node holds a subgraph: no walk)
        holders = [node for graph in graphs for node in graph if subgraphs(node)] if nested else []
        result = folder(model)
        for node in holders:
            if node.graph is None:  # an If the folder replaced by its taken branch: the other
                detach_whole(node)  # branch's reads of outer values would keep them alive
        self.folded += folder.folded
        return result

    def drop_notes(self, graphs: list[ir.Graph]) -> None:
        """Remove the provenance notes of the values this pass folded, and of the inputs and
        initializers of ``graphs`` (a model an exporter folded carries its folder's notes there):
        noise in saved models; the folder reads them while it folds, so they go once it is done."""
        drop_folding_notes([*self.folded, *(v for graph in graphs for v in graph.inputs),
                            *(v for graph in graphs if isinstance(graph, ir.Graph) for v in graph.initializers.values())])
        self.folded = []

    def should_fold(self, node: ir.Node) -> bool | None:
        """Keep fills (ConstantOfShape, Expand of one number) as nodes: folded, they only grow.
        The folder cannot fold multi-output nodes (it would evaluate them, then log a warning).
        It folds every Transpose whatever its size: a frozen weight's would become a second,
        in-memory copy of it (a multi-GB model's external data read into the model)."""
        if len(node.outputs) != 1:
            return False
        if node.domain == "" and node.op_type == "Transpose":
            shape = shapes.dims(node.inputs[0])
            if not analysis.static(shape) or analysis.size(shape) > self.limit:
                return False
        if node.domain == "" and node.op_type in ("ConstantOfShape", "Expand"):
            out = shapes.dims(node.outputs[0])
            if not analysis.static(out) or analysis.size(out) > analysis.SMALL:
                return False
        return None


def drop_folding_notes(values: Iterable[ir.Value]) -> None:
    """Remove the provenance notes onnxscript's folder attaches to the values it folds."""
    for value in values:
        value.meta.pop(FOLDED_FROM_KEY, None)
        value.metadata_props.pop(FOLDED_FROM_KEY, None)
