"""Reverse-mode automatic differentiation for ONNX models, as an onnx-ir pass emitting standard ops."""

from onnx_autodiff.errors import (
    AutodiffError,
    MissingRuleError,
    NotDifferentiableError,
    OpsetTooOldError,
    RuleError,
    UnknownValueError,
    UnsupportedModelError,
)
from onnx_autodiff.passes import (
    AutodiffPass,
    AutodiffResult,
    CleanupResult,
    GradientOpLoweringPass,
    OutlinePass,
    autodiff_pass,
    cleanup_passes,
    gradient_of_function,
    gradient_of_nodes,
)
from onnx_autodiff.commands import collector_paused
from onnx_autodiff.passes.rewrite_rules import cleanup_rules, lowering_rules
from onnx_autodiff.passes.transforms import (
    HvpPass,
    JacobianPass,
    JvpPass,
    TransformResult,
    hvp,
    jacobian,
    jvp,
    vjp,
)
from onnx_autodiff.rules import GradRegistry, GradRule, default_registry, register_gradient


def check_grads(*args, **kwargs):
    """Check a model's first (and second) derivatives against finite differences; see
    :func:`onnx_autodiff.conformance.gradcheck.check_grads`."""
    from onnx_autodiff.conformance.gradcheck import check_grads as check

    return check(*args, **kwargs)


__version__ = "0.1.0"

__all__ = [
    "AutodiffError",
    "AutodiffPass",
    "AutodiffResult",
    "CleanupResult",
    "GradRegistry",
    "GradientOpLoweringPass",
    "HvpPass",
    "JacobianPass",
    "JvpPass",
    "GradRule",
    "MissingRuleError",
    "OutlinePass",
    "NotDifferentiableError",
    "OpsetTooOldError",
    "RuleError",
    "UnknownValueError",
    "TransformResult",
    "UnsupportedModelError",
    "autodiff_pass",
    "check_grads",
    "cleanup_passes",
    "cleanup_rules",
    "collector_paused",
    "lowering_rules",
    "default_registry",
    "gradient_of_function",
    "gradient_of_nodes",
    "hvp",
    "jacobian",
    "jvp",
    "register_gradient",
    "vjp",
]
