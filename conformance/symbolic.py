"""Symbolic dimensions: a model's copy whose graph inputs have named extents only, and the sweep's
re-check of a case on it. The rules then know no input's extents and must compute sizes in the
graph; the backward graph built from the copy must give the VJP the static one gave (which the
oracle judged), so no second finite-difference run is needed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

SYMBOLIC_OUTCOMES = ("pass", "fail", "needs-static")
"""A check's outcome on symbolic dimensions; "needs-static": onnx's inference or the runtime refuses
the symbolic forward model, or it computes other outputs (nothing to hold the rules to)."""

NEEDS_STATIC = "forward needs static shapes"


def symbolic_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs' every dimension is a distinct name, its outputs'
    and value_info's shapes cleared and inferred again from those; an output inference leaves
    without a shape keeps its declared rank, each dimension a name (as exporters declare)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    initialized = {t.name for t in graph.initializer}
    for info in graph.input:
        if info.name in initialized or not info.type.HasField("tensor_type"):
            continue
        for k, dim in enumerate(info.type.tensor_type.shape.dim):
            dim.Clear()
            dim.dim_param = f"{info.name}_d{k}"
    del graph.value_info[:]
    declared = {}
    for info in graph.output:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            declared[info.name] = list(info.type.tensor_type.shape.dim)
            info.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(copy, strict_mode=False, data_prop=True)
    for info in inferred.graph.output:
        if info.name not in declared:
            continue
        if not info.type.tensor_type.HasField("shape"):
            info.type.tensor_type.shape.dim.extend(
                onnx.TensorShapeProto.Dimension(dim_param=f"{info.name}_d{k}") for k in range(len(declared[info.name])))
        # an extent the static model contradicts is a name: some inference functions read a symbolic
        # extent as 0 (Attention-23's: Y's hidden size, the scores' key length)
        for k, (dim, static) in enumerate(zip(info.type.tensor_type.shape.dim, declared[info.name])):
            if dim.HasField("dim_value") and static.HasField("dim_value") and dim.dim_value != static.dim_value:
                dim.dim_param = f"{info.name}_d{k}"
    return inferred


@dataclasses.dataclass
class SymbolicCheck:
    """What the symbolic re-check says about one input: ``outcome`` (one of SYMBOLIC_OUTCOMES) and
    why, for anything but a pass."""

    outcome: str
    message: str = ""


def same_values(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> str:
    """"" when ``got`` equals ``want`` within |got − want| ≤ atol·max(1, ‖want‖∞) + rtol·|want|
    (NaN equal to NaN), else what differs (shape or worst element)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shaped {got.shape}, not {want.shape}"
    if got.size == 0:
        return ""
    a, b = got.astype(np.float64), want.astype(np.float64)
    scale = max(1.0, float(np.max(np.abs(b), initial=0.0, where=np.isfinite(b))))
    close = np.isclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True)
    if close.all():
        return ""
    with np.errstate(invalid="ignore"):
        gap = np.where(close, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf, posinf=np.inf))
    index = np.unravel_index(int(np.argmax(gap)), gap.shape)
    return (f"{int((~close).sum())} of {close.size} elements differ, worst {[int(i) for i in index]}: "
            f"{a[index]:.6g} vs {b[index]:.6g}")


def recheck(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    static_ad: Mapping[str, np.ndarray],
    *,
    forward_backend: str,
    outputs: Sequence[np.ndarray],
    build: Callable[[onnx.ModelProto, list[str]], tuple[onnx.ModelProto, dict, dict]],
    run: Callable[[onnx.ModelProto, Mapping[str, np.ndarray]], tuple[list[np.ndarray], str]],
    tolerance: Callable[[np.ndarray], tuple[float, float]],
    describe: Callable[[BaseException], str],
) -> dict[str, SymbolicCheck]:
    """Re-check the inputs of ``static_ad`` (their VJPs from the backward graphs of ``model``) on
    :func:`symbolic_model` of ``model``: its forward must pass onnx's strict shape inference, run on
    ``forward_backend`` and give the static ``outputs`` (else every input "needs-static"); its
    backward graph, built once by ``build(model, wrt) -> (proto, gradient names, seed feeds)``, must
    pass onnx's full checker and strict shape inference and, run by ``run(proto, feeds) ->
    (outputs, runtime)``, give VJPs equal to the static ones within ``tolerance(ad) -> (atol,
    rtol)``. When several inputs fail together each is built alone, so a failure names its input."""
    from onnx_autodiff.conformance.evaluator import Evaluator

    wrt = list(static_ad)
    try:
        symbolic = symbolic_model(model)
        onnx.shape_inference.infer_shapes(symbolic, check_type=True, strict_mode=True, data_prop=True)
        forward = Evaluator(symbolic, backends=(forward_backend,))(feeds)
    except Exception as error:  # noqa: BLE001 - onnx's inference or the runtime refuses it
        return dict.fromkeys(wrt, SymbolicCheck("needs-static", f"{NEEDS_STATIC}: {describe(error)}"))
    for out, want in zip(forward, outputs):
        differs = same_values(out, want, *tolerance(np.asarray(want))) if np.asarray(want).dtype.kind == "f" else (
            "" if np.array_equal(out, want) else "integer outputs differ")
        if differs:
            return dict.fromkeys(wrt, SymbolicCheck("needs-static", f"{NEEDS_STATIC}: the symbolic forward "
                                                    f"model computes other outputs ({differs})"))
    checks = _backward(symbolic, feeds, static_ad, wrt, build, run, tolerance, describe)
    if len(wrt) > 1 and any(c.outcome == "fail" for c in checks.values()):
        checks = {x: _backward(symbolic, feeds, static_ad, [x], build, run, tolerance, describe)[x] for x in wrt}
    return checks


def _backward(symbolic, feeds, static_ad, wrt, build, run, tolerance, describe) -> dict[str, SymbolicCheck]:
    """The symbolic backward graph for ``wrt``: built, checked, run and compared with the static VJPs."""
    try:
        proto, names, seed = build(symbolic, wrt)
        onnx.checker.check_model(proto, full_check=True)
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
        results, runtime = run(proto, {**feeds, **seed})
    except Exception as error:  # noqa: BLE001 - the rules' graph on symbolic inputs is what is judged
        return dict.fromkeys(wrt, SymbolicCheck("fail", f"symbolic dimensions: {describe(error)}"))
    named = dict(zip((o.name for o in proto.graph.output), results))
    checks = {}
    for x in wrt:
        want = np.asarray(static_ad[x])
        differs = same_values(named[names[x]], want, *tolerance(want))
        checks[x] = SymbolicCheck("fail", f"symbolic dimensions: the VJP differs from the static one ({differs}; "
                                  f"run on {runtime})") if differs else SymbolicCheck("pass")
    return checks
