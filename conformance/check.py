"""Gradient checks: the backward graph built by the pass, run on onnxruntime, against the oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_autodiff.conformance.oracle import Evaluator, FDGradient, fd_vjp, random_cotangents
from onnx_autodiff.modelfile import from_proto, to_proto
from onnx_autodiff.passes.autodiff import AutodiffPass
from onnx_autodiff.rules import GradRegistry

LOSS = "onnx_autodiff_check_loss"


def scalarize(model: onnx.ModelProto, cotangents: Sequence[np.ndarray | None], fed: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` whose only output is Σ_k ⟨out_k, r_k⟩ over the float outputs; with ``fed``
    the r_k are inputs (:func:`cotangent_feeds`) whose every dimension is a name, for a model with
    symbolic inputs: there a constant's extents would meet the outputs' inferred ones, which some
    inference functions get wrong (Attention-23's read a symbolic extent as 0)."""
    scalar = onnx.ModelProto()
    scalar.CopyFrom(model)
    graph = scalar.graph
    terms = []
    for k, (out, r) in enumerate(zip(model.graph.output, cotangents)):
        if r is None:
            continue
        names = [f"{LOSS}_r{k}", f"{LOSS}_m{k}", f"{LOSS}_s{k}"]
        if fed:
            graph.input.append(helper.make_tensor_value_info(
                names[0], helper.np_dtype_to_tensor_dtype(r.dtype), [f"{names[0]}_d{j}" for j in range(r.ndim)]))
        else:
            graph.node.append(helper.make_node("Constant", [], [names[0]], value=numpy_helper.from_array(r)))
        graph.node.extend(
            [
                helper.make_node("Mul", [out.name, names[0]], [names[1]]),
                helper.make_node("ReduceSum", [names[1]], [names[2]], keepdims=0),
            ]
        )
        terms.append(names[2])
    graph.node.append(helper.make_node("Sum", terms, [LOSS]))
    elem_type = next(o.type.tensor_type.elem_type for o, r in zip(model.graph.output, cotangents) if r is not None)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(LOSS, elem_type, []))
    return scalar


def cotangent_feeds(cotangents: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    """The inputs of ``scalarize(..., fed=True)``."""
    return {f"{LOSS}_r{k}": r for k, r in enumerate(cotangents) if r is not None}


def symbolic_inputs(model: onnx.ModelProto) -> bool:
    """Whether some graph input of ``model`` has a named dimension."""
    return any(d.HasField("dim_param") for i in model.graph.input for d in i.type.tensor_type.shape.dim)


def backward_model(
    model: onnx.ModelProto,
    of: str,
    wrt: Sequence[str],
    registry: GradRegistry | None = None,
    seed: str = "auto",
    upgrade_opset: bool = True,
) -> tuple[onnx.ModelProto, AutodiffPass]:
    """The model with gradient outputs appended, checked with ``full_check=True``."""
    autodiff = AutodiffPass(of=of, wrt=list(wrt), registry=registry, seed=seed, upgrade_opset=upgrade_opset)
    result = autodiff(from_proto(model))
    proto = to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, autodiff


def ad_vjp(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    cotangents: Sequence[np.ndarray | None],
    registry: GradRegistry | None = None,
    backends: Sequence[str] = ("onnxruntime",),
) -> dict[str, np.ndarray]:
    """The VJP Σ_k r_k·∂out_k/∂x computed by the generated backward graph on onnxruntime
    (``backends`` may add "reference" for models whose forward op onnxruntime lacks)."""
    floats = [i for i, r in enumerate(cotangents) if r is not None]
    if len(floats) == 1:
        of = model.graph.output[floats[0]].name
        proto, autodiff = backward_model(model, of, wrt, registry, seed="input")
        extra = {autodiff.seed_name: cotangents[floats[0]]}
    else:
        fed = symbolic_inputs(model)
        proto, autodiff = backward_model(scalarize(model, cotangents, fed), LOSS, wrt, registry)
        extra = cotangent_feeds(cotangents) if fed else {}
    outputs = [o.name for o in proto.graph.output]
    results = Evaluator(proto, backends=tuple(backends))({**feeds, **extra})
    named = dict(zip(outputs, results))
    return {x: named[autodiff.gradient_names[x]] for x in wrt}


@dataclasses.dataclass
class GradCheck:
    """Per-variable comparison of AD against finite differences.

    ``fd`` holds the oracle's central estimates (NaN where not sampled); ``errors`` the worst
    scaled error per variable (≤ 1 passes). ``counts`` has per-variable element counts
    (checked, kinks, unstable, ...), ``backend`` the oracle backend and ``weak`` whether it fell
    back to the model's own precision (then the tolerances were loosened to 3e-2).
    """

    ad: dict[str, np.ndarray]
    fd: dict[str, np.ndarray]
    errors: dict[str, float]
    ok: bool
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    backend: str = ""
    weak: bool = False

    def __str__(self) -> str:
        lines = []
        for name, err in self.errors.items():
            extra = self.counts.get(name)
            extra = f" ({', '.join(f'{k} {v}' for k, v in extra.items())})" if extra else ""
            lines.append(f"{name}: worst scaled error {err:.3g}{extra}")
        if self.backend:
            lines.append(f"oracle: {self.backend}{' (weak check)' if self.weak else ''}")
        return ("ok\n" if self.ok else "MISMATCH\n") + "\n".join(lines)


WEAK_TOLERANCE = 3e-2
"""atol = rtol used when the oracle fell back to the model's own precision."""


def compare_elements(
    ad: np.ndarray, fd: np.ndarray | FDGradient, atol: float, rtol: float
) -> np.ndarray:
    """Per-element scaled error |ad − fd| / (atol·S + rtol·|fd|), S = max(1, ‖fd‖∞).

    With an :class:`FDGradient`, kinks accept any value in [lower, upper] (distance to that
    interval), and skipped or unsampled elements get NaN. With a plain array, non-finite
    differences give inf. Raises ValueError on a shape mismatch.
    """
    ad = np.asarray(ad)
    if isinstance(fd, FDGradient):
        value, lower, upper, checkable = fd.value, fd.lower, fd.upper, fd.checkable
    else:
        value = lower = upper = np.asarray(fd, np.float64)
        checkable = np.ones(value.shape, bool)
    if ad.shape != value.shape:
        raise ValueError(f"AD shape {ad.shape} differs from the oracle's {value.shape}")
    magnitude = np.maximum(np.abs(lower), np.abs(upper))
    scale = max(1.0, float(np.max(magnitude[checkable])) if checkable.any() else 1.0)
    bound = atol * scale + rtol * magnitude
    a = ad.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.maximum(np.maximum(lower - a, a - upper), 0.0)
        diff = np.where(np.isfinite(diff), diff, np.inf)
        errors = np.where(checkable, diff / bound, np.nan)
    return errors


def compare(ad: np.ndarray, fd: np.ndarray | FDGradient, atol: float, rtol: float) -> float:
    """Worst ratio |ad − fd| / (atol·S + rtol·|fd|), S = max(1, ‖fd‖∞); ≤ 1 passes.

    ``fd`` is a plain array or an :class:`FDGradient` (kink intervals honoured, skipped and
    unsampled elements ignored). A shape mismatch or a non-finite difference gives inf.
    """
    try:
        errors = compare_elements(ad, fd, atol, rtol)
    except ValueError:
        return float("inf")
    if errors.size == 0 or np.all(np.isnan(errors)):
        return 0.0
    return float(np.nanmax(errors))


def check_vjp(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    *,
    registry: GradRegistry | None = None,
    seed: int = 0,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    ad_backends: Sequence[str] = ("onnxruntime",),
    **oracle_options,
) -> GradCheck:
    """Build the backward graph, run it on onnxruntime, compare with float64 finite differences.

    ``ad_backends`` may add "reference" for a model whose forward op onnxruntime cannot run.
    ``oracle_options`` go to :func:`fd_vjp` (``max_coords``, ``time_budget``, ...). ``ok`` needs
    every variable within tolerance and at least one checked element per non-empty variable.
    """
    cotangents = random_cotangents(model, feeds, seed)
    ad = ad_vjp(model, feeds, wrt, cotangents, registry, backends=ad_backends)
    fd = fd_vjp(model, feeds, wrt, cotangents, seed=seed, **oracle_options)
    if fd.weak:
        atol, rtol = max(atol, WEAK_TOLERANCE), max(rtol, WEAK_TOLERANCE)
    errors = {x: compare(ad[x], fd.details[x], atol, rtol) for x in wrt}
    counts = {x: fd.details[x].counts() for x in wrt}
    ok = all(e <= 1.0 for e in errors.values()) and all(
        c["checked"] > 0 or c["size"] == 0 for c in counts.values()
    )
    return GradCheck(ad, dict(fd), errors, ok, counts, fd.backend, fd.weak)
