"""Protobuf entry points: the gradient of a list of nodes or of a function as an onnx.FunctionProto."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnx_ir as ir

from onnx_autodiff.errors import UnknownValueError, UnsupportedModelError
from onnx_autodiff.passes.autodiff import (
    backward_builder,
    check_differentiable,
    differentiate,
    find_value,
    gradient_outputs,
    topological_order,
)
from onnx_autodiff.rules import GradRegistry, default_registry
from onnx_autodiff.toolkit import Namer, captured_values, infer_shapes, initializers_to_constants

DOMAIN = "onnx_autodiff"


def gradient_of_nodes(
    nodes: Sequence[onnx.NodeProto],
    xs: Sequence[str],
    y: str,
    zs: Sequence[str] = (),
    registry: GradRegistry | None = None,
    *,
    opset_imports: dict[str, int] | None = None,
    name: str | None = None,
    domain: str = DOMAIN,
    value_info: Sequence[onnx.ValueInfoProto] = (),
) -> onnx.FunctionProto:
    """The function [xs..., zs..., dy] -> [grad_x1, ...] computing dy·∂y/∂x through ``nodes``.

    ``zs`` are the other values the nodes read; ``opset_imports`` defaults to the installed
    onnx's default-domain version. ``value_info`` gives types and shapes of inputs or other
    values (a model's ``graph.input``, say): rules that need ranks (MatMul's) get them from there,
    completed through the nodes by shape inference.
    """
    opsets = dict(opset_imports or {"": onnx.defs.onnx_opset_version()})
    function = onnx.helper.make_function(
        domain,
        name or f"Forward_{y}",
        list(xs) + list(zs),
        [y],
        list(nodes),
        [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
        value_info=list(value_info),
    )
    return gradient_of_function(function, xs, y, zs, registry, name=name, domain=domain)


def gradient_of_function(
    fn: onnx.FunctionProto | onnx.ModelProto | onnx.GraphProto,
    xs: Sequence[str],
    y: str,
    zs: Sequence[str] = (),
    registry: GradRegistry | None = None,
    *,
    name: str | None = None,
    domain: str = DOMAIN,
) -> onnx.FunctionProto:
    """The function [xs..., zs..., dy] -> [grad_x1, ...] for a function, model or graph.

    Initializers of a model or graph may be named in ``xs`` or ``zs`` like inputs; those not
    named become Constant nodes, so the function is self-contained. It recomputes every forward
    value the backward nodes need. Shapes are inferred and completed as by the pass (a function's
    types come from its ``value_info``).
    """
    model = _as_ir_model(fn)
    infer_shapes(model)
    graph, opsets = model.graph, dict(model.opset_imports)
    variables = [find_value(graph, x, "xs") for x in xs]
    for x in variables:
        check_differentiable(x, "xs")
    others = [find_value(graph, z, "zs") for z in zs]
    output = find_value(graph, y, "y")
    initializers_to_constants(graph, keep=set(xs) | set(zs))  # functions hold no initializers
    namer = Namer.for_graph(graph)
    op = backward_builder(registry or default_registry(), opsets, namer)
    dy = ir.Value(name=namer.fresh("dy"), type=output.type, shape=output.shape)
    grads = differentiate(graph, [(output, dy)], variables, op)
    results = gradient_outputs(op, namer, variables, grads)
    inputs = [*variables, *others, dy]
    nodes = _needed_nodes([*topological_order(graph), *op.nodes], results, inputs)
    for value in (*variables, *others):
        if value.producer() is not None:
            raise UnsupportedModelError(
                f"'{value.name}' is computed by the nodes; xs and zs must name their inputs"
            )
    graph.remove([node for node in nodes if node.graph is graph])
    graph.inputs.clear()
    graph.outputs.clear()
    body = ir.Graph(inputs, results, nodes=nodes, opset_imports={**opsets, **op.opsets})
    function = ir.Function(domain, name or f"Gradient_of_{y}", graph=body, attributes=[])
    return ir.serde.serialize_function(function)


def _as_ir_model(fn) -> ir.Model:
    if isinstance(fn, onnx.FunctionProto):
        if fn.attribute or fn.attribute_proto:
            raise UnsupportedModelError(
                f"function '{fn.name}' has attributes: differentiate a call site's body instead"
            )
        infos = {info.name: info for info in fn.value_info}
        signature = {*fn.input, *fn.output}
        body = onnx.helper.make_graph(
            list(fn.node),
            fn.name,
            [infos.get(n, onnx.ValueInfoProto(name=n)) for n in fn.input],
            [infos.get(n, onnx.ValueInfoProto(name=n)) for n in fn.output],
            value_info=[info for name, info in infos.items() if name not in signature],
        )
        return ir.serde.deserialize_model(onnx.helper.make_model(body, opset_imports=list(fn.opset_import)))
    if isinstance(fn, onnx.GraphProto):
        default = [onnx.helper.make_opsetid("", onnx.defs.onnx_opset_version())]
        return ir.serde.deserialize_model(onnx.helper.make_model(fn, opset_imports=default))
    if isinstance(fn, onnx.ModelProto):
        return ir.serde.deserialize_model(fn)
    raise TypeError(f"expected a FunctionProto, GraphProto or ModelProto, not {type(fn).__name__}")


def _needed_nodes(nodes: list[ir.Node], results, inputs) -> list[ir.Node]:
    """The nodes that the results depend on, in their order; every other read must be an input."""
    needed = set(results)
    keep: list[ir.Node] = []
    for node in reversed(nodes):
        if any(out in needed for out in node.outputs):
            keep.append(node)
            # Values its subgraphs read count too (an If's branch VJP reads the seed's expansion).
            needed.update(v for v in (*node.inputs, *captured_values(node)) if v is not None)
    keep.reverse()
    produced = {out for node in keep for out in node.outputs}
    missing = [v.name for v in needed if v not in produced and v not in set(inputs)]
    if missing:
        raise UnknownValueError(
            f"the gradient needs {sorted(missing)}, which are neither computed by the nodes nor "
            "listed in xs or zs: add them to zs"
        )
    return keep
