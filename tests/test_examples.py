"""The examples run and do what they say (each skipped when its optional packages are missing)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_custom_rule_example(capsys):
    load("custom_rule").main()
    out = capsys.readouterr().out
    assert "without a rule: no gradient rule" in out and "with the rule: ok" in out


def test_saliency_example_gradients_are_per_image_and_correct(tmp_path, capsys):
    pytest.importorskip("sklearn")
    saliency = load("saliency")
    assert saliency.main(["--steps", "60", "--out", str(tmp_path / "s.png")]) == 0
    assert "test accuracy" in capsys.readouterr().out
    from onnx_autodiff.conformance import check_vjp

    model = saliency.classifier(seed=3)
    top = saliency.saliency_model(model)
    X = np.random.default_rng(0).random((3, 64)).astype(np.float32)
    import onnxruntime as ort

    session = ort.InferenceSession(top.SerializeToString(), providers=["CPUExecutionProvider"])
    batch = session.run(["grad_X"], {"X": X})[0]
    single = session.run(["grad_X"], {"X": X[1:2]})[0]
    np.testing.assert_allclose(batch[1:2], single, rtol=1e-5, atol=1e-7)
    forward = saliency.top_logit_model(model)
    forward.graph.output.remove(forward.graph.output[0])  # keep 'top' only
    result = check_vjp(forward, {"X": X}, ["X"])
    assert result.ok, str(result)
