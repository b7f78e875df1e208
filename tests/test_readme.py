"""The README's generated operator list matches the registry; its two set-up commands stay on top."""

from pathlib import Path

from onnx_autodiff.cli import OPS_BEGIN, OPS_END, operator_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_operator_list_is_current():
    text = README.read_text(encoding="utf-8")
    section = text.split(OPS_BEGIN, 1)[1].split(OPS_END, 1)[0].strip()
    assert section == operator_table().strip(), "regenerate with: onnx-autodiff ops --update README.md"


def test_two_setup_commands_at_the_top():
    lines = README.read_text(encoding="utf-8").splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert block == ['pip install . && onnx-autodiff demo', 'pip install -e ".[test]" && python -m pytest -q']
    assert lines.index("```bash") < 5


def test_train_section_runs_as_written(tmp_path, monkeypatch, capsys):
    import shlex

    from onnx_autodiff.cli import main

    section = README.read_text(encoding="utf-8").split("## Train from the command line", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    for line in block.splitlines():
        command = shlex.split(line, comments=True)
        assert command[0] == "onnx-autodiff"
        assert main(command[1:]) == 0, line
    out = capsys.readouterr().out
    assert "epoch 5/5:" in out and "epoch 8/8:" in out
    assert (tmp_path / "example" / "run" / "model.onnx").is_file()
