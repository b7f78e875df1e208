"""Numeric checking of gradients: the finite-difference oracle, comparisons against it, and the
conformance runner over the ONNX backend test data (:mod:`onnx_autodiff.conformance.runner`)."""

from onnx_autodiff.conformance.check import GradCheck, ad_vjp, check_vjp, compare, compare_elements, scalarize
from onnx_autodiff.conformance.oracle import (
    Evaluator,
    FDGradient,
    OracleError,
    OracleResult,
    fd_vjp,
    random_cotangents,
    to_float64,
)

__all__ = [
    "Evaluator",
    "FDGradient",
    "GradCheck",
    "OracleError",
    "OracleResult",
    "ad_vjp",
    "check_vjp",
    "compare",
    "compare_elements",
    "fd_vjp",
    "random_cotangents",
    "scalarize",
    "to_float64",
]
