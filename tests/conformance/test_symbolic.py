"""The sweep's re-check on symbolic dimensions: a pass, a forward that needs static shapes, and a
rule wrong (or refusing) only when the extents are unknown, reported as a failure of the sweep."""

import argparse
import json

import numpy as np
import onnx
import pytest

from onnx_autodiff.conformance import runner
from onnx_autodiff.conformance.symbolic import same_values, symbolic_model
from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules import default_registry
from onnx_autodiff.toolkit import shapes


@pytest.fixture(scope="module")
def cases():
    return runner.load_node_cases()


def only(cases, name, registry=None):
    (case,) = runner.select_cases(cases, names=[name])
    return runner.run_case(case, registry)


def _mul_registry(refuse: bool = False):
    """Mul's rule, right when A's shape is static, wrong (doubled) or refusing when it is not."""
    registry = default_registry().copy()

    @registry.register("Mul", differentiable=("A", "B"), broadcast=True, since=7)
    def mul(op, node, dY):
        A, B = node.inputs
        static = shapes.static_shape(A) is not None
        if refuse and not static:
            raise RuleError("Mul: this rule needs A's shape static")
        dA = op.Mul(dY, B) if static else op.Mul(op.Mul(dY, B), 2.0)
        return {"A": dA, "B": op.Mul(dY, A)}

    return registry


def test_symbolic_model_names_every_input_dimension(cases):
    (case,) = runner.select_cases(cases, names=["test_mul_bcast"])
    model = symbolic_model(case.proto())
    dims = [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    assert dims == [["x_d0", "x_d1", "x_d2"], ["y_d0"]]
    (out,) = model.graph.output
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim][:2] == ["x_d0", "x_d1"]
    assert case.proto().graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3  # a copy


def test_every_judged_input_is_rechecked_on_symbolic_dimensions(cases):
    results = only(cases, "test_mul_bcast")
    assert [(r.input, r.status, r.symbolic, r.symbolic_message) for r in results] == [
        ("x", "pass", "pass", ""), ("y", "pass", "pass", "")]


def test_a_forward_onnxruntime_refuses_symbolically_needs_static_shapes(cases):
    # onnxruntime's Resize inference wants the length of a run-time 'sizes' known
    (result,) = only(cases, "test_resize_upsample_sizes_nearest")
    assert result.status == "pass" and result.symbolic == "needs-static"
    assert result.symbolic_message.startswith("forward needs static shapes: ") and "sizes" in result.symbolic_message


def test_a_rule_wrong_only_on_symbolic_dimensions_fails_the_sweep(cases, tmp_path, capsys):
    x, y = only(cases, "test_mul_bcast", _mul_registry())
    assert (x.status, x.symbolic) == ("pass", "fail")  # the oracle judged the static graph only
    assert "differs from the static one" in x.symbolic_message
    assert (y.status, y.symbolic) == ("pass", "pass")  # failing inputs are rebuilt alone

    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    code = runner.run(parser.parse_args(["--case", "test_mul_bcast", "--report", str(tmp_path / "r")]), _mul_registry())
    printed = capsys.readouterr().out
    assert code == 1
    assert "symbolic dimensions, 1 cases re-checked: pass 0, fail 1, forward needs static shapes 0" in printed
    assert "symbolic fail: test_mul_bcast [x] symbolic dimensions: the VJP differs" in printed
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["totals"]["symbolic"] == {"pass": 0, "fail": 1, "needs-static": 0}
    assert document["totals"]["cases"]["pass"] == 1
    assert "**symbolic fail** `test_mul_bcast` input `x`" in (tmp_path / "r.md").read_text()
    # and without the re-check the same registry passes
    assert runner.run(parser.parse_args(["--case", "test_mul_bcast", "--no-symbolic"]), _mul_registry()) == 0


def test_a_rule_refusing_symbolic_dimensions_fails(cases):
    for result in only(cases, "test_mul_bcast", _mul_registry(refuse=True)):  # the node's rule refuses for both
        assert (result.status, result.symbolic) == ("pass", "fail")
        assert "RuleError" in result.symbolic_message and "needs A's shape static" in result.symbolic_message


def test_the_recheck_can_be_limited_to_some_cases(cases):
    selected = runner.select_cases(cases, names=["test_mul_bcast", "test_add_bcast"])
    results = runner.run_cases(selected, _mul_registry(), symbolic=lambda case: case.op == "Add")
    assert {(r.case, r.symbolic) for r in results} == {("test_mul_bcast", ""), ("test_add_bcast", "pass")}


def test_same_values_scales_by_the_largest_element():
    want = np.array([1000.0, 1.0], np.float32)
    assert same_values(want + np.float32(0.05), want, 1e-4, 1e-3) == ""  # 0.05 ≤ 1e-4·1000 + 1e-3·|w|
    assert "1 of 2 elements differ, worst [1]" in same_values(np.array([1000.0, 1.2], np.float32), want, 1e-4, 1e-3)
    assert same_values(np.zeros(3), np.zeros(2), 1e-4, 1e-3) == "shaped (3,), not (2,)"
    assert same_values(np.array([np.nan]), np.array([np.nan]), 1e-4, 1e-3) == ""
