"""The rule registry: forward patterns (domain, op type, opset range, condition) mapped to backward templates."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

import onnx
import onnx_ir as ir

from onnx_autodiff.errors import AutodiffError
from onnx_autodiff.toolkit.onnxscript_compat import pattern_nodes, pattern_outputs

MAX_OPSET = 10_000

Backward = Callable[..., dict]
"""``backward(op, node, *dYs) -> {input_name: gradient}``: one ``dY`` per node output, None where
that output carries no gradient. A gradient is an ``ir.Value``, None for none, or a list for a
variadic input."""


@dataclasses.dataclass(frozen=True)
class GradRule:
    """How to differentiate one operator.

    ``differentiable`` names the inputs that receive gradients, by the schema's input names; every
    other input is non-differentiable. An empty tuple declares the whole op non-differentiable:
    gradients stop at it. ``broadcast`` says the gradients come back in the output's broadcast
    shape and the engine reduces them to each input's shape (a tuple of input names: only those
    inputs' gradients); several such contributions to one value in the same shape are summed
    before the one reduction (a tied parameter). ``saves`` names optional outputs, by the schema's
    output names, that the rule reads: the engine gives the forward node those it lacks before
    calling the rule, so the rule reuses forward values. ``when`` restricts the rule to nodes
    it accepts (attribute conditions); ``inputs`` names the inputs of an op without a schema.
    ``captures`` makes the outer-scope values read by the node's subgraphs differentiable too: the
    rule is called with the keyword ``captures``, those of them needing gradients, and returns
    their gradients keyed by value.
    """

    op_type: str
    domain: str = ""
    opsets: tuple[int, int] = (1, MAX_OPSET)
    differentiable: tuple[str, ...] = ()
    backward: Backward | None = None
    broadcast: bool | tuple[str, ...] = False
    when: Callable[[ir.Node], bool] | None = None
    inputs: tuple[tuple[str, ...], bool] | None = None
    captures: bool = False
    saves: tuple[str, ...] = ()

    def unreduced(self, name: str) -> bool:
        """Whether the gradient of input ``name`` comes back in the output's broadcast shape."""
        return self.broadcast is True or (isinstance(self.broadcast, tuple) and name in self.broadcast)

    def saved_outputs(self, node: ir.Node, opset: int) -> list[int]:
        """The indices of the outputs named in ``saves`` (by the op's schema)."""
        if not self.saves:
            return []
        names = _schema_outputs(node.op_type, opset, node.domain)
        missing = [name for name in self.saves if names is None or name not in names]
        if missing:
            raise AutodiffError(
                f"the rule for {node.domain or 'ai.onnx'}::{node.op_type} saves outputs {missing}, "
                "which its schema does not name"
            )
        return [names.index(name) for name in self.saves]

    def matches(self, node: ir.Node, opset: int) -> bool:
        low, high = self.opsets
        return low <= opset <= high and (self.when is None or self.when(node))

    def input_names(self, node: ir.Node, opset: int) -> list[str]:
        """The schema name of each of the node's inputs (variadic inputs repeat their name)."""
        formal = self.inputs if self.inputs is not None else _schema_input_names(node, opset)
        if formal is None:
            raise AutodiffError(
                f"the rule for {node.domain or 'ai.onnx'}::{node.op_type} has no input names and "
                "the op has no registered schema: pass inputs=(...) to register_gradient"
            )
        names, variadic = formal
        count = len(node.inputs)
        if len(names) >= count:
            return list(names[:count])
        if not variadic:
            raise AutodiffError(
                f"{node.op_type} node '{node.name}' has {count} inputs, its schema names {len(names)}"
            )
        return list(names) + [names[-1]] * (count - len(names))


def _schema_input_names(node: ir.Node, opset: int) -> tuple[tuple[str, ...], bool] | None:
    return _schema_inputs(node.op_type, opset, node.domain)


@functools.lru_cache(maxsize=None)
def _schema_inputs(op_type: str, opset: int, domain: str) -> tuple[tuple[str, ...], bool] | None:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    params = schema.inputs
    return tuple(p.name for p in params), bool(params) and params[-1].option == variadic


@functools.lru_cache(maxsize=None)
def _schema_outputs(op_type: str, opset: int, domain: str) -> tuple[str, ...] | None:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    return tuple(p.name for p in schema.outputs)


def _normalise(inputs) -> tuple[tuple[str, ...], bool] | None:
    if inputs is None:
        return None
    names = tuple(inputs)
    variadic = bool(names) and names[-1].endswith("...")
    if variadic:
        names = names[:-1] + (names[-1][:-3],)
    return names, variadic


@dataclasses.dataclass(frozen=True)
class PatternRule:
    """How to differentiate a subgraph as one unit: ``pattern(op, x, ...)`` is an onnxscript
    pattern function; ``backward(op, match, *dYs)`` returns gradients keyed by the pattern's
    parameter names (``match["x"]`` is the value bound to ``x``), one ``dY`` per pattern output.
    A match applies only where the pattern's interior values are read by nothing else."""

    name: str
    pattern: Callable
    differentiable: tuple[str, ...]
    backward: Backward
    opsets: tuple[int, int] = (1, MAX_OPSET)
    broadcast: bool | tuple[str, ...] = False
    when: Callable | None = None  # an onnxscript condition: when(context, **bindings) -> bool

    @functools.cached_property
    def matcher(self):
        """The pattern as an onnxscript rule (only its matching is used)."""
        from onnxscript.rewriter import RewriteRule

        return RewriteRule(self.pattern, _never_replaced, self.when, name=self.name)

    @functools.cached_property
    def size(self) -> int:
        """The number of nodes in the pattern: larger patterns are matched first."""
        return len(pattern_nodes(self.matcher))

    @functools.cached_property
    def root(self) -> tuple[str, str] | None:
        return pattern_root(self.matcher)

    @functools.cached_property
    def parameters(self) -> tuple[str, ...]:
        """The pattern function's parameter names, after ``op``."""
        import inspect

        return tuple(inspect.signature(self.pattern).parameters)[1:]


def _never_replaced(op, **_):
    raise AssertionError("a pattern gradient rule is matched, never used to rewrite")


def pattern_root(rule) -> tuple[str, str] | None:
    """The (domain, op type) of the node an onnxscript rule's pattern ends in; None for a pattern
    with several output nodes or another kind of root (to be tried on every node)."""
    outputs = pattern_outputs(rule)
    if len(outputs) != 1:
        return None
    identifier = outputs[0].op_identifier()
    if identifier is None or not all(isinstance(part, str) for part in identifier[:2]):
        return None
    return identifier[0], identifier[1]


class GradRegistry:
    """Gradient rules keyed by (domain, op type); the most recently registered match wins.
    Pattern rules (subgraphs differentiated as one unit) are kept beside them."""

    def __init__(self, rules: Iterable[GradRule] = ()) -> None:
        self._rules: dict[tuple[str, str], list[GradRule]] = {}
        self._patterns: dict[str, PatternRule] = {}
        for rule in rules:
            self.add(rule)

    def add_pattern(self, rule: PatternRule) -> PatternRule:
        self._patterns[rule.name] = rule  # a later rule of the same name replaces the earlier one
        return rule

    def patterns(self) -> list[PatternRule]:
        return list(self._patterns.values())

    def add(self, rule: GradRule) -> GradRule:
        self._rules.setdefault((_domain(rule.domain), rule.op_type), []).append(rule)
        return rule

    def lookup(self, node: ir.Node, opset: int) -> GradRule | None:
        for rule in reversed(self._rules.get((_domain(node.domain), node.op_type), ())):
            if rule.matches(node, opset):
                return rule
        return None

    def copy(self, patterns: bool = True) -> GradRegistry:
        """A registry of the same rules (``patterns=False``: without the pattern rules, so that
        every op is differentiated alone)."""
        clone = GradRegistry()
        clone._rules = {key: list(rules) for key, rules in self._rules.items()}
        clone._patterns = dict(self._patterns) if patterns else {}
        return clone

    def op_types(self, differentiable: bool | None = None) -> list[tuple[str, str]]:
        """Sorted (domain, op type) pairs with a rule; filter by whether any rule is differentiable."""
        keys = []
        for key, rules in self._rules.items():
            has_grad = any(r.backward is not None for r in rules)
            if differentiable is None or has_grad == differentiable:
                keys.append(key)
        return sorted(keys)

    def rules(self) -> list[GradRule]:
        return [r for key in sorted(self._rules) for r in self._rules[key]]

    def __contains__(self, key: str | tuple[str, str]) -> bool:
        domain, op_type = ("", key) if isinstance(key, str) else key
        return (_domain(domain), op_type) in self._rules

    def register(
        self,
        op_type: str | None = None,
        domain: str = "",
        *,
        pattern: Callable | None = None,
        differentiable: Sequence[str] = (),
        opsets: tuple[int, int] | None = None,
        since: int | None = None,
        until: int | None = None,
        broadcast: bool | Sequence[str] = False,
        when: Callable[[ir.Node], bool] | None = None,
        inputs: Sequence[str] | None = None,
        captures: bool = False,
        saves: Sequence[str] = (),
    ) -> Callable[[Backward], Backward]:
        """Decorator registering ``backward`` for ``op_type``; see :class:`GradRule`.

        ``inputs`` is only needed for ops without a schema; a trailing ``"name..."`` marks a
        variadic last input. ``since``/``until`` are a shorthand for ``opsets``. ``pattern``
        instead of ``op_type``: a :class:`PatternRule` for the subgraph the onnxscript pattern
        function matches (``differentiable`` names its parameters; the default-domain opset bounds it).
        """
        if opsets is not None and (since is not None or until is not None):
            raise TypeError("give the opsets as opsets=(low, high) or as since=/until=, not both")
        bounds = opsets or (since or 1, until or MAX_OPSET)
        if pattern is not None:
            if op_type is not None or domain or inputs is not None or captures or saves:
                raise TypeError("a pattern rule takes pattern=, differentiable=, broadcast=, when= and the opsets only")

            def decorate_pattern(backward: Backward) -> Backward:
                self.add_pattern(PatternRule(pattern.__name__, pattern, tuple(differentiable), backward, bounds,
                                             broadcast if isinstance(broadcast, bool) else tuple(broadcast), when))
                return backward

            return decorate_pattern
        if op_type is None:
            raise TypeError("register a rule for an op_type, or for a pattern=")

        def decorate(backward: Backward) -> Backward:
            self.add(
                GradRule(
                    op_type,
                    domain,
                    bounds,
                    tuple(differentiable),
                    backward,
                    broadcast if isinstance(broadcast, bool) else tuple(broadcast),
                    when,
                    _normalise(inputs),
                    captures,
                    tuple(saves),
                )
            )
            return backward

        return decorate

    def not_differentiable(self, *op_types: str, domain: str = "") -> None:
        """Declare ops whose outputs carry no gradient to any input (Shape, comparisons, ...)."""
        for op_type in op_types:
            self.add(GradRule(op_type, domain))


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


SHIPPED = GradRegistry()
"""The registry the shipped rule families register into (:func:`~onnx_autodiff.rules.default_registry`)."""

rule = SHIPPED.register
"""Decorator the shipped rule families register with: ``@rule("Mul", differentiable=("A", "B"))``."""

not_differentiable = SHIPPED.not_differentiable
