"""CI gate: every eligible backend test case against the stored oracle references.

The finite differences of the whole sweep are stored in conformance/references/oracle.npz
(regenerate: ``python -m onnx_autodiff conformance --jobs 2 --save-references
conformance/references/oracle.npz``), so this test only builds and runs the backward graphs, each
judged case's also on symbolic input dimensions (about 30 s more CPU time; the symbolic VJP must
equal the static one).
A new ``fail`` or ``error`` breaks it, a new failure on symbolic dimensions too; so does an
allow-listed pair (or case) that no longer fails.
"""

import os
import warnings

import onnx
import pytest

from onnx_autodiff.conformance import runner

# (case, input) → why it is expected to fail. Remove an entry as soon as its case passes.
ALLOWED_FAILURES: dict[tuple[str, str], str] = {
    # Empty: every eligible case passes or is classified (refused, no-rule, oracle-skip with a
    # reason). Add an entry only with the reason and the rule that owns the failure.
}

# why → the cases whose re-check on symbolic dimensions fails (the static check passes): rules that
# refuse, or build an invalid graph, when the extents are unknown. Remove a case as soon as it passes.
_SYMBOLIC_GAPS: dict[str, list[str]] = {
    # Empty: every case whose forward takes symbolic dimensions passes on them.
}
ALLOWED_SYMBOLIC_FAILURES = {case: why for why, names in _SYMBOLIC_GAPS.items() for case in names}


@pytest.fixture(scope="module")
def sweep():
    references = runner.References.load(runner.DEFAULT_REFERENCES)
    if not any(version == onnx.__version__ for _, version, _ in references.entries):
        pytest.skip(f"{runner.DEFAULT_REFERENCES.name} holds no references for onnx {onnx.__version__}: "
                    "regenerate it (see onnx_autodiff.conformance.runner)")
    cases = runner.load_node_cases() + runner.load_model_cases()
    return runner.run_cases(cases, jobs=min(2, os.cpu_count() or 1), references=references)


def problems(results):
    return {(r.case, r.input): r for r in results if r.status in ("fail", "error")}


def symbolic_failures(results):
    return {r.case: r for r in results if r.symbolic == "fail"}


def test_no_new_failures_or_errors(sweep):
    assert len({r.case for r in sweep}) > 1300
    new = {key: r for key, r in problems(sweep).items() if key not in ALLOWED_FAILURES}
    listing = "\n".join(f"{r.status}: {r.case} [{r.input}] {r.message}" for r in new.values())
    assert not new, f"{len(new)} new failures or errors against the stored references:\n{listing}"


def test_allow_listed_failures_still_fail(sweep):
    failing = problems(sweep)
    fixed = sorted(key for key in ALLOWED_FAILURES if key not in failing)
    assert not fixed, (
        "these allow-listed (case, input) pairs no longer fail: remove them from ALLOWED_FAILURES in "
        f"{__file__}: {fixed}"
    )


def test_symbolic_dimensions_give_the_static_gradients(sweep):
    assert sum(r.symbolic == "pass" for r in sweep) > 2000
    new = {case: r for case, r in symbolic_failures(sweep).items() if case not in ALLOWED_SYMBOLIC_FAILURES}
    listing = "\n".join(f"{r.case} [{r.input}] {r.symbolic_message}" for r in new.values())
    assert not new, f"{len(new)} new failures on symbolic dimensions:\n{listing}"
    fixed = sorted(set(ALLOWED_SYMBOLIC_FAILURES) - set(symbolic_failures(sweep)))
    assert not fixed, f"now passing on symbolic dimensions: remove them from _SYMBOLIC_GAPS in {__file__}: {fixed}"


def test_oracle_answers_come_from_the_references(sweep):
    live = [f"{r.case} [{r.input}] ({r.source})" for r in sweep if r.source.startswith("live")]
    stored = sum(r.source == "stored" for r in sweep)
    assert stored > 1500
    if live:  # a new rule or case: correct but slower; regenerate the references
        warnings.warn(f"{len(live)} checks ran the live oracle (not in the references): {', '.join(live)}")
