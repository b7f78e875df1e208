"""The command line's error policy: bad input is blamed on the input, ordinary failures get a plain
sentence (usage 2, others 1), output files get ordinary modes, success lines stay short."""

import errno
import os
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff.passes
from onnx_autodiff.cli import main
from onnx_autodiff.files import write_atomically


def save(path, nodes, initializers, ir_version=8, opset=18, output_shape=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(output_shape))], list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    path.write_bytes(model.SerializeToString())  # onnx.save would refuse some of the invalid ones
    return str(path)


def weight(name="W"):
    return numpy_helper.from_array(np.array([2.0, -1.0, 0.5], np.float32), name)


def scalar_loss(inputs=("x", "W")):
    return [helper.make_node("Mul", list(inputs), ["p"]), helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0)]


@pytest.fixture
def good(tmp_path):
    return save(tmp_path / "good.onnx", scalar_loss(), [weight()])


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def files(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), directory) for d, _, fs in os.walk(directory) for f in fs)


INVALID = {
    "undefined input": (dict(nodes=scalar_loss(("x", "Z"))), "'Z'"),
    "bogus attribute": (dict(nodes=[helper.make_node("Mul", ["x", "W"], ["p"], frobnicate=3),
                                    helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0)]), "frobnicate"),
    "initializer not an input at IR 3": (dict(nodes=[helper.make_node("Mul", ["x", "W"], ["p"]),
                                                      helper.make_node("ReduceSum", ["p"], ["y"], keepdims=1)],
                                              ir_version=3, opset=8, output_shape=(1,)), "not in graph input"),
    "ir_version from the future": (dict(nodes=scalar_loss(), ir_version=99), "ir_version 99"),
}


@pytest.mark.parametrize("command", ["grad", "jvp", "hvp", "jacobian", "check", "artifacts"])
@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_input_model_is_blamed_on_the_input(tmp_path, capsys, command, case):
    options, checker_says = INVALID[case]
    model = save(tmp_path / "bad.onnx", initializers=[weight()], **options)
    out = ["-o", str(tmp_path / "out")] if command != "check" else []
    loss = ["--loss", "none"] if command == "artifacts" else []
    assert main([command, model, *out, *loss]) == 1
    line = error_line(capsys)
    assert f"the input model {model} is invalid" in line and checker_says in line
    assert "generated" not in line and "please report" not in line
    assert files(tmp_path) == ["bad.onnx"]


def test_input_without_a_shape_is_named(tmp_path, capsys):
    """ONNX requires graph inputs to declare at least their rank; the checker's own message does
    not say which one lacks it."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "B"], ["Y"]), helper.make_node("ReduceSum", ["Y"], ["y"], keepdims=0)], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.ones(4, np.float32), "B")],
    )
    model = tmp_path / "unshaped.onnx"
    model.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString())
    assert main(["grad", str(model), "-o", str(tmp_path / "out.onnx"), "--wrt", "X", "B"]) == 1
    line = error_line(capsys)
    assert "is invalid" in line and "'X' declares no shape" in line and "please report" not in line
    assert files(tmp_path) == ["unshaped.onnx"]


@pytest.mark.parametrize("command", ["grad", "artifacts"])
def test_empty_and_non_model_files_are_not_onnx_models(tmp_path, capsys, command):
    empty, text = tmp_path / "empty.onnx", tmp_path / "notes.txt"
    empty.write_bytes(b"")
    text.write_text("hello, this is not a model\n")
    for path, reason in ((empty, "the file is empty"), (text, "DecodeError")):
        assert main([command, str(path), "-o", str(tmp_path / "out")]) == 1
        line = error_line(capsys)
        assert f"cannot read {path} as an ONNX model" in line and reason in line
        assert "please report" not in line and "--of" not in line
    assert files(tmp_path) == ["empty.onnx", "notes.txt"]


def test_output_that_is_a_directory_is_a_usage_error(good, tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    assert main(["grad", good, "-o", str(tmp_path / "adir")]) == 2
    assert f"-o {tmp_path / 'adir'} is a directory" in error_line(capsys)
    assert main(["artifacts", good, "--loss", "none", "-o", good]) == 2
    assert f"-o {good} is a file" in error_line(capsys)
    assert files(tmp_path) == ["good.onnx"]


def deny_writes_under(monkeypatch, directory):
    real_open = os.open

    def fake_open(path, *args, **kwargs):  # root writes through chmod 0o500: fail the way a user's write would
        if os.fspath(path).startswith(os.fspath(directory)) and args and args[0] & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def fill_the_disk(monkeypatch):
    real_fdopen = os.fdopen

    def fake_fdopen(handle, *args, **kwargs):
        stream = real_fdopen(handle, *args, **kwargs)

        def write(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        stream.write = write
        return stream

    monkeypatch.setattr(os, "fdopen", fake_fdopen)


@pytest.mark.parametrize("failure,reason", [("unwritable", "Permission denied"), ("full", "No space left on device")])
@pytest.mark.parametrize("command", ["grad", "hvp", "artifacts"])
def test_unwritable_directory_and_full_disk_are_plain_errors(good, tmp_path, monkeypatch, capsys, failure, command, reason):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "g.onnx" if command != "artifacts" else out
    if command == "artifacts":
        (out / "artifacts.json").write_text("old")  # a previous run's file survives whole
    else:
        target.write_bytes(b"old")
    before = files(tmp_path)
    if failure == "unwritable":
        deny_writes_under(monkeypatch, out)
    else:
        fill_the_disk(monkeypatch)
    assert main([command, good, "-o", str(target), *(["--loss", "none"] if command == "artifacts" else [])]) == 1
    line = error_line(capsys)
    assert "cannot write" in line and str(target) in line and reason in line and "please report" not in line
    assert files(tmp_path) == before  # no temporary file left behind
    assert (out / ("artifacts.json" if command == "artifacts" else "g.onnx")).read_bytes() == b"old"


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_really_unwritable_directory(good, tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("this user (root) writes into a 0o500 directory anyway")
        assert main(["grad", good, "-o", str(out / "g.onnx")]) == 1
        assert "Permission denied" in error_line(capsys)
        assert files(out) == []
    finally:
        out.chmod(0o700)


@pytest.mark.parametrize("chunk", ["0", "-1", "two"])
def test_jacobian_chunk_must_be_positive(good, tmp_path, capsys, chunk):
    assert main(["jacobian", good, "-o", str(tmp_path / "j.onnx"), "--chunk", chunk]) == 2
    line = error_line(capsys)
    assert "--chunk" in line and "positive integer" in line and "please report" not in line
    assert files(tmp_path) == ["good.onnx"]


def test_internal_errors_still_ask_for_a_report(good, tmp_path, monkeypatch, capsys):
    def broken(self, model):
        raise RuntimeError("forced")

    monkeypatch.setattr(onnx_autodiff.passes.AutodiffPass, "call", broken)
    assert main(["grad", good, "-o", str(tmp_path / "g.onnx")]) == 1
    assert error_line(capsys) == "onnx-autodiff: error: unexpected RuntimeError (please report): forced"
    assert files(tmp_path) == ["good.onnx"]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_written_files_get_the_mode_of_an_ordinary_write(good, tmp_path, umask_022):
    out = tmp_path / "g.onnx"
    assert main(["grad", good, "-o", str(out)]) == 0
    assert mode(out) == 0o644
    out.chmod(0o640)
    assert main(["grad", good, "-o", str(out)]) == 0  # replacing a file keeps its mode, as open("w") does
    assert mode(out) == 0o640
    assert main(["artifacts", good, "--loss", "none", "-o", str(tmp_path / "art")]) == 0
    assert {mode(tmp_path / "art" / name) for name in os.listdir(tmp_path / "art")} == {0o644}
    os.umask(0o077)
    write_atomically(tmp_path / "private.bin", b"x")
    assert mode(tmp_path / "private.bin") == 0o600
    assert files(tmp_path) == sorted(["good.onnx", "g.onnx", "private.bin",
                                      *(f"art/{n}" for n in os.listdir(tmp_path / "art"))])


@pytest.fixture
def many_parameters(tmp_path):
    count = 40
    nodes = [helper.make_node("Mul", ["x", f"W{i}"], [f"p{i}"]) for i in range(count)]
    nodes += [helper.make_node("Sum", [f"p{i}" for i in range(count)], ["s"]),
              helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0)]
    return save(tmp_path / "wide.onnx", nodes, [weight(f"W{i}") for i in range(count)])


@pytest.mark.parametrize("command,name,noun", [
    ("grad", "grad_W", "40 gradient outputs"), ("hvp", "hvp_W", "40 outputs"), ("jacobian", "jac_W", "40 outputs"),
])
def test_success_line_counts_instead_of_listing_every_name(many_parameters, tmp_path, capsys, command, name, noun):
    assert main([command, many_parameters, "-o", str(tmp_path / "out.onnx")]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and len(line) < 300, line
    assert noun in line and f"{name}0" in line and f"{name}39" not in line and " more" in line


def test_artifacts_success_line_counts_parameters(many_parameters, tmp_path, capsys):
    assert main(["artifacts", many_parameters, "--loss", "none", "-o", str(tmp_path / "art")]) == 0
    line = capsys.readouterr().out.strip()
    assert "40 parameters (W0, W1, W2, W3, W4, W5 and 34 more)" in line and len(line) < 300


@pytest.fixture
def with_constant(tmp_path):
    exponent = numpy_helper.from_array(np.array(2.0, np.float32), "e")
    nodes = [helper.make_node("Mul", ["x", "W"], ["p"]), helper.make_node("Pow", ["p", "e"], ["q"]),
             helper.make_node("ReduceSum", ["q"], ["y"], keepdims=0)]
    return save(tmp_path / "pow.onnx", nodes, [weight(), exponent])


@pytest.mark.parametrize("command,option", [("grad", "--wrt"), ("jvp", "--wrt"), ("artifacts", "--requires-grad")])
def test_left_out_constants_get_one_note(with_constant, tmp_path, capsys, command, option):
    extra = ["--loss", "none"] if command == "artifacts" else []
    assert main([command, with_constant, "-o", str(tmp_path / "out"), *extra]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        "onnx-autodiff: note: 1 float initializer is a constant and was not "
        f"{'trained' if command == 'artifacts' else 'differentiated'} (e); name them with {option} to "
        f"{'train' if command == 'artifacts' else 'differentiate'} them"
    )
    assert main([command, with_constant, "-o", str(tmp_path / "out2"), *extra, option, "W", "e"]) == 0
    assert capsys.readouterr().err == ""


def test_old_opset_is_converted_with_one_note_or_refused(tmp_path, capsys):
    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    model, out = os.path.join(light, "light_squeezenet.onnx"), tmp_path / "grad.onnx"
    assert main(["grad", model, "-o", str(out), "--wrt", "data_0"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [captured.err.strip()]
    assert captured.err.startswith("onnx-autodiff: note: converted the model from opset 9 to 16")
    assert next(o.version for o in onnx.load(str(out)).opset_import if o.domain == "") == 16
    refused = tmp_path / "refused.onnx"
    assert main(["grad", model, "-o", str(refused), "--wrt", "data_0", "--no-upgrade"]) == 1
    line = error_line(capsys)
    assert "needs opset 16" in line and "conversion is off" in line and not refused.exists()
