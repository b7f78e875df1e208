"""Second-order conformance (--order 2): the first-order graph differentiated again."""

import argparse
import json

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff.conformance import runner
from onnx_autodiff.rules import GradRegistry, default_registry


@pytest.fixture(scope="module")
def tanh():
    (case,) = runner.select_cases(runner.load_node_cases(), names=["test_tanh"])
    return case


def test_first_order_case_outputs_only_the_gradient(tanh):
    second = runner.first_order_case(tanh, "x")
    model = second.proto()
    assert second.wrt == ["x"] and second.name == "order2:test_tanh[x]"
    assert len(model.graph.output) == 1 and model.graph.output[0].name.startswith("grad_x")
    (dy,) = set(second.inputs) - set(tanh.inputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (grad,) = session.run(None, second.inputs)
    x = tanh.inputs["x"]
    np.testing.assert_allclose(grad, second.inputs[dy] * (1 - np.tanh(x) ** 2), rtol=1e-5, atol=1e-6)


def test_tanh_is_twice_differentiable(tanh):
    (result,) = runner.run_case_order2(tanh)
    assert (result.case, result.input, result.status) == ("test_tanh", "x", "pass")
    assert result.counts["checked"] == tanh.inputs["x"].size


def test_a_wrong_rule_inside_the_backward_template_is_caught(tanh):
    registry = default_registry().copy()

    @registry.register("Mul", differentiable=("A", "B"), broadcast=True, since=7)
    def wrong_mul(op, node, dY):  # right for A, sign error for B: Tanh's first order is unaffected
        A, B = node.inputs
        return {"A": op.Mul(dY, B), "B": op.Neg(op.Mul(dY, A))}

    assert runner.run_case(tanh, registry)[0].status == "pass"
    (result,) = runner.run_case_order2(tanh, registry)
    assert result.status == "fail" and result.error > 1
    (verdict,) = runner.order2_verdicts([result])
    assert verdict["verdict"] == "no" and "wrong value" in verdict["reasons"][0]


def test_a_missing_rule_for_a_template_op_is_reported(tanh):
    only_tanh = GradRegistry([r for r in default_registry().rules() if r.op_type == "Tanh"])
    (result,) = runner.run_case_order2(tanh, only_tanh)
    assert result.status == "no-rule" and ("Mul" in result.message or "Sub" in result.message)
    (verdict,) = runner.order2_verdicts([result])
    assert verdict["verdict"] == "no" and verdict["reasons"][0].startswith("no-rule")
    # no rule for the op itself: the first order is missing, not the second
    (missing,) = runner.run_case_order2(tanh, GradRegistry())
    assert missing.status == "no-rule" and missing.message.startswith("first order:")
    assert runner.order2_verdicts([missing])[0]["verdict"] == "no first order"


def test_cli_order2_report(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    code = runner.run(parser.parse_args(["--order", "2", "--op", "Tanh", "Sigmoid", "--report", str(tmp_path / "o2")]))
    out = capsys.readouterr().out
    assert code == 0 and "second order, op types: yes 2" in out
    markdown = (tmp_path / "o2.md").read_text()
    assert "second-order" in markdown and "Twice differentiable (2): Sigmoid, Tanh" in markdown
    document = json.loads((tmp_path / "o2.json").read_text())
    assert {v["op"]: v["verdict"] for v in document["second_order"]} == {"Sigmoid": "yes", "Tanh": "yes"}


@pytest.mark.slow
def test_order2_sweep(tmp_path):
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    code = runner.run(parser.parse_args(["--order", "2", "--jobs", "2", "--report", str(tmp_path / "o2")]))
    document = json.loads((tmp_path / "o2.json").read_text())
    verdicts = {v["op"]: v["verdict"] for v in document["second_order"]}
    assert code in (0, 1) and sum(v == "yes" for v in verdicts.values()) > 50
