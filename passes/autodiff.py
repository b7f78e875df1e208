"""Reverse-mode automatic differentiation as an onnx-ir pass: appends the nodes computing dy·∂y/∂x."""

from __future__ import annotations

import dataclasses
import heapq
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import (
    AutodiffError,
    MissingRuleError,
    NotDifferentiableError,
    RuleError,
    UnknownValueError,
    UnsupportedModelError,
    describe_node,
    names_summary,
)
from onnx_autodiff.passes import progress
from onnx_autodiff.passes.metadata import Provenance, mark, record_differentiated
from onnx_autodiff.passes.opsets import build_upgrading
from onnx_autodiff.passes.lift import LiftWeightConstantsPass
from onnx_autodiff.passes.parameters import default_parameters
from onnx_autodiff.passes.patterns import Match, grouped
from onnx_autodiff.rules import GradRegistry, GradRule, default_registry
from onnx_autodiff.toolkit import Namer, OpBuilder, captured_values, may_be_float, shapes, subgraphs
from onnx_autodiff.toolkit.inference import infer_output_types, infer_shapes


DEFAULT_OPSET = 18  # the default-domain version backward nodes use when the model imports none

_STOPPED: weakref.WeakSet[ir.Value] = weakref.WeakSet()  # what stop_gradient marked, while it lives


def stop_gradient(value: ir.Value) -> ir.Value:
    """Marks ``value`` (in memory, not in the saved model) as a constant to the differentiation, as
    torch's ``detach``: no gradient flows back through it, whatever computed it (an observer's range
    of the values it quantizes)."""
    _STOPPED.add(value)
    return value


def topological_order(nodes: ir.Graph | ir.Function | Sequence[ir.Node]) -> list[ir.Node]:
    """The nodes in an order where every producer precedes its consumers (stable)."""
    nodes = list(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    # Per node, the producers among ``nodes`` of what it reads (once per read).
    producers = [
        [p for value in (*node.inputs, *captured_values(node)) if value is not None and (p := value.producer()) in position]
        for node in nodes
    ]
    if all(position[p] < i for i, found in enumerate(producers) for p in found):
        return nodes
    pending = {node: len(found) for node, found in zip(nodes, producers)}
    consumers: dict[ir.Node, list[ir.Node]] = {node: [] for node in nodes}
    for node, found in zip(nodes, producers):
        for producer in found:
            consumers[producer].append(node)
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


Unit = ir.Node | Match
"""One step of the walk: a node, or the nodes a pattern rule matched, differentiated as one."""


def _reads(unit: Unit) -> Sequence[ir.Value | None]:
    """What a unit reads: a node's inputs and the outer values its subgraphs capture, a match's
    bound values."""
    if isinstance(unit, Match):
        return unit.inputs
    return (*unit.inputs, *captured_values(unit))


def _subgraphs(unit: Unit) -> list[ir.Graph]:
    return [] if isinstance(unit, Match) else subgraphs(unit)


def backward_builder(registry: GradRegistry, opsets: Mapping[str, int], namer: Namer) -> OpBuilder:
    """The set-up of a backward pass: the builder its nodes are emitted with, at the model's
    ``opsets`` (the default domain at :data:`DEFAULT_OPSET` where it imports none), named by
    ``namer``, differentiating with ``registry``'s rules. The caller builds its seeds with it (ones
    shaped like y, say), then calls :func:`differentiate` with it."""
    opsets = {("" if k == "ai.onnx" else k): v for k, v in opsets.items()}
    # A model of ai.onnx.ml ops only still gets standard-op backward nodes.
    opsets.setdefault("", DEFAULT_OPSET)
    return OpBuilder(opsets[""], namer, opsets, _Engine(registry), share_numbers=True)


def differentiate(
    nodes: ir.Graph | ir.Function | Sequence[ir.Node],
    seeds: Sequence[tuple[ir.Value, ir.Value | None]],
    xs: Sequence[ir.Value],
    op: OpBuilder,
) -> list[ir.Value | None]:
    """The VJP Σ_k dy_k·∂y_k/∂x through ``nodes`` for each x and the (y_k, dy_k) seeds (a None
    dy_k seeds nothing); None where no seeded value depends on x. The engine's one entry point: it
    emits into ``op``, a builder from :func:`backward_builder` (or its ``child()``, a subgraph
    body), with that builder's rules. A second sweep over a first one's nodes passes the same
    builder; the rules of If, Loop and Scan reach this as ``op.differentiate``."""
    return op.differentiate(nodes, seeds, xs)


class _Engine:
    """What a :func:`backward_builder`'s ``differentiate`` runs: one walk per call, with the
    registry's rules. The walk a caller starts reports progress; those its rules start (subgraph
    bodies) do not."""

    def __init__(self, registry: GradRegistry) -> None:
        self.registry = registry
        self.walking = False

    def __call__(self, op: OpBuilder, nodes, seeds, xs) -> list[ir.Value | None]:
        outermost = not self.walking
        self.walking = True
        try:
            return Backward(nodes, self.registry, op, report_progress=outermost).vjp(seeds, xs)
        finally:
            if outermost:
                self.walking = False


class Backward:
    """One walk: the backward nodes of a set of nodes for seeded outputs and a list of variables,
    emitted into ``op``. Only the engine makes one, for each call of :func:`differentiate`."""

    def __init__(
        self,
        nodes: ir.Graph | ir.Function | Sequence[ir.Node],
        registry: GradRegistry,
        op: OpBuilder,
        report_progress: bool,
    ) -> None:
        self.registry = registry
        self.op = op
        self.opsets = op.opsets
        self.report_progress = report_progress
        self.order = topological_order(nodes)

    def opset_of(self, unit: Unit) -> int:
        return self.opsets.get("" if unit.domain == "ai.onnx" else unit.domain, 1)

    def rule_of(self, unit: Unit) -> GradRule | None:
        """A match's own rule, the registry's for a node (None: it has none)."""
        return unit.rule if isinstance(unit, Match) else self.registry.lookup(unit, self.opset_of(unit))

    def vjp(self, seeds, xs) -> list[ir.Value | None]:
        seeds = [(y, dy) for y, dy in seeds if dy is not None]
        order = self.order
        if self.registry.patterns():  # a match applies where no gradient reaches its other inputs
            order = grouped(order, self.registry.patterns(), self.op.opset, lambda: self._forward_reach(xs, order)[0])
        reached, rules, targets = self._forward_reach(xs, order)
        active = self._backward_reach([y for y, _ in seeds], reached, rules, targets, order)
        # Per value, its gradient contributions: (gradient, None) when in the value's shape,
        # (gradient, y) when still in the broadcast shape of the output y.
        contributions: dict[ir.Value, list[tuple[ir.Value, ir.Value | None]]] = {}
        totals: dict[ir.Value, ir.Value] = {}
        for y, dy in seeds:
            if y in reached:
                contributions.setdefault(y, []).append((dy, None))

        def total(value: ir.Value) -> ir.Value | None:
            if value in totals:
                return totals[value]
            items = contributions.get(value)
            if items is None:
                return None
            if len(items) == 1 and items[0][1] is None:  # most values: one use, nothing to reduce
                grad = items[0][0]
            else:
                grad = shapes.accumulate(self.op, self._reduce_contributions(value, items), like=value)
            totals[value] = grad
            return grad

        # Every node without a rule is reported at once. Those inside subgraphs show up only when
        # the rule holding them runs, so with subgraphs on the path the walk goes on to find them.
        missing = [self._missing_entry(unit) for unit in active if rules[unit] is None]
        if missing and not any(_subgraphs(unit) for unit in active):
            raise _missing_rules_error(missing, seeds, xs)
        for done, unit in enumerate(reversed(active)):
            if self.report_progress and done % 512 == 0:
                progress.report("gradients", done, len(active))
            rule = rules[unit]
            if rule is None:  # stand-in gradients, so that the walk reaches the subgraphs before it
                for value in _reads(unit):
                    if value is not None and value in reached:
                        contributions.setdefault(value, []).append((shapes.zeros(self.op, value), None))
                continue
            dys = [total(out) for out in unit.outputs]
            if all(g is None for g in dys):
                continue
            try:
                if rule.saves:
                    self._save_outputs(rule, unit)
                found = self._call_rule(rule, unit, dys, targets[unit])
            except MissingRuleError as error:  # raised by the differentiation of a subgraph
                missing += self._nested_missing(unit, error)
                continue
            except AutodiffError:
                if missing:  # the gradients are discarded anyway: the missing rules come first
                    continue
                raise
            for value, grad, unreduced in found:
                contributions.setdefault(value, []).append((grad, unit.outputs[0] if unreduced else None))
        if missing:
            raise _missing_rules_error(missing, seeds, xs)
        return [total(x) for x in xs]

    def _reduce_contributions(self, value: ir.Value, items) -> list[ir.Value]:
        """The contributions in the value's shape and type. Those in one broadcast shape (the uses
        of a tied parameter) are summed first, so one reduction serves them all."""
        groups: dict[object, list[tuple[ir.Value, ir.Value]]] = {}
        slots: list[tuple[ir.Value | None, object]] = []  # (a gradient, None) or (None, a group's key)
        for grad, like in items:
            if like is None:
                slots.append((grad, None))
                continue
            shape = shapes.dims(like)
            key = (shape if shape is not None and None not in shape else like, grad.dtype)
            if key not in groups:
                groups[key] = []
                slots.append((None, key))
            groups[key].append((grad, like))
        reduced: list[ir.Value] = []
        value_shape = shapes.dims(value)
        for ready, key in slots:
            if key is None:
                reduced.append(ready)
                continue
            group = groups[key]
            grad = shapes.accumulate(self.op, [grad for grad, _ in group])
            if not (type(key[0]) is tuple and key[0] == value_shape):  # a shape known equal needs no reduction
                grad = shapes.unbroadcast(self.op, grad, value, group[0][1])
            if grad.dtype is not None and value.dtype is not None and grad.dtype != value.dtype:
                grad = self.op.Cast(grad, to=value.dtype)
            reduced.append(grad)
        return reduced

    def _save_outputs(self, rule: GradRule, node: Unit) -> None:
        """Gives the node the optional outputs its rule reads (``GradRule.saves``), typed by the
        op's type inference; the forward results are unchanged."""
        indices = rule.saved_outputs(node, self.opset_of(node))
        if all(i < len(node.outputs) and node.outputs[i].name for i in indices):
            return
        if len(node.outputs) <= max(indices):
            node.resize_outputs(max(indices) + 1)
            for output in node.outputs:  # outputs between the old last and a saved one stay absent
                if output.name is None:
                    output.name = ""
        stem = node.outputs[0].name or node.name or node.op_type
        for i, saved in zip(indices, rule.saves):
            if not node.outputs[i].name:
                node.outputs[i].name = self.op.namer.fresh(f"{stem}_{saved}")
        infer_output_types(node, self.opset_of(node), [node.outputs[i] for i in indices])

    def _forward_reach(self, xs: Sequence[ir.Value], order: Sequence[Unit]):
        """The values gradients reach from ``xs``; the rule of each unit reading one (None: it has
        none); the targets of each such unit with a rule (see :meth:`_targets`). A unit's inputs
        are all reached or not before it in ``order``, so its targets are final here."""
        reached: set[ir.Value] = set(xs)
        stopped = set(_STOPPED)
        rules: dict[Unit, GradRule | None] = {}
        targets: dict[Unit, list[tuple[int | None, ir.Value, str | None]]] = {}
        for unit in order:
            if reached.isdisjoint(_reads(unit)):
                continue
            rule = rules[unit] = self.rule_of(unit)
            if rule is not None:
                found = targets[unit] = self._targets(rule, unit, reached)
                if not found:
                    continue
            reached.update(out for out in unit.outputs if may_be_float(out) and out not in stopped)
        return reached, rules, targets

    def _targets(self, rule: GradRule, node: Unit, reached) -> list[tuple[int | None, ir.Value, str | None]]:
        """(input index, value, input name) triples that get gradients; index and name None for
        captured values."""
        if rule.backward is None:
            return []
        names = rule.input_names(node, self.opset_of(node))
        targets: list[tuple[int | None, ir.Value, str | None]] = [
            (i, value, name)
            for i, (name, value) in enumerate(zip(names, node.inputs))
            if name in rule.differentiable and value is not None and value in reached
        ]
        if rule.captures:
            targets += [(None, v, None) for v in captured_values(node) if v in reached]
        return targets

    def _backward_reach(self, ys: Sequence[ir.Value], reached, rules, targets, order: Sequence[Unit]) -> list[Unit]:
        needed: set[ir.Value] = set(ys)
        active: list[Unit] = []
        for unit in reversed(order):
            if unit not in rules or not any(out in needed and out in reached for out in unit.outputs):
                continue
            active.append(unit)
            if rules[unit] is None:
                needed.update(v for v in _reads(unit) if v is not None)
            else:
                needed.update(value for _, value, _ in targets[unit])
        active.reverse()
        return active

    def _call_rule(self, rule: GradRule, node: Unit, dys, targets) -> list[tuple[ir.Value, ir.Value, bool]]:
        """(value, gradient, whether in the broadcast shape) for each of ``targets`` the rule
        gives a gradient."""
        opset = self.opset_of(node)
        context = {"captures": [value for index, value, _ in targets if index is None]} if rule.captures else {}
        start = len(self.op.nodes)
        try:
            result = rule.backward(self.op, node, *dys, **context)
        except MissingRuleError:  # the caller names the nodes and where they are
            raise
        except AutodiffError as error:
            named = type(error)(f"{describe_node(node, opset)}: {error}")
            named.__dict__.update(vars(error))  # keeps what the error carries (the opset it needs)
            raise named from error
        except Exception as error:  # a rule bug must still name the node
            raise RuleError(
                f"the gradient rule of {describe_node(node, opset)} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if not isinstance(result, dict):
            raise RuleError(f"the rule of {describe_node(node, opset)} must return a dict of gradients")
        origin = Provenance.of(node)
        for emitted in self.op.nodes[start:]:  # a nested rule's nodes keep their own tag
            mark(emitted, origin)
        unknown = [k for k in result if isinstance(k, str) and k not in rule.differentiable]
        if unknown:
            raise RuleError(
                f"the rule of {describe_node(node, opset)} returned gradients for {sorted(unknown)}, "
                f"which are not among its differentiable inputs {list(rule.differentiable)}"
            )
        found = []
        for index, value, name in targets:
            if index is None:
                grad = result.get(value)
            else:
                grad = result.get(name)
                if isinstance(grad, (list, tuple)):  # a variadic input: one gradient per input of that name
                    position = rule.input_names(node, opset)[:index].count(name)
                    grad = grad[position] if position < len(grad) else None
            if grad is not None:
                found.append((value, grad, index is not None and rule.unreduced(name)))
        return found

    def _missing_entry(self, node: ir.Node, where: str = "") -> tuple[tuple, str, str]:
        """(name, op type, domain, opset) of a node without a rule, the phrase naming it alone and
        its label in a list (``where`` says which subgraph holds it)."""
        opset = self.opset_of(node)
        label = f"'{node.name}'" if node.name else f"<unnamed, computing '{node.outputs[0].name}'>"
        return (node.name, node.op_type, node.domain, opset), describe_node(node, opset) + where, label + where

    def _nested_missing(self, holder: Unit, error: MissingRuleError) -> list[tuple[tuple, str, str]]:
        """The nodes of ``holder``'s subgraphs that ``error`` reports: the rule differentiated
        renamed copies of them, so the originals of those op types are named instead."""
        kinds = {(op_type, domain) for _, op_type, domain, _ in error.nodes}
        holder_name = f"'{holder.name or holder.outputs[0].name}' ({holder.op_type})"
        where = f" in a subgraph of {holder_name}"
        found = [
            self._missing_entry(inner, where)
            for graph in _subgraphs(holder)
            for inner in ir.traversal.RecursiveGraphIterator(graph)
            if (inner.op_type, inner.domain) in kinds
            and self.registry.lookup(inner, self.opset_of(inner)) is None
        ]
        where = f" in the nodes the rule of {holder_name} differentiates"  # its own decomposition
        return found or [(key, phrase + where, label + where) for key, phrase, label in error._entries]


def _missing_rules_error(entries: list[tuple[tuple, str, str]], seeds, xs) -> MissingRuleError:
    """One error naming every node without a rule (``entries`` from ``_missing_entry``), on one
    line: for several, grouped by op type."""
    path = f"the path from {[x.name for x in xs]} to {', '.join(repr(y.name) for y, _ in seeds)}"
    _, op_type, domain, _ = entries[0][0]
    domain = f", domain={domain!r}" if domain else ""
    how = (
        f"@onnx_autodiff.register_gradient({op_type!r}{domain}, differentiable=(...)), or declare it "
        f"non-differentiable with default_registry().not_differentiable({op_type!r}{domain})"
    )
    if len(entries) == 1:
        message = f"no gradient rule for {entries[0][1]}, which lies on {path}. Register one with {how}"
    else:
        groups: dict[tuple, list[str]] = {}
        for (_, *kind), _, label in entries:
            groups.setdefault(tuple(kind), []).append(label)
        listed = "; ".join(
            f"op {t} (domain {d or 'ai.onnx'}, opset {v}) at {', '.join(labels)}"
            for (t, d, v), labels in groups.items()
        )
        message = (
            f"no gradient rule for {len(entries)} nodes on {path}: {listed}. Register one rule per "
            f"op type, e.g. {how}"
        )
    error = MissingRuleError(message, [key for key, _, _ in entries])
    error._entries = entries  # the phrases, for a holder's rule that re-raises it
    return error


def _infer_shapes_stage(model: ir.Model) -> None:
    """The toolkit's :func:`~onnx_autodiff.toolkit.inference.infer_shapes`, as the build's "shapes"
    stage (progress is the passes' concern, not the toolkit's)."""
    progress.report("shapes", 0, 1)
    infer_shapes(model)


def find_value(graph: ir.Graph | ir.Function, name: str, role: str) -> ir.Value:
    """The graph value named ``name`` (input, initializer or node output)."""
    return find_values(graph, [name], role)[0]


def find_values(graph: ir.Graph | ir.Function, names: Sequence[str], role: str) -> list[ir.Value]:
    """The graph values of ``names`` (inputs, initializers or node outputs), looked up at once."""
    wanted = set(names)
    found = {value.name: value for value in graph.inputs if value.name in wanted}
    if isinstance(graph, ir.Graph):
        found.update((name, graph.initializers[name]) for name in wanted - set(found) if name in graph.initializers)
    if wanted - set(found):
        for node in graph:
            for value in node.outputs:
                if value.name in wanted and value.name not in found:
                    found[value.name] = value
    for name in names:
        if name not in found:
            raise UnknownValueError(f"{role} '{name}' names no input, initializer or node output of the graph")
    return [found[name] for name in names]


def check_differentiable(value: ir.Value, role: str) -> None:
    """Refuse a value that cannot carry a gradient (``role`` names it in the message)."""
    if not may_be_float(value):
        raise NotDifferentiableError(
            f"{role} '{value.name}' has type {value.dtype.name}; only floating-point values "
            "carry gradients"
        )


def choose_variables(
    model: ir.Model, wrt: Sequence[str] | None, registry: GradRegistry
) -> tuple[list[ir.Value], list[str]]:
    """The values named by ``wrt``, or the model's default parameters when it is None; and the
    float initializers that the default left out."""
    graph = model.graph
    if wrt is None:
        default = default_parameters(model, registry)
        left_out = list(default.left_out)
        if not default.parameters:
            constants = f" (it left out {names_summary(left_out)})" if left_out else ""
            raise UnknownValueError(
                "wrt was not given and the graph has no floating-point initializer that the "
                f"default treats as a parameter{constants}: name the variables with wrt"
            )
        return default.parameters, left_out
    try:
        xs = find_values(graph, list(wrt), "wrt")
    except UnknownValueError:
        # a weight stored as a Constant inside a branch, named as `params` lists it: an
        # initializer once lifted, as the default's are
        if not LiftWeightConstantsPass(only=list(wrt))(model).modified:
            raise
        xs = find_values(graph, list(wrt), "wrt")
    for x in xs:
        check_differentiable(x, "wrt")
    if len(set(xs)) != len(xs):
        raise UnknownValueError(f"wrt names a value twice: {wrt}")
    return xs, []


def is_scalar(value: ir.Value) -> bool:
    shape = shapes.static_shape(value)
    return shape is not None and int(np.prod(shape, dtype=np.int64)) == 1


@dataclasses.dataclass
class AutodiffResult(ir.passes.PassResult):
    """What one call of :class:`AutodiffPass` did: the model and ``modified`` (as every
    ``PassResult``), the name of the seed input it added (None when the seed is computed: a
    one-element ``of`` or ``seed="ones"``), the gradient output of each variable in ``wrt``'s
    order, and the float initializers the default variables left out (constants)."""

    seed_name: str | None = None
    gradient_names: dict[str, str] = dataclasses.field(default_factory=dict)
    left_out: list[str] = dataclasses.field(default_factory=list)


class AutodiffPass(ir.passes.InPlacePass):
    """Appends to the model the gradient of ``of`` with respect to each of ``wrt``.

    Every forward output stays; one graph output ``grad_<x>`` per x follows, in the order given.
    ``wrt=None`` takes the model's parameters (:func:`onnx_autodiff.passes.parameters.default_parameters`:
    not the exponents, epsilons, scale factors and masks an exporter stored; ``left_out`` lists
    those). ``seed`` is "auto" (1 for a one-element
    ``of``, else a new graph input ``dy`` shaped like ``of``), "input" (always ``dy``) or "ones"
    (the gradient of the sum of ``of``'s elements). ``unreachable`` is "zeros" (an x that ``of``
    does not depend on gets zeros) or "raise". When a rule needs a newer opset than the model
    imports, the model is converted with onnx.version_converter (one warning line on the logger of
    :mod:`onnx_autodiff.passes.opsets`); ``upgrade_opset=False`` refuses instead. After the pass,
    ``seed_name`` and ``gradient_names`` report the names chosen.

    Calling the pass returns an :class:`AutodiffResult`, which carries ``seed_name``,
    ``gradient_names`` and ``left_out`` of that call. ``ir.passes.PassManager`` (and
    ``Sequential``) return a plain ``PassResult`` of their own, not the passes' results: in a
    pipeline, read the pass's ``last_result`` (or its attributes ``seed_name``,
    ``gradient_names`` and ``left_out``, which are a view of the last result; before the first
    call, None, {} and []).
    """

    def __init__(
        self,
        of: str,
        wrt: Sequence[str] | str | None = None,
        registry: GradRegistry | None = None,
        seed: str = "auto",
        unreachable: str = "zeros",
        infer_shapes: bool = True,
        upgrade_opset: bool = True,
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
        self.upgrade_opset = upgrade_opset
        self.last_result: AutodiffResult | None = None

    @property
    def seed_name(self) -> str | None:
        """The seed input the last call added (None: a scalar seed, or no call yet)."""
        return None if self.last_result is None else self.last_result.seed_name

    @property
    def gradient_names(self) -> dict[str, str]:
        """The last call's gradient output per variable ({} before the first call)."""
        return {} if self.last_result is None else self.last_result.gradient_names

    @property
    def left_out(self) -> list[str]:
        """The float initializers the last call's default variables left out ([] before a call)."""
        return [] if self.last_result is None else self.last_result.left_out

    def call(self, model: ir.Model) -> AutodiffResult:
        result = build_upgrading(model, self._build, self.upgrade_opset)
        self.last_result = result
        return result

    def _build(self, model: ir.Model) -> AutodiffResult:
        graph = model.graph
        if self.infer_shapes:
            _infer_shapes_stage(model)
        y = find_value(graph, self.of, "of")
        check_differentiable(y, "of")
        xs, left_out = choose_variables(model, self.wrt, self.registry)
        # Tells the cleanup passes never to fold these (a training loop feeds new values of them).
        record_differentiated(model, [x.name for x in xs])
        namer = Namer.for_graph(graph)
        op = backward_builder(self.registry, model.opset_imports, namer)
        dy, seed_name = self._seed(op, graph, y, namer)
        grads = differentiate(graph, [(y, dy)], xs, op)
        outputs = self._gradient_outputs(op, graph, y, xs, grads, namer)
        if seed_name is not None:
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
        gradient_names = {x.name: grad.name for x, grad in zip(xs, outputs)}
        return AutodiffResult(model, True, seed_name, gradient_names, left_out)

    def _seed(self, op: OpBuilder, graph: ir.Graph, y: ir.Value, namer: Namer) -> tuple[ir.Value, str | None]:
        """The seed and the name of the graph input it is (None: ones computed from ``y``)."""
        if self.seed == "ones" or (self.seed == "auto" and is_scalar(y)):
            return shapes.ones_like(op, y), None
        dy = ir.Value(name=namer.fresh("dy"), type=y.type, shape=y.shape)
        return dy, dy.name

    def _gradient_outputs(self, op, graph, y, xs, grads, namer) -> list[ir.Value]:
        if self.unreachable == "raise":
            for x, grad in zip(xs, grads):
                if grad is None:
                    raise NotDifferentiableError(
                        f"'{y.name}' does not depend on '{x.name}' through differentiable inputs"
                    )
        return gradient_outputs(op, namer, xs, grads)


def gradient_outputs(op: OpBuilder, namer: Namer, xs, grads) -> list[ir.Value]:
    """One distinct value per x, produced by a backward node, named ``grad_<x>`` and typed like x
    (zeros where the gradient is None, an Identity where it is not a fresh value of its own)."""
    produced = {out for node in op.nodes for out in node.outputs}
    outputs: list[ir.Value] = []
    for x, grad in zip(xs, grads):
        if grad is None:
            grad = shapes.zeros(op, x)
            produced.update(op.nodes[-1].outputs)
        if grad not in produced:
            grad = shapes.alias(op, grad)
        produced.discard(grad)  # a second x with the same gradient gets an alias of it
        grad.name = None
        grad.name = namer.fresh(f"grad_{x.name}")
        grad.type, grad.shape = x.type, x.shape
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
