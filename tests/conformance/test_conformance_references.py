"""CI gate: every eligible backend test case against the stored oracle references.

The finite differences of the whole sweep are stored in conformance/references/oracle.npz
(regenerate: ``python -m onnx_autodiff conformance --jobs 2 --save-references
conformance/references/oracle.npz``), so this test only builds and runs the backward graphs.
A new ``fail`` or ``error`` breaks it; so does an allow-listed pair that no longer fails.
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


def test_oracle_answers_come_from_the_references(sweep):
    live = [f"{r.case} [{r.input}] ({r.source})" for r in sweep if r.source.startswith("live")]
    stored = sum(r.source == "stored" for r in sweep)
    assert stored > 1500
    if live:  # a new rule or case: correct but slower; regenerate the references
        warnings.warn(f"{len(live)} checks ran the live oracle (not in the references): {', '.join(live)}")
