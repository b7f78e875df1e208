"""Lowers ai.onnx.preview.training::Gradient nodes into the standard-op subgraphs they stand for."""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.errors import UnsupportedModelError
from onnx_autodiff.passes.autodiff import backward_builder, differentiate, find_value
from onnx_autodiff.rules import GradRegistry, default_registry
from onnx_autodiff.toolkit import Namer, infer_shapes, shapes

TRAINING_DOMAIN = "ai.onnx.preview.training"


class GradientOpLoweringPass(ir.passes.InPlacePass):
    """Replaces each Gradient node by the backward nodes of dy/dx (seed: ones shaped like y).

    Nodes are lowered in graph order, so a Gradient of a Gradient (higher order) works once the
    inner one is lowered.
    """

    def __init__(self, registry: GradRegistry | None = None) -> None:
        super().__init__()
        self.registry = registry if registry is not None else default_registry()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        if _first_gradient_node(graph) is not None:
            infer_shapes(model)
        while (node := _first_gradient_node(graph)) is not None:
            self._lower(model, graph, node)
            modified = True
        if modified:
            graph.sort()
            if not any(n.domain == TRAINING_DOMAIN for n in graph.all_nodes()):
                model.opset_imports.pop(TRAINING_DOMAIN, None)
        return ir.passes.PassResult(model, modified)

    def _lower(self, model: ir.Model, graph: ir.Graph, node: ir.Node) -> None:
        xs_names = shapes.attr(node, "xs")
        y_name = shapes.attr(node, "y")
        if not xs_names or not y_name:
            raise UnsupportedModelError(f"Gradient node '{node.name}' needs the attributes xs and y")
        xs = [find_value(graph, name, "xs") for name in xs_names]
        y = find_value(graph, y_name, "y")
        namer = Namer.for_graph(graph)
        op = backward_builder(self.registry, model.opset_imports, namer)
        grads = differentiate(graph, [(y, shapes.ones_like(op, y))], xs, op)
        results = []
        for x, grad, out in zip(xs, grads, node.outputs):
            grad = shapes.zeros(op, x) if grad is None else grad
            results.append((out, grad, x))
        graph.extend(op.nodes)
        for out, grad, x in results:
            if out.is_graph_output() or grad.producer() is None or grad.is_graph_output():
                grad = op.Identity(grad)
                graph.append(grad.producer())
            grad.type, grad.shape = x.type, x.shape
            out.replace_all_uses_with(grad, replace_graph_outputs=True)
            if out.name:
                name = out.name
                out.name = None
                grad.name = name
        graph.remove(node, safe=True)


def _first_gradient_node(graph: ir.Graph) -> ir.Node | None:
    return next((n for n in graph if n.domain == TRAINING_DOMAIN and n.op_type == "Gradient"), None)
