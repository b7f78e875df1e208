"""check_grads: a model's first and second derivatives against finite differences (gradcheck/gradgradcheck)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from onnx_autodiff.conformance.check import GradCheck, check_vjp
from onnx_autodiff.conformance.widening import FLOAT_ELEM_TYPES
from onnx_autodiff.errors import UnknownValueError
from onnx_autodiff.modelfile import from_proto, to_proto
from onnx_autodiff.passes.autodiff import AutodiffPass


@dataclasses.dataclass
class GradReport:
    """One GradCheck per order checked; ``ok`` when every order passed."""

    of: str
    wrt: list[str]
    checks: dict[int, GradCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks.values())

    def __str__(self) -> str:
        lines = []
        for order, check in self.checks.items():
            lines.append(f"order {order} of '{self.of}':")
            lines += [f"  {line}" for line in str(check).splitlines()]
        lines.append("ok" if self.ok else "FAILED")
        return "\n".join(lines)


def _only_output(model: onnx.ModelProto, of: str) -> onnx.ModelProto:
    single = onnx.ModelProto()
    single.CopyFrom(model)
    outputs = [o for o in model.graph.output if o.name == of]
    if not outputs:
        outputs = [helper.make_value_info(of, onnx.TypeProto())]
        for info in model.graph.value_info:
            if info.name == of:
                outputs = [info]
    del single.graph.output[:]
    single.graph.output.extend(outputs)
    return single


def random_feeds(model: onnx.ModelProto, seed: int = 0, batch: int = 2) -> dict[str, np.ndarray]:
    """Standard-normal float inputs (symbolic dims set to ``batch``); other types must be given."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        if tensor.elem_type not in FLOAT_ELEM_TYPES:
            raise UnknownValueError(
                f"input '{value.name}' is not floating point: pass its value (feeds= or --inputs FILE.npz)"
            )
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def check_grads(
    model: onnx.ModelProto | str,
    of: str | None = None,
    wrt: Sequence[str] | None = None,
    order: int = 1,
    feeds: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> GradReport:
    """Check ∂of/∂wrt (order 1) and the derivative of that gradient (order 2) numerically.

    ``wrt`` defaults to the float initializers, or the float graph inputs when there are none.
    Order 2 differentiates the first-order graph (seeded by a random ``dy``) and compares it with
    finite differences of that graph: every rule on the path must be twice differentiable.
    """
    if isinstance(model, str):
        model = onnx.load(model)
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, not {order}")
    of = of or _single_output(model)
    feeds = dict(feeds) if feeds is not None else random_feeds(model, seed)
    if wrt is None:
        wrt = [t.name for t in model.graph.initializer if t.data_type in FLOAT_ELEM_TYPES]
        wrt = wrt or [k for k, v in feeds.items() if np.asarray(v).dtype.kind == "f"]
    wrt = list(wrt)
    single = _only_output(model, of)
    checks = {1: check_vjp(single, feeds, wrt, seed=seed, atol=atol, rtol=rtol)}
    if order == 2:
        autodiff = AutodiffPass(of=of, wrt=wrt, seed="input")
        first = to_proto(autodiff(from_proto(single)).model)
        grads = set(autodiff.gradient_names.values())
        kept = [o for o in first.graph.output if o.name in grads]
        del first.graph.output[:]
        first.graph.output.extend(kept)
        rng = np.random.default_rng(seed + 1)
        y = _evaluate_of(single, feeds)
        feeds2 = {**feeds, autodiff.seed_name: rng.standard_normal(y.shape).astype(y.dtype)}
        checks[2] = check_vjp(first, feeds2, wrt, seed=seed, atol=atol, rtol=rtol)
    return GradReport(of, wrt, checks)


def _evaluate_of(model: onnx.ModelProto, feeds) -> np.ndarray:
    from onnx_autodiff.conformance.oracle import Evaluator

    return np.asarray(Evaluator(model)(feeds)[0])


def _single_output(model: onnx.ModelProto) -> str:
    if len(model.graph.output) != 1:
        raise UnknownValueError(
            f"the model has {len(model.graph.output)} outputs: name the one to check (of=...)"
        )
    return model.graph.output[0].name
