"""Reverse-mode automatic differentiation for ONNX models, as an onnx-ir pass emitting standard ops."""

from onnx_autodiff.errors import (
    AutodiffError,
    MissingRuleError,
    NotDifferentiableError,
    RuleError,
    UnknownValueError,
    UnsupportedModelError,
)
from onnx_autodiff.passes import (
    AutodiffPass,
    GradientOpLoweringPass,
    autodiff_pass,
    cleanup_passes,
    gradient_of_function,
    gradient_of_nodes,
)
from onnx_autodiff.rules import GradRegistry, GradRule, default_registry, register_gradient

__version__ = "0.1.0"

__all__ = [
    "AutodiffError",
    "AutodiffPass",
    "GradRegistry",
    "GradientOpLoweringPass",
    "GradRule",
    "MissingRuleError",
    "NotDifferentiableError",
    "RuleError",
    "UnknownValueError",
    "UnsupportedModelError",
    "autodiff_pass",
    "cleanup_passes",
    "default_registry",
    "gradient_of_function",
    "gradient_of_nodes",
    "register_gradient",
]
