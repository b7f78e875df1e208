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
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype", "output_datatype")

STEPS = {"float64": (1e-6, 1e-4), "float32": (1e-3, 1e-2)}
"""Absolute finite-difference steps (h1, h2) per oracle precision."""

BACKENDS = ("onnxruntime-float64", "reference-float64", "float32")
"""The oracle's backend chain, in order of preference."""


# --------------------------------------------------------------------------- float64 widening


_HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _widen_tensor(tensor: TensorProto, to: int) -> TensorProto:
    if tensor.data_type not in _widened(to):
        return tensor
    array = numpy_helper.to_array(tensor).astype(helper.tensor_dtype_to_np_dtype(to))
    return numpy_helper.from_array(array, tensor.name)


def _widened(to: int) -> tuple[int, ...]:
    """The element types that widening to ``to`` (DOUBLE or FLOAT) replaces."""
    return _FLOAT_TYPES if to == TensorProto.DOUBLE else _HALF_TYPES


def _widen_type(type_proto: onnx.TypeProto, to: int) -> None:
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        if type_proto.tensor_type.elem_type in _widened(to):
            type_proto.tensor_type.elem_type = to
    elif which == "sequence_type":
        _widen_type(type_proto.sequence_type.elem_type, to)
    elif which == "optional_type":
        _widen_type(type_proto.optional_type.elem_type, to)


def _widen_nodes(nodes, keep: frozenset[str], to: int) -> None:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                attribute.t.CopyFrom(_widen_tensor(attribute.t, to))
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _widen_graph(attribute.g, keep, to)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _widen_graph(sub, keep, to)
            elif attribute.name in _DTYPE_ATTRIBUTES and attribute.i in _widened(to):
                attribute.i = to
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and to == TensorProto.DOUBLE:
            for attribute in node.attribute:
                if attribute.name in ("value_float", "value_floats"):
                    values = attribute.f if attribute.name == "value_float" else list(attribute.floats)
                    widened = helper.make_attribute(
                        "value", numpy_helper.from_array(np.asarray(values, np.float64))
                    )
                    attribute.CopyFrom(widened)


def _widen_graph(graph: onnx.GraphProto, keep: frozenset[str], to: int) -> None:
    for index, tensor in enumerate(graph.initializer):
        if tensor.name not in keep:
            graph.initializer[index].CopyFrom(_widen_tensor(tensor, to))
    for value in (*graph.input, *graph.output):
        if value.name not in keep:
            _widen_type(value.type, to)
    del graph.value_info[:]
    _widen_nodes(graph.node, keep, to)


def to_float64(model: onnx.ModelProto, keep: Sequence[str] = (), to: int = TensorProto.DOUBLE) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 (inputs named in ``keep`` stay as they are).

    Widens float16/bfloat16/float32 graph inputs, outputs, initializers, tensor attributes
    (``Constant``, ``ConstantOfShape``), ``value_float(s)``, dtype attributes (``Cast.to``,
    ``dtype``, ...), subgraphs and model-local functions; drops ``value_info`` so that runtimes
    re-derive intermediate types. ``to=TensorProto.FLOAT`` widens float16/bfloat16 to float32 only.
    """
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    _widen_graph(widened.graph, frozenset(keep), to)
    for function in widened.functions:
        _widen_nodes(function.node, frozenset(), to)
    return widened


# --------------------------------------------------------------------------- reference kernels


def _float64_reference_ops() -> list[type]:
    """OpRun classes replacing reference kernels that compute in float32 inside."""
    from onnx.reference.op_run import OpRun

    erf = np.vectorize(math.erf, otypes=[np.float64])

    class Erf(OpRun):
        def _run(self, x):
            return (erf(np.asarray(x, np.float64)).astype(x.dtype),)

    class LayerNormalization(OpRun):
        def _run(self, X, Scale, B=None, axis=None, epsilon=None, stash_type=None):
            axis = -1 if axis is None else axis
            epsilon = 1e-5 if epsilon is None else epsilon
            axis = axis + X.ndim if axis < 0 else axis
            x = X.astype(np.float64)
            reduced = tuple(range(axis, X.ndim))
            mean = x.mean(axis=reduced, keepdims=True)
            inv_std = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=reduced, keepdims=True) + epsilon)
            y = (x - mean) * inv_std * Scale
            if B is not None:
                y = y + B
            return y.astype(X.dtype), mean.astype(X.dtype), inv_std.astype(X.dtype)

    class GroupNormalization(OpRun):
        def _run(self, X, scale, bias, epsilon=None, num_groups=None, stash_type=None):
            epsilon = 1e-5 if epsilon is None else epsilon
            n, c = X.shape[:2]
            x = X.astype(np.float64).reshape(n, num_groups, -1)
            mean = x.mean(axis=2, keepdims=True)
            y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=2, keepdims=True) + epsilon)
            extra = (1,) * (X.ndim - 2)
            if self.run_params["opsets"].get("", 21) < 21:  # opset 18: scale/bias per group
                y = y * scale.reshape(1, -1, 1) + bias.reshape(1, -1, 1)
                return (y.reshape(X.shape).astype(X.dtype),)
            y = y.reshape(X.shape) * scale.reshape(1, c, *extra) + bias.reshape(1, c, *extra)
            return (y.astype(X.dtype),)

    class AffineGrid(OpRun):
        def _run(self, theta, size, align_corners=None):
            spatial = [int(s) for s in size[2:]]
            axes = [
                np.linspace(-1.0, 1.0, d) if align_corners else (2 * np.arange(d) + 1) / d - 1
                for d in spatial
            ]
            mesh = np.meshgrid(*axes, indexing="ij")
            count = int(np.prod(spatial))
            homogeneous = np.stack([m.reshape(-1) for m in reversed(mesh)] + [np.ones(count)])
            grid = np.matmul(theta.astype(np.float64), homogeneous)
            grid = grid.transpose(0, 2, 1).reshape(theta.shape[0], *spatial, len(spatial))
            return (grid.astype(theta.dtype),)

    class BatchNormalization(OpRun):
        # The reference BatchNormalization-9 mixes batch statistics in whenever momentum is set.
        def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None,
                 is_test=None, spatial=None):
            epsilon = 1e-5 if epsilon is None else epsilon
            momentum = 0.9 if momentum is None else momentum
            opset = self.run_params["opsets"].get("", 21)
            outputs = [o for o in self.onnx_node.output if o]
            training = bool(training_mode) if opset >= 14 else len(outputs) > 1 and not is_test
            shape = (1, -1) + (1,) * (x.ndim - 2)
            axes = (0, *range(2, x.ndim))
            x64 = x.astype(np.float64)
            if training:
                batch_mean, batch_var = x64.mean(axis=axes), x64.var(axis=axes)
            else:
                batch_mean, batch_var = mean.astype(np.float64), var.astype(np.float64)
            y = (x64 - batch_mean.reshape(shape)) / np.sqrt(batch_var.reshape(shape) + epsilon)
            y = (y * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)
            if not training:
                return (y,)
            running_mean = (mean * momentum + batch_mean * (1 - momentum)).astype(mean.dtype)
            running_var = (var * momentum + batch_var * (1 - momentum)).astype(var.dtype)
            if opset >= 14:
                return y, running_mean, running_var
            return (y, running_mean, running_var, batch_mean.astype(x.dtype), batch_var.astype(x.dtype))[: len(outputs)]

    # The reference evaluator runs these through schema function bodies built at run time,
    # whose float constants (and so some intermediate results) stay float32.
    class Gelu(OpRun):
        def _run(self, X, approximate=None):
            x = X.astype(np.float64)
            if approximate == "tanh":
                y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
            else:
                y = 0.5 * x * (1 + erf(x / np.sqrt(2)))
            return (y.astype(X.dtype),)

    class HardSwish(OpRun):
        def _run(self, X):
            x = X.astype(np.float64)
            return ((x * np.clip(x / 6 + 0.5, 0, 1)).astype(X.dtype),)

    class Mish(OpRun):
        def _run(self, X):
            x = X.astype(np.float64)
            return ((x * np.tanh(np.logaddexp(0, x))).astype(X.dtype),)

    class MeanVarianceNormalization(OpRun):
        def _run(self, X, axes=None):
            x = X.astype(np.float64)
            axes = tuple(axes) if axes is not None else (0, 2, 3)
            mean = x.mean(axis=axes, keepdims=True)
            std = np.sqrt((x**2).mean(axis=axes, keepdims=True) - mean**2)
            return (((x - mean) / (std + 1e-9)).astype(X.dtype),)

    from onnx.reference.ops.op_loop import Loop as _Loop

    class Loop(_Loop):
        # The reference kernel runs no iteration when cond is omitted (it means true) and
        # concatenates the scan outputs (np.vstack) instead of stacking them on a new first axis.
        def _run(self, M, cond, *carried, context=None, attributes=None, bindings=None, **unused):
            names = self.body.input_names
            state, scans = list(carried), [[] for _ in range(self.K)]
            going, step = True if cond is None else bool(cond), 0
            while going and (M is None or step < int(M)):
                feeds = dict(context or {})
                feeds.update({names[0]: np.array(step, np.int64), names[1]: np.array(going)})
                feeds.update(zip(names[2:], state))
                outputs = self._run_body(feeds, attributes=attributes, bindings=bindings)
                going, state = bool(outputs[0]), list(outputs[1:1 + self.N])
                for k in range(self.K):
                    scans[k].append(outputs[1 + self.N + k])
                step += 1
            stacked = [np.stack(s) if s else np.zeros((0,)) for s in scans]
            return self._check_and_fix_outputs(tuple(state + stacked))

    return [Erf, LayerNormalization, GroupNormalization, AffineGrid, BatchNormalization,
            Gelu, HardSwish, Mish, MeanVarianceNormalization, Loop]


# --------------------------------------------------------------------------- running models


class Evaluator:
    """Runs a model on onnxruntime (single-threaded), falling back to onnx's reference evaluator.

    ``prefer="onnxruntime"`` tries onnxruntime then the reference evaluator; ``"reference"`` uses
    the reference evaluator only; ``backends=(...)`` gives the order explicitly. The reference
    evaluator runs with float64 kernels for Erf, LayerNormalization, GroupNormalization and
    AffineGrid. ``backend`` names the one in use; construction raises RuntimeError if none loads.
    A model with a seeded random op runs in a new onnxruntime session per call (same draws).
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        prefer: str = "onnxruntime",
        backends: Sequence[str] | None = None,
    ) -> None:
        self.model = model
        self.backend = None
        self._run = None
        errors = []
        if backends is None:
            backends = ("onnxruntime", "reference") if prefer == "onnxruntime" else ("reference",)
        for backend in backends:
            try:
                self._run = getattr(self, f"_make_{backend}")()
                self.backend = backend
                break
            except Exception as error:  # noqa: BLE001 - any failure means: try the next backend
                errors.append(f"{backend}: {_first_line(error)}")
        if self._run is None:
            raise RuntimeError("no backend runs the model: " + "; ".join(errors))

    def _make_onnxruntime(self):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        serialized = self.model.SerializeToString()
        session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
        if _seeded(self.model):
            # a seeded random op (training Dropout) repeats its draws in a new session only: its
            # generator moves on from run to run within one
            def fresh(feeds):
                return ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"]).run(None, feeds)

            return fresh
        return lambda feeds: session.run(None, feeds)

    def _make_reference(self):
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(self.model, new_ops=_float64_reference_ops())
        return lambda feeds: evaluator.run(None, feeds)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        # copies: onnxruntime may write into a fed array (training BatchNormalization updates its
        # running mean and variance in place), which would move the caller's base point
        feeds = {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in feeds.items()}
        return [np.asarray(out) for out in self._run(feeds)]


def _seeded(model: onnx.ModelProto) -> bool:
    """Whether a node of the main graph has a ``seed`` attribute (a seeded random op)."""
    return any(a.name == "seed" for node in model.graph.node for a in node.attribute)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def _float_outputs(model: onnx.ModelProto) -> list[int]:
    return [
        i
        for i, out in enumerate(model.graph.output)
        if out.type.tensor_type.elem_type in (*_FLOAT_TYPES, TensorProto.DOUBLE)
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
            yield backend, None, f"{backend}: {_first_line(error)}"


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
    notes: list[str] = []
    chosen = None
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
            chosen = backend, objective
            break
        notes.append(reason)
    if chosen is None:
        raise OracleError("no oracle backend evaluates the model: " + "; ".join(notes))
    backend, objective = chosen
    precision = "float32" if backend == "float32" else "float64"
    h1, h2 = STEPS[precision]
    h1 = step if step is not None else h1
    h2 = large_step if large_step is not None else h2

    base = objective.base
    flats = {n: np.asarray(base[n]).reshape(-1) for n in values}
    dtypes = {n: flats[n].dtype.type for n in values}
    sizes = {n: int(v.size) for n, v in values.items()}
    raw = {n: np.full((7, sizes[n]), np.nan) for n in values}  # s+, s-, c1, c2, f'', s+(h2), s-(h2)
    evaluated = {n: np.zeros(sizes[n], bool) for n in values}
    nonfinite = {n: np.zeros(sizes[n], bool) for n in values}
    shape_changed = {n: np.zeros(sizes[n], bool) for n in values}
    one_sided = {n: np.zeros(sizes[n], bool) for n in values}
    f0 = objective.f0
    rng = np.random.default_rng(seed)
    started = time.perf_counter()  # the budget covers sampling, not choosing the backend
    for name, k in _sample(sizes, max_coords, rng):
        elapsed = time.perf_counter() - started
        if time_budget is not None and elapsed > time_budget:
            if elapsed > 3 * time_budget or any(e.any() for e in evaluated.values()):
                break
        fs, deltas, same = [], [], []
        for delta in (h1, -h1, h2, -h2):
            point, actual = _perturbed(base, name, flats[name], k, delta, dtypes[name])
            value, ok = objective(point)
            fs.append(value)
            deltas.append(actual)
            same.append(ok)
        evaluated[name][k] = True
        if not all(same):
            # The output length changes on one side only (Range at an exact multiple of delta):
            # f is right- or left-continuous there and the other side's slope is its derivative.
            side = [i for i in ((0, 2), (1, 3)) if same[i[0]] and same[i[1]]]
            if len(side) != 1:
                shape_changed[name][k] = True
                continue
            i1, i2 = side[0]
            fs = [fs[i1], fs[i1], fs[i2], fs[i2]]
            deltas = [deltas[i1], deltas[i1], deltas[i2], deltas[i2]]
            one_sided[name][k] = True
        if not all(math.isfinite(v) for v in fs) or any(d == 0 for d in deltas):
            nonfinite[name][k] = True
            continue
        fp1, fm1, fp2, fm2 = fs
        dp1, dm1, dp2, dm2 = deltas
        if one_sided[name][k]:
            s1, s2 = (fp1 - f0) / dp1, (fp2 - f0) / dp2
            raw[name][:, k] = (s1, s1, s1, s2, 0.0, s2, s2)
            continue
        raw[name][:, k] = (
            (fp1 - f0) / dp1,
            (fm1 - f0) / dm1,
            (fp1 - fm1) / (dp1 - dm1),
            (fp2 - fm2) / (dp2 - dm2),
            2 * ((fp2 - f0) / dp2 - (fm2 - f0) / dm2) / (dp2 - dm2),
            (fp2 - f0) / dp2,
            (fm2 - f0) / dm2,
        )

    noise = 10 * objective.eps * max(1.0, objective.scale) / h1
    details, plain = {}, {}
    for name, value in values.items():
        right, left, c1, c2, curvature, right2, left2 = raw[name]
        finite = np.isfinite(c1)
        scale = max(1.0, float(np.max(np.abs(c1[finite]))) if finite.any() else 1.0)
        with np.errstate(invalid="ignore"):
            # a smooth f has s+ − s- ≈ h1·f''; a kink's jump is far larger than that
            smooth_gap = 10 * h1 * np.abs(curvature)
            kink = finite & (np.abs(right - left) > noise + 1e-8 * scale + smooth_gap)
            unstable = finite & (np.abs(c1 - c2) > noise + 1e-5 * scale + 1e-4 * np.abs(c1))
            # a jump: the change of f over h1 does not shrink with the step (|s(h1)| ≈ |s(h2)|·h2/h1)
            floor = 100 * objective.eps * max(1.0, objective.scale) / h1
            jump = finite & (
                ((np.abs(right) > floor) & (np.abs(right) * h1 > 0.5 * np.abs(right2) * h2))
                | ((np.abs(left) > floor) & (np.abs(left) * h1 > 0.5 * np.abs(left2) * h2))
            )
        lower = np.where(kink, np.minimum(left, right), c1)
        upper = np.where(kink, np.maximum(left, right), c1)
        shape = value.shape
        detail = FDGradient(
            value=c1.reshape(shape),
            lower=lower.reshape(shape),
            upper=upper.reshape(shape),
            evaluated=evaluated[name].reshape(shape),
            kink=(kink & ~jump).reshape(shape),
            unstable=(unstable | jump).reshape(shape),
            discontinuous=jump.reshape(shape),
            nonfinite=nonfinite[name].reshape(shape),
            shape_changed=shape_changed[name].reshape(shape),
            one_sided=one_sided[name].reshape(shape),
        )
        details[name] = detail
        plain[name] = detail.value
    return OracleResult(plain, details=details, backend=backend, weak=backend == "float32", notes=notes,
                        f0=objective.f0)
