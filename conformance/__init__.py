"""Numeric checking of gradients: the finite-difference oracle and comparisons against it."""

from onnx_autodiff.conformance.check import GradCheck, ad_vjp, check_vjp, compare, scalarize
from onnx_autodiff.conformance.oracle import Evaluator, fd_vjp, random_cotangents, to_float64

__all__ = [
    "Evaluator",
    "GradCheck",
    "ad_vjp",
    "check_vjp",
    "compare",
    "fd_vjp",
    "random_cotangents",
    "scalarize",
    "to_float64",
]
