"""The JavaScript trainer says in one line when artifacts open on an execution provider they were
not built for (default-target artifacts on WebGPU, where LogSoftmax and Sum fall back to the CPU)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parents[1] / "js"

if shutil.which("node") is None:
    pytest.skip("node is not installed", allow_module_level=True)

SCRIPT = """
import { targetNote } from TRAINER;
const cases = JSON.parse(process.argv[1]);
console.log(JSON.stringify(cases.map(([layout, providers]) => targetNote(layout, providers) ?? null)));
"""


def notes(cases) -> list:
    script = SCRIPT.replace("TRAINER", json.dumps((JS / "trainer.mjs").as_uri()))
    done = subprocess.run(["node", "--input-type=module", "-e", script, json.dumps(cases)], capture_output=True,
                          text=True, check=True, timeout=60, cwd=JS)
    return json.loads(done.stdout)


def test_one_line_where_the_provider_is_not_the_target():
    default, webgpu, canonical = {}, {"target": "webgpu"}, {"target": None}
    found = notes([[default, ["webgpu"]], [default, [{"name": "webgpu"}, "cpu"]], [canonical, ["webgpu"]],
                   [default, ["cpu"]], [default, []], [webgpu, ["webgpu"]], [webgpu, ["cpu"]]])
    assert found[3:] == [None] * 4  # (artifacts built for WebGPU run on any provider)
    assert found[0] == found[1] and "\n" not in found[0]
    assert found[0] == ('trainer.mjs: note: these artifacts were built for target "onnxruntime", not for the webgpu '
                        "execution provider, which runs some of their nodes on the CPU: generate them with --target webgpu")
    assert 'built for target null' in found[2]
