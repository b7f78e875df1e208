"""Finite differences of f(x) = Σ_k ⟨out_k(x), r_k⟩: the cotangents r, the objective on one backend,
the backend chain with its precision probe, and :func:`fd_vjp` with its per-element flags (see
:mod:`onnx_autodiff.conformance.oracle` for the method)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.conformance.evaluator import Evaluator, first_line
from onnx_autodiff.conformance.widening import FLOAT_ELEM_TYPES, to_float64

STEPS = {"float64": (1e-6, 1e-4), "float32": (1e-3, 1e-2)}
"""Absolute finite-difference steps (h1, h2) per oracle precision."""

BACKENDS = ("onnxruntime-float64", "reference-float64", "float32")
"""The oracle's backend chain, in order of preference."""


# --------------------------------------------------------------------------- cotangents


def _float_outputs(model: onnx.ModelProto) -> list[int]:
    return [
        i
        for i, out in enumerate(model.graph.output)
        if out.type.tensor_type.elem_type in FLOAT_ELEM_TYPES
    ]


def random_cotangents(model: onnx.ModelProto, feeds, seed: int = 0) -> list[np.ndarray | None]:
    """One standard-normal r per float output, shaped like that output at ``feeds`` (None if not float).

    r is 0 where the output is not finite or at its dtype's limit (see :func:`usable`), so that
    ``f = Σ ⟨out, r⟩`` ignores those elements.
    """
    return cotangents_for(model, Evaluator(model)(feeds), seed)


def cotangents_for(model: onnx.ModelProto, outputs: Sequence[np.ndarray], seed: int = 0) -> list[np.ndarray | None]:
    """:func:`random_cotangents` for already computed ``outputs`` of ``model``."""
    rng = np.random.default_rng(seed)
    floats = set(_float_outputs(model))
    cotangents: list[np.ndarray | None] = []
    for i, out in enumerate(outputs):
        out = np.asarray(out)
        if i not in floats or out.dtype.kind != "f":
            cotangents.append(None)
            continue
        r = rng.standard_normal(out.shape).astype(out.dtype)
        cotangents.append(np.where(usable(out), r, 0).astype(out.dtype))
    return cotangents


def usable(out: np.ndarray) -> np.ndarray:
    """Where a float output counts in f: finite and below its dtype's largest magnitude.

    A value at the dtype's limit is a masking sentinel (attention fills masked scores with the
    float32 lowest value), which a float64 evaluation of the same model turns into -inf.
    """
    out = np.asarray(out)
    with np.errstate(invalid="ignore"):
        return np.isfinite(out) & (np.abs(out) < np.finfo(out.dtype).max)


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class FDGradient:
    """Finite-difference estimate of one VJP with per-element diagnostics (all float64/bool arrays).

    ``value`` is the central estimate at h1 (NaN where not evaluated); ``lower``/``upper`` bound
    the valid values: equal to ``value`` at smooth points, the two one-sided slopes at kinks.
    """

    value: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    evaluated: np.ndarray
    kink: np.ndarray
    unstable: np.ndarray
    nonfinite: np.ndarray
    shape_changed: np.ndarray
    discontinuous: np.ndarray | None = None
    one_sided: np.ndarray | None = None  # estimated from the side whose output shape is unchanged

    @property
    def skipped(self) -> np.ndarray:
        """Evaluated elements that cannot be checked (unstable, discontinuous, non-finite, shape-changing)."""
        return self.evaluated & (self.nonfinite | self.shape_changed | (self.unstable & ~self.kink))

    @property
    def checkable(self) -> np.ndarray:
        return self.evaluated & ~self.skipped

    def counts(self) -> dict[str, int]:
        """How many elements were sampled, checked, skipped, flagged as kinks, ... ."""
        return {
            "size": int(self.value.size),
            "evaluated": int(self.evaluated.sum()),
            "checked": int(self.checkable.sum()),
            "kinks": int((self.kink & self.checkable).sum()),
            "unstable": int((self.unstable & ~self.kink & self.evaluated).sum()),
            "discontinuous": int(self.discontinuous.sum()) if self.discontinuous is not None else 0,
            "nonfinite": int(self.nonfinite.sum()),
            "shape_changed": int(self.shape_changed.sum()),
            "one_sided": int((self.one_sided & self.checkable).sum()) if self.one_sided is not None else 0,
        }


class OracleResult(dict):
    """``{name: float64 array}`` of central estimates, plus ``details`` (name → FDGradient).

    ``backend`` is the backend that computed it (see :data:`BACKENDS`), ``weak`` is True when the
    oracle had to fall back to the model's own precision, at least float32 (compare with loose
    tolerances), and
    ``notes`` lists why earlier backends were rejected; ``f0`` is f at the base point.
    """

    def __init__(self, values=(), *, details=None, backend="", weak=False, notes=(), f0=float("nan")):
        super().__init__(values)
        self.f0: float = f0  # f at the base point, on that backend
        self.details: dict[str, FDGradient] = dict(details or {})
        self.backend: str = backend
        self.weak: bool = weak
        self.notes: list[str] = list(notes)


class OracleError(RuntimeError):
    """The oracle cannot evaluate the model at the given point on any backend."""


# --------------------------------------------------------------------------- the objective


class _Objective:
    """f(x) = Σ_k ⟨out_k(x), r_k⟩ over the base point's finite output elements, on one backend."""

    def __init__(self, evaluate: Evaluator, base: dict, weights, dtype) -> None:
        self.evaluate = evaluate
        self.base = base
        self.dtype = dtype
        self.eps = float(np.finfo(dtype).eps)
        started = time.perf_counter()
        outs = evaluate(base)
        self.seconds = time.perf_counter() - started
        if len(outs) != len(weights):
            raise OracleError(f"the model has {len(outs)} outputs, {len(weights)} cotangents given")
        self.weights, self.masks, self.shapes = [], [], []
        for out, r in zip(outs, weights):
            if r is None:
                self.weights.append(None)
                self.masks.append(None)
                self.shapes.append(None)
                continue
            if out.shape != np.shape(r):
                raise OracleError(f"output shape {out.shape} differs from the cotangent's {np.shape(r)}")
            self.weights.append(np.asarray(r, np.float64))
            self.masks.append(np.isfinite(out))
            self.shapes.append(out.shape)
        terms = [np.where(m, o, 0).astype(np.float64) * r for o, r, m in zip(outs, self.weights, self.masks) if r is not None]
        self.f0 = float(sum(np.sum(t) for t in terms))
        self.scale = float(sum(np.sum(np.abs(t)) for t in terms))
        if not math.isfinite(self.f0):
            raise OracleError("f(x) is not finite at the base point")

    def __call__(self, point: Mapping[str, np.ndarray]) -> tuple[float, bool]:
        """(f, same output shapes as at the base point)."""
        try:
            outs = self.evaluate(point)
        except Exception:  # noqa: BLE001 - a failing evaluation is a non-finite value
            return float("nan"), True
        total = 0.0
        for out, r, mask, shape in zip(outs, self.weights, self.masks, self.shapes):
            if r is None:
                continue
            if out.shape != shape:
                return float("nan"), False
            total += float(np.sum(np.where(mask, out, 0).astype(np.float64) * r))
        return total, True


def _perturbed(base: dict, name: str, flat: np.ndarray, k: int, delta: float, dtype):
    moved = flat.copy()
    moved[k] = dtype(flat[k] + delta)
    point = dict(base)
    point[name] = moved.reshape(base[name].shape)
    return point, float(moved[k]) - float(flat[k])


def _probe(objective: _Objective, base: dict, names: Sequence[str], seed: int) -> str | None:
    """None if the backend computes f precisely enough for finite differences; else why not.

    Central directional derivatives at h = 1e-9 and 1e-6 must agree to 1e-3 relative (the
    direction is scaled by max(1, |x|) so the steps stay representable). A backend computing in
    float32 inside fails by orders of magnitude. When f itself is not smooth along the direction
    (a jump that does not shrink with h, or a non-finite value nearby) the probe cannot judge
    precision and accepts the backend: the per-element flags deal with such points.
    """
    rng = np.random.default_rng(seed + 7919)
    direction = {n: rng.standard_normal(base[n].shape) * np.maximum(1.0, np.abs(base[n])) for n in names}
    estimates, jumps = [], []
    for h in (1e-9, 1e-6):
        with np.errstate(all="ignore"):  # infinite inputs stay infinite
            plus = dict(base, **{n: base[n] + h * direction[n] for n in names})
            minus = dict(base, **{n: base[n] - h * direction[n] for n in names})
        (fp, ok_p), (fm, ok_m) = objective(plus), objective(minus)
        if not (ok_p and ok_m and math.isfinite(fp) and math.isfinite(fm)):
            return None
        estimates.append((fp - fm) / (2 * h))
        jumps.append(abs(fp - fm))
    fine, coarse = estimates
    scale = max(1.0, objective.scale)
    if abs(fine - coarse) <= 1e-3 * max(abs(fine), abs(coarse)) + 1e-5 * scale:
        return None
    if jumps[0] > 0.5 * jumps[1] and jumps[0] > 1e-4 * scale:
        return None  # a discontinuity of f itself, far above float32 rounding
    return f"precision probe failed (directional derivative {fine:.6g} at h=1e-9, {coarse:.6g} at h=1e-6)"


# --------------------------------------------------------------------------- fd_vjp


def _resolve(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], wrt: Sequence[str]):
    """The model with every ``wrt`` initializer turned into a plain graph input, and the values.

    Initializers are removed rather than overridden: some runtimes treat an initializer that is
    also a graph input as a constant (onnxruntime then rejects it as a feed).
    """
    graph_inputs = {i.name for i in model.graph.input}
    initializers = {t.name: t for t in model.graph.initializer}
    promoted = onnx.ModelProto()
    promoted.CopyFrom(model)
    values: dict[str, np.ndarray] = {}
    for name in wrt:
        if name in feeds:
            values[name] = np.asarray(feeds[name])
        elif name in initializers:
            values[name] = numpy_helper.to_array(initializers[name])
            if name not in graph_inputs:
                promoted.graph.input.append(
                    helper.make_tensor_value_info(
                        name, initializers[name].data_type, list(initializers[name].dims)
                    )
                )
        else:
            raise KeyError(f"'{name}' is neither a fed input nor an initializer")
        if values[name].dtype.kind != "f":
            raise TypeError(f"'{name}' has dtype {values[name].dtype}; only float values have gradients")
    kept = [t for t in promoted.graph.initializer if t.name not in values]
    del promoted.graph.initializer[:]
    promoted.graph.initializer.extend(kept)
    return promoted, values


def _at_least_float32(promoted, feeds, values, keep):
    """(evaluator, base point) of the model in float32, or in its own precision when float16 or
    bfloat16 parts of it cannot run in float32: finite differences in half precision are noise."""
    base = {n: np.asarray(v) for n, v in feeds.items()}
    base.update(values)
    half = {n for n, v in base.items() if v.dtype == np.float16 or v.dtype.name == "bfloat16"}
    if half:
        single = {n: v.astype(np.float32) if n in half else v for n, v in base.items()}
        try:
            evaluate = Evaluator(to_float64(promoted, keep, to=TensorProto.FLOAT))
            evaluate(single)
        except Exception:  # noqa: BLE001 - an op without float32 kernels: its own precision then
            return Evaluator(promoted), base
        return evaluate, single
    return Evaluator(promoted), base


def _backend_objectives(promoted, feeds, values, weights, backends):
    """Yield (backend, objective-or-None, reason) for each backend of the chain, lazily."""
    keep = [
        i.name
        for i in promoted.graph.input
        if i.name in feeds and np.asarray(feeds[i.name]).dtype.kind != "f"
    ]
    wide = None
    for backend in backends:
        try:
            if backend == "float32":
                evaluate, base = _at_least_float32(promoted, feeds, values, keep)
                dtype = np.float32
            else:
                if wide is None:
                    wide = to_float64(promoted, keep)
                runtime = "onnxruntime" if backend == "onnxruntime-float64" else "reference"
                evaluate = Evaluator(wide, backends=(runtime,))
                base = {
                    n: (np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v))
                    for n, v in feeds.items()
                }
                base.update({n: v.astype(np.float64) for n, v in values.items()})
                dtype = np.float64
            yield backend, _Objective(evaluate, base, weights, dtype), None
        except Exception as error:  # noqa: BLE001 - any failure means: try the next backend
            yield backend, None, f"{backend}: {first_line(error)}"


def _sample(sizes: dict[str, int], max_coords: int | None, rng) -> list[tuple[str, int]]:
    """Coordinates to evaluate, interleaved across names so a time budget cuts them evenly."""
    orders = {}
    for name, size in sizes.items():
        if max_coords is None or size <= max_coords:
            orders[name] = list(range(size))
        else:
            orders[name] = sorted(rng.choice(size, max_coords, replace=False).tolist())
            rng.shuffle(orders[name])
    plan: list[tuple[str, int]] = []
    longest = max((len(o) for o in orders.values()), default=0)
    for i in range(longest):
        plan.extend((name, order[i]) for name, order in orders.items() if i < len(order))
    return plan


def fd_vjp(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    cotangents: Sequence[np.ndarray | None],
    step: float | None = None,
    *,
    large_step: float | None = None,
    max_coords: int | None = 2000,
    time_budget: float | None = None,
    backends: Sequence[str] = BACKENDS,
    probe: bool = True,
    seed: int = 0,
) -> OracleResult:
    """Central finite differences in float64 of f(x) = Σ_k ⟨out_k(x), r_k⟩ for each input in ``wrt``.

    ``wrt`` names graph inputs or initializers (initializers are fed as inputs); ``cotangents``
    holds one array per graph output (None for outputs left out of f), e.g. from
    :func:`random_cotangents`. ``step``/``large_step`` override h1/h2. At most ``max_coords``
    coordinates per input are sampled (None: all); ``time_budget`` (seconds) stops sampling early
    (and passes over the reference evaluator when it takes more than an eighth of it per evaluation).
    ``backends`` is the chain tried in order (see :data:`BACKENDS`); ``probe`` enables the
    precision probe on the float64 backends.

    Returns an :class:`OracleResult`: ``result[name]`` is the float64 estimate shaped like the
    value (NaN where not evaluated), ``result.details[name]`` the :class:`FDGradient`. Raises
    :class:`OracleError` when no backend evaluates the model.
    """
    promoted, values = _resolve(model, feeds, wrt)
    weights = [None if r is None else np.asarray(r, np.float64) for r in cotangents]
    backend, objective, notes = _choose_backend(promoted, feeds, values, weights, backends, time_budget, probe, seed)
    h1, h2 = STEPS["float32" if backend == "float32" else "float64"]
    h1 = step if step is not None else h1
    h2 = large_step if large_step is not None else h2
    samples = _sample_differences(objective, values, h1, h2, max_coords, time_budget, seed)
    details = {name: _gradient(samples[name], value.shape, objective, h1, h2) for name, value in values.items()}
    return OracleResult({name: detail.value for name, detail in details.items()}, details=details, backend=backend,
                        weak=backend == "float32", notes=notes, f0=objective.f0)


def _choose_backend(promoted, feeds, values, weights, backends, time_budget, probe, seed):
    """(backend, objective, notes): the first backend of the chain that evaluates f, fast enough
    for the time budget and, on the float64 backends, precisely enough (``probe``); ``notes`` says
    why earlier ones were passed over. Raises OracleError when none qualifies."""
    notes: list[str] = []
    chain = list(backends)
    for backend, objective, reason in _backend_objectives(promoted, feeds, values, weights, chain):
        # the reference evaluator can be orders of magnitude slower than onnxruntime in float32
        slow = time_budget is not None and objective is not None and objective.seconds > time_budget / 8
        if slow and backend == "reference-float64" and backend != chain[-1]:
            notes.append(f"{backend}: too slow for the time budget ({objective.seconds:.2g} s per evaluation)")
            continue
        if objective is not None and probe and backend != "float32":
            reason = _probe(objective, objective.base, list(values), seed)
            reason = reason and f"{backend}: {reason}"
        if reason is None and objective is not None:
            return backend, objective, notes
        notes.append(reason)
    raise OracleError("no oracle backend evaluates the model: " + "; ".join(notes))


@dataclasses.dataclass
class _Samples:
    """The finite differences of one input, filled coordinate by coordinate. ``raw`` rows: the
    one-sided slopes s+ and s- at h1, the central estimates at h1 and h2, f'' at h2, and s+ and
    s- at h2."""

    raw: np.ndarray
    evaluated: np.ndarray
    nonfinite: np.ndarray
    shape_changed: np.ndarray
    one_sided: np.ndarray

    @classmethod
    def empty(cls, size: int) -> _Samples:
        return cls(np.full((7, size), np.nan), *(np.zeros(size, bool) for _ in range(4)))


def _sample_differences(objective: _Objective, values, h1: float, h2: float, max_coords, time_budget,
                        seed: int) -> dict[str, _Samples]:
    """Evaluate the sampled coordinates of every input until the time budget runs out."""
    base = objective.base
    flats = {n: np.asarray(base[n]).reshape(-1) for n in values}
    sizes = {n: int(v.size) for n, v in values.items()}
    samples = {n: _Samples.empty(sizes[n]) for n in values}
    rng = np.random.default_rng(seed)
    started = time.perf_counter()  # the budget covers sampling, not choosing the backend
    for name, k in _sample(sizes, max_coords, rng):
        # past the budget, stop once a coordinate is done: the check comes before each one, so a
        # pause before the first (the collector's) must not leave the oracle with none at all
        if time_budget is not None and time.perf_counter() - started > time_budget:
            if any(s.evaluated.any() for s in samples.values()):
                break
        _difference_at(objective, name, flats[name], k, h1, h2, samples[name])
    return samples


def _difference_at(objective: _Objective, name: str, flat: np.ndarray, k: int, h1: float, h2: float,
                   samples: _Samples) -> None:
    """Evaluate f at ±h1 and ±h2 along coordinate ``k`` of ``name`` and record slopes or flags."""
    fs, deltas, same = [], [], []
    for delta in (h1, -h1, h2, -h2):
        point, actual = _perturbed(objective.base, name, flat, k, delta, flat.dtype.type)
        value, ok = objective(point)
        fs.append(value)
        deltas.append(actual)
        same.append(ok)
    samples.evaluated[k] = True
    if not all(same):
        # The output length changes on one side only (Range at an exact multiple of delta):
        # f is right- or left-continuous there and the other side's slope is its derivative.
        side = [i for i in ((0, 2), (1, 3)) if same[i[0]] and same[i[1]]]
        if len(side) != 1:
            samples.shape_changed[k] = True
            return
        i1, i2 = side[0]
        fs = [fs[i1], fs[i1], fs[i2], fs[i2]]
        deltas = [deltas[i1], deltas[i1], deltas[i2], deltas[i2]]
        samples.one_sided[k] = True
    if not all(math.isfinite(v) for v in fs) or any(d == 0 for d in deltas):
        samples.nonfinite[k] = True
        return
    samples.raw[:, k] = _slopes(fs, deltas, objective.f0, samples.one_sided[k])


def _slopes(fs, deltas, f0: float, one_sided: bool) -> tuple[float, ...]:
    """The seven ``_Samples.raw`` entries of one coordinate from f at the four steps."""
    fp1, fm1, fp2, fm2 = fs
    dp1, dm1, dp2, dm2 = deltas
    if one_sided:
        s1, s2 = (fp1 - f0) / dp1, (fp2 - f0) / dp2
        return s1, s1, s1, s2, 0.0, s2, s2
    return (
        (fp1 - f0) / dp1,
        (fm1 - f0) / dm1,
        (fp1 - fm1) / (dp1 - dm1),
        (fp2 - fm2) / (dp2 - dm2),
        2 * ((fp2 - f0) / dp2 - (fm2 - f0) / dm2) / (dp2 - dm2),
        (fp2 - f0) / dp2,
        (fm2 - f0) / dm2,
    )


def _gradient(samples: _Samples, shape, objective: _Objective, h1: float, h2: float) -> FDGradient:
    """The estimate of one input with its per-element flags (kink, unstable, discontinuous, ...)."""
    noise = 10 * objective.eps * max(1.0, objective.scale) / h1
    right, left, c1, c2, curvature, right2, left2 = samples.raw
    finite = np.isfinite(c1)
    with np.errstate(invalid="ignore"):
        # a jump: the change of f over h1 does not shrink with the step (|s(h1)| ≈ |s(h2)|·h2/h1)
        floor = 100 * objective.eps * max(1.0, objective.scale) / h1
        jump = finite & (
            ((np.abs(right) > floor) & (np.abs(right) * h1 > 0.5 * np.abs(right2) * h2))
            | ((np.abs(left) > floor) & (np.abs(left) * h1 > 0.5 * np.abs(left2) * h2))
        )
        # the slopes' scale without the jumps, whose estimates grow as 1/h1 and would hide kinks
        # and instability elsewhere
        sloped = finite & ~jump
        scale = max(1.0, float(np.max(np.abs(c1[sloped]))) if sloped.any() else 1.0)
        # a smooth f has s+ − s- ≈ h1·f''; a kink's jump is far larger than that
        smooth_gap = 10 * h1 * np.abs(curvature)
        kink = finite & (np.abs(right - left) > noise + 1e-8 * scale + smooth_gap)
        unstable = finite & (np.abs(c1 - c2) > noise + 1e-5 * scale + 1e-4 * np.abs(c1))
    lower = np.where(kink, np.minimum(left, right), c1)
    upper = np.where(kink, np.maximum(left, right), c1)
    return FDGradient(
        value=c1.reshape(shape),
        lower=lower.reshape(shape),
        upper=upper.reshape(shape),
        evaluated=samples.evaluated.reshape(shape),
        kink=(kink & ~jump).reshape(shape),
        unstable=(unstable | jump).reshape(shape),
        discontinuous=jump.reshape(shape),
        nonfinite=samples.nonfinite.reshape(shape),
        shape_changed=samples.shape_changed.reshape(shape),
        one_sided=samples.one_sided.reshape(shape),
    )
