"""The command line of ``onnx-autodiff conformance`` (also ``python -m onnx_autodiff.conformance.runner``):
its options, the progress line, the printed summary, and the references and reports it writes."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from onnx_autodiff.conformance.cases import MODEL_SUITES, Case, UsageError, load_model_cases, load_node_cases, select_cases
from onnx_autodiff.conformance.judge import DEFAULT_BUDGET, MAX_COORDS, STATUSES, Result, one_line
from onnx_autodiff.conformance.order2 import order2_verdicts
from onnx_autodiff.conformance.references import DEFAULT_REFERENCES, ORACLE_REVISION, References
from onnx_autodiff.conformance.report import (
    SHORT,
    case_status,
    eligible_line,
    fmt_error,
    format_table,
    report_base,
    summarize,
    symbolic_line,
    totals,
    versions,
    write_reports,
)
from onnx_autodiff.conformance.sweep import run_cases

PROG = "onnx-autodiff conformance"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``onnx-autodiff conformance`` to ``parser``."""
    parser.add_argument("--op", nargs="+", action="extend", default=[], metavar="OP",
                        help="only cases of these op types (or model suites: pytorch-converted, pytorch-operator)")
    parser.add_argument("--case", nargs="+", action="extend", default=[], metavar="NAME",
                        help="only these cases (e.g. test_add_bcast, pytorch-converted/test_Linear)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument("--report", metavar="PATH", help="write PATH.md and PATH.json")
    parser.add_argument("--limit", type=int, metavar="N", help="at most N cases (after filtering)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, metavar="SECONDS",
                        help=f"finite-difference time budget per case (default {DEFAULT_BUDGET:g})")
    parser.add_argument("--no-models", action="store_true",
                        help="skip the pytorch-converted/pytorch-operator models")
    parser.add_argument("--refresh-cache", action="store_true", help="collect the backend test cases again")
    parser.add_argument("--order", type=int, choices=(1, 2), default=1,
                        help="2: differentiate each single-node case's first-order graph again and check it "
                             "against finite differences of that graph (per-op verdict: twice differentiable)")
    parser.add_argument("--no-symbolic", action="store_true",
                        help="skip the re-check of each judged case with symbolic input dimensions "
                             "(its backward graph must give the static VJP)")
    parser.add_argument("--references", nargs="?", const=str(DEFAULT_REFERENCES), metavar="FILE",
                        help="compare with the oracle answers stored in FILE (default: the packaged "
                             "conformance/references/oracle.npz) instead of running finite differences; "
                             "cases missing from FILE use the live oracle and are listed")
    parser.add_argument("--save-references", metavar="FILE",
                        help="run the live oracle on every candidate input and store its answers in FILE "
                             "(.npz; entries of other cases, onnx versions or seeds already in FILE are kept)")


def run(args: argparse.Namespace, registry=None) -> int:
    """Run ``onnx-autodiff conformance``: 0 all registered rules pass, 1 a rule fails (on static or
    symbolic dimensions), 2 bad usage.

    ``args`` comes from a parser set up by :func:`add_arguments`; ``registry`` defaults to the
    shipped one.
    """
    try:
        _check_numbers(args)
        if args.report:
            _check_report_path(args.report)
        references, save = _reference_options(args)
        started = time.perf_counter()
        selected = _selected_cases(args)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    budget = getattr(args, "budget", DEFAULT_BUDGET)
    order = getattr(args, "order", 1)
    results = run_cases(selected, registry, jobs=args.jobs, budget=budget, progress=_Progress(),
                        references=references, save=save, order=order,
                        symbolic=not getattr(args, "no_symbolic", False))
    wall = time.perf_counter() - started
    verdicts = order2_verdicts(results) if order == 2 else None
    _print_summary(results, verdicts)
    print(f"wall time {wall:.1f} s ({args.jobs} job(s), {len(selected)} selected cases)")
    if references is not None:
        _print_sources(results, args.references)
    if save is not None and not _save_references(save, args.save_references, budget):
        return 2
    if args.report:
        meta = {"wall_seconds": wall, "jobs": args.jobs, "budget": budget, "selected_cases": len(selected), "order": order,
                "symbolic": not getattr(args, "no_symbolic", False),
                "filters": {"op": list(args.op), "case": list(args.case), "limit": args.limit}}
        if not _write_report(args.report, results, meta, verdicts):
            return 2
    return 1 if any(r.status in ("fail", "error") or r.symbolic == "fail" for r in results) else 0


def _check_report_path(path: str) -> None:
    base = report_base(path)
    directory = base.parent if str(base.parent) else Path(".")
    if not directory.is_dir():
        raise UsageError(f"cannot write the report: directory '{directory}' does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"cannot write the report: directory '{directory}' is not writable")
    for suffix in (".md", ".json"):
        target = base.with_name(base.name + suffix)
        if target.is_dir() or (target.exists() and not os.access(target, os.W_OK)):
            raise UsageError(f"cannot write the report: '{target}' is not a writable file")


class _Progress:
    def __init__(self, stream=None) -> None:
        self.stream = sys.stderr if stream is None else stream  # the stream of the time it runs
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self.counts = {s: 0 for s in STATUSES}
        self.symbolic_failures = 0
        self.last = 0.0

    def __call__(self, done: int, total: int, results: list[Result]) -> None:
        if results:
            self.counts[case_status(results)] += 1
            self.symbolic_failures += any(r.symbolic == "fail" for r in results)
        now = time.perf_counter()
        if not (self.tty and now - self.last > 0.2) and not (done == total or done % 50 == 0):
            return
        self.last = now
        counts = " ".join(f"{SHORT.get(s, s)} {n}" for s, n in self.counts.items() if n)
        if self.symbolic_failures:
            counts += f" symbolic-fail {self.symbolic_failures}"
        name = results[0].case if results else ""
        line = f"[{done}/{total}] {now - self.started:.0f}s {counts} {name}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:160])
            if done == total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _reference_options(args: argparse.Namespace) -> tuple[References | None, References | None]:
    """(references to compare with, references to fill) from --references / --save-references."""
    load, save = getattr(args, "references", None), getattr(args, "save_references", None)
    if load and save:
        raise UsageError("use either --references or --save-references, not both")
    references = None
    if load:
        if not Path(load).is_file():
            raise UsageError(f"cannot read the references: '{load}' does not exist")
        try:
            references = References.load(load)
        except Exception as error:  # noqa: BLE001 - a corrupt file is a usage problem
            raise UsageError(f"cannot read the references '{load}': {one_line(error)}") from None
    target = None
    if save:
        directory = Path(save).parent
        if not directory.is_dir():
            raise UsageError(f"cannot write the references: directory '{directory}' does not exist")
        target = References()
        if Path(save).is_file():
            try:
                target = References.load(save)
            except Exception as error:  # noqa: BLE001
                raise UsageError(f"cannot update the references '{save}': {one_line(error)}") from None
    return references, target


def _check_numbers(args: argparse.Namespace) -> None:
    """UsageError unless --jobs and --limit are at least 1 and --budget is positive."""
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, not {args.limit}")
    if getattr(args, "budget", DEFAULT_BUDGET) <= 0:
        raise UsageError(f"--budget must be positive, not {args.budget}")


def _selected_cases(args: argparse.Namespace) -> list[Case]:
    """The cases the options select: backend node cases, the model suites unless the filters
    exclude them, single-node cases only for ``--order 2``."""
    cases = load_node_cases(refresh=getattr(args, "refresh_cache", False))
    node_names = {c.name for c in cases}
    if (
        not getattr(args, "no_models", False)
        and (not args.op or any(op in MODEL_SUITES for op in args.op))
        and (not args.case or any(name not in node_names for name in args.case))
    ):
        cases += load_model_cases()
    if getattr(args, "order", 1) == 2:  # the op's own rule twice: single-node cases (expanded bodies and models are order-1 matters)
        cases = [c for c in cases if c.kind == "node" or c.name in args.case]
    return select_cases(cases, args.op, args.case, args.limit)


def _print_summary(results: Sequence[Result], verdicts: Sequence[dict] | None) -> None:
    """The per-op table, the totals, every fail and error, and the second-order verdicts."""
    summary = totals(results)
    print(format_table(summarize(results)))
    print()
    print(f"{summary['case_count']} cases: " + ", ".join(f"{s} {n}" for s, n in summary["cases"].items() if n))
    print(eligible_line(summary))
    print(f"{summary['check_count']} checks: " + ", ".join(f"{s} {n}" for s, n in summary["checks"].items() if n))
    if any(r.symbolic for r in results):
        print(symbolic_line(summary))
    for r in results:
        if r.status in ("fail", "error"):
            print(f"{r.status}: {r.case} [{r.input}] {fmt_error(r.error) if r.error is not None else ''} {r.message}".rstrip())
        if r.symbolic == "fail":
            print(f"symbolic fail: {r.case} [{r.input}] {r.symbolic_message}")
    if verdicts is None:
        return
    counts = {}
    for v in verdicts:
        counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
    print("second order, op types: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    for v in verdicts:
        if v["verdict"] not in ("yes", "not differentiable"):
            print(f"  {v['op']}: {v['verdict']}: " + "; ".join(v["reasons"][:2]))


def _print_sources(results: Sequence[Result], path: str) -> None:
    """How many checks the stored references answered, and which ran the live oracle."""
    live = [r for r in results if r.source.startswith("live")]
    stored = sum(r.source == "stored" for r in results)
    print(f"references {path}: {stored} checks from stored values, {len(live)} with the live oracle")
    for r in live:
        print(f"  {r.source}: {r.case} [{r.input}]")


def _save_references(save: References, target: str, budget: float) -> bool:
    """Write the references filled by the sweep; False (after one error line) when that fails."""
    save.meta.update(versions=versions(), budget=budget, max_coords=MAX_COORDS, oracle_revision=ORACLE_REVISION)
    try:
        path = save.save(target)
    except OSError as error:
        print(f"{PROG}: error: cannot write the references: {error}", file=sys.stderr)
        return False
    print(f"references: {len(save)} entries in {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return True


def _write_report(target: str, results: Sequence[Result], meta: dict, verdicts) -> bool:
    """Write PATH.md and PATH.json; False (after one error line) when that fails."""
    try:
        md_path, json_path = write_reports(target, results, meta, verdicts)
    except OSError as error:
        print(f"{PROG}: error: cannot write the report: {error}", file=sys.stderr)
        return False
    print(f"report: {md_path}, {json_path}")
    return True
