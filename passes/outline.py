"""Groups each rule's backward nodes into one call of a model-local function.

The graph then reads one backward node per differentiated forward node (``LayerNormalizationGrad``,
``GeluGrad``, ...), as a training runtime's fused kernels do, while every function body holds
standard ops only: runtimes inline model-local functions when they load the model, so it computes
the same values at the same speed. Run it last, after the cleanup passes (they optimise the graph,
not function bodies). To differentiate the result again, inline it first
(``onnx_ir.passes.common.InlinePass``).

Nodes are grouped by their ``onnx_autodiff.grad_of`` metadata, which the engine sets on the nodes
each rule emits and the cleanup rewrites keep. A group is outlined when it has at least two nodes,
none holding a subgraph, and no path leaves it and comes back (a call must not read its own
output). Groups of the same structure share one function: ``LayerNormalizationGrad`` is defined
once and called for every LayerNormalization.
"""

from __future__ import annotations

import hashlib

import onnx_ir as ir
from onnx_autodiff.passes.metadata import provenance, unmark
from onnx_ir.passes import common

DOMAIN = "onnx_autodiff.grad"


class OutlinePass(ir.passes.InPlacePass):
    """Groups each rule's backward nodes in the main graph into one call of a model-local function."""

    def __init__(self, min_nodes: int = 2) -> None:
        super().__init__()
        self.min_nodes = min_nodes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        common.TopologicalSortPass()(model)
        groups: dict[str, list[ir.Node]] = {}
        op_types: dict[str, str] = {}
        for node in graph:
            origin = provenance(node)
            if origin is not None:
                groups.setdefault(origin.tag, []).append(node)
                op_types.setdefault(origin.tag, origin.op_type)
        position = {node: i for i, node in enumerate(graph)}
        by_body: dict[bytes, ir.Function] = {}
        modified = False
        for tag, nodes in groups.items():
            if len(nodes) < self.min_nodes or not _outlinable(graph, nodes, position):
                continue
            _outline(model, op_types[tag], nodes, by_body)
            modified = True
        if modified:
            model.opset_imports.setdefault(DOMAIN, 1)
            common.TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=modified)


def _outlinable(graph: ir.Graph, nodes: list[ir.Node], position: dict[ir.Node, int]) -> bool:
    """No subgraphs, no value read inside another node's subgraph (a path this walk would not
    see), and no path from the group through other nodes back into it."""
    if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
           for node in nodes for attr in node.attributes.values()):
        return False
    if any(user.graph is not graph for n in nodes for out in n.outputs for user, _ in out.uses()):
        return False
    group = set(nodes)
    last = max(position[n] for n in nodes)
    # Only nodes placed before the group's last node can lead back into it (topological order).
    frontier = [user for n in nodes for out in n.outputs for user, _ in out.uses()
                if user not in group and position.get(user, last) < last]
    seen = set(frontier)
    while frontier:
        node = frontier.pop()
        for out in node.outputs:
            for user, _ in out.uses():
                if user in group:
                    return False
                if user not in seen and position.get(user, last) < last:
                    seen.add(user)
                    frontier.append(user)
    return True


def _outline(model: ir.Model, op_type: str, nodes: list[ir.Node], by_body: dict[bytes, ir.Function]) -> None:
    graph = model.graph
    group = set(nodes)
    inputs: list[ir.Value] = []  # read from outside, in order of first use
    for node in nodes:
        for value in node.inputs:
            if value is not None and value.producer() not in group and value not in inputs:
                inputs.append(value)
    outputs = [out for node in nodes for out in node.outputs
               if out.is_graph_output() or any(user not in group for user, _ in out.uses())]

    # The body: the group's nodes moved into a function, its values renamed x*, t*, y* so that
    # groups of the same structure serialise alike and share a function.
    graph.remove(nodes)
    params = [ir.Value(name=f"x{i}", type=v.type, shape=v.shape) for i, v in enumerate(inputs)]
    call_outputs = []
    for out in outputs:
        outer = ir.Value(name=out.name, type=out.type, shape=out.shape)
        for user, index in list(out.uses()):
            if user not in group:
                user.replace_input_with(index, outer)
        for k, graph_out in enumerate(graph.outputs):
            if graph_out is out:
                graph.outputs[k] = outer
        call_outputs.append(outer)
    for node in nodes:
        for index, value in enumerate(node.inputs):
            if value in inputs:
                node.replace_input_with(index, params[inputs.index(value)])
    count = 0
    for k, node in enumerate(nodes):
        unmark(node)
        node.name = f"n{k}"
        for out in node.outputs:
            if out in outputs:
                out.name = f"y{outputs.index(out)}"
            elif out.name:  # an absent optional output stays ""
                out.name, count = f"t{count}", count + 1
    # Function values are untyped: the types come from the call site when a runtime inlines it,
    # and groups that differ only in shapes share a function.
    for value in [*params, *(out for node in nodes for out in node.outputs)]:
        value.type, value.shape = None, None
    body = ir.Graph(params, outputs, nodes=nodes, opset_imports=dict(model.opset_imports))

    function = _shared_function(model, op_type, body, by_body)
    call = ir.Node(DOMAIN, function.name, inputs, outputs=call_outputs,
                   name=f"{op_type}Grad_{call_outputs[0].name}")
    graph.append(call)


def _shared_function(model: ir.Model, op_type: str, body: ir.Graph, by_body: dict[bytes, ir.Function]) -> ir.Function:
    """The function with this body: an existing one of the same structure, or a new one."""
    probe = ir.Function(DOMAIN, "probe", graph=body, attributes=[])
    key = hashlib.sha256(ir.to_proto(probe).SerializeToString(deterministic=True)).digest()
    if key in by_body:
        return by_body[key]
    base = f"{op_type}Grad"
    name, k = base, 1
    while (DOMAIN, name, "") in model.functions:
        k += 1
        name = f"{base}_{k}"
    function = ir.Function(DOMAIN, name, graph=body, attributes=[])
    model.functions[function.identifier()] = function
    by_body[key] = function
    return function
