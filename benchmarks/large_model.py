"""``onnx-autodiff grad`` on a model over 2 GB: time, peak memory, and the output checked on onnxruntime.

    python benchmarks/large_model.py [--scale 1] [--train] [--dir /tmp] [--keep]

Builds a four-layer MLP (X[2, 16384] -> MatMul 16384x8192 -> Relu -> MatMul 8192x16384 -> ...,
loss = mean(y²)), four float32 weights of 512 MiB each (2.15 GB), stored as external data and
written in slices so that building stays small. Then, each in its own process so that peak RSS
is that step's alone:

- ``onnx-autodiff grad`` on it (wall time, peak RSS);
- the output on onnxruntime: the loss and ``grad_W1`` (the gradient that flows through all four
  layers) against numpy in float64;
- with ``--train``: ``onnx-autodiff artifacts --loss none --optimizer sgd``, then the Trainer: two
  steps and ``export(path)`` (external data), the exported loss checked against the eval model.

``--scale K`` divides every width by K (``--scale 8``: 34 MB, seconds). The files are removed
afterwards unless ``--keep``. At full size the onnxruntime check needs about 6 GB of memory,
and the files 4.3 GB of disk (8.6 GB with ``--train``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

WIDTHS = (16384, 8192, 16384, 8192, 16384)
BATCH = 2
ROWS = 1024  # rows of a weight generated at a time


def build(path: str, widths, seed: int = 0) -> int:
    """Writes the model to ``path`` and its weights to ``path``.data, a slice at a time; returns the data size."""
    rng = np.random.default_rng(seed)
    data = os.path.basename(path) + ".data"
    inits, nodes, x, offset = [], [], "X", 0
    with open(os.path.join(os.path.dirname(path), data), "wb") as stream:
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:]), 1):
            for start in range(0, fan_in, ROWS):
                rows = min(ROWS, fan_in - start)
                block = rng.standard_normal((rows, fan_out), dtype=np.float32) * np.float32(fan_in**-0.5)
                stream.write(block.astype("<f4").tobytes())
            length = fan_in * fan_out * 4
            tensor = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[fan_in, fan_out],
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data), ("offset", offset), ("length", length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            inits.append(tensor)
            offset += length
            y = f"h{i}"
            nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [y]))
            if i < len(widths) - 1:
                nodes.append(helper.make_node("Relu", [y], [f"a{i}"]))
                y = f"a{i}"
            x = y
    nodes += [helper.make_node("Mul", [x, x], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "large_mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [BATCH, widths[0]])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return offset


def run_measured(argv: list[str]) -> tuple[int, float, float, str]:
    """Runs ``argv``; returns (exit code, wall seconds, peak RSS in MB, its output)."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, time.perf_counter() - start, usage.ru_maxrss / 1024, output.strip()


def _weights(path: str, widths) -> list[np.ndarray]:
    """The weights, memory-mapped from the data file."""
    data, offset, weights = path + ".data", 0, []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        weights.append(np.memmap(data, "<f4", "r", offset, (fan_in, fan_out)))
        offset += fan_in * fan_out * 4
    return weights


def _times(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """a @ w in float64, w converted a slice of rows at a time."""
    return sum(a[:, s:s + ROWS] @ w[s:s + ROWS].astype(np.float64) for s in range(0, w.shape[0], ROWS))


def _times_t(d: np.ndarray, w: np.ndarray) -> np.ndarray:
    """d @ w.T in float64."""
    return np.concatenate([d @ w[s:s + ROWS].astype(np.float64).T for s in range(0, w.shape[0], ROWS)], axis=1)


def check(model: str, output: str, widths) -> int:
    """The output on onnxruntime: loss and grad_W1 against numpy (float64); prints the errors."""
    import onnxruntime as ort

    x = np.random.default_rng(1).standard_normal((BATCH, widths[0])).astype(np.float32)
    start = time.perf_counter()
    session = ort.InferenceSession(output, providers=["CPUExecutionProvider"])
    loss, grad = session.run(["loss", "grad_W1"], {"X": x})
    seconds = time.perf_counter() - start
    del session
    weights = _weights(model, widths)
    acts = [x.astype(np.float64)]
    for i, w in enumerate(weights):
        h = _times(acts[-1], w)
        acts.append(np.maximum(h, 0) if i < len(weights) - 1 else h)
    y = acts[-1]
    d = 2 * y / y.size  # d loss / d y
    for i in range(len(weights) - 1, 0, -1):
        d = _times_t(d, weights[i]) * (acts[i] > 0)
    worst = scale = 0.0
    for s in range(0, widths[0], ROWS):  # grad_W1 = X^T d, compared a slice at a time
        reference = acts[0][:, s:s + ROWS].T @ d
        worst = max(worst, float(np.abs(grad[s:s + ROWS] - reference).max()))
        scale = max(scale, float(np.abs(reference).max()))
    loss_error = abs(float(loss) - float(np.mean(y * y))) / abs(float(np.mean(y * y)))
    print(f"onnxruntime: session + run {seconds:.1f} s; loss relative error {loss_error:.1e}; "
          f"grad_W1 {grad.shape} max error {worst / scale:.1e} of its largest element")
    return 0 if loss_error < 1e-4 and worst <= 1e-4 * scale else 1


def train(folder: str, widths) -> int:
    """Two SGD steps of the artifacts in ``folder``/artifacts, export with external data, and the
    exported model's loss against the eval model's."""
    import onnxruntime as ort

    from onnx_autodiff.training import Trainer

    batch = {"X": np.random.default_rng(1).standard_normal((BATCH, widths[0])).astype(np.float32)}
    start = time.perf_counter()
    trainer = Trainer(os.path.join(folder, "artifacts"), lr=1e-3, providers=["CPUExecutionProvider"])
    losses = [trainer.step(batch) for _ in range(2)]
    steps = time.perf_counter() - start
    expected = float(trainer.evaluate(batch)["loss"])
    del trainer.artifacts.checkpoint  # the initial values, not needed any more
    start = time.perf_counter()
    path = os.path.join(folder, "exported.onnx")
    trainer.export(path)
    exporting = time.perf_counter() - start
    del trainer
    (loss,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["loss"], batch)
    error = abs(float(loss) - expected) / abs(expected)
    print(f"Trainer: 2 steps in {steps:.1f} s (loss {losses[0]:.4f} -> {losses[1]:.4f}), export {exporting:.1f} s; "
          f"exported loss relative error {error:.1e}")
    return 0 if error < 1e-5 and losses[1] < losses[0] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="divide every width by this (default 1: 2.15 GB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the model and its output")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--train", action="store_true", help="also artifacts, two Trainer steps and export")
    parser.add_argument("--check", nargs=2, metavar=("MODEL", "OUTPUT"), help=argparse.SUPPRESS)
    parser.add_argument("--trainer", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    widths = [w // args.scale for w in WIDTHS]
    if args.check:
        return check(*args.check, widths)
    if args.trainer:
        return train(args.trainer, widths)
    folder = tempfile.mkdtemp(prefix="onnx-autodiff-large-", dir=args.dir)
    try:
        model, output = os.path.join(folder, "model.onnx"), os.path.join(folder, "grad.onnx")
        start = time.perf_counter()
        size = build(model, widths)
        print(f"model: {len(widths) - 1} MatMul weights {widths[0]}x{widths[1]}, {size / 1e9:.2f} GB of "
              f"external data, built in {time.perf_counter() - start:.1f} s")
        code, seconds, peak, text = run_measured(
            [sys.executable, "-m", "onnx_autodiff", "grad", model, "-o", output])
        print(f"onnx-autodiff grad: exit {code}, {seconds:.1f} s, peak RSS {peak:.0f} MB"
              f" (largest tensor {widths[0] * widths[1] * 4 / 1e6:.0f} MB)\n  {text}")
        if code:
            return code
        files = sorted(f for f in os.listdir(folder) if f.startswith("grad"))
        print("  wrote " + ", ".join(f"{f} ({os.path.getsize(os.path.join(folder, f)) / 1e6:.1f} MB)" for f in files))
        code, seconds, peak, text = run_measured(
            [sys.executable, __file__, "--scale", str(args.scale), "--check", model, output])
        print(f"{text}\n  check: exit {code}, {seconds:.1f} s, peak RSS {peak:.0f} MB")
        if code or not args.train:
            return code
        os.unlink(output)
        os.unlink(output + ".data")
        code, seconds, peak, text = run_measured([sys.executable, "-m", "onnx_autodiff", "artifacts", model, "-o",
                                                  os.path.join(folder, "artifacts"), "--loss", "none", "--optimizer", "sgd"])
        print(f"onnx-autodiff artifacts: exit {code}, {seconds:.1f} s, peak RSS {peak:.0f} MB\n  {text}")
        if code:
            return code
        code, seconds, peak, text = run_measured(
            [sys.executable, __file__, "--scale", str(args.scale), "--trainer", folder])
        print(f"{text}\n  exit {code}, {seconds:.1f} s, peak RSS {peak:.0f} MB")
        return code
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
