"""The browser demo (examples/web) trains the digits classifier in headless Chromium to >= 90 %;
Adam(W) artifacts step on onnxruntime-web's reduced-type WebAssembly build (no float64 kernels).

Skipped without Chromium or js/node_modules (CI installs both: apt-get install chromium, npm ci).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_browser_page_trains_to_90_percent(tmp_path):
    if not (os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    if not (ROOT / "js" / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("js/node_modules is missing: run npm ci --ignore-scripts --prefix js")
    pytest.importorskip("safetensors", reason="prepare.py writes safetensors with the safetensors package")
    screenshot = tmp_path / "page.png"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "web" / "check.py"), "--screenshot", str(screenshot)],
                            capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = re.search(r"^browser: test accuracy ([0-9.]+)%", result.stdout, re.MULTILINE)
    assert accuracy and float(accuracy.group(1)) >= 90, result.stdout
    # check.py's server sends COOP/COEP: isolated, the page runs WebAssembly on several threads
    backend = re.search(r"^browser: backend wasm, (\d+) thread\(s\) of (\d+) core\(s\), (not )?cross-origin isolated",
                        result.stdout, re.MULTILINE)
    assert backend and not backend.group(3), result.stdout
    assert int(backend.group(1)) > 1 or int(backend.group(2)) == 1, result.stdout
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_llm_page_fine_tunes_a_llama_to_reproduce_its_sentence(tmp_path):
    """check.py --llm --small: LoRA on the int4 (MatMulNBits) base of a small Llama-shaped decoder
    in headless Chromium on WebAssembly (SwiftShader's WebGPU takes minutes for the same steps);
    the loss falls to under a tenth and the greedy generation after training reproduces the start
    of the sentence, which the one before does not."""
    if not (os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    if not (ROOT / "js" / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("js/node_modules is missing: run npm ci --ignore-scripts --prefix js")
    pytest.importorskip("transformers", reason="prepare_llm.py builds the model with transformers")
    pytest.importorskip("safetensors", reason="the JavaScript trainer reads a safetensors checkpoint")
    screenshot = tmp_path / "llm.png"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "web" / "check.py"), "--llm", "--small",
                             "--backend", "wasm", "--screenshot", str(screenshot)],
                            capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    loss = re.search(r"^browser: llm loss ([0-9.]+) -> ([0-9.]+)$", result.stdout, re.MULTILINE)
    assert loss and float(loss.group(2)) < float(loss.group(1)) / 10, result.stdout
    sentence = re.search(r"^browser: llm before: .* \((\d+)/(\d+) characters", result.stdout, re.MULTILINE)
    after = re.search(r"^browser: llm after: '(.*)' \((\d+)/(\d+) characters", result.stdout, re.MULTILINE)
    assert sentence and after, result.stdout
    assert int(after.group(2)) >= min(16, int(after.group(3))) > int(sentence.group(1)), result.stdout
    assert re.search(r"^browser: llm memory: WebAssembly.Memory [1-9]\d* MB", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^browser: backend wasm ", result.stdout, re.MULTILINE), result.stdout
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# A page that opens each artifacts directory named in its query with js/trainer.mjs on the
# WebAssembly build that onnxruntime-web's WebGPU bundle ships (reduced kernel type lists: no
# float64 Cast) and trains it as its batch.json's plan says (test_webgpu.run_plan: steps, and
# micro-batches accumulated and applied); window.trainingResult holds each directory's losses or error.
STEP_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>one step per artifacts directory</title></head>
<body data-state="loading"><script type="module">
const query = new URLSearchParams(location.search);
try {
  const ort = await import(`./js/node_modules/onnxruntime-web/dist/${query.get("bundle")}`);
  const { Trainer, sliceRows } = await import("./js/trainer.mjs");
  ort.env.wasm.numThreads = 1;
  const results = {};
  for (const dir of query.get("dirs").split(",")) {
    const read = async (name) => {
      const response = await fetch(`${dir}/${name}`);
      return response.ok ? new Uint8Array(await response.arrayBuffer()) : null;
    };
    try {
      const batch = JSON.parse(new TextDecoder().decode(await read("batch.json")));
      const feeds = { X: { type: "float32", dims: batch.dims, data: Float32Array.from(batch.X) },
                      labels: { type: "int64", dims: [batch.dims[0]], data: BigInt64Array.from(batch.labels, BigInt) } };
      const trainer = await Trainer.open(ort, read, { sessionOptions: { executionProviders: ["wasm"] } });
      const losses = [];
      for (const micro of batch.plan) {  // 1: a step; k > 1: k micro-batches accumulated, then applied
        if (micro === 1) {
          losses.push(await trainer.step(feeds));
          continue;
        }
        const rows = batch.dims[0] / micro;
        for (let i = 0; i < micro; i++) losses.push(await trainer.accumulate(sliceRows(feeds, i * rows, (i + 1) * rows)));
        await trainer.apply();
      }
      results[dir] = { losses, steps: trainer.stepCount };
    } catch (error) {
      results[dir] = { error: String(error.message ?? error).split("\\n")[0] };
    }
  }
  window.trainingResult = results;
  document.body.dataset.state = "done";
} catch (error) {
  window.trainingError = String(error.message ?? error);
  document.body.dataset.state = "error";
}
</script></body></html>
"""


def test_artifacts_train_on_the_reduced_type_wasm_build(tmp_path):
    """Adam and AdamW artifacts (clipping, LoRA, BatchNormalization in training mode) create a
    session and step on onnxruntime-web's reduced-type WebAssembly build, whose missing float64
    Cast failed every Adam(W) train model while the graph computed the bias corrections in float64
    ("Could not find an implementation for Cast(13)"); gradient accumulation (js/trainer.mjs's
    accumulate and apply) and the webgpu target's hashed Dropout (BatchNormalization's network,
    LoRA's) train there too. The losses are the Python Trainer's: the hashed masks are the same."""
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    bundle = "ort.webgpu.min.mjs"
    if not (ROOT / "js" / "node_modules" / "onnxruntime-web" / "dist" / bundle).is_file():
        pytest.skip("js/node_modules is missing: run npm ci --ignore-scripts --prefix js")
    import importlib.util
    import json

    import numpy as np
    from test_training import batches, bn_dropout_model, mlp
    from test_webgpu import run_plan

    from onnx_autodiff.training.lora import LoraConfig
    from onnx_autodiff.training import Trainer, generate_artifacts

    spec = importlib.util.spec_from_file_location("web_check", ROOT / "examples" / "web" / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)

    def bn_model():  # BatchNormalization in training mode; Dropout as Identity, so that steps repeat
        model = bn_dropout_model()
        dropout = next(n for n in model.graph.node if n.op_type == "Dropout")
        dropout.op_type, dropout.input[:] = "Identity", dropout.input[:1]
        return model

    configs = {
        "adamw": (mlp, {"optimizer": "adamw", "optimizer_options": {"lr": 0.01, "weight_decay": 0.1}}),
        "adam-amsgrad-clip": (mlp, {"optimizer": "adam", "max_grad_norm": 0.5,
                                    "optimizer_options": {"lr": 0.01, "amsgrad": True, "weight_decay": 0.05}}),
        "adamw-lora": (mlp, {"optimizer": "adamw", "lora": LoraConfig(rank=2), "optimizer_options": {"lr": 0.05}}),
        "adamw-batchnorm": (bn_model, {"optimizer": "adamw", "optimizer_options": {"lr": 0.01}}),
        "adamw-accumulate": (mlp, {"optimizer": "adamw", "max_grad_norm": 1.0, "gradient_accumulation": True,
                                   "optimizer_options": {"lr": 0.01}}),
        "webgpu-sgd-batchnorm-dropout": (bn_dropout_model, {"optimizer": "sgd", "gradient_accumulation": True,
                                                            "optimizer_options": {"lr": 0.1, "momentum": 0.9},
                                                            "target": "webgpu"}),
        "webgpu-adamw-lora-dropout": (mlp, {"optimizer": "adamw", "lora": LoraConfig(rank=2, dropout=0.25),
                                            "optimizer_options": {"lr": 0.05}, "target": "webgpu"}),
    }
    plans = {"adamw-accumulate": [1, 2, 3], "webgpu-sgd-batchnorm-dropout": [1, 3, 2], "webgpu-adamw-lora-dropout": [1, 1, 1]}
    site = tmp_path / "site"
    site.mkdir()
    (site / "js").symlink_to(ROOT / "js", target_is_directory=True)
    (site / "step.html").write_text(STEP_PAGE, encoding="utf-8")
    X, y = next(batches(1))
    expected = {}
    for name, (make, options) in configs.items():
        artifacts = generate_artifacts(make(), **options)
        artifacts.save(site / name, checkpoint_format="safetensors")
        plan = plans.get(name, [1, 1])
        (site / name / "batch.json").write_text(json.dumps({"dims": list(X.shape), "X": X.ravel().tolist(),
                                                            "labels": y.tolist(), "plan": plan}))
        expected[name] = run_plan(Trainer(artifacts), (X, y), plan), len(plan)
    results, _ = check.open_page(executable, site, f"step.html?bundle={bundle}&dirs={','.join(configs)}",
                                 str(tmp_path / "page.png"), 120)
    for name, (want, steps) in expected.items():
        got = results[name]
        assert "error" not in got, f"{name}: {got['error']}"
        assert got["steps"] == steps, name
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, err_msg=name)
