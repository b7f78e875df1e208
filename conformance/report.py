"""Summaries and reports: a case's status from its inputs', per-op rows and totals, the text table
printed by the command line, and the Markdown and JSON reports (``--report PATH``)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from onnx_autodiff.conformance.judge import STATUSES, Result
from onnx_autodiff.conformance.symbolic import NEEDS_STATIC, SYMBOLIC_OUTCOMES
from onnx_autodiff.files import write_atomically

_CASE_PRECEDENCE = ("error", "fail", "no-rule", "refused", "pass", "oracle-skip", "not-differentiable")
"""A case's status is the first of these among its inputs' statuses."""

_COLUMNS = ("pass", "fail", "no-rule", "not-differentiable", "refused", "oracle-skip", "error")
SHORT = {"not-differentiable": "not-diff", "oracle-skip": "skip", "needs-static": "static"}
"""Short status names for narrow columns."""
_PROBLEMS = ("fail", "error", "refused", "no-rule")


def case_status(results: Sequence[Result]) -> str:
    """The status of a case from its inputs' statuses (see _CASE_PRECEDENCE)."""
    statuses = {r.status for r in results}
    return next(s for s in _CASE_PRECEDENCE if s in statuses)


def case_symbolic(results: Sequence[Result]) -> str:
    """A case's outcome on symbolic dimensions: "fail" if an input's is, else "needs-static" if an
    input's is, else "pass" if an input's is; "" when no input was re-checked."""
    outcomes = {r.symbolic for r in results}
    return next((o for o in ("fail", "needs-static", "pass") if o in outcomes), "")


def summarize(results: Sequence[Result]) -> list[dict]:
    """One row per op type: cases per status (each case counted once), cases per outcome on
    symbolic dimensions (``symbolic_pass``, ...) and the worst error."""
    by_case: dict[str, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    rows: dict[str, dict] = {}
    for case_results in by_case.values():
        op = case_results[0].op
        row = rows.setdefault(op, {"op": op, "cases": 0, **{s: 0 for s in STATUSES}, "constants": 0,
                                   **{_symbolic_key(o): 0 for o in SYMBOLIC_OUTCOMES}, "worst_error": None})
        row["cases"] += 1
        if case_symbolic(case_results):
            row[_symbolic_key(case_symbolic(case_results))] += 1
        row[case_status(case_results)] += 1
        row["constants"] += case_status(case_results) == "pass" and any(r.constants or r.defaults for r in case_results)
        for r in case_results:
            if r.error is not None and math.isfinite(r.error):
                row["worst_error"] = max(row["worst_error"] or 0.0, r.error)
            elif r.error is not None:
                row["worst_error"] = float("inf")
    return [rows[op] for op in sorted(rows)]


def _symbolic_key(outcome: str) -> str:
    return "symbolic_" + outcome.replace("-", "_")


def totals(results: Sequence[Result]) -> dict:
    """Cases and checks per status; ``eligible`` cases (all but not-differentiable), the percent
    of them that pass, ``constants``: passing cases whose backward graph needed run-time inputs
    fed as constants, and ``defaults``: passing cases whose model needed its default attributes
    written out to pass onnx.checker; ``symbolic``: cases per outcome on symbolic dimensions."""
    by_case: dict[str, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    cases = {s: 0 for s in STATUSES}
    checks = {s: 0 for s in STATUSES}
    constants = defaults = 0
    symbolic = dict.fromkeys(SYMBOLIC_OUTCOMES, 0)
    for case_results in by_case.values():
        status = case_status(case_results)
        cases[status] += 1
        if case_symbolic(case_results):
            symbolic[case_symbolic(case_results)] += 1
        constants += status == "pass" and any(r.constants for r in case_results)
        defaults += status == "pass" and any(r.defaults for r in case_results)
    for r in results:
        checks[r.status] += 1
    eligible = len(by_case) - cases["not-differentiable"]
    return {"cases": cases, "checks": checks, "case_count": len(by_case), "check_count": len(results),
            "eligible": eligible, "constants": constants, "defaults": defaults, "symbolic": symbolic,
            "pass_percent": round(100 * cases["pass"] / eligible, 2) if eligible else 0.0}


def eligible_line(summary: Mapping) -> str:
    """One line: eligible cases (all but not-differentiable), how many pass (how many of those with
    run-time inputs fed as constants) and the percent."""
    parts = [f"{summary['constants']} with run-time inputs fed as constants" if summary["constants"] else "",
             f"{summary['defaults']} with default attributes written out" if summary.get("defaults") else ""]
    fed = f" ({', '.join(p for p in parts if p)})" if any(parts) else ""
    return (f"{summary['eligible']} eligible cases (all but not-differentiable): pass {summary['cases']['pass']}"
            f"{fed} = {summary['pass_percent']:.1f}%")


def symbolic_line(summary: Mapping) -> str:
    """One line: the cases re-checked on symbolic dimensions and how many pass, fail and cannot run
    their forward model so."""
    counts = summary.get("symbolic") or dict.fromkeys(SYMBOLIC_OUTCOMES, 0)
    return (f"symbolic dimensions, {sum(counts.values())} cases re-checked: pass {counts['pass']}, "
            f"fail {counts['fail']}, {NEEDS_STATIC} {counts['needs-static']}")


def fmt_error(value) -> str:
    """An error ratio as printed: three significant digits, "inf", or "-" when there is none."""
    if value is None:
        return "-"
    return "inf" if not math.isfinite(value) else f"{value:.3g}"


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The per-op summary as aligned text, or as a Markdown table. Column ``pass*``: passing
    cases checked exporter-style, run-time inputs fed as constants or default attributes written
    out (counted in ``pass`` too). Columns ``sym ...``: cases per outcome on symbolic dimensions."""
    header = ["op", "cases", *(SHORT.get(c, c) for c in _COLUMNS), "pass*",
              *(f"sym {SHORT.get(o, o)}" for o in SYMBOLIC_OUTCOMES), "worst error"]
    body = [[r["op"], str(r["cases"]), *(str(r[c]) for c in _COLUMNS), str(r.get("constants", 0)),
             *(str(r.get(_symbolic_key(o), 0)) for o in SYMBOLIC_OUTCOMES), fmt_error(r["worst_error"])] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in column) for column in zip(header, *body)]
    fmt = lambda row: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])


def versions() -> dict:
    """The versions of the libraries that decide the results."""
    import onnx_ir
    import onnxruntime

    import onnx_autodiff

    return {
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx_ir": onnx_ir.__version__,
        "numpy": np.__version__,
        "onnx_autodiff": getattr(onnx_autodiff, "__version__", "?"),
    }


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return value


def write_reports(path: str | Path, results: Sequence[Result], meta: Mapping, verdicts=None) -> tuple[Path, Path]:
    """Write PATH.md and PATH.json (atomically); returns both paths. ``verdicts`` (from
    :func:`~onnx_autodiff.conformance.order2.order2_verdicts`) adds the second-order section."""
    base = report_base(path)
    rows = summarize(results)
    summary = totals(results)
    document = {
        **meta,
        "versions": versions(),
        "statuses": list(STATUSES),
        "totals": summary,
        "ops": [{k: _jsonable(v) for k, v in row.items()} for row in rows],
        "results": [{k: _jsonable(v) for k, v in dataclasses.asdict(r).items()} for r in results],
    }
    if verdicts is not None:
        document["second_order"] = verdicts
    md = _header(document["versions"], rows, summary, meta, second_order=verdicts is not None)
    if verdicts is not None:
        md += _second_order_section(verdicts)
    md += (_problems_section(results) + _exporter_style_section(results) + _needs_static_section(results)
           + _skips_section(results))
    md_path, json_path = base.with_name(base.name + ".md"), base.with_name(base.name + ".json")
    write_atomically(md_path, "\n".join(md).encode())
    write_atomically(json_path, (json.dumps(document, indent=1, default=str) + "\n").encode())
    return md_path, json_path


_INTRO = ("Gradients of the backward graphs (onnxruntime) against float64 finite differences on the "
          "ONNX backend test data. Tolerance: |ad − fd| ≤ atol·max(1, ‖fd‖∞) + rtol·|fd| "
          "(float32: 1e-4, 1e-3; float64: 1e-6, 1e-5; float16: 1e-2, 1e-2; weak oracle: 3e-2); "
          "worst error is that ratio (≤ 1 passes). Cases are counted once, by their worst input.")
_SECOND_ORDER_INTRO = ("Per single-node case and input x: the first-order graph (VJP for x with seed dy = r) "
                       "differentiated again with respect to x, against finite differences of that graph. "
                       "Same tolerances as the first-order report. " + _INTRO.split(". ", 1)[1])


def _header(installed: Mapping, rows: Sequence[dict], summary: Mapping, meta: Mapping, second_order: bool) -> list[str]:
    """The report's title, method, versions, totals and per-op table."""
    return [
        "# onnx-autodiff second-order conformance report" if second_order else "# onnx-autodiff conformance report",
        "",
        _SECOND_ORDER_INTRO if second_order else _INTRO,
        "",
        ", ".join(f"{k} {v}" for k, v in installed.items()),
        f"wall time {meta.get('wall_seconds', 0):.1f} s with {meta.get('jobs', 1)} job(s)",
        "",
        f"**{eligible_line(summary)}**",
        "",
        f"**{symbolic_line(summary)}**",
        "",
        f"**{summary['case_count']} cases**: "
        + ", ".join(f"{s} {n}" for s, n in summary["cases"].items() if n),
        "",
        f"**{summary['check_count']} checks** (case × input): "
        + ", ".join(f"{s} {n}" for s, n in summary["checks"].items() if n),
        "",
        format_table(rows, markdown=True),
        "",
        "Column pass*: passing cases checked exporter-style (counted in pass, listed below and "
        "marked ⚑): first refused because an input the rule needs as a constant (Resize scales, "
        "Slice axes, ...) is fed at run time in the backend data, they ran with those inputs (every "
        "input not checked) as initializers; or onnx.checker rejected the model until the schema's "
        "default attributes were written out (onnx's shape inference reads other defaults).",
        "",
        "Columns sym pass / sym fail / sym static: each case whose inputs passed or failed is re-checked "
        "with every graph-input dimension a distinct name (value shapes inferred again): its backward "
        "graph must pass onnx.checker (full check) and strict shape inference, run, and give the static "
        f"VJP within the same tolerance; \"{NEEDS_STATIC}\" (static): onnx's inference or the runtime "
        "refuses the symbolic forward model, or it computes other outputs.",
        "",
    ]


def _second_order_section(verdicts: Sequence[dict]) -> list[str]:
    """Twice differentiable? The tally of verdicts and a row per op type that is not."""
    tally: dict[str, list[str]] = {}
    for v in verdicts:
        tally.setdefault(v["verdict"], []).append(v["op"])
    md = ["## Twice differentiable?", "",
          "yes: every check passes (or has no trustworthy reference) and one at least passes; "
          "no: a check fails, errs, or a rule is missing or refuses inside the backward template; "
          "no first order: the first-order graph itself cannot be built.", "",
          ", ".join(f"**{k}** {len(ops)}" for k, ops in sorted(tally.items())), "",
          f"Twice differentiable ({len(tally.get('yes', []))}): " + ", ".join(tally.get("yes", [])), "",
          "| op | verdict | checks | pass | reasons |", "|---|---|---:|---:|---|"]
    md += [f"| {v['op']} | {v['verdict']} | {v['checks']} | {v['pass']} | {'; '.join(v['reasons'][:4]).replace('|', '/')} |"
           for v in verdicts if v["verdict"] != "yes"]
    return md + [""]


def _problems_section(results: Sequence[Result]) -> list[str]:
    problems = [r for r in results if r.status in _PROBLEMS or r.symbolic == "fail"]
    if not problems:
        return []
    md = ["## Failures, errors, refusals and missing rules", ""]
    for r in problems:
        fed = " ⚑" if r.constants or r.defaults else ""
        if r.status in _PROBLEMS:
            error = f" (error {fmt_error(r.error)})" if r.error is not None else ""
            md.append(f"- **{r.status}**{fed} `{r.case}` input `{r.input}`{error}: {r.message}".rstrip(": "))
        if r.symbolic == "fail":
            md.append(f"- **symbolic fail**{fed} `{r.case}` input `{r.input}`: {r.symbolic_message}")
    return md + [""]


def _needs_static_section(results: Sequence[Result]) -> list[str]:
    """One line per case whose forward model cannot run on symbolic dimensions, and why."""
    seen = {}
    for r in results:
        if r.symbolic == "needs-static":
            seen.setdefault(r.case, r.symbolic_message)
    if not seen:
        return []
    return ([f"## Symbolic dimensions: {NEEDS_STATIC}", ""]
            + [f"- `{case}`: {message.removeprefix(NEEDS_STATIC + ': ')}" for case, message in seen.items()] + [""])


def _exporter_style_section(results: Sequence[Result]) -> list[str]:
    fed = [r for r in results if (r.constants or r.defaults) and r.status not in _PROBLEMS]
    if not fed:
        return []
    md = ["## ⚑ Checked exporter-style", "",
          "Run-time inputs fed as constants (the first attempt, with the inputs as in the backend "
          "data, was refused) and default attributes written out.", ""]
    md += [f"- **{r.status}** ⚑ `{r.case}` input `{r.input}`: "
           + "; ".join(p for p in (", ".join(r.constants), ", ".join(f"@{d}" for d in r.defaults)) if p)
           + (f" ({r.message})" if r.message else "") for r in fed]
    return md + [""]


def _skips_section(results: Sequence[Result]) -> list[str]:
    skips = [r for r in results if r.status == "oracle-skip"]
    if not skips:
        return []
    return ["## Oracle skips", ""] + [f"- `{r.case}` input `{r.input}`: {r.message}" for r in skips] + [""]


def report_base(path: str | Path) -> Path:
    """PATH without a .md or .json suffix: the reports are PATH.md and PATH.json."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".md", ".json") else path
