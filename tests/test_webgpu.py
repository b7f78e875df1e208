"""Artifacts built with ``--target webgpu`` run every compute node on onnxruntime-web's WebGPU
provider in headless Chromium (SwiftShader's adapter where there is no GPU), read from
onnxruntime's verbose node-placement log, and their losses are the Python Trainer's on the same
artifacts (optimisers, clipping, LoRA, Dropout in training mode, BatchNormalization, and gradient
accumulation through js/trainer.mjs's accumulate and apply); the default target's artifacts, as a
control, leave nodes (the loss's LogSoftmax, the step's Sum) to the CPU provider.

Skipped without Chromium or js/node_modules (CI installs both: apt-get install chromium, npm ci),
or where Chromium offers no WebGPU adapter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import numpy_dropout_mask
from test_training import OUT, batches, bn_dropout_model, mlp

from onnx_autodiff.cli import main
from onnx_autodiff.training import Trainer, generate_artifacts

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = "ort.webgpu.min.mjs"
MODELS = ("training_model.onnx", "eval_model.onnx", "accumulate_model.onnx", "apply_model.onnx")
STEPS = 3
# What onnxruntime may keep on its CPU provider by design (shape computations: a kernel's shape or
# axes inputs, a mean's element count Cast(Size(x) / Size(mean))): these ops, and only on values
# computed from Shape or Size.
SHAPE_OPS = frozenset({"Shape", "Size", "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Reshape", "Range",
                       "ConstantOfShape", "Div", "Cast"})

# artifacts command options per directory; "sgd-onnxruntime" is the control (default target)
CONFIGS = {
    "sgd": ["--optimizer", "sgd", "--lr", "0.1"],
    "sgd-momentum": ["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01"],
    "adamw": ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1"],
    "adam-clip": ["--optimizer", "adam", "--lr", "0.01", "--max-grad-norm", "0.5"],
    "adamw-accumulate": ["--optimizer", "adamw", "--lr", "0.01", "--max-grad-norm", "1.0", "--gradient-accumulation"],
    # LoRA, with the hashed dropout on the adapters' input
    "adamw-lora-dropout": ["--optimizer", "adamw", "--lr", "0.05", "--lora", "2", "--lora-dropout", "0.25"],
    # float labels; the gradient's Sign, and the mean's Cast(Size) that stays on the CPU
    "sgd-l1": ["--optimizer", "sgd", "--lr", "0.1", "--loss", "l1"],
    # BatchNormalization in training mode (the WebGPU kernel lacks the mode), running statistics,
    # then Dropout in training mode (the hashed masks). SGD: the bias before it has a zero gradient
    # up to rounding, which Adam would scale up to steps of lr whose signs differ between devices
    # (the running means, and the eval loss, with them)
    "sgd-batchnorm-dropout": ["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--gradient-accumulation"],
}
# How each directory trains (the others take STEPS steps): per step, 1 for Trainer.step, k > 1
# for k micro-batches of the batch's rows accumulated, then applied
PLANS = {"adamw-accumulate": [1, 2, 3], "sgd-batchnorm-dropout": [1, 3, 2]}
MODEL_OF = {"sgd-batchnorm-dropout": "batchnorm-dropout"}  # the others: mlp
CONTROL = "sgd-onnxruntime"

# Trains each artifacts directory of the query with js/trainer.mjs as its batch.json's plan says
# (run_plan), on sessions with the verbose log: markers around the trainer's first use of each
# model, when it creates its session, bound the lines of that model's node placement.
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>WebGPU placement and steps</title></head>
<body data-state="loading"><script type="module">
const query = new URLSearchParams(location.search);
try {
  const ort = await import(`./js/node_modules/onnxruntime-web/dist/${query.get("bundle")}`);
  const { Trainer, sliceRows } = await import("./js/trainer.mjs");
  ort.env.wasm.numThreads = 1;
  ort.env.logLevel = "verbose";
  const results = { adapter: Boolean(await navigator.gpu?.requestAdapter()) };
  const options = { executionProviders: ["webgpu"], logSeverityLevel: 0, logVerbosityLevel: 0 };
  for (const dir of results.adapter ? query.get("dirs").split(",") : []) {
    const read = async (name) => {
      const response = await fetch(`${dir}/${name}`);
      return response.ok ? new Uint8Array(await response.arrayBuffer()) : null;
    };
    const result = results[dir] = {};
    const started = performance.now();
    const opened = new Set();
    const logged = async (model, work) => {
      if (opened.has(model)) return work();
      opened.add(model);
      console.log(`@@session ${dir}/${model}`);
      try {
        return await work();
      } finally {
        console.log(`@@end ${dir}/${model}`);
      }
    };
    try {
      const batch = JSON.parse(new TextDecoder().decode(await read("batch.json")));
      const labels = batch.labelDims ? { type: "float32", dims: batch.labelDims, data: Float32Array.from(batch.labels) }
        : { type: "int64", dims: [batch.dims[0]], data: BigInt64Array.from(batch.labels, BigInt) };
      const feeds = { X: { type: "float32", dims: batch.dims, data: Float32Array.from(batch.X) }, labels };
      const trainer = await logged("training_model.onnx", () => Trainer.open(ort, read, { sessionOptions: options }));
      result.losses = [];
      for (const micro of batch.plan) {  // 1: a step; k > 1: k micro-batches accumulated, then applied
        if (micro === 1) {
          result.losses.push(await trainer.step(feeds));
          continue;
        }
        const rows = batch.dims[0] / micro;
        for (let i = 0; i < micro; i++) {
          const part = sliceRows(feeds, i * rows, (i + 1) * rows);
          result.losses.push(await logged("accumulate_model.onnx", () => trainer.accumulate(part)));
        }
        await logged("apply_model.onnx", () => trainer.apply());
      }
      result.evalLoss = (await logged("eval_model.onnx", () => trainer.evaluate(feeds))).loss;
    } catch (error) {
      result.error = String(error.message ?? error).split("\\n")[0];
    }
    result.seconds = (performance.now() - started) / 1000;
  }
  window.trainingResult = results;
  document.body.dataset.state = "done";
} catch (error) {
  window.trainingError = String(error.message ?? error);
  document.body.dataset.state = "error";
}
</script></body></html>
"""


def run_plan(trainer: Trainer, batch: tuple, plan: list[int]) -> list[float]:
    """The losses of the steps of ``plan`` on ``batch`` (arrays with rows): per step, 1 for
    Trainer.step, k > 1 for k micro-batches of its rows accumulated, then applied (as the pages
    run js/trainer.mjs)."""
    losses = []
    for micro in plan:
        if micro == 1:
            losses.append(trainer.step(batch))
            continue
        rows = len(batch[0]) // micro
        losses += [trainer.accumulate(tuple(a[i * rows:(i + 1) * rows] for a in batch)) for i in range(micro)]
        trainer.apply()
    return losses


def node_placements(lines: list[str]) -> dict[str, dict[str, dict]]:
    """{model: {provider: {"count": N, "nodes": [(op type, node name), ...]}}} from onnxruntime's
    verbose log (session_state.cc's VerifyEachNodeIsAssignedToAnEp: "Node(s) placed on [EP].
    Number of nodes: N" and a line per node, or "All nodes placed on [EP]. Number of nodes: N"),
    between the page's "@@session DIR/MODEL" and "@@end" markers. The counts take in the nodes
    of subgraphs (the update's If branches) and the copies onnxruntime adds between providers."""
    found: dict[str, dict[str, dict]] = {}
    model = provider = None
    for line in lines:
        if line.startswith("@@session "):
            model, provider = line.split(" ", 1)[1], None
            found[model] = {}
            continue
        if line.startswith("@@end"):
            model = None
            continue
        if model is None or "VerifyEachNodeIsAssignedToAnEp]" not in line:
            provider = None
            continue
        placed = re.search(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)", line)
        if placed:
            provider = placed.group(1)
            entry = found[model].setdefault(provider, {"count": 0, "nodes": []})
            entry["count"] += int(placed.group(2))
            continue
        node = re.search(r"\]   (\w+) \((.*)\)\s*$", line)
        if node and provider:
            found[model][provider]["nodes"].append((node.group(1), node.group(2)))
    return found


def shape_computations(model: onnx.ModelProto) -> set[str]:
    """The names of the nodes of SHAPE_OPS that compute on shapes only: Shape and Size, and the
    others whose inputs are computed from their outputs and int64 constants alone."""
    constants = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT64}
    from_shapes: set[str] = set()
    names = set()
    for node in model.graph.node:
        inputs = [x for x in node.input if x]
        if node.op_type == "Constant":
            constants.update(node.output)
        elif node.op_type in ("Shape", "Size") or (node.op_type in SHAPE_OPS and any(x in from_shapes for x in inputs)
                                                   and all(x in from_shapes or x in constants for x in inputs)):
            from_shapes.update(node.output)
            names.add(node.name)
    return names


def bn_model() -> onnx.ModelProto:
    """Gemm, BatchNormalization in training mode, Gemm (its Dropout as Identity: steps repeat)."""
    model = bn_dropout_model()
    dropout = next(n for n in model.graph.node if n.op_type == "Dropout")
    dropout.op_type, dropout.input[:] = "Identity", dropout.input[:1]
    return model


def _check_module():
    spec = importlib.util.spec_from_file_location("web_check", ROOT / "examples" / "web" / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def _nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                yield from _nodes(sub)


# what the WebGPU provider has no kernel for
ABSENT = {"Sum", "Sign", "LogSoftmax", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}


def test_artifacts_and_grad_commands_lower_for_webgpu(tmp_path, capsys):
    """Without a browser: --target webgpu leaves none of the ops the provider lacks in any model
    (the update's If branches included), the labels are read only as Gather indices, every model
    passes the full checker and trains on onnxruntime; grad --target webgpu lowers too."""
    onnx.save(mlp(), tmp_path / "mlp.onnx")
    directory = tmp_path / "artifacts"
    assert main(["artifacts", str(tmp_path / "mlp.onnx"), "-o", str(directory), "--target", "webgpu",
                 "--optimizer", "adamw", "--max-grad-norm", "1", "--gradient-accumulation"]) == 0
    assert json.loads((directory / "artifacts.json").read_text())["target"] == "webgpu"
    for model in MODELS:
        proto = onnx.load(directory / model)
        onnx.checker.check_model(proto, full_check=True)
        nodes = list(_nodes(proto.graph))
        assert not ABSENT & {n.op_type for n in nodes}, model
        assert all(n.op_type == "Gather" and list(n.input).index("labels") == 1 for n in nodes if "labels" in n.input), model
    X, y = next(batches(1))
    trainer = Trainer(str(directory))
    default = Trainer(generate_artifacts(mlp(), optimizer="adamw", max_grad_norm=1.0))
    np.testing.assert_allclose(trainer.evaluate((X, y))["loss"], default.evaluate((X, y))["loss"], rtol=1e-6)
    assert np.isfinite([trainer.step((X, y)) for _ in range(2)]).all()
    with_loss = mlp(extra_nodes=[onnx.helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])])
    with_loss.graph.input.append(onnx.helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["N"]))
    with_loss.graph.output[0].CopyFrom(onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []))
    onnx.save(with_loss, tmp_path / "loss.onnx")
    for target, lowered in (("onnxruntime", False), ("webgpu", True)):
        out = tmp_path / f"grad-{target}.onnx"
        assert main(["grad", str(tmp_path / "loss.onnx"), "-o", str(out), "--target", target]) == 0
        ops = {n.op_type for n in _nodes(onnx.load(out).graph)}
        assert bool(ABSENT & ops) != lowered, (target, ops)
    capsys.readouterr()


def test_training_batchnorm_in_standard_ops_computes_the_kernels_step():
    """The webgpu target's BatchNormalization in training mode, in standard ops (the WebGPU kernel
    lacks the mode): the losses, parameters, momentum and running statistics of three steps and an
    accumulated one are those of onnxruntime's kernel (the default target's artifacts)."""
    states = {}
    for target in ("onnxruntime", "webgpu"):
        artifacts = generate_artifacts(bn_model(), optimizer="sgd", optimizer_options={"lr": 0.1, "momentum": 0.9},
                                       gradient_accumulation=True, target=target)
        training_mode = [n for n in _nodes(artifacts.train_model.graph) if n.op_type == "BatchNormalization"]
        assert bool(training_mode) == (target == "onnxruntime")
        trainer = Trainer(artifacts)
        losses = [trainer.step(batch) for batch in batches(3)]
        trainer.accumulate(next(batches(1)))
        trainer.apply()
        states[target] = losses, trainer.state_dict()
    np.testing.assert_allclose(states["webgpu"][0], states["onnxruntime"][0], rtol=1e-6)
    assert states["webgpu"][1].keys() == states["onnxruntime"][1].keys()
    for key, value in states["onnxruntime"][1].items():
        np.testing.assert_allclose(states["webgpu"][1][key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def dropout_mlp(ratio: float) -> onnx.ModelProto:
    """X[N, 5] → MatMul W[5, 7] → Dropout(ratio) → MatMul V[7, 3] → y[N, 3]."""
    rng = np.random.default_rng(4)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["X", "W"], ["h"]), onnx.helper.make_node("Dropout", ["h", "ratio"], ["d"]),
         onnx.helper.make_node("MatMul", ["d", "V"], ["y"])],
        "dropout_mlp", [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", 5])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
        [onnx.numpy_helper.from_array(a, name) for name, a in (
            ("W", rng.standard_normal((5, 7)).astype(np.float32)), ("V", rng.standard_normal((7, 3)).astype(np.float32)),
            ("ratio", np.array(ratio, np.float32)))])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=8)


def test_hashed_dropout_trains_as_numpy_does_with_its_masks():
    """The webgpu target's Dropout in training mode against numpy with the masks of the hash's
    definition: the MSE loss and SGD's update of both weights (the scale 1/(1 − p), the gradient
    through the same mask) of two steps (the masks of steps 1 and 2), then of a step accumulated
    in two micro-batches (those of its micro-batches 0 and 1) and applied."""
    ratio, lr = 0.4, 0.1
    artifacts = generate_artifacts(dropout_mlp(ratio), loss="mse", optimizer="sgd", optimizer_options={"lr": lr},
                                   gradient_accumulation=True, target="webgpu")
    for model in (artifacts.train_model, artifacts.accumulate_model):
        onnx.checker.check_model(model, full_check=True)
        assert "Dropout" not in {n.op_type for n in _nodes(model.graph)}
    rng = np.random.default_rng(8)
    X, T = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
    W, V = (artifacts.checkpoint[k].astype(np.float64) for k in ("W", "V"))

    def numpy_step(X, T, step, micro_batch=0):
        """The loss and the gradients of W and V, in float64."""
        m = numpy_dropout_mask((len(X), 7), ratio, step, micro_batch) / (1 - np.float32(ratio))
        h = X @ W
        y = (h * m) @ V
        dy = 2 * (y - T) / y.size
        return np.mean((y - T) ** 2), X.T @ ((dy @ V.T) * m), (h * m).T @ dy

    trainer = Trainer(artifacts)
    for step in (1, 2):
        loss, dW, dV = numpy_step(X, T, step)
        np.testing.assert_allclose(trainer.step((X, T)), loss, rtol=1e-5)
        W, V = W - lr * dW, V - lr * dV
        np.testing.assert_allclose(trainer.parameters()["W"], W, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trainer.parameters()["V"], V, rtol=1e-5, atol=1e-6)
    parts = [numpy_step(X[i:i + 3], T[i:i + 3], 3, micro_batch) for micro_batch, i in enumerate((0, 3))]
    for (loss, _, _), i in zip(parts, (0, 3)):
        np.testing.assert_allclose(trainer.accumulate((X[i:i + 3], T[i:i + 3])), loss, rtol=1e-5)
    trainer.apply()
    W, V = W - lr * (parts[0][1] + parts[1][1]) / 2, V - lr * (parts[0][2] + parts[1][2]) / 2
    np.testing.assert_allclose(trainer.parameters()["W"], W, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.parameters()["V"], V, rtol=1e-5, atol=1e-6)


def test_placement_parser_reads_both_forms():
    lines = ["@@session a/m.onnx",
             "[V:onnxruntime:, session_state.cc:1377 VerifyEachNodeIsAssignedToAnEp] Node placements",
             "[V:onnxruntime:, session_state.cc:1383 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 2",
             "[V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp]   Sum (opt_Sum_4)",
             "[V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp]   LogSoftmax ()",
             "[V:onnxruntime:, session_state.cc:1383 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [WebGpuExecutionProvider]. Number of nodes: 1",
             "[V:onnxruntime:, session_state.cc:1385 VerifyEachNodeIsAssignedToAnEp]   Gemm (g)",
             "[I:onnxruntime:, session_state.cc:186 CreateGraphInfo] SaveMLValueNameIndexMapping",
             "@@end a/m.onnx", "@@session b/m.onnx",
             "[V:onnxruntime:, session_state.cc:1380 VerifyEachNodeIsAssignedToAnEp]  All nodes placed on [WebGpuExecutionProvider]. Number of nodes: 63",
             "@@end b/m.onnx"]
    assert node_placements(lines) == {
        "a/m.onnx": {"CPUExecutionProvider": {"count": 2, "nodes": [("Sum", "opt_Sum_4"), ("LogSoftmax", "")]},
                     "WebGpuExecutionProvider": {"count": 1, "nodes": [("Gemm", "g")]}},
        "b/m.onnx": {"WebGpuExecutionProvider": {"count": 63, "nodes": []}},
    }


def test_webgpu_artifacts_run_every_compute_node_on_the_gpu(tmp_path, capsys):
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    if not (ROOT / "js" / "node_modules" / "onnxruntime-web" / "dist" / BUNDLE).is_file():
        pytest.skip("js/node_modules is missing: run npm ci --ignore-scripts --prefix js")
    pytest.importorskip("safetensors", reason="the JavaScript trainer reads safetensors checkpoints")
    check = _check_module()
    site = tmp_path / "site"
    site.mkdir()
    (site / "js").symlink_to(ROOT / "js", target_is_directory=True)
    (site / "step.html").write_text(PAGE, encoding="utf-8")
    models = {"mlp": mlp(), "batchnorm-dropout": bn_dropout_model()}
    for key, model in models.items():
        onnx.save(model, tmp_path / f"{key}.onnx")
    X, y = next(batches(1))
    targets = np.random.default_rng(5).standard_normal((X.shape[0], OUT)).astype(np.float32)  # for l1
    expected = {}
    configs = {**{name: [*options, "--target", "webgpu"] for name, options in CONFIGS.items()},
               CONTROL: CONFIGS["sgd"]}
    for name, options in configs.items():
        directory = site / name
        model = tmp_path / f"{MODEL_OF.get(name, 'mlp')}.onnx"
        assert main(["artifacts", str(model), "-o", str(directory), "--checkpoint-format", "safetensors", *options]) == 0
        labels = targets if "--loss" in options else y
        plan = PLANS.get(name, [1] * STEPS)
        batch = {"dims": list(X.shape), "X": X.ravel().tolist(), "labels": labels.ravel().tolist(), "plan": plan}
        if labels.dtype == np.float32:
            batch["labelDims"] = list(labels.shape)
        (directory / "batch.json").write_text(json.dumps(batch))
        trainer = Trainer(str(directory))
        expected[name] = run_plan(trainer, (X, labels), plan) + [float(trainer.evaluate((X, labels))["loss"])]
    capsys.readouterr()
    results, console = check.open_page(executable, site, f"step.html?bundle={BUNDLE}&dirs={','.join(configs)}",
                                       str(tmp_path / "page.png"), 240, webgpu=True)
    if not results["adapter"]:
        pytest.skip("this Chromium offers no WebGPU adapter (navigator.gpu.requestAdapter() gave none)")
    placements = node_placements(console)
    figures = []
    for name in configs:
        got = results[name]
        assert "error" not in got, f"{name}: {got['error']}"
        np.testing.assert_allclose([*got["losses"], got["evalLoss"]], expected[name], rtol=1e-4, err_msg=name)
        for model in MODELS:
            if not (site / name / model).is_file():
                continue
            placed = placements.get(f"{name}/{model}")
            assert placed and placed.get("WebGpuExecutionProvider", {}).get("count"), f"{name}/{model}: no placement logged"
            cpu = placed.get("CPUExecutionProvider", {"count": 0, "nodes": []})
            figures.append(f"{name}/{model}: {cpu['count']} CPU, {placed['WebGpuExecutionProvider']['count']} WebGPU"
                           + (f" ({got['seconds']:.1f} s for the directory)" if model == MODELS[0] else ""))
            if name == CONTROL:
                continue
            allowed = shape_computations(onnx.load(site / name / model, load_external_data=False))
            compute = [f"{op} '{node}'" for op, node in cpu["nodes"] if op not in SHAPE_OPS or node not in allowed]
            assert cpu["count"] == len(cpu["nodes"]) and compute == [], f"{name}/{model} on the CPU: {compute}"
    control = placements[f"{CONTROL}/training_model.onnx"]["CPUExecutionProvider"]["nodes"]
    assert {"LogSoftmax", "Sum"} <= {op for op, _ in control}, control  # what the webgpu target lowers
    print("\n".join(figures))
