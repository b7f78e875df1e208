"""The numeric oracle: float64 central finite differences of ⟨outputs, r⟩, independent of any rule.

``fd_vjp(model, feeds, wrt, cotangents)`` estimates the vector-Jacobian product
``Σ_k r_k · ∂out_k/∂x`` for each ``x`` in ``wrt`` by perturbing one coordinate at a time of the
scalar ``f(x) = Σ_k ⟨out_k(x), r_k⟩``. It works on any model:

- the model is widened to float64 (inputs, initializers, constants, ``Cast`` targets, dtype
  attributes, subgraphs and functions) and run on the first backend of a chain that passes a
  precision probe: onnxruntime in float64, the ONNX reference evaluator in float64 (with float64
  kernels for the ops whose reference kernels compute in float32 inside: Erf, LayerNormalization,
  GroupNormalization, AffineGrid, and the function-bodied Gelu, HardSwish, Mish,
  MeanVarianceNormalization; and an inference-mode BatchNormalization-9, whose reference kernel
  mixes in batch statistics when ``momentum`` is set; and a Loop that follows the spec for an
  omitted cond and for scan outputs), and finally the model in its own precision, float16 and
  bfloat16 widened to float32 (a *weak* check); a reference evaluator too slow for the time
  budget is passed over;
- inputs are copied before every run (onnxruntime writes some in place), and a model with a
  seeded random op (training Dropout with ``seed``) runs in a new onnxruntime session per call;
- steps are absolute (h1 = 1e-6 and h2 = 1e-4 in float64; 1e-3 and 1e-2 in the float32
  fallback), using the step actually representable at each coordinate;
- every coordinate gets flags: ``kink`` (the two one-sided slopes at h1 differ: the point is a
  kink or a tie, and any value between them is a valid subgradient), ``unstable`` (the central
  estimates at h1 and h2 disagree), ``discontinuous`` (a jump: the change of f over a step does
  not shrink with the step; also counted unstable), ``nonfinite`` and ``shape_changed``; flagged
  elements other than kinks are skipped by :func:`onnx_autodiff.conformance.check.compare`;
- where the output shape changes on one side of a coordinate only (Range with the limit an exact
  multiple of delta away), the slopes of the other side at h1 and h2 stand in for the central
  estimates (flag ``one_sided``; checked, and unstable when the two slopes disagree);
- the work is capped: at most ``max_coords`` sampled coordinates per input and an optional time
  budget per call; coordinates not evaluated are NaN in the plain result.

The result is an :class:`OracleResult`: a plain ``{name: float64 array}`` dict (the central
estimate at h1) with the per-element details in ``.details`` and the backend in ``.backend``.

The parts: :mod:`~onnx_autodiff.conformance.widening` (to float64), :mod:`~.kernels` (float64
reference kernels), :mod:`~.evaluator` (running a model) and :mod:`~.differences` (the cotangents,
the backend chain and the finite differences). None of them imports the engine or the rules: the
oracle stays independent of what it checks.
"""

from onnx_autodiff.conformance.differences import (
    BACKENDS,
    STEPS,
    FDGradient,
    OracleError,
    OracleResult,
    cotangents_for,
    fd_vjp,
    random_cotangents,
    usable,
)
from onnx_autodiff.conformance.evaluator import Evaluator
from onnx_autodiff.conformance.widening import to_float64

__all__ = [
    "BACKENDS",
    "STEPS",
    "Evaluator",
    "FDGradient",
    "OracleError",
    "OracleResult",
    "cotangents_for",
    "fd_vjp",
    "random_cotangents",
    "to_float64",
    "usable",
]
