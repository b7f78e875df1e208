"""The command line: exit codes, one-line errors, atomic output."""

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.cli import main


def write_model(path, nodes, inputs, outputs, initializers=(), opsets=(("", 18),)):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        list(initializers),
    )
    opset_imports = [helper.make_opsetid(d, v) for d, v in opsets]
    ir_version = max(4, helper.find_min_ir_version_for(opset_imports, ignore_unknown=True))
    model = helper.make_model(graph, opset_imports=opset_imports, ir_version=ir_version)
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture
def scaled_model(tmp_path):
    W = numpy_helper.from_array(np.array([2.0, -1.0, 0.5], np.float32), "W")
    return write_model(
        tmp_path / "m.onnx",
        [helper.make_node("Mul", ["x", "W"], ["y"])],
        [("x", TensorProto.FLOAT, [3])],
        [("y", TensorProto.FLOAT, [3])],
        [W],
    )


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_grad_writes_model_with_gradient_outputs(scaled_model, tmp_path, capsys):
    out = tmp_path / "g.onnx"
    assert main(["grad", scaled_model, "-o", str(out)]) == 0
    assert "grad_W" in capsys.readouterr().out
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["y", "grad_W"]
    assert [i.name for i in model.graph.input] == ["x", "dy"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([1.0, 2.0, 3.0], np.float32)
    _, grad = session.run(None, {"x": x, "dy": np.ones(3, np.float32)})
    np.testing.assert_array_equal(grad, x)


def test_output_check_structural_by_default_full_when_asked(scaled_model, tmp_path, monkeypatch):
    from onnx_autodiff import commands

    levels = []
    monkeypatch.setattr(commands, "_check_generated", lambda model, full=True: levels.append(full))
    monkeypatch.delenv("ONNX_AUTODIFF_CHECK_OUTPUT", raising=False)
    assert main(["grad", scaled_model, "-o", str(tmp_path / "a.onnx")]) == 0
    assert main(["grad", scaled_model, "-o", str(tmp_path / "b.onnx"), "--check-output"]) == 0
    monkeypatch.setenv("ONNX_AUTODIFF_CHECK_OUTPUT", "1")  # as the test suite sets it
    assert main(["grad", scaled_model, "-o", str(tmp_path / "c.onnx")]) == 0
    assert levels == [False, True, True]


def test_grad_with_explicit_of_wrt_and_no_cleanup(scaled_model, tmp_path):
    out = tmp_path / "g.onnx"
    assert main(["grad", scaled_model, "-o", str(out), "--of", "y", "--wrt", "x", "W", "--no-cleanup"]) == 0
    assert [o.name for o in onnx.load(str(out)).graph.output] == ["y", "grad_x", "grad_W"]


def test_grad_outline_writes_function_calls_with_the_same_gradients(tmp_path):
    x = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], np.float32)
    model = write_model(
        tmp_path / "m.onnx",
        [helper.make_node("Softmax", ["x"], ["p"], axis=-1), helper.make_node("Mul", ["p", "x"], ["y"])],
        [("x", TensorProto.FLOAT, [2, 3])],
        [("y", TensorProto.FLOAT, [2, 3])],
    )
    plain, outlined = tmp_path / "plain.onnx", tmp_path / "outlined.onnx"
    assert main(["grad", model, "-o", str(plain), "--wrt", "x"]) == 0
    assert main(["grad", model, "-o", str(outlined), "--wrt", "x", "--outline"]) == 0
    a, b = onnx.load(str(plain)), onnx.load(str(outlined))
    onnx.checker.check_model(b, full_check=True)
    assert "SoftmaxGrad" in [f.name for f in b.functions] and len(b.graph.node) < len(a.graph.node)
    feeds = {"x": x, "dy": np.arange(6, dtype=np.float32).reshape(2, 3)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (a, b)]
    np.testing.assert_allclose(run[1][1], run[0][1], rtol=1e-6)


def test_grad_target_none_keeps_canonical_forms_with_the_same_gradients(tmp_path):
    # Relu's gradient gate: Where(X > 0, dY, 0) in canonical graphs, dY·Cast(X > 0) once lowered
    # for onnxruntime; the same gradient for finite values
    rng = np.random.default_rng(3)
    W = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    model = write_model(
        tmp_path / "m.onnx",
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [("x", TensorProto.FLOAT, [5, 4])],
        [("y", TensorProto.FLOAT, [5, 3])],
        [W],
    )
    lowered, canonical = tmp_path / "lowered.onnx", tmp_path / "canonical.onnx"
    assert main(["grad", model, "-o", str(lowered)]) == 0
    assert main(["grad", model, "-o", str(canonical), "--target", "none"]) == 0
    a, b = onnx.load(str(lowered)), onnx.load(str(canonical))
    onnx.checker.check_model(b, full_check=True)
    ops_a, ops_b = [n.op_type for n in a.graph.node], [n.op_type for n in b.graph.node]
    assert "Cast" in ops_a and "Where" not in ops_a and "Where" in ops_b and "Cast" not in ops_b
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32), "dy": rng.standard_normal((5, 3)).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (a, b)]
    np.testing.assert_allclose(run[1][1], run[0][1], rtol=1e-5, atol=1e-6)


def test_missing_rule_exits_1_with_one_line_and_writes_nothing(tmp_path, capsys):
    model = write_model(
        tmp_path / "m.onnx",
        [helper.make_node("Foo", ["x"], ["h"], domain="acme", name="foo1"), helper.make_node("Neg", ["h"], ["y"])],
        [("x", TensorProto.FLOAT, [2])],
        [("y", TensorProto.FLOAT, [2])],
        opsets=(("", 18), ("acme", 2)),
    )
    out = tmp_path / "g.onnx"
    assert main(["grad", model, "-o", str(out), "--wrt", "x"]) == 1
    line = one_line(capsys.readouterr().err)
    for part in ("foo1", "Foo", "acme", "opset 2", "register_gradient"):
        assert part in line
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


@pytest.mark.parametrize(
    "args,code,fragment",
    [
        (["--of", "nope"], 2, "of 'nope'"),
        (["--wrt", "nope"], 2, "wrt 'nope'"),
    ],
)
def test_unknown_names_exit_2(scaled_model, tmp_path, capsys, args, code, fragment):
    assert main(["grad", scaled_model, "-o", str(tmp_path / "g.onnx"), *args]) == code
    assert fragment in one_line(capsys.readouterr().err)
    assert not (tmp_path / "g.onnx").exists()


def test_integer_wrt_exits_1(tmp_path, capsys):
    model = write_model(
        tmp_path / "m.onnx",
        [helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT), helper.make_node("Neg", ["f"], ["y"])],
        [("i", TensorProto.INT64, [2])],
        [("y", TensorProto.FLOAT, [2])],
    )
    assert main(["grad", model, "-o", str(tmp_path / "g.onnx"), "--wrt", "i"]) == 1
    assert "INT64" in one_line(capsys.readouterr().err)


def test_malformed_and_missing_files(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf \xff\xfe")
    assert main(["grad", str(bad), "-o", str(tmp_path / "g.onnx")]) == 1
    assert "cannot read" in one_line(capsys.readouterr().err)
    assert main(["grad", str(tmp_path / "none.onnx"), "-o", str(tmp_path / "g.onnx")]) == 2
    assert "no such model file" in one_line(capsys.readouterr().err)


def test_cyclic_model_exits_1(tmp_path, capsys):
    model = write_model(
        tmp_path / "m.onnx",
        [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Neg", ["a"], ["b"])],
        [("x", TensorProto.FLOAT, [2])],
        [("b", TensorProto.FLOAT, [2])],
    )
    assert main(["grad", model, "-o", str(tmp_path / "g.onnx"), "--wrt", "x"]) == 1
    line = one_line(capsys.readouterr().err)  # onnx.checker sees the cycle first: a graph that cannot be sorted
    assert "the input model" in line and "invalid" in line and "topologically sorted" in line


def test_several_outputs_need_of(tmp_path, capsys):
    model = write_model(
        tmp_path / "m.onnx",
        [helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Abs", ["x"], ["z"])],
        [("x", TensorProto.FLOAT, [2])],
        [("y", TensorProto.FLOAT, [2]), ("z", TensorProto.FLOAT, [2])],
    )
    assert main(["grad", model, "-o", str(tmp_path / "g.onnx"), "--wrt", "x"]) == 2
    assert "--of" in one_line(capsys.readouterr().err)


def test_bad_usage_exits_2(capsys):
    assert main([]) == 2
    one_line(capsys.readouterr().err)
    assert main(["grad"]) == 2
    one_line(capsys.readouterr().err)


def test_module_entry_point_runs(scaled_model, tmp_path):
    out = tmp_path / "g.onnx"
    done = subprocess.run(
        [sys.executable, "-m", "onnx_autodiff", "grad", scaled_model, "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.exists()


def test_demo_trains_and_checks(capsys):
    assert main(["demo", "--steps", "30"]) == 0
    report = capsys.readouterr().out
    assert "gradient check" in report and "result         ok" in report


@pytest.fixture
def tanh_model(tmp_path):
    W = numpy_helper.from_array(np.array([[0.5, -1.0], [0.3, 0.8]], np.float32), "W")
    return write_model(
        tmp_path / "t.onnx",
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0)],
        [("x", TensorProto.FLOAT, [3, 2])],
        [("y", TensorProto.FLOAT, [])],
        [W],
    )


@pytest.mark.parametrize(
    "command,inputs,outputs",
    [("jvp", ["x", "t_W"], ["y", "jvp_y"]), ("hvp", ["x", "v_W"], ["y", "hvp_W"]), ("jacobian", ["x"], ["y", "jac_W"])],
)
def test_transform_commands(tanh_model, tmp_path, capsys, command, inputs, outputs):
    out = tmp_path / f"{command}.onnx"
    assert main([command, tanh_model, "-o", str(out)]) == 0
    assert outputs[-1] in capsys.readouterr().out
    model = onnx.load(str(out))
    assert [i.name for i in model.graph.input] == inputs
    assert [o.name for o in model.graph.output] == outputs
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_check_command_orders_and_inputs(tanh_model, tmp_path, capsys):
    assert main(["check", tanh_model, "--order", "2"]) == 0
    report = capsys.readouterr().out
    assert "order 2" in report and report.strip().endswith("ok")
    np.savez(tmp_path / "in.npz", x=np.ones((3, 2), np.float32))
    assert main(["check", tanh_model, "--inputs", str(tmp_path / "in.npz"), "--wrt", "x"]) == 0
    assert main(["check", tanh_model, "--inputs", str(tmp_path / "missing.npz")]) == 2
    assert "cannot read inputs" in one_line(capsys.readouterr().err)


def test_artifacts_command_writes_training_files(tmp_path, capsys):
    from onnx_autodiff.demo import classifier_model

    forward = classifier_model()
    del forward.graph.node[-1]  # keep the logits; the artifacts add the loss
    forward.graph.output.remove(forward.graph.output[0])
    forward.graph.input.remove(forward.graph.input[1])
    path = tmp_path / "classifier.onnx"
    onnx.save(forward, str(path))
    out = tmp_path / "artifacts"
    assert main(["artifacts", str(path), "-o", str(out), "--loss", "cross_entropy", "--optimizer", "adam"]) == 0
    assert "4 parameters" in capsys.readouterr().out
    assert {"checkpoint.npz", "artifacts.json"} <= set(os.listdir(out))
    assert main(["artifacts", str(path), "-o", str(out), "--loss", "nope"]) == 2
    one_line(capsys.readouterr().err)


@pytest.fixture
def cnn_path(tmp_path):
    from helpers import small_cnn

    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(path))
    return str(path)


def _reads(model: onnx.ModelProto, op_type: str) -> set[str]:
    return {node.input[0] for node in model.graph.node if node.op_type == op_type}


def test_artifacts_qat_records_the_config_and_observes_the_activations(cnn_path, tmp_path, capsys):
    """--qat int8: artifacts.json's "qat" record, an observer (min and max buffers) per quantized
    activation, the weights read through QuantizeLinear, BatchNormalization folded."""
    import json

    out = tmp_path / "qat"
    assert main(["artifacts", cnn_path, "-o", str(out), "--qat", "int8", "--qat-calibration-steps", "3"]) == 0
    assert ", QAT int8," in capsys.readouterr().out
    layout = json.loads((out / "artifacts.json").read_text())
    expected = {"scheme": "int8", "calibration_steps": 3, "skip": [], "symmetric": True, "block_size": 32}
    assert {key: layout["qat"][key] for key in expected} == expected
    observers = [name for name in layout["buffers"] if name.endswith(("_observed_min", "_observed_max"))]
    # each quantized layer's input and output (after its Relu): X, r (conv), f, logits (fc)
    assert sorted(observers) == sorted(f"{name}_observed_{end}" for name in ("X", "r", "f", "logits") for end in ("min", "max"))
    train = onnx.load(str(out / "training_model.onnx"))
    assert {"conv.weight", "fc.weight", "X"} <= _reads(train, "QuantizeLinear")
    assert "BatchNormalization" not in {node.op_type for node in train.graph.node}


def test_artifacts_qat_skip_leaves_a_node_in_float(cnn_path, tmp_path, capsys):
    import json

    out = tmp_path / "qat"
    assert main(["artifacts", cnn_path, "-o", str(out), "--qat", "int8", "--qat-skip", "f*", "--qat-asymmetric"]) == 0
    layout = json.loads((out / "artifacts.json").read_text())
    assert layout["qat"]["skip"] == ["f*"] and layout["qat"]["symmetric"] is False
    assert [name for name in layout["buffers"] if "_observed_" in name] == [
        "X_observed_min", "X_observed_max", "r_observed_min", "r_observed_max"]
    train = onnx.load(str(out / "training_model.onnx"))
    quantized = _reads(train, "QuantizeLinear")
    assert "conv.weight" in quantized and "fc.weight" not in quantized and "f" not in quantized
    gemm = next(node for node in train.graph.node if node.op_type == "Gemm")
    assert gemm.input[1] == "fc.weight"


@pytest.mark.parametrize("args, code, message", [
    (["--qat-skip", "fc"], 2, "--qat-skip needs --qat SCHEME"),
    (["--qat-calibration-steps", "3", "--qat-asymmetric"], 2,
     "--qat-calibration-steps and --qat-asymmetric need --qat SCHEME"),
    (["--qat", "int8", "--gradient-accumulation"], 2, "--qat int8 does not combine with --gradient-accumulation"),
    (["--qat", "int8", "--qat-calibration-steps", "0"], 2, "must be a positive integer"),
    (["--qat", "int9"], 2, "invalid choice: 'int9'"),
    (["--qat", "int8", "--qat-skip", "*"], 1, "found no Conv, ConvTranspose, Gemm or MatMul"),
])
def test_artifacts_qat_misuse_is_one_line(cnn_path, tmp_path, capsys, args, code, message):
    out = tmp_path / "qat"
    assert main(["artifacts", cnn_path, "-o", str(out), *args]) == code
    assert message in one_line(capsys.readouterr().err)
    assert not out.exists()
