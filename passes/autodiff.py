"""Reverse-mode automatic differentiation as an onnx-ir pass: appends the nodes computing dy·∂y/∂x."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from onnx_autodiff.errors import (
    AutodiffError,
    MissingRuleError,
    NotDifferentiableError,
    RuleError,
    UnknownValueError,
    UnsupportedModelError,
    describe_node,
)
from onnx_autodiff.rules import GradRegistry, GradRule, default_registry, shapes
from onnx_autodiff.rules.builder import FLOAT_TYPES, Namer, OpBuilder


def _can_carry_gradient(value: ir.Value) -> bool:
    return value.dtype is None or value.dtype in FLOAT_TYPES


def _captured_values(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values that the node's subgraphs read (implicit inputs)."""
    captured: list[ir.Value] = []
    seen: set[ir.Value] = set()
    for attribute in node.attributes.values():
        graphs = ()
        if attribute.type == ir.AttributeType.GRAPH:
            graphs = (attribute.value,)
        elif attribute.type == ir.AttributeType.GRAPHS:
            graphs = tuple(attribute.value)
        for graph in graphs:
            for inner in ir.traversal.RecursiveGraphIterator(graph):
                for value in inner.inputs:
                    if value is not None and value.graph is not None and value.graph is node.graph:
                        if value not in seen:
                            seen.add(value)
                            captured.append(value)
    return captured


def topological_order(graph: ir.Graph | ir.Function) -> list[ir.Node]:
    """The graph's nodes in an order where every producer precedes its consumers (stable)."""
    nodes = list(graph)
    position = {node: i for i, node in enumerate(nodes)}
    pending = {node: 0 for node in nodes}
    consumers: dict[ir.Node, list[ir.Node]] = {node: [] for node in nodes}
    for node in nodes:
        for value in (*node.inputs, *_captured_values(node)):
            producer = value.producer() if value is not None else None
            if producer is not None and producer in position:
                pending[node] += 1
                consumers[producer].append(node)
    if all(
        position[p] < position[n] for p, users in consumers.items() for n in users
    ):
        return nodes
    import heapq

    ready = [position[n] for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    order: list[ir.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for user in consumers[node]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, position[user])
    if len(order) != len(nodes):
        stuck = next(n for n in nodes if pending[n] > 0)
        raise UnsupportedModelError(
            f"the graph has a cycle through node '{stuck.name}' (op {stuck.op_type}): "
            "an ONNX graph must be acyclic"
        )
    return order


class Backward:
    """Builds the backward nodes of one graph for one output and a list of variables."""

    def __init__(
        self,
        graph: ir.Graph | ir.Function,
        registry: GradRegistry,
        opsets: dict[str, int],
        namer: Namer,
    ) -> None:
        self.graph = graph
        self.registry = registry
        self.opsets = {("" if k == "ai.onnx" else k): v for k, v in opsets.items()}
        if "" not in self.opsets:
            raise UnsupportedModelError("the model imports no version of the default ONNX domain")
        self.op = OpBuilder(self.opsets[""], namer, self.opsets)
        self.order = topological_order(graph)

    def opset_of(self, node: ir.Node) -> int:
        return self.opsets.get("" if node.domain == "ai.onnx" else node.domain, 1)

    def gradients(self, y: ir.Value, xs: Sequence[ir.Value], dy: ir.Value) -> list[ir.Value | None]:
        """The VJP dy·∂y/∂x per x (None where y does not depend on x); emits into ``self.op``."""
        reached, rules = self._forward_reach(xs)
        active = self._backward_reach(y, reached, rules)
        contributions: dict[ir.Value, list[ir.Value]] = {}
        totals: dict[ir.Value, ir.Value] = {}
        if y in reached:
            contributions[y] = [dy]

        def total(value: ir.Value) -> ir.Value | None:
            if value not in totals and value in contributions:
                totals[value] = shapes.accumulate(self.op, contributions[value])
            return totals.get(value)

        for node in reversed(active):
            rule = rules[node]
            if rule is None:
                self._missing_rule(node, y, xs)
            dys = [total(out) for out in node.outputs]
            if all(g is None for g in dys):
                continue
            for index, grad in self._call_rule(rule, node, dys, reached):
                value = node.inputs[index]
                if rule.broadcast:
                    grad = shapes.unbroadcast(self.op, grad, value, node.outputs[0])
                contributions.setdefault(value, []).append(grad)
        return [total(x) for x in xs]

    def _forward_reach(self, xs: Sequence[ir.Value]):
        reached: set[ir.Value] = set(xs)
        rules: dict[ir.Node, GradRule | None] = {}
        for node in self.order:
            if not any(v in reached for v in (*node.inputs, *_captured_values(node)) if v is not None):
                continue
            rule = self.registry.lookup(node, self.opset_of(node))
            rules[node] = rule
            if rule is not None and not any(
                i in self._differentiable_inputs(rule, node, reached) for i in range(len(node.inputs))
            ):
                continue
            reached.update(out for out in node.outputs if _can_carry_gradient(out))
        return reached, rules

    def _differentiable_inputs(self, rule: GradRule, node: ir.Node, reached) -> list[int]:
        if rule.backward is None:
            return []
        names = rule.input_names(node, self.opset_of(node))
        return [
            i
            for i, (name, value) in enumerate(zip(names, node.inputs))
            if name in rule.differentiable and value is not None and value in reached
        ]

    def _backward_reach(self, y: ir.Value, reached, rules) -> list[ir.Node]:
        needed: set[ir.Value] = {y}
        active: list[ir.Node] = []
        for node in reversed(self.order):
            if node not in rules or not any(out in needed and out in reached for out in node.outputs):
                continue
            active.append(node)
            rule = rules[node]
            if rule is None:
                needed.update(v for v in (*node.inputs, *_captured_values(node)) if v is not None)
            else:
                needed.update(node.inputs[i] for i in self._differentiable_inputs(rule, node, reached))
        active.reverse()
        return active

    def _call_rule(self, rule: GradRule, node: ir.Node, dys, reached):
        opset = self.opset_of(node)
        try:
            result = rule.backward(self.op, node, *dys)
        except AutodiffError as error:
            raise type(error)(f"{describe_node(node, opset)}: {error}") from error
        except Exception as error:  # a rule bug must still name the node
            raise RuleError(
                f"the gradient rule of {describe_node(node, opset)} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if not isinstance(result, dict):
            raise RuleError(f"the rule of {describe_node(node, opset)} must return a dict of gradients")
        names = rule.input_names(node, opset)
        unknown = sorted(set(result) - set(rule.differentiable))
        if unknown:
            raise RuleError(
                f"the rule of {describe_node(node, opset)} returned gradients for {unknown}, "
                f"which are not among its differentiable inputs {list(rule.differentiable)}"
            )
        wanted = set(self._differentiable_inputs(rule, node, reached))
        seen: dict[str, int] = {}
        for index, name in enumerate(names):
            position = seen.get(name, 0)
            seen[name] = position + 1
            grad = result.get(name)
            if isinstance(grad, (list, tuple)):
                grad = grad[position] if position < len(grad) else None
            if grad is not None and index in wanted:
                yield index, grad

    def _missing_rule(self, node: ir.Node, y: ir.Value, xs: Sequence[ir.Value]) -> None:
        opset = self.opset_of(node)
        domain = f", domain={node.domain!r}" if node.domain else ""
        raise MissingRuleError(
            f"no gradient rule for {describe_node(node, opset)}, which lies on the path from "
            f"{[x.name for x in xs]} to '{y.name}'. Register one with "
            f"@onnx_autodiff.register_gradient({node.op_type!r}{domain}, differentiable=(...)), "
            "or declare it non-differentiable with default_registry().not_differentiable("
            f"{node.op_type!r}{domain})"
        )


def find_value(graph: ir.Graph | ir.Function, name: str, role: str) -> ir.Value:
    """The graph value named ``name`` (input, initializer or node output)."""
    for value in graph.inputs:
        if value.name == name:
            return value
    if isinstance(graph, ir.Graph) and name in graph.initializers:
        return graph.initializers[name]
    for node in graph:
        for value in node.outputs:
            if value.name == name:
                return value
    raise UnknownValueError(f"{role} '{name}' names no input, initializer or node output of the graph")


def _check_differentiable(value: ir.Value, role: str) -> None:
    if value.dtype is not None and value.dtype not in FLOAT_TYPES:
        raise NotDifferentiableError(
            f"{role} '{value.name}' has type {value.dtype.name}; only floating-point values "
            "carry gradients"
        )


def is_scalar(value: ir.Value) -> bool:
    shape = shapes.static_shape(value)
    return shape is not None and int(np.prod(shape, dtype=np.int64)) == 1


class AutodiffPass(ir.passes.InPlacePass):
    """Appends to the model the gradient of ``of`` with respect to each of ``wrt``.

    Every forward output stays; one graph output ``grad_<x>`` per x follows, in the order given.
    ``wrt=None`` takes every floating-point initializer. ``seed`` is "auto" (1 for a one-element
    ``of``, else a new graph input ``dy`` shaped like ``of``), "input" (always ``dy``) or "ones"
    (the gradient of the sum of ``of``'s elements). ``unreachable`` is "zeros" (an x that ``of``
    does not depend on gets zeros) or "raise". After the pass, ``seed_name`` and
    ``gradient_names`` report the names chosen.
    """

    def __init__(
        self,
        of: str,
        wrt: Sequence[str] | str | None = None,
        registry: GradRegistry | None = None,
        seed: str = "auto",
        unreachable: str = "zeros",
        infer_shapes: bool = True,
    ) -> None:
        super().__init__()
        if seed not in ("auto", "input", "ones"):
            raise ValueError(f"seed must be 'auto', 'input' or 'ones', not {seed!r}")
        if unreachable not in ("zeros", "raise"):
            raise ValueError(f"unreachable must be 'zeros' or 'raise', not {unreachable!r}")
        self.of = of
        self.wrt = [wrt] if isinstance(wrt, str) else (None if wrt is None else list(wrt))
        self.registry = registry if registry is not None else default_registry()
        self.seed = seed
        self.unreachable = unreachable
        self.infer_shapes = infer_shapes
        self.seed_name: str | None = None
        self.gradient_names: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if self.infer_shapes:
            ShapeInferencePass(strict_mode=False)(model)
        y = find_value(graph, self.of, "of")
        _check_differentiable(y, "of")
        xs = self._variables(graph)
        namer = Namer.for_graph(graph)
        backward = Backward(graph, self.registry, model.opset_imports, namer)
        op = backward.op
        dy = self._seed(op, graph, y, namer)
        grads = backward.gradients(y, xs, dy)
        outputs = self._gradient_outputs(op, graph, y, xs, grads, namer)
        if self.seed_name is not None:
            if y.shape is None:
                raise UnsupportedModelError(
                    f"the rank of '{y.name}' is unknown, so no 'dy' input can be declared for it: "
                    "give it a shape in the model's outputs or value_info, or use seed='ones'"
                )
            graph.inputs.append(dy)
        graph.extend(op.nodes)
        graph.outputs.extend(outputs)
        for domain, version in op.opsets.items():
            model.opset_imports.setdefault(domain, version)
        return ir.passes.PassResult(model, modified=True)

    def _variables(self, graph: ir.Graph) -> list[ir.Value]:
        if self.wrt is None:
            xs = [v for v in graph.initializers.values() if v.dtype in FLOAT_TYPES]
            if not xs:
                raise UnknownValueError(
                    "wrt was not given and the graph has no floating-point initializer"
                )
            return xs
        xs = [find_value(graph, name, "wrt") for name in self.wrt]
        for x in xs:
            _check_differentiable(x, "wrt")
        if len(set(xs)) != len(xs):
            raise UnknownValueError(f"wrt names a value twice: {self.wrt}")
        return xs

    def _seed(self, op: OpBuilder, graph: ir.Graph, y: ir.Value, namer: Namer) -> ir.Value:
        if self.seed == "ones" or (self.seed == "auto" and is_scalar(y)):
            self.seed_name = None
            return shapes.ones_like(op, y)
        dy = ir.Value(name=namer.fresh("dy"), type=y.type, shape=y.shape)
        self.seed_name = dy.name
        return dy

    def _gradient_outputs(self, op, graph, y, xs, grads, namer) -> list[ir.Value]:
        produced_here = {out for node in op.nodes for out in node.outputs}
        outputs: list[ir.Value] = []
        for x, grad in zip(xs, grads):
            if grad is None:
                if self.unreachable == "raise":
                    raise NotDifferentiableError(
                        f"'{y.name}' does not depend on '{x.name}' through differentiable inputs"
                    )
                grad = shapes.zeros_like(op, x)
                produced_here.update(op.nodes[-1].outputs)
            if grad not in produced_here or grad in outputs:
                grad = shapes.alias(op, grad)
            grad.name = None
            grad.name = namer.fresh(f"grad_{x.name}")
            grad.type = x.type
            grad.shape = x.shape
            self.gradient_names[x.name] = grad.name
            outputs.append(grad)
        return outputs


def autodiff_pass(
    of: str,
    wrt: Sequence[str] | str | None = None,
    registry: GradRegistry | None = None,
    **options,
) -> AutodiffPass:
    """The :class:`AutodiffPass` computing the gradient of ``of`` with respect to ``wrt``."""
    return AutodiffPass(of=of, wrt=wrt, registry=registry, **options)
