"""The peer of train_step.py: onnxruntime-training 1.19.2's train step and AdamW step on the same MLP 784-256-10, batch 64.

onnxruntime-training is discontinued (its last wheels are for Python 3.11); in a venv of its own:

    python3.11 -m venv /tmp/ortt && /tmp/ortt/bin/pip install onnxruntime-training==1.19.2 "numpy<2" onnx==1.16.2 torch==2.13.0
    /tmp/ortt/bin/python benchmarks/ort_training_step.py

Run it alternately with ``python benchmarks/train_step.py --torch`` (ms per call, median (min) [median
process CPU time] of 7 runs of 200), or let that script run it: ``--peer /tmp/ortt/bin/python``.
"""
import os
import statistics
import tempfile
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module, Optimizer

def mlp(sizes=(784, 256, 10), seed=0):
    """train_step.py's MLP (Gemm, Relu, Gemm; the same seed), at the opset onnxruntime-training knows."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "X"
    for i, (fi, fo) in enumerate(zip(sizes[:-1], sizes[1:])):
        b = 1 / fi ** 0.5
        inits += [numpy_helper.from_array(rng.uniform(-b, b, (fo, fi)).astype(np.float32), f"W{i}"),
                  numpy_helper.from_array(rng.uniform(-b, b, fo).astype(np.float32), f"b{i}")]
        y = "logits" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [y], transB=1))
        if y != "logits":
            nodes.append(helper.make_node("Relu", [y], [f"a{i}"])); y = f"a{i}"
        x = y
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", sizes[0]])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", sizes[-1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

d = tempfile.mkdtemp()
artifacts.generate_artifacts(mlp(), requires_grad=["W0", "b0", "W1", "b1"], loss=artifacts.LossType.CrossEntropyLoss,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
module = Module(os.path.join(d, "training_model.onnx"), state, os.path.join(d, "eval_model.onnx"))
opt = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
module.train()
rng = np.random.default_rng(1)
X = rng.standard_normal((64, 784)).astype(np.float32); y = rng.integers(0, 10, 64).astype(np.int64)
def step():
    module(X, y); opt.step(); module.lazy_reset_grad()
def optimizer_only():
    opt.step()
for _ in range(20): step()
runs = {"step": [], "optimizer": []}
cpu = {"step": [], "optimizer": []}
for r in range(7):
    for name, f in (("step", step), ("optimizer", optimizer_only)):
        s, c = time.perf_counter(), time.process_time()
        for _ in range(200): f()
        runs[name].append((time.perf_counter() - s) / 200 * 1e3)
        cpu[name].append((time.process_time() - c) / 200 * 1e3)
print("onnxruntime-training 1.19.2: train step %.3f (%.3f) [%.3f] ms, optimiser step %.3f (%.3f) [%.3f] ms" % (
    statistics.median(runs["step"]), min(runs["step"]), statistics.median(cpu["step"]),
    statistics.median(runs["optimizer"]), min(runs["optimizer"]), statistics.median(cpu["optimizer"])))
