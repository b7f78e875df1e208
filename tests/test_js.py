"""The JavaScript trainer (js/) on onnxruntime-node gives what the Python Trainer gives.

Skipped without node or without js/node_modules (CI installs it with npm ci --ignore-scripts --prefix js).
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from onnx_autodiff.demo import blobs, classifier_model
from onnx_autodiff.training import Trainer, generate_artifacts
from onnx_autodiff.training.qat import QatConfig

ROOT = Path(__file__).resolve().parents[1]
JS = ROOT / "js"

if shutil.which("node") is None:
    pytest.skip("node is not installed", allow_module_level=True)
if not (JS / "node_modules" / "onnxruntime-node").is_dir():
    pytest.skip("js/node_modules is missing: run npm ci --ignore-scripts --prefix js", allow_module_level=True)
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")


def save_artifacts(artifacts, directory: str) -> None:
    artifacts.save(directory, checkpoint_format="safetensors")  # the checkpoint js/ reads

OPTIMIZERS = {
    "adamw": ("adamw", {"lr": 0.01, "weight_decay": 0.05}),
    "sgd_momentum": ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
}


def logits_model():
    """The demo classifier without its loss node: X in, logits out (the loss comes from the artifacts)."""
    model = classifier_model()
    graph = model.graph
    del graph.node[-1]
    graph.output.remove(graph.output[0])
    graph.input.remove(graph.input[1])
    return model


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def artifacts_dir(request, tmp_path_factory):
    name, options = OPTIMIZERS[request.param]
    directory = tmp_path_factory.mktemp(request.param) / "artifacts"
    save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", optimizer=name, optimizer_options=options),
                   str(directory))
    return directory


@pytest.fixture(scope="module")
def batch():
    X, labels = blobs(samples=64)
    return {"X": X, "labels": labels}


def write_data(path, arrays):
    safetensors_numpy.save_file(arrays, str(path))
    return str(path)


def node(*args, check=True):
    result = subprocess.run(["node", str(JS / "train.mjs"), *map(str, args)], capture_output=True, text=True, check=False, timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def python_state(directory, batches, lr=None, state=None):
    trainer = Trainer(str(directory), lr=lr)
    if state is not None:
        trainer.load_state_dict(state)
    losses = [trainer.step(b) for b in batches]
    return trainer.state_dict(), losses


def assert_same_state(js, python):
    assert sorted(js) == sorted(python)
    for key, value in python.items():
        assert js[key].dtype == value.dtype and js[key].shape == value.shape, key
        np.testing.assert_allclose(js[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_node_steps_match_the_python_trainer(artifacts_dir, batch, tmp_path):
    data = write_data(tmp_path / "batch.safetensors", batch)
    out = tmp_path / "trained.safetensors"
    result = node(artifacts_dir, "--data", data, "--steps", 6, "--out", out)
    python, losses = python_state(artifacts_dir, [batch] * 6)
    js = safetensors_numpy.load_file(str(out))
    assert_same_state(js, python)
    assert js["__step__"].shape == () and int(js["__step__"]) == 6
    printed = [float(line.split("loss")[1]) for line in result.stdout.splitlines() if line.startswith("step ")]
    np.testing.assert_allclose(printed, losses, atol=2e-6)
    assert losses[-1] < losses[0] * 0.9  # it trained
    initial = safetensors_numpy.load_file(str(artifacts_dir / "checkpoint.safetensors"))
    assert not np.allclose(js["W1"], initial["W1"])


def test_epochs_slice_in_order_and_resume_counts_steps(artifacts_dir, batch, tmp_path):
    data = write_data(tmp_path / "batch.safetensors", batch)
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    # 64 rows in batches of 24: 24, 24 and 16 rows per epoch; --lr overrides the optimiser's
    node(artifacts_dir, "--data", data, "--epochs", 2, "--batch-size", 24, "--lr", 0.02, "--out", first, "--quiet")
    node(artifacts_dir, "--data", data, "--steps", 2, "--checkpoint", first, "--lr", 0.02, "--out", second, "--quiet")
    slices = [{k: v[i:i + 24] for k, v in batch.items()} for i in (0, 24, 48)]
    python, _ = python_state(artifacts_dir, slices * 2 + [batch] * 2, lr=0.02)
    js = safetensors_numpy.load_file(str(second))
    assert int(js["__step__"]) == 8  # resumed at step 7: Adam's bias correction and SGD's first step depend on it
    assert_same_state(js, python)


def test_nonfinite_step_raises_or_skips_and_keeps_nothing(artifacts_dir, batch, tmp_path):
    bad = dict(batch, X=batch["X"].copy())
    bad["X"][3, 2] = np.nan
    data = write_data(tmp_path / "bad.safetensors", bad)
    out = tmp_path / "out.safetensors"
    result = node(artifacts_dir, "--data", data, "--steps", 2, "--out", out, check=False)
    assert result.returncode == 1 and not out.exists()
    assert result.stderr.count("\n") == 1 and "step 1" in result.stderr and "'X' holds NaN" in result.stderr, result.stderr
    node(artifacts_dir, "--data", data, "--steps", 2, "--out", out, "--nonfinite", "skip")
    js = safetensors_numpy.load_file(str(out))
    initial = safetensors_numpy.load_file(str(artifacts_dir / "checkpoint.safetensors"))
    assert int(js["__step__"]) == 0
    assert_same_state({k: v for k, v in js.items() if k != "__step__"}, initial)


@pytest.mark.parametrize("case, status, message", [
    ("no data option", 2, "--data is required"),
    ("no artifacts", 2, "holds no training artifacts"),
    ("labels missing", 1, "missing [\"labels\"]"),
    ("no safetensors checkpoint", 1, "checkpoint_format=\"safetensors\""),
    ("damaged data", 2, "not a safetensors file"),
    ("zero steps", 2, "--steps must be a whole number >= 1"),
    ("unknown format", 1, "unsupported artifacts format 99 (this trainer reads formats 1, 2, 3)"),
])
def test_bad_input_is_one_line_and_writes_nothing(case, status, message, batch, tmp_path):
    directory = tmp_path / "artifacts"
    save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", optimizer="sgd"), str(directory))
    data = write_data(tmp_path / "batch.safetensors", batch)
    out = tmp_path / "out.safetensors"
    args = [directory, "--data", data, "--steps", 1, "--out", out]
    if case == "no data option":
        args = [directory, "--steps", 1, "--out", out]
    elif case == "no artifacts":
        args[0] = tmp_path
    elif case == "labels missing":
        args[2] = write_data(tmp_path / "x.safetensors", {"X": batch["X"]})
    elif case == "no safetensors checkpoint":
        (directory / "checkpoint.safetensors").unlink()
    elif case == "damaged data":
        Path(data).write_bytes(Path(data).read_bytes()[:50])
    elif case == "zero steps":
        args[4] = 0
    elif case == "unknown format":
        layout = json.loads((directory / "artifacts.json").read_text())
        (directory / "artifacts.json").write_text(json.dumps({**layout, "format": 99}))
    result = node(*args, check=False)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith("train.mjs: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and not out.exists()


def test_safetensors_module_round_trips_what_python_writes(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "scalar": np.array(3, np.int64), "f64": rng.standard_normal((2, 3)), "f32": rng.standard_normal(5).astype(np.float32),
        "f16": rng.standard_normal((3, 1)).astype(np.float16), "odd": np.arange(3, dtype=np.uint8),
        "mask": np.array([True, False, True]), "i32": np.array([-1, 2**31 - 1], np.int32), "empty": np.zeros((0, 4), np.float32),
    }
    source, copy = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    safetensors_numpy.save_file(arrays, str(source), metadata={"source": "test"})
    script = (f"import {{ parse, serialize }} from {json.dumps((JS / 'safetensors.mjs').as_uri())};"
              "import fs from 'node:fs';"
              "const { tensors, metadata } = parse(fs.readFileSync(process.argv[1]));"
              "fs.writeFileSync(process.argv[2], serialize(tensors, metadata));"
              "console.log(JSON.stringify(Object.fromEntries(Object.entries(tensors).map(([k, t]) => [k, [t.type, t.dims]]))));")
    result = subprocess.run(["node", "--input-type=module", "-e", script, str(source), str(copy)],
                            capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["scalar"] == ["int64", []] and seen["f16"] == ["float16", [3, 1]] and seen["mask"] == ["bool", [3]]
    from safetensors import safe_open

    with safe_open(str(copy), "numpy") as handle:
        assert handle.metadata() == {"source": "test"}
    back = safetensors_numpy.load_file(str(copy))
    assert sorted(back) == sorted(arrays)
    for key, value in arrays.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    # the same bytes again: the writer is deterministic
    again = subprocess.run(["node", "--input-type=module", "-e", script, str(copy), str(tmp_path / "again.safetensors")],
                           capture_output=True, text=True, check=False, timeout=60)
    assert again.returncode == 0 and (tmp_path / "again.safetensors").read_bytes() == copy.read_bytes()


# Chromium's SwiftShader (Vulkan on the CPU), for Dawn inside onnxruntime-node where no other
# Vulkan driver is installed; the loader reads these at process start
SWIFTSHADER = Path("/usr/lib/chromium")


def test_backend_webgpu_matches_the_python_trainer_or_says_why_not(batch, tmp_path):
    """--backend webgpu trains artifacts built for the WebGPU provider on onnxruntime-node's own
    (Dawn) to the Python Trainer's losses; where it has no adapter, one line says so (exit 3) and
    --backend auto trains on cpu with a notice."""
    import os

    directory = tmp_path / "artifacts"
    save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", optimizer="adamw",
                                      optimizer_options={"lr": 0.01, "weight_decay": 0.05}, target="webgpu"), str(directory))
    data = write_data(tmp_path / "batch.safetensors", batch)
    _, losses = python_state(directory, [batch] * 4)
    env = dict(os.environ)
    if (SWIFTSHADER / "libvulkan.so.1").is_file() and (SWIFTSHADER / "vk_swiftshader_icd.json").is_file():
        env.setdefault("LD_LIBRARY_PATH", str(SWIFTSHADER))
        env.setdefault("VK_ICD_FILENAMES", str(SWIFTSHADER / "vk_swiftshader_icd.json"))
    out = tmp_path / "out.safetensors"
    result = subprocess.run(["node", str(JS / "train.mjs"), directory, "--data", data, "--steps", "4", "--out", out,
                             "--backend", "webgpu"], capture_output=True, text=True, check=False, timeout=120, env=env)
    if result.returncode == 3:
        # Dawn writes its own warnings to stderr first; the trainer's line is the last
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith("train.mjs: error: --backend webgpu: ") and not out.exists(), result.stderr
        assert "no adapter" in line or "no WebGPU execution provider" in line, line
        auto = subprocess.run(["node", str(JS / "train.mjs"), directory, "--data", data, "--steps", "4", "--out", out,
                               "--backend", "auto"], capture_output=True, text=True, check=False, timeout=120, env=env)
        assert auto.returncode == 0 and "--backend auto: training on cpu" in auto.stderr, auto.stderr
        pytest.skip(line.split("--backend webgpu: ", 1)[1])
    assert result.returncode == 0, result.stderr
    assert "on webgpu; wrote" in result.stdout, result.stdout
    printed = [float(line.split("loss")[1]) for line in result.stdout.splitlines() if line.startswith("step ")]
    np.testing.assert_allclose(printed, losses, rtol=1e-4)
    assert printed[-1] < printed[0] * 0.9


def test_backend_webgpu_without_a_vulkan_driver_is_one_clear_line(batch, tmp_path):
    """With no Vulkan driver for Dawn (no ICD file), --backend webgpu refuses in one line, exit 3."""
    import os

    directory = tmp_path / "artifacts"
    save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", optimizer="sgd", target="webgpu"), str(directory))
    data = write_data(tmp_path / "batch.safetensors", batch)
    out = tmp_path / "out.safetensors"
    env = dict(os.environ, VK_ICD_FILENAMES=str(tmp_path / "no-driver.json"), VK_DRIVER_FILES=str(tmp_path / "no-driver.json"))
    result = subprocess.run(["node", str(JS / "train.mjs"), directory, "--data", data, "--steps", "1", "--out", out,
                             "--backend", "webgpu"], capture_output=True, text=True, check=False, timeout=120, env=env)
    if result.returncode == 0:
        pytest.skip("Dawn found an adapter without a Vulkan ICD (another backend)")
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("train.mjs: error: --backend webgpu: onnxruntime-node's"), result.stderr
    assert not out.exists()
    bad = node(directory, "--data", data, "--steps", 1, "--out", out, "--backend", "gpu", check=False)
    assert bad.returncode == 2 and "--backend must be cpu, webgpu, auto" in bad.stderr, bad.stderr


def test_external_data_files_are_mounted_for_the_train_and_eval_models(tmp_path):
    """A quantized LoRA base saved with external_data=True: the train and eval models read their
    tensors from training_model.onnx.data and eval_model.onnx.data, which the trainer gives
    onnxruntime with the model bytes; the steps are the Python Trainer's."""
    import sys

    sys.path.insert(0, str(ROOT / "examples" / "web"))
    from prepare import classifier

    from onnx_autodiff.training.lora import LoraConfig

    directory = tmp_path / "artifacts"
    generate_artifacts(classifier(hidden=256), loss="cross_entropy", optimizer="adamw",
                       lora=LoraConfig(rank=4, quantize_base="int4")).save(directory, external_data=True,
                                                                            checkpoint_format="safetensors")
    assert (directory / "training_model.onnx.data").is_file() and (directory / "eval_model.onnx.data").is_file()
    rng = np.random.default_rng(0)
    batch = {"X": rng.random((16, 64), dtype=np.float32), "labels": rng.integers(0, 10, 16).astype(np.int64)}
    data = write_data(tmp_path / "batch.safetensors", batch)
    out = tmp_path / "out.safetensors"
    result = node(directory, "--data", data, "--steps", 3, "--out", out)
    python, losses = python_state(directory, [batch] * 3)
    printed = [float(line.split("loss")[1]) for line in result.stdout.splitlines() if line.startswith("step ")]
    np.testing.assert_allclose(printed, losses, rtol=1e-5)
    assert_same_state(safetensors_numpy.load_file(str(out)), python)
    script = (f"import {{ Trainer }} from {json.dumps((JS / 'trainer.mjs').as_uri())};"
              "import * as ort from 'onnxruntime-node'; import fs from 'node:fs/promises'; import path from 'node:path';"
              "const read = (n) => fs.readFile(path.join(process.argv[1], n)).catch(() => null);"
              "const t = await Trainer.open(ort, read);"
              "const X = new ort.Tensor('float32', new Float32Array(64 * 2).fill(0.5), [2, 64]);"
              "const labels = new ort.Tensor('int64', BigInt64Array.of(1n, 2n), [2]);"
              "console.log((await t.evaluate({ X, labels })).loss);")
    evaluated = subprocess.run(["node", "--input-type=module", "-e", script, str(directory)], capture_output=True, text=True,
                               check=False, timeout=60, cwd=JS)
    assert evaluated.returncode == 0, evaluated.stderr
    want = Trainer(str(directory)).evaluate({"X": np.full((2, 64), 0.5, np.float32), "labels": np.array([1, 2])})["loss"]
    np.testing.assert_allclose(float(evaluated.stdout), want, rtol=1e-5)


# Two steps of three micro-batches each (accumulate, accumulate, accumulate, apply), then a plain
# step; prints the losses and writes the state as a safetensors checkpoint
ACCUMULATE_SCRIPT = """
import { Trainer } from "TRAINER";
import * as ort from "onnxruntime-node";
import fs from "node:fs/promises";
import path from "node:path";
import { parse } from "SAFETENSORS";
const [directory, data, out] = process.argv.slice(1);
const read = (name) => fs.readFile(path.join(directory, name)).catch(() => null);
const trainer = await Trainer.open(ort, read);
const tensors = Object.entries(parse(await fs.readFile(data)).tensors);
const batches = ["0", "1", "2"].map((k) => Object.fromEntries(tensors.filter(([name]) => name.endsWith(`.${k}`))
  .map(([name, t]) => [name.split(".")[0], t])));
const losses = [];
for (let step = 0; step < 2; step++) {
  for (const batch of batches) losses.push(await trainer.accumulate(batch));
  await trainer.apply();
}
let error = "";
try { await trainer.apply(); } catch (e) { error = e.message; }
losses.push(await trainer.step(batches[0]));
await fs.writeFile(out, trainer.checkpointBytes());
console.log(JSON.stringify({ losses, steps: trainer.stepCount, error }));
"""


@pytest.mark.parametrize("target", ["onnxruntime", "webgpu"])
def test_accumulate_and_apply_match_the_python_trainer(target, batch, tmp_path):
    """Trainer.accumulate and apply in JavaScript take the Python Trainer's steps: the losses of
    every micro-batch and the state after them, with AdamW and clipping on LoRA adapters; the
    webgpu target's adapters with dropout, whose hashed masks (step and micro-batch fed as the
    layout says) are the same on both trainers, bit for bit."""
    from onnx_autodiff.training.lora import LoraConfig

    directory = tmp_path / "artifacts"
    lora = LoraConfig(rank=2, dropout=0.25 if target == "webgpu" else 0.0)
    save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", optimizer="adamw", lora=lora,
                                      optimizer_options={"lr": 0.05}, max_grad_norm=1.0, gradient_accumulation=True,
                                      target=target), str(directory))
    layout = json.loads((directory / "artifacts.json").read_text())
    assert ("dropout_micro_batch" in layout["accumulate"]["scalars"]) == (target == "webgpu")
    slices = [{k: v[i:i + 20] for k, v in batch.items()} for i in (0, 20, 40)]
    data = write_data(tmp_path / "batches.safetensors", {f"{k}.{i}": v for i, b in enumerate(slices) for k, v in b.items()})
    out = tmp_path / "out.safetensors"
    script = (ACCUMULATE_SCRIPT.replace("TRAINER", (JS / "trainer.mjs").as_uri())
              .replace("SAFETENSORS", (JS / "safetensors.mjs").as_uri()))
    result = subprocess.run(["node", "--input-type=module", "-e", script, str(directory), data, str(out)],
                            capture_output=True, text=True, check=False, timeout=60, cwd=JS)
    assert result.returncode == 0, result.stderr
    js = json.loads(result.stdout)
    trainer = Trainer(str(directory))
    losses = []
    for _ in range(2):
        losses += [trainer.accumulate(b) for b in slices]
        trainer.apply()
    losses.append(trainer.step(slices[0]))
    np.testing.assert_allclose(js["losses"], losses, rtol=1e-5)
    assert js["steps"] == 3 and "apply() needs accumulate() first" in js["error"]
    assert_same_state(safetensors_numpy.load_file(str(out)), trainer.state_dict())
    assert not np.allclose(trainer.state_dict()["W1.lora_B"], 0)  # it trained


NONFINITE_SCRIPT = """
import { Trainer } from "TRAINER";
import * as ort from "onnxruntime-node";
import fs from "node:fs/promises";
import path from "node:path";
const [directory, batchJson] = process.argv.slice(1);
const read = (name) => fs.readFile(path.join(directory, name)).catch(() => null);
const { X, labels, rows } = JSON.parse(batchJson);
const batch = (bad) => ({ X: { type: "float32", dims: [rows, X.length / rows], data: Float32Array.from(X, (x, i) => (bad && i === 3 ? NaN : x)) },
                          labels: { type: "int64", dims: [rows], data: BigInt64Array.from(labels, BigInt) } });
const out = {};
const raising = await Trainer.open(ort, read);
await raising.accumulate(batch(false));
try { await raising.accumulate(batch(true)); } catch (e) { out.error = e.message; }
await raising.apply();  // the first micro-batch's step: the one that raised kept nothing
const skipping = await Trainer.open(ort, read, { nonfinite: "skip" });
await skipping.accumulate(batch(false));
await skipping.accumulate(batch(true));
await skipping.apply();
Object.assign(out, { raised: [raising.stepCount, Array.from(raising.parameters().W1.data)],
                     skipped: [skipping.stepCount, skipping.skippedSteps, Array.from(skipping.parameters().W1.data)] });
console.log(JSON.stringify(out));
"""


def test_a_nonfinite_micro_batch_raises_or_skips_its_step_as_in_python(batch, tmp_path):
    """accumulate() on a micro-batch holding NaN: "raise" throws naming it and keeps nothing of it
    (apply then steps on the others), "skip" counts it and apply() skips the whole step, as the
    Python Trainer does."""
    directory = tmp_path / "artifacts"
    save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", optimizer="sgd", gradient_accumulation=True),
                   str(directory))
    rows = 16
    X, labels = batch["X"][:rows], batch["labels"][:rows]
    bad = X.copy()
    bad.flat[3] = np.nan
    script = NONFINITE_SCRIPT.replace("TRAINER", (JS / "trainer.mjs").as_uri())
    payload = json.dumps({"X": X.ravel().tolist(), "labels": labels.tolist(), "rows": rows})
    result = subprocess.run(["node", "--input-type=module", "-e", script, str(directory), payload],
                            capture_output=True, text=True, check=False, timeout=60, cwd=JS)
    assert result.returncode == 0, result.stderr
    js = json.loads(result.stdout)
    assert js["error"].startswith("micro-batch 2 of step 1: the loss is NaN") and "'X' holds NaN" in js["error"], js["error"]
    raising = Trainer(str(directory))
    raising.accumulate((X, labels))
    with pytest.raises(Exception, match="micro-batch 2 of step 1"):
        raising.accumulate((bad, labels))
    raising.apply()
    skipping = Trainer(str(directory), nonfinite="skip")
    skipping.accumulate((X, labels))
    skipping.accumulate((bad, labels))
    skipping.apply()
    assert js["raised"][0] == raising.step_count == 1
    np.testing.assert_allclose(np.array(js["raised"][1]).reshape(raising.parameters()["W1"].shape),
                               raising.parameters()["W1"], rtol=1e-6)
    assert js["skipped"][:2] == [skipping.step_count, skipping.skipped_steps] == [0, 1]
    np.testing.assert_array_equal(np.array(js["skipped"][2], np.float32).reshape(skipping.parameters()["W1"].shape),
                                  skipping.parameters()["W1"])


def test_artifacts_json_matches_the_schema_in_node(artifacts_dir, tmp_path):
    """js/validate.mjs (ajv) finds every artifacts.json of the JS tests' kinds valid against
    js/artifacts.schema.json, the schema the Python manifest generates, and names what breaks it."""
    from onnx_autodiff.training.lora import LoraConfig

    kinds = {
        "accumulation, clipping": dict(optimizer="adamw", gradient_accumulation=True, max_grad_norm=1.0),
        "webgpu lora with dropout": dict(lora=LoraConfig(rank=2, dropout=0.25), target="webgpu",
                                         gradient_accumulation=True),
    }
    directories = [artifacts_dir]
    for i, options in enumerate(kinds.values()):
        directories.append(tmp_path / f"artifacts{i}")
        save_artifacts(generate_artifacts(logits_model(), loss="cross_entropy", **options), str(directories[-1]))
    result = subprocess.run(["node", str(JS / "validate.mjs"), *map(str, directories)], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0 and f"{len(directories)} of {len(directories)} match" in result.stdout, result.stdout
    layout = json.loads((directories[-1] / "artifacts.json").read_text())
    assert layout["format"] == 3 and "lora" in layout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**layout, "train": {**layout["train"], "carry": [["W1", "W1"]]}}))
    result = subprocess.run(["node", str(JS / "validate.mjs"), str(bad)], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.returncode == 1 and "/train/carry/0 must NOT have fewer than 3 items" in result.stdout, result.stdout


def test_a_learning_rate_schedule_steps_as_in_python(batch, tmp_path):
    """Artifacts whose manifest holds a schedule (cosine with warmup): the node trainer's steps
    give the Python Trainer's state, and js/trainer.mjs's scheduleFactor equals
    training/schedules.py's at every step of every kind."""
    import dataclasses

    from onnx_autodiff.training.schedules import LRSchedule

    artifacts = generate_artifacts(logits_model(), loss="cross_entropy", optimizer="adamw", optimizer_options={"lr": 0.02})
    schedule = LRSchedule("cosine", 2, 5)
    directory = tmp_path / "scheduled"
    save_artifacts(dataclasses.replace(artifacts, manifest=dataclasses.replace(artifacts.manifest, lr_schedule=schedule)),
                   str(directory))
    assert json.loads((directory / "artifacts.json").read_text())["lr_schedule"] == schedule.to_json()
    data = write_data(tmp_path / "batch.safetensors", batch)
    out = tmp_path / "trained.safetensors"
    node(directory, "--data", data, "--steps", 6, "--out", out, "--quiet")
    python, _ = python_state(directory, [batch] * 6)
    assert_same_state(safetensors_numpy.load_file(str(out)), python)
    schedules = [LRSchedule("constant", 3), LRSchedule("linear", 2, 9), LRSchedule("cosine", 0, 7), LRSchedule("cosine", 4, 11)]
    script = ("import { scheduleFactor } from './trainer.mjs';"
              f"const schedules = {json.dumps([s.to_json() for s in schedules])};"
              "console.log(JSON.stringify(schedules.map(s => [...Array(14).keys()].map(k => scheduleFactor(s, k)))));")
    result = subprocess.run(["node", "--input-type=module", "-e", script], cwd=JS, capture_output=True, text=True, check=True,
                            timeout=60)
    factors = json.loads(result.stdout)
    for schedule, js in zip(schedules, factors):
        assert js == pytest.approx([schedule.factor(k) for k in range(14)], rel=1e-15, abs=0)


def test_quantization_aware_training_steps_as_in_python(batch, tmp_path):
    # the observers' ranges are buffers the train model carries, calibrated over the first steps
    directory = tmp_path / "qat"
    save_artifacts(generate_artifacts(logits_model(), qat=QatConfig("int8", calibration_steps=3), optimizer="sgd",
                                      optimizer_options={"lr": 0.1}), str(directory))
    data = write_data(tmp_path / "batch.safetensors", batch)
    out = tmp_path / "trained.safetensors"
    node(directory, "--data", data, "--steps", 5, "--out", out)
    python, _ = python_state(directory, [batch] * 5)
    assert any(key.endswith("_observed_max") and value.max() > 0 for key, value in python.items())
    assert_same_state(safetensors_numpy.load_file(str(out)), python)
