"""Running many cases, in worker processes when asked: results in case order, stored references
collected from the workers."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from onnx_autodiff.conformance.cases import Case
from onnx_autodiff.conformance.judge import DEFAULT_BUDGET, Result, one_line, run_case
from onnx_autodiff.conformance.order2 import run_case_order2
from onnx_autodiff.conformance.references import References

_WORKER: dict = {}  # the sweep's cases and options, inherited by forked workers


def _work(index: int) -> tuple[list[Result], dict]:
    state = _WORKER
    case = state["cases"][index]
    record = {} if state.get("record") else None
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            options = {"references": state.get("references"), "record": record}
            if state.get("order", 1) == 2:
                check = run_case_order2
            else:
                check, options["symbolic"] = run_case, state["symbolic"](case)
            results = check(case, state["registry"], state["budget"], state.get("seed", 0), **options)
            return results, record or {}
    except Exception as error:  # noqa: BLE001 - one broken case must not stop the sweep
        return [Result(case.name, case.op, case.kind, "*", "error", message=one_line(error))], {}


def _quiet_onnxruntime() -> None:
    """Keep the progress line readable: no runtime or serializer chatter on stderr."""
    import logging

    logging.getLogger("onnx_ir").setLevel(logging.ERROR)
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)
    except Exception:  # noqa: BLE001
        pass


def run_cases(
    cases: Sequence[Case],
    registry=None,
    *,
    jobs: int = 1,
    budget: float = DEFAULT_BUDGET,
    progress: Callable[[int, int, list[Result]], None] | None = None,
    references: References | None = None,
    save: References | None = None,
    seed: int = 0,
    order: int = 1,
    symbolic: bool | Callable[[Case], bool] = True,
) -> list[Result]:
    """Run :func:`run_case` over ``cases`` (in ``jobs`` processes); results in case order.

    ``progress(done, total, results_of_that_case)`` is called after each case. ``references``:
    compare with stored oracle answers where they exist; ``save``: run the live oracle on every
    candidate input and put its answers into that :class:`References`. ``symbolic``: re-check the
    judged inputs on symbolic dimensions (first order), in every case or where ``symbolic(case)``.
    """
    from onnx_autodiff.rules import default_registry

    _quiet_onnxruntime()
    _WORKER.update(cases=list(cases), registry=registry if registry is not None else default_registry(), budget=budget,
                   references=references, record=save is not None, seed=seed, order=order,
                   symbolic=symbolic if callable(symbolic) else (lambda case: symbolic))
    by_index: dict[int, list[Result]] = {}

    def done(i: int, outcome: tuple[list[Result], dict]) -> None:
        by_index[i], recorded = outcome
        if save is not None:
            for name, entry in recorded.items():
                save.put(name, entry, seed)
        if progress:
            progress(len(by_index), len(cases), by_index[i])

    try:
        if jobs <= 1 or len(cases) <= 1:
            for i in range(len(cases)):
                done(i, _work(i))
        else:
            import multiprocessing

            os.environ.setdefault("OMP_NUM_THREADS", "1")
            context = multiprocessing.get_context("fork")  # workers inherit cases and registry
            with context.Pool(jobs, initializer=_quiet_onnxruntime) as pool:
                order = sorted(range(len(cases)), key=lambda i: -len(cases[i].model))
                for i, outcome in zip(order, pool.imap(_work, order, chunksize=1)):
                    done(i, outcome)
    finally:
        _WORKER.clear()
    return [r for i in range(len(cases)) for r in by_index[i]]
