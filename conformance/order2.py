"""Second order (``--order 2``): each single-node case's first-order graph differentiated again with
respect to the same input and checked against finite differences of that graph, and the per-op
verdict "twice differentiable?"."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence

import numpy as np
import onnx

from onnx_autodiff.conformance.cases import CHECKED_ELEM_TYPES, Case, elem_type
from onnx_autodiff.conformance.judge import (
    DEFAULT_BUDGET,
    STATUSES,
    Result,
    backward_graph,
    classify,
    differentiable_inputs,
    one_line,
    run_case,
    training_dropout,
)
from onnx_autodiff.conformance.oracle import Evaluator, cotangents_for

ORDER2_PREFIX = "order2:"


def first_order_case(case: Case, x: str, registry=None, seed: int = 0) -> Case:
    """The case whose model computes the VJP for ``x`` (its only output) and whose check is with
    respect to ``x``: a second-order check of the rules. The seed ``dy`` is a graph input fed with
    the first-order cotangent r (or, for several float outputs, Σ⟨out_k, r_k⟩ is differentiated).
    Raises what the pass raises when the first-order graph cannot be built."""
    model = case.proto()
    feeds = dict(case.inputs)
    try:
        outputs = Evaluator(model, backends=("onnxruntime",))(feeds)
    except Exception:  # noqa: BLE001 - as in run_case: the reference evaluator runs what onnxruntime cannot
        outputs = Evaluator(model, backends=("reference",))(feeds)
    cotangents = cotangents_for(model, outputs, seed)
    proto, gradient_name, seed_feeds = backward_graph(model, x, cotangents, registry)
    feeds.update(seed_feeds)
    grad = next(o for o in proto.graph.output if o.name == gradient_name)
    kept = onnx.ValueInfoProto()
    kept.CopyFrom(grad)
    del proto.graph.output[:]
    proto.graph.output.append(kept)
    return Case(f"{ORDER2_PREFIX}{case.name}[{x}]", case.op, case.kind, proto.SerializeToString(), feeds, wrt=[x])


def run_case_order2(case: Case, registry=None, budget: float = DEFAULT_BUDGET, seed: int = 0, **options) -> list[Result]:
    """Second-order check of one case: for each input x checked at first order, the derivative of
    the first-order graph's VJP with respect to x (rules applied to the backward templates),
    against finite differences of that first-order graph. Results carry the original case name;
    a first-order graph that cannot be built gives that status with a "first order:" message."""
    from onnx_autodiff.rules import default_registry

    registry = registry if registry is not None else default_registry()
    started = time.perf_counter()
    model = case.proto()
    if any(not isinstance(v, np.ndarray) for v in case.inputs.values()):
        return []
    if not any(elem_type(o) in CHECKED_ELEM_TYPES for o in model.graph.output):
        return []
    if not any(elem_type(i) in CHECKED_ELEM_TYPES for i in model.graph.input) and case.kind != "model":
        return []
    status, wrt, message = differentiable_inputs(case, model, registry)
    if status:
        return [Result(case.name, case.op, case.kind, "*", status, message=f"first order: {message}")]
    try:  # as in run_case: no oracle for a model that fails the checker or is random
        onnx.checker.check_model(model, full_check=True)
        if training_dropout(model, case.inputs):
            raise ValueError("training-mode Dropout is random")
    except Exception as error:  # noqa: BLE001
        return [Result(case.name, case.op, case.kind, "*", "oracle-skip", message=f"first order: {one_line(error)}")]
    results = []
    for x in wrt:
        try:
            second = first_order_case(case, x, registry, seed)
        except Exception as error:  # noqa: BLE001 - the first-order graph is a prerequisite
            results.append(Result(case.name, case.op, case.kind, x, classify(error),
                                  message=f"first order: {one_line(error)}",
                                  seconds=time.perf_counter() - started))
            continue
        for r in run_case(second, registry, budget, seed, symbolic=False, **options):
            results.append(dataclasses.replace(r, case=case.name, input=x if r.input in ("*", x) else r.input))
    return results


def order2_verdicts(results: Sequence[Result]) -> list[dict]:
    """Per op type: whether its rule is twice differentiable on the backend cases (every check
    passes or has no trustworthy reference, at least one passes) and, if not, why."""
    by_op: dict[str, list[Result]] = {}
    for r in results:
        by_op.setdefault(r.op, []).append(r)
    verdicts = []
    for op, rs in sorted(by_op.items()):
        statuses = {r.status for r in rs}
        first = [r for r in rs if r.message.startswith("first order:") and r.status != "oracle-skip"]
        bad = [r for r in rs if r.status in ("fail", "error", "no-rule", "refused") and r not in first]
        if statuses <= {"not-differentiable"}:
            verdict = "not differentiable"
        elif first and len(first) == len(rs):
            verdict = "no first order"
        elif bad:
            verdict = "no"
        elif "pass" in statuses:
            verdict = "yes"
        else:
            verdict = "unchecked"
        reasons: dict[str, int] = {}
        for r in bad or (first if verdict == "no first order" else []) or ([r for r in rs if r.status == "oracle-skip"] if verdict == "unchecked" else []):
            reason = f"{r.status}: {_reason(r.message)}"
            reasons[reason] = reasons.get(reason, 0) + 1
        verdicts.append({"op": op, "verdict": verdict, "checks": len(rs),
                         **{s: sum(r.status == s for r in rs) for s in STATUSES},
                         "reasons": [f"{text} (×{n})" if n > 1 else text for text, n in reasons.items()]})
    return verdicts


def _reason(message: str) -> str:
    """A message without the run-specific parts (element indices, values, node numbers)."""
    def value(match: re.Match) -> str:
        ad = match.group(1).rstrip(",")
        return f"wrong value (AD {ad})" if ad in ("nan", "inf", "-inf") else "wrong value"

    text = re.sub(r"worst element \[[^\]]*\]: AD (\S+), FD .*", value, message)
    text = re.sub(r"(bwd_\w+?)_\d+", r"\1", text)
    return text[:240]

