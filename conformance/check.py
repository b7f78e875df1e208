"""Gradient checks: the backward graph built by the pass, run on onnxruntime, against the oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from onnx_autodiff.conformance.oracle import Evaluator, fd_vjp, random_cotangents
from onnx_autodiff.passes.autodiff import AutodiffPass
from onnx_autodiff.rules import GradRegistry

LOSS = "onnx_autodiff_check_loss"


def scalarize(model: onnx.ModelProto, cotangents: Sequence[np.ndarray | None]) -> onnx.ModelProto:
    """A copy of ``model`` whose only output is Σ_k ⟨out_k, r_k⟩ over the float outputs."""
    scalar = onnx.ModelProto()
    scalar.CopyFrom(model)
    graph = scalar.graph
    terms = []
    for k, (out, r) in enumerate(zip(model.graph.output, cotangents)):
        if r is None:
            continue
        names = [f"{LOSS}_r{k}", f"{LOSS}_m{k}", f"{LOSS}_s{k}"]
        graph.node.extend(
            [
                helper.make_node("Constant", [], [names[0]], value=numpy_helper.from_array(r)),
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


def backward_model(
    model: onnx.ModelProto,
    of: str,
    wrt: Sequence[str],
    registry: GradRegistry | None = None,
    seed: str = "auto",
) -> tuple[onnx.ModelProto, AutodiffPass]:
    """The model with gradient outputs appended, checked with ``full_check=True``."""
    autodiff = AutodiffPass(of=of, wrt=list(wrt), registry=registry, seed=seed)
    result = autodiff(ir.from_proto(model))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, autodiff


def ad_vjp(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    cotangents: Sequence[np.ndarray | None],
    registry: GradRegistry | None = None,
) -> dict[str, np.ndarray]:
    """The VJP Σ_k r_k·∂out_k/∂x computed by the generated backward graph on onnxruntime."""
    floats = [i for i, r in enumerate(cotangents) if r is not None]
    if len(floats) == 1:
        of = model.graph.output[floats[0]].name
        proto, autodiff = backward_model(model, of, wrt, registry, seed="input")
        extra = {autodiff.seed_name: cotangents[floats[0]]}
    else:
        proto, autodiff = backward_model(scalarize(model, cotangents), LOSS, wrt, registry)
        extra = {}
    outputs = [o.name for o in proto.graph.output]
    results = Evaluator(proto)({**feeds, **extra})
    named = dict(zip(outputs, results))
    return {x: named[autodiff.gradient_names[x]] for x in wrt}


@dataclasses.dataclass
class GradCheck:
    """Per-variable comparison of AD against finite differences."""

    ad: dict[str, np.ndarray]
    fd: dict[str, np.ndarray]
    errors: dict[str, float]
    ok: bool

    def __str__(self) -> str:
        lines = [f"{name}: worst scaled error {err:.3g}" for name, err in self.errors.items()]
        return ("ok\n" if self.ok else "MISMATCH\n") + "\n".join(lines)


def compare(ad: np.ndarray, fd: np.ndarray, atol: float, rtol: float) -> float:
    """Worst ratio |ad − fd| / (atol·S + rtol·|fd|), S = max(1, ‖fd‖∞); ≤ 1 passes."""
    if ad.shape != fd.shape:
        return float("inf")
    scale = max(1.0, float(np.max(np.abs(fd))) if fd.size else 1.0)
    bound = atol * scale + rtol * np.abs(fd)
    diff = np.abs(ad.astype(np.float64) - fd)
    if not np.all(np.isfinite(diff)):
        return float("inf")
    return float(np.max(diff / bound)) if diff.size else 0.0


def check_vjp(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    *,
    registry: GradRegistry | None = None,
    seed: int = 0,
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> GradCheck:
    """Build the backward graph, run it on onnxruntime, compare with float64 finite differences."""
    cotangents = random_cotangents(model, feeds, seed)
    ad = ad_vjp(model, feeds, wrt, cotangents, registry)
    fd = fd_vjp(model, feeds, wrt, cotangents)
    errors = {x: compare(ad[x], fd[x], atol, rtol) for x in wrt}
    return GradCheck(ad, fd, errors, all(e <= 1.0 for e in errors.values()))
