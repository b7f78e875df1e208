"""Constant lifting: the main graph's Constant nodes become initializers."""

from __future__ import annotations

import onnx_ir as ir
from onnx_autodiff.toolkit import shapes


class LiftConstantsPass(ir.passes.InPlacePass):
    """Turn the main graph's Constant nodes into initializers (one node fewer each).

    Only the main graph, from IR version 4 on: before it an initializer must also be a graph
    input, and functions have no initializers. A Constant that is a graph output stays a node.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if (model.ir_version or 0) < 4:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        lifted = False
        for node in list(graph):
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attributes) != 1:
                continue
            out = node.outputs[0]
            tensor = shapes.constant(out, computed=False)
            if out.is_graph_output() or tensor is None or not out.name or out.name in graph.initializers:
                continue
            if out.const_value is not None:
                tensor = out.const_value
            else:
                tensor = ir.tensor(tensor)
            init = ir.Value(name=out.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                            const_value=tensor)
            out.replace_all_uses_with(init)
            graph.remove(node, safe=True)
            graph.register_initializer(init)
            lifted = True
        return ir.passes.PassResult(model, modified=lifted)
