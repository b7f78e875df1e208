"""The conformance runner: statuses, a wrong rule caught, reports, the command line."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnx_autodiff.conformance import judge, references, runner
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


# --------------------------------------------------------------------------- constants retry


def _expand_registry(wrong: bool = False, refuse_always: bool = False):
    """A registry whose Expand rule, like Resize's or Slice's, needs its shape input as a constant."""
    from onnx_autodiff.toolkit import shapes

    registry = default_registry().copy()

    @registry.register("Expand", differentiable=("input",), broadcast=True, since=8)
    def expand(op, node, dY):
        if refuse_always or shapes.constant(node.inputs[1]) is None:
            raise RuleError("Expand: the gradient needs 'shape' as a constant")
        return {"input": op.Mul(dY, 2.0) if wrong else dY}

    return registry


def test_refused_run_time_input_passes_when_fed_as_constant(cases):
    (case,) = runner.select_cases(cases, names=["test_expand_dim_changed"])
    (result,) = runner.run_case(case, _expand_registry())
    assert result.status == "pass" and result.constants == ["new_shape"]
    assert result.oracle == "onnxruntime-float64" and result.counts["checked"] > 0
    # the retry is judged on its merits: a wrong rule fed constants still fails
    (wrong,) = runner.run_case(case, _expand_registry(wrong=True))
    assert wrong.status == "fail" and wrong.constants == ["new_shape"]
    # a rule that refuses either way stays refused, and says it was retried
    (refused,) = runner.run_case(case, _expand_registry(refuse_always=True))
    assert refused.status == "refused" and refused.constants == []
    assert "the same with new_shape fed as constants" in refused.message


def test_first_attempt_keeps_run_time_inputs(cases):
    # the shipped Expand rule handles a run-time shape: no retry, nothing fed as a constant
    (case,) = runner.select_cases(cases, names=["test_expand_dim_changed"])
    (result,) = runner.run_case(case)
    assert result.status == "pass" and result.constants == []


def test_with_constants_moves_inputs_to_initializers(cases):
    (case,) = runner.select_cases(cases, names=["test_expand_dim_changed"])
    model, feeds = runner.with_constants(case.proto(), case.inputs, ["new_shape"])
    assert [i.name for i in model.graph.input] == ["data"] and set(feeds) == {"data"}
    (tensor,) = model.graph.initializer
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), case.inputs["new_shape"])


def test_reports_mark_constant_fed_cases(cases, tmp_path):
    selected = runner.select_cases(cases, names=["test_expand_dim_changed", "test_add"])
    results = runner.run_cases(selected, _expand_registry())
    summary = runner.totals(results)
    assert summary["eligible"] == 2 and summary["constants"] == 1 and summary["pass_percent"] == 100.0
    assert "pass 2 (1 with run-time inputs fed as constants) = 100.0%" in runner.eligible_line(summary)
    md_path, json_path = runner.write_reports(tmp_path / "r", results, {})
    markdown = md_path.read_text()
    assert "⚑ `test_expand_dim_changed` input `data`: new_shape" in markdown
    assert "| Expand | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 1 |" in markdown
    document = json.loads(json_path.read_text())
    fed = {r["case"]: r["constants"] for r in document["results"]}
    assert fed == {"test_expand_dim_changed": ["new_shape"], "test_add": []}
    assert document["totals"]["constants"] == 1


# --------------------------------------------------------------------------- former oracle skips


def only(cases, name, registry=None):
    (case,) = runner.select_cases(cases, names=[name])
    return runner.run_case(case, registry)


def test_float32_masking_values_are_left_out_of_f(cases):
    # Attention fills masked scores with float32's lowest value; float64 runs give -inf there
    results = only(cases, "test_attention_4d_with_past_and_present_qk_matmul_bias_3d_mask_causal")
    assert {r.status for r in results} == {"pass"}, [r.message for r in results]


def test_forward_agreement_ignores_non_finite_elements_only(cases):
    # test_cast_*: inf and NaN among finite values; the whole output used to be left out
    (result,) = only(cases, "test_cast_FLOAT_to_FLOAT16")
    assert result.status == "pass" and result.oracle == "onnxruntime-float64"
    out = np.array([1.0, np.nan, np.finfo(np.float32).min, 2.0], np.float32)
    r = np.array([1.0, 5.0, 7.0, 3.0], np.float32)
    assert judge._objective([out], [r]) == 7.0


def test_inputs_are_not_moved_by_a_runtime_writing_into_them(cases):
    # onnxruntime's training BatchNormalization writes its running statistics into the fed arrays
    results = only(cases, "test_batchnorm_example_training_mode")
    assert {r.status for r in results} == {"pass"}, [r.message for r in results]


def test_backward_graph_runs_on_reference_when_onnxruntime_cannot(cases):
    # onnxruntime has no batchwise (layout=1) GRU at all; the reference evaluator runs both graphs
    results = only(cases, "test_gru_batchwise")
    assert {r.status for r in results} == {"pass"}
    assert all(r.oracle.endswith("AD on reference") for r in results)
    # onnxruntime's Attention rejects nonpad_kv_seqlen with a 4-D mask at run time
    results = only(cases, "test_attention_4d_diff_heads_mask4d_padded_kv")
    assert {r.status for r in results} == {"pass"}
    assert all(r.oracle.endswith("AD on reference") for r in results)


def test_seeded_training_dropout_is_checked(cases):
    for name in ("test_training_dropout_zero_ratio_mask", "test_training_dropout_mask"):
        (result,) = only(cases, name)
        assert result.status == "pass" and "seed" in result.message, result.message
        assert result.oracle == "onnxruntime-float64"
    (case,) = runner.select_cases(cases, names=["test_training_dropout_mask"])
    model = case.proto()
    del model.graph.node[0].attribute[:]  # no seed: a new mask every run
    unseeded = runner.Case("unseeded", "Dropout", "node", model.SerializeToString(), case.inputs)
    (result,) = runner.run_case(unseeded)
    assert result.status == "oracle-skip" and "random" in result.message


def test_runtime_semantics_mismatch_checks_against_onnxruntime(cases):
    # onnxruntime's MaxUnpool reads the indices over output_shape, the reference evaluator not
    (result,) = only(cases, "test_maxunpool_export_with_output_shape")
    assert result.status == "pass" and result.weak and result.oracle == "float32"
    assert "disagree on the forward outputs" in result.message
    registry = default_registry().copy()

    @registry.register("MaxUnpool", differentiable=("X",))
    def wrong(op, node, dY):
        return {"X": op.Mul(op.Gather(op.Reshape(dY, [-1]), node.inputs[1], axis=0), 1.5)}

    (result,) = only(cases, "test_maxunpool_export_with_output_shape", registry)
    assert result.status == "fail"


def test_range_at_a_length_change_is_checked_one_sided(cases):
    results = only(cases, "test_range_float_type_positive_delta")
    assert {r.status for r in results} == {"pass"}
    assert all(r.counts["one_sided"] == 1 and "one-sided" in r.message for r in results)
    registry = default_registry().copy()

    @registry.register("Range", differentiable=("start", "delta"))
    def wrong(op, node, dY):
        total = op.ReduceSum(dY, keepdims=0)
        return {"start": total, "delta": total}  # d/d delta is Σ i·dY, not Σ dY

    statuses = {r.input: r.status for r in only(cases, "test_range_float_type_positive_delta", registry)}
    assert statuses == {"start": "pass", "delta": "fail"}


def test_default_attributes_are_written_out_when_onnx_checker_needs_them(cases):
    # onnx's inference expands MeanVarianceNormalization-13's body without its default axes
    (result,) = only(cases, "test_mvn")
    assert result.status == "pass" and result.defaults == ["MeanVarianceNormalization.axes=[0, 2, 3]"]
    model, written = runner.explicit_defaults(cases_by_name(cases)["test_mvn"].proto())
    assert written == ["MeanVarianceNormalization.axes=[0, 2, 3]"]
    assert [a.name for a in model.graph.node[0].attribute] == ["axes"]
    broken = cases_by_name(cases)["test_add"].proto()
    broken.graph.node[0].input[1] = "missing"
    assert runner.explicit_defaults(broken) == (None, [])


def test_constants_and_default_attributes_together(cases):
    # STFT with frame_step an initializer: onnx's inference reads onesided as 0 unless written
    registry = default_registry().copy()
    shipped = [r for r in default_registry().rules() if r.op_type == "STFT"][-1]
    from onnx_autodiff.toolkit import shapes

    @registry.register("STFT", differentiable=shipped.differentiable, since=17)
    def stft(op, node, *dYs):
        if shapes.constant(node.inputs[1]) is None:
            raise RuleError("STFT: the gradient needs a constant frame_step")
        return shipped.backward(op, node, *dYs)

    (result,) = only(cases, "test_stft", registry)
    assert result.status == "pass", result.message
    assert result.constants == ["frame_step", "frame_length"] and result.defaults == ["STFT.onesided=1"]


def cases_by_name(cases):
    return {c.name: c for c in cases}


def test_half_precision_references_from_the_old_fallback_are_stale():
    # before revision 2 the float32 fallback differentiated float16 models in float16 (noise)
    stored = runner.StoredOracle("f", backend="float32", weak=True)
    half = {"x": np.ones(2, np.float16)}
    single = {"x": np.ones(2, np.float32)}
    assert references.is_stale(stored, runner.References(), half)
    assert not references.is_stale(stored, runner.References(meta={"oracle_revision": 2}), half)
    assert not references.is_stale(stored, runner.References(), single)
    assert not references.is_stale(runner.StoredOracle("f", backend="reference-float64"), runner.References(), half)


def test_exporter_style_forward_must_run_where_the_case_ran(cases):
    from onnx_autodiff.conformance.oracle import Evaluator, cotangents_for

    def trouble(name, constants):
        case = cases_by_name(cases)[name]
        outputs = Evaluator(case.proto(), backends=("onnxruntime",))(case.inputs)
        cotangents = cotangents_for(case.proto(), outputs)
        exported = runner.with_constants(case.proto(), case.inputs, constants)
        return judge._forward_trouble(exported, "onnxruntime", cotangents, judge._objective(outputs, cotangents))

    assert trouble("test_expand_dim_changed", ["new_shape"]) == ""
    # onnxruntime folds AffineGrid's body once size is constant and rejects its Range inputs
    assert "does not run on onnxruntime" in trouble("test_affine_grid_2d_expanded", ["size"])
