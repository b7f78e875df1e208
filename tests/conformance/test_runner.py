"""The conformance runner: statuses, a wrong rule caught, reports, the command line."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from onnx_autodiff.conformance import runner
from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules import GradRegistry, default_registry

FAST_OPS = ["Add", "Mul", "Relu", "Sigmoid", "Max"]


@pytest.fixture(scope="module")
def cases():
    return runner.load_node_cases()


def statuses(results):
    return {(r.case, r.input): r.status for r in results}


def parse(argv):
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    return parser.parse_args(argv)


def test_collected_cases_are_cached_and_seeded(cases):
    by_name = {c.name: c for c in cases}
    assert len(cases) > 1800
    assert by_name["test_add"].kind == "node" and by_name["test_add"].op == "Add"
    expanded = by_name["test_softmax_axis_0_expanded"]
    assert expanded.kind == "expanded" and expanded.op == "Softmax" and expanded.base is not None
    again = {c.name: c for c in runner.load_node_cases()}  # from the cache: same seeded inputs
    np.testing.assert_array_equal(again["test_add"].inputs["x"], by_name["test_add"].inputs["x"])


def test_sign_error_in_mul_is_caught(cases):
    registry = default_registry().copy()

    @registry.register("Mul", differentiable=("A", "B"), broadcast=True, since=7)
    def wrong_mul(op, node, dY):
        A, B = node.inputs
        return {"A": op.Mul(dY, B), "B": op.Neg(op.Mul(dY, A))}

    selected = runner.select_cases(cases, ops=["Mul"])
    results = runner.run_cases(selected, registry)
    found = statuses(results)
    assert found[("test_mul", "x")] == "pass"
    assert found[("test_mul", "y")] == "fail"
    fail = next(r for r in results if r.status == "fail")
    assert fail.error > 1 and "worst element" in fail.message
    assert {r.status for r in results if r.input == "y"} == {"fail"}


def test_statuses_no_rule_not_differentiable_refused_error(cases):
    (relu,) = runner.select_cases(cases, names=["test_relu"])
    (relu_expanded,) = runner.select_cases(cases, names=["test_relu_expanded_ver18"])
    assert runner.run_case(relu, GradRegistry())[0].status == "no-rule"
    assert runner.run_case(relu_expanded, GradRegistry())[0].status == "no-rule"  # body op Max

    declared = GradRegistry()
    declared.not_differentiable("Relu")
    assert runner.run_case(relu, declared)[0].status == "not-differentiable"

    refusing = GradRegistry()

    @refusing.register("Relu", differentiable=("X",))
    def refuse(op, node, dY):
        raise RuleError("this attribute is not supported")

    (result,) = runner.run_case(relu, refusing)
    assert result.status == "refused" and "not supported" in result.message

    crashing = GradRegistry()

    @crashing.register("Relu", differentiable=("X",))
    def crash(op, node, dY):
        return {"X": op.Mul(dY, None, "extra")}

    (result,) = runner.run_case(relu, crashing)
    assert result.status == "error" and result.message


def test_integer_cases_are_not_eligible(cases):
    (case,) = runner.select_cases(cases, names=["test_add_uint8"])
    assert runner.run_case(case) == []


def test_relu_and_max_kinks_pass_through_the_runner(cases):
    # The backend data for Max has ties (test_max_example's equal entries, test_max_one_input)
    results = runner.run_cases(runner.select_cases(cases, ops=["Max", "Relu"]))
    assert results and all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]


def test_run_end_to_end_writes_reports(tmp_path, capsys):
    report = tmp_path / "conformance"
    code = runner.run(parse(["--op", *FAST_OPS, "--report", str(report), "--no-models"]))
    out = capsys.readouterr()
    assert code == 0, out.out
    assert "Relu" in out.out and "worst error" in out.out
    document = json.loads((tmp_path / "conformance.json").read_text())
    rows = {row["op"]: row for row in document["ops"]}
    assert set(rows) == set(FAST_OPS)
    assert rows["Add"]["pass"] == rows["Add"]["cases"] > 0
    assert document["totals"]["cases"]["fail"] == 0
    markdown = (tmp_path / "conformance.md").read_text()
    assert "| Mul |" in markdown


def test_run_exits_1_when_a_registered_rule_fails(tmp_path, capsys):
    registry = default_registry().copy()

    @registry.register("Add", differentiable=("A", "B"), broadcast=True, since=7)
    def wrong_add(op, node, dY):
        return {"A": dY, "B": op.Mul(dY, 2.0)}

    code = runner.run(parse(["--case", "test_add", "--jobs", "2", "--report", str(tmp_path / "r")]), registry)
    out = capsys.readouterr().out
    assert code == 1 and "fail: test_add [y]" in out
    assert "**fail** `test_add` input `y`" in (tmp_path / "r.md").read_text()


def test_model_suites_load_with_float_weights():
    models = runner.load_model_cases(["pytorch-operator"])
    assert models and all(c.kind == "model" and c.op == "pytorch-operator" for c in models)
    results = runner.run_case(models[0])
    weights = {r.input for r in results}
    assert weights and weights <= {t.name for t in models[0].proto().graph.initializer}


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--op", "Relux"], "unknown op 'Relux'"),
        (["--case", "test_nope"], "unknown case 'test_nope'"),
        (["--op", "Add", "--report", "/nonexistent/dir/report"], "does not exist"),
        (["--op", "Add", "--jobs", "0"], "--jobs"),
        (["--op", "Add", "--limit", "0"], "--limit"),
    ],
)
def test_bad_usage_exits_2_with_one_line(argv, needle, capsys):
    assert runner.run(parse(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_module_entry_point_bad_usage():
    process = subprocess.run(
        [sys.executable, "-m", "onnx_autodiff.conformance.runner", "--op", "NoSuchOp"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        "onnx-autodiff conformance: error: unknown op 'NoSuchOp': no backend test case exercises it"
    ]


@pytest.mark.slow
def test_full_sweep(tmp_path):
    code = runner.run(parse(["--jobs", "2", "--report", str(tmp_path / "full")]))
    document = json.loads((tmp_path / "full.json").read_text())
    assert document["totals"]["case_count"] > 1200
    assert code in (0, 1)
