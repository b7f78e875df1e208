"""The README's two set-up commands stay on top and its tour runs; the manual's generated operator
list matches the registry and its commands run as written."""

import shlex
from pathlib import Path

from onnx_autodiff.cli import OPS_BEGIN, OPS_END, operator_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_operator_list_is_current():
    text = (DOCS / "operators.md").read_text(encoding="utf-8")
    section = text.split(OPS_BEGIN, 1)[1].split(OPS_END, 1)[0].strip()
    assert section == operator_table().strip(), "regenerate with: onnx-autodiff ops --update docs/operators.md"


def test_two_setup_commands_at_the_top():
    lines = README.read_text(encoding="utf-8").splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert block == ['pip install . && onnx-autodiff demo', 'pip install -e ".[test]" && python -m pytest -q']
    assert lines.index("```bash") < 5


def _run_bash_blocks(text, capsys):
    from onnx_autodiff.cli import main

    blocks = [part.split("```", 1)[0] for part in text.split("```bash\n")[1:]]
    assert blocks
    for block in blocks:
        for line in block.splitlines():
            command = shlex.split(line, comments=True)
            assert command[0] == "onnx-autodiff"
            assert main(command[1:]) == 0, line
    return capsys.readouterr().out


def test_train_section_runs_as_written(tmp_path, monkeypatch, capsys):
    section = (DOCS / "training.md").read_text(encoding="utf-8").split("## Train from the command line", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    out = _run_bash_blocks(f"```bash\n{block}```", capsys)
    assert "epoch 5/5:" in out and "epoch 8/8:" in out
    assert (tmp_path / "example" / "run" / "model.onnx").is_file()


def test_tour_runs_as_written(tmp_path):
    """Each command in its own process, as typed (conformance's progress binds the stderr of its import)."""
    import subprocess
    import sys

    tour = README.read_text(encoding="utf-8").split("## A tour", 1)[1].split("\n## ", 1)[0]
    blocks = [part.split("```", 1)[0] for part in tour.split("```bash\n")[1:]]
    out = ""
    for line in (line for block in blocks for line in block.splitlines()):
        command = shlex.split(line, comments=True)
        assert command[0] == "onnx-autodiff"
        run = subprocess.run([sys.executable, "-m", "onnx_autodiff", *command[1:]], cwd=tmp_path,
                             capture_output=True, text=True)
        assert run.returncode == 0, (line, run.stderr)
        out += run.stdout
    assert (tmp_path / "example" / "grads.onnx").is_file()
    assert "epoch 5/5:" in out and (tmp_path / "example" / "run" / "model.onnx").is_file()
    assert "pass 2 = 100.0%" in out


def test_links_resolve():
    import re

    for page in [README, ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
