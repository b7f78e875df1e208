"""Progress of long builds: the passes report their stages; the command line shows a bar on a
terminal only."""

import io
import time

import numpy as np
import onnx
import onnx_ir as ir
from helpers import make_model, rng
from onnx import helper
from onnx_autodiff.passes import progress

from onnx_autodiff import autodiff_pass, cleanup_passes, cli, commands

R = rng(5)


def chain(layers: int) -> onnx.ModelProto:
    nodes, weights, x = [], {}, "x"
    for i in range(layers):
        weights[f"w{i}"] = R.standard_normal((3, 3)).astype(np.float32)
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"t{i}"])]
        x = f"t{i}"
    nodes.append(helper.make_node("ReduceSum", [x], ["loss"], keepdims=0))
    return make_model(nodes, {"x": R.standard_normal((2, 3)).astype(np.float32)}, ["loss"], initializers=weights)


def test_the_passes_report_their_stages():
    reports = []
    with progress.reporting(lambda stage, done, total: reports.append((stage, done, total))):
        ir.passes.PassManager([autodiff_pass(of="loss"), *cleanup_passes()])(ir.from_proto(chain(600)))
    stages = list(dict.fromkeys(stage for stage, _, _ in reports))
    assert stages[:3] == ["shapes", "gradients", "cleanup, round 1"]
    assert all(0 <= done <= total for _, done, total in reports)
    walked = [done for stage, done, _ in reports if stage == "gradients"]
    assert walked == sorted(walked) and len(walked) > 1  # the walk over 1,201 nodes, in steps
    progress.report("outside", 0, 1)  # nobody listens: nothing happens


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _grad_stderr(tmp_path, monkeypatch, stderr) -> str:
    path = tmp_path / "chain.onnx"
    onnx.save(chain(3), path)
    monkeypatch.setattr(commands, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr("sys.stderr", stderr)
    assert cli.main(["grad", str(path), "-o", str(tmp_path / "out.onnx")]) == 0
    return stderr.getvalue()


def test_the_command_line_shows_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    assert "%|" in _grad_stderr(tmp_path, monkeypatch, _Terminal())


def test_the_bar_follows_the_stages(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(commands, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr("sys.stderr", terminal)
    with commands.progress_bar():
        progress.report("gradients", 1, 4)
        time.sleep(0.2)  # tqdm redraws at most every 0.1 s
        progress.report("cleanup, round 1", 3, 5)
    assert "cleanup, round 1:  60%" in terminal.getvalue()


def test_no_progress_bar_where_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    assert _grad_stderr(tmp_path, monkeypatch, io.StringIO()) == ""


def test_the_library_leaves_pythons_collector_alone_and_the_command_line_pauses_it(tmp_path, monkeypatch):
    """The passes and generate_artifacts never switch the cyclic collector off (a process-wide
    effect); collector_paused does, for a caller's large build, and the command line builds inside
    it, switching it back on after an in-process call."""
    import gc

    from onnx_autodiff import collector_paused
    from onnx_autodiff.training import generate_artifacts

    def refused():
        raise AssertionError("a library call switched the collector off")

    with monkeypatch.context() as patch:
        patch.setattr(gc, "disable", refused)
        ir.passes.PassManager([autodiff_pass(of="loss"), *cleanup_passes()])(ir.from_proto(chain(4)))
        generate_artifacts(chain(4), loss=None, optimizer="adamw")
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr(cli, "cmd_grad", lambda args: seen.append(gc.isenabled()) or 0)
        assert cli.main(["grad", "m.onnx", "-o", str(tmp_path / "out.onnx")]) == 0
    assert seen == [False] and gc.isenabled()
