"""Gradient rules: the registry and the shipped rule families (their op builder is the toolkit's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir

from onnx_autodiff.rules.registry import SHIPPED, Backward, GradRegistry, GradRule
from onnx_autodiff.toolkit import OpBuilder

__all__ = [
    "Backward",
    "GradRegistry",
    "GradRule",
    "OpBuilder",
    "default_registry",
    "register_gradient",
]

_FAMILIES = (
    "math", "activation", "nn", "spatial", "tensor", "sequence", "indexing", "reduction", "normalization",
    "losses", "linalg", "attention", "streaming", "signal", "ml", "recurrent", "control_flow", "nondiff",
    "decomposed", "quantized", "qdq",
)


def default_registry() -> GradRegistry:
    """The registry holding every shipped rule (and those added with ``register_gradient``)."""
    import importlib

    for family in _FAMILIES:
        importlib.import_module(f"onnx_autodiff.rules.{family}")
    return SHIPPED


def register_gradient(
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
    registry: GradRegistry | None = None,
) -> Callable[[Backward], Backward]:
    """Decorator adding (or overriding) the rule of ``domain::op_type`` in ``registry``; the
    options are those of :class:`GradRule` (``saves`` gives the forward node optional outputs the
    rule reads, ``broadcast`` may name the inputs whose gradients come back unreduced;
    ``since``/``until`` bound the opsets it applies to, inclusive).

    The default is the shipped registry, so the rule applies to every later pass::

        @register_gradient("MyScale", domain="custom", differentiable=("X",), inputs=("X", "s"))
        def my_scale(op, node, dY):
            X, s = node.inputs
            return {"X": op.Mul(dY, s)}

    ``pattern=`` (instead of ``op_type``) differentiates the subgraph an onnxscript pattern
    function matches as one unit (:class:`~onnx_autodiff.rules.registry.PatternRule`)::

        def silu(op, x):
            return op.Mul(x, op.Sigmoid(x, _outputs=["s"]))  # "s" names an interior value

        @register_gradient(pattern=silu, differentiable=("x",))
        def silu_grad(op, match, dY):
            s, y = match["s"], match.outputs[0]  # dy/dx = s + x·s·(1 − s) = s + y·(1 − s)
            return {"x": op.Mul(dY, op.Add(s, op.Mul(y, op.Sub(op.const(1.0, like=s), s))))}
    """
    target = registry if registry is not None else default_registry()
    return target.register(
        op_type,
        domain,
        pattern=pattern,
        differentiable=differentiable,
        opsets=opsets,
        since=since,
        until=until,
        broadcast=broadcast,
        when=when,
        inputs=inputs,
        captures=captures,
        saves=saves,
    )
