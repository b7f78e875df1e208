"""Build time of the autodiff pass, the cleanup, the ``grad`` command and the training artifacts against graph size.

Run: python benchmarks/build_time.py [--models gpt8 res1000 res5000 res20001 resb20001 blocks64 ...] [--repeat 3]
[--cli] [--artifacts] [--ort-training-python /tmp/ortt/bin/python]
Models: ``gptN`` (the GPT-style decoder of benchmarks/models.py with N blocks, 224 nodes for N = 8),
``resN`` (a residual chain x + tanh(x·W_i) of N nodes: MatMul, Tanh, Add per layer, then the
mean; a 16×16 parameter per three nodes), ``resbN`` (x + tanh(x·W_i + b_i): MatMul, Add, Tanh, Add,
two parameters per four nodes) and ``blocksN`` (N stacked transformer-style blocks). Prints one row
per model: forward nodes, float parameters, backward nodes without and with cleanup, seconds for
the pass alone (``pass s``), for the cleanup and for both (``total s``, in process), and
microseconds per forward node (flat when growth is linear); the best of ``--repeat`` runs, each on
a fresh copy of the model. Builds in process run inside ``onnx_autodiff.collector_paused()``, as
the command line's do. Columns of the options:

- ``--cli``: ``cli s``, the wall-clock seconds of ``onnx-autodiff grad MODEL -o OUT`` (a process:
  loading, checking and writing included), ``cli raw s`` the same with ``--no-cleanup``, and
  ``cli art s``, ``onnx-autodiff artifacts MODEL -o DIR --loss none`` (AdamW, every parameter).
- ``--artifacts``: ``artifacts s``, the seconds of ``generate_artifacts(MODEL, loss=None,
  optimizer="adamw")`` and ``save(DIR)`` in a fresh process per run (import and exit left out), and
  ``us/param art``, those microseconds per parameter.
- ``--ort-training-python PY``: ``ortt art s``, onnxruntime-training 1.19.2's ``generate_artifacts``
  (AdamW, every float initializer, the model's output as the loss, which writes the directory) on the
  same model file, timed the same way by benchmarks/ort_training_build.py run with ``PY``, the
  python of its own venv (see that script); "failed" where its gradient builder fails on the model
  (gpt8's), the error's last line printed after the table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff

D, HEADS, SEQ = 32, 4, 8


def transformer_stack(blocks: int, seed: int = 0):
    """blocks × (LayerNorm → QKV MatMul → Split → attention → projection → residual → MLP)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name))
        return name

    def node(op, inputs, outputs, **attrs):
        nodes.append(helper.make_node(op, inputs, outputs, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    weight("ones", D)
    weight("zeros", D)
    inits.append(numpy_helper.from_array(np.array([0, SEQ, HEADS, D // HEADS], np.int64), "heads"))
    inits.append(numpy_helper.from_array(np.array([0, SEQ, D], np.int64), "merged"))
    inits.append(numpy_helper.from_array(np.array([D, D, D], np.int64), "qkv_split"))
    inits.append(numpy_helper.from_array(np.array(1 / np.sqrt(D // HEADS), np.float32), "scale"))
    x = "x"
    for b in range(blocks):
        p = f"b{b}_"
        h = node("LayerNormalization", [x, "ones", "zeros"], [p + "ln1"], axis=-1)
        qkv = node("MatMul", [h, weight(p + "Wqkv", D, 3 * D)], [p + "qkv"])
        q, k, v = node("Split", [qkv, "qkv_split"], [p + "q", p + "k", p + "v"], axis=-1)
        heads = []
        for name in (q, k, v):
            r = node("Reshape", [name, "heads"], [name + "_r"])
            heads.append(node("Transpose", [r], [name + "_t"], perm=[0, 2, 1, 3]))
        kt = node("Transpose", [heads[1]], [p + "kT"], perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [heads[0], kt], [p + "qk"]), "scale"], [p + "scores"])
        attn = node("Softmax", [scores], [p + "attn"], axis=-1)
        ctx = node("Transpose", [node("MatMul", [attn, heads[2]], [p + "ctx"])], [p + "ctx_t"], perm=[0, 2, 1, 3])
        merged = node("Reshape", [ctx, "merged"], [p + "merged"])
        x = node("Add", [x, node("MatMul", [merged, weight(p + "Wo", D, D)], [p + "proj"])], [p + "res1"])
        h = node("LayerNormalization", [x, "ones", "zeros"], [p + "ln2"], axis=-1)
        up = node("Relu", [node("MatMul", [h, weight(p + "W1", D, 4 * D)], [p + "up"])], [p + "act"])
        x = node("Add", [x, node("MatMul", [up, weight(p + "W2", 4 * D, D)], [p + "down"])], [p + "res2"])
    loss = node("ReduceMean", [node("Mul", [x, x], ["sq"])], ["loss"], keepdims=0)
    graph = helper.make_graph(
        nodes, "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SEQ, D])],
        [helper.make_tensor_value_info(loss, TensorProto.FLOAT, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def residual_chain(nodes: int, width: int = 16, batch: int = 8, seed: int = 0, bias: bool = False) -> onnx.ModelProto:
    """x ← x + tanh(x·W_i) (MatMul, Tanh, Add) until ``nodes`` nodes with the final mean (Tanh
    nodes fill up what three do not divide); ``bias``: x ← x + tanh(x·W_i + b_i) (MatMul, Add,
    Tanh, Add: two parameters per four nodes)."""
    rng = np.random.default_rng(seed)
    layers, extra = divmod(nodes - 1, 4 if bias else 3)
    graph_nodes, inits, x = [], [], "x"
    for i in range(layers):
        array = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(array, f"w{i}"))
        graph_nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        product = f"m{i}"
        if bias:
            inits.append(numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(np.float32), f"b{i}"))
            graph_nodes.append(helper.make_node("Add", [product, f"b{i}"], [f"a{i}"]))
            product = f"a{i}"
        graph_nodes += [helper.make_node("Tanh", [product], [f"t{i}"]),
                        helper.make_node("Add", [x, f"t{i}"], [f"r{i}"])]
        x = f"r{i}"
    for j in range(extra):
        graph_nodes.append(helper.make_node("Tanh", [x], [f"e{j}"]))
        x = f"e{j}"
    graph_nodes.append(helper.make_node("ReduceMean", [x], ["loss"], keepdims=0))
    graph = helper.make_graph(graph_nodes, "residual",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def build(name: str) -> onnx.ModelProto:
    if name.startswith("gpt"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import models

        return models.helper_model(models.GPTConfig(layers=int(name[3:])))
    if name.startswith("resb"):
        return residual_chain(int(name[4:]), bias=True)
    if name.startswith("res"):
        return residual_chain(int(name[3:]))
    if name.startswith("blocks"):
        return transformer_stack(int(name[6:]))
    raise SystemExit(f"unknown model {name!r}: gptN, resN or blocksN")


def measure(proto: onnx.ModelProto, repeat: int) -> dict:
    """Best seconds of the pass and of the cleanup, and the node counts."""
    forward = len(proto.graph.node)
    row = {"pass": float("inf"), "cleanup": float("inf"), "total": float("inf"), "forward": forward}
    for _ in range(repeat):
        model = ir.from_proto(proto)
        with onnx_autodiff.collector_paused():
            start = time.perf_counter()
            onnx_autodiff.autodiff_pass(of="loss")(model)
            middle = time.perf_counter()
            row["raw"] = len(model.graph) - forward
            for cleanup in onnx_autodiff.cleanup_passes():
                cleanup(model)
            end = time.perf_counter()
        row["cleaned"] = len(model.graph) - forward
        for key, seconds in (("pass", middle - start), ("cleanup", end - middle), ("total", end - start)):
            row[key] = min(row[key], seconds)
    return row


def cli_seconds(path: str, repeat: int, *options: str) -> float:
    """Best wall-clock seconds of ``onnx-autodiff grad path -o OUT options``."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            start = time.perf_counter()
            # (run from tmp: from the checkout, "-m" would find the package folder beside it)
            subprocess.run([sys.executable, "-m", "onnx_autodiff", "grad", path, "-o", os.path.join(tmp, "out.onnx"),
                            *options], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
            best = min(best, time.perf_counter() - start)
    return best


def cli_artifacts_seconds(path: str, repeat: int) -> float:
    """Best wall-clock seconds of ``onnx-autodiff artifacts path -o DIR --loss none``."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "onnx_autodiff", "artifacts", path, "-o", os.path.join(tmp, f"art{i}"),
                            "--loss", "none", "--optimizer", "adamw"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
            best = min(best, time.perf_counter() - start)
    return best


def artifacts_once(path: str) -> float:
    """Seconds of generate_artifacts (AdamW, the output as the loss, every float initializer) and save."""
    from onnx_autodiff.training import generate_artifacts

    proto = onnx.load(path)
    params = [t.name for t in proto.graph.initializer if t.data_type in FLOATS]
    with tempfile.TemporaryDirectory() as tmp, onnx_autodiff.collector_paused():
        start = time.perf_counter()
        generate_artifacts(proto, requires_grad=params, loss=None, optimizer="adamw").save(tmp)
        return time.perf_counter() - start


def process_seconds(command: list[str], repeat: int) -> float:
    """Best of the seconds that ``command`` prints on its last line, a fresh process per run."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tmp)
            best = min(best, float(done.stdout.strip().splitlines()[-1]))
    return best


FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt8", "res1000", "res5000", "res20001"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cli", action="store_true", help="also time the commands (a process per run)")
    parser.add_argument("--artifacts", action="store_true", help="also time generate_artifacts and save")
    parser.add_argument("--ort-training-python", metavar="PY",
                        help="also time onnxruntime-training's generate_artifacts with this python (its venv)")
    parser.add_argument("--no-pass", action="store_true", help="leave out the in-process pass and cleanup columns")
    parser.add_argument("--artifacts-worker", help=argparse.SUPPRESS)  # a model file: print artifacts_once's seconds
    args = parser.parse_args()
    if args.artifacts_worker:
        print(f"{artifacts_once(args.artifacts_worker):.3f}")
        return
    header = f"{'model':>10} {'fwd nodes':>9} {'params':>6}"
    if not args.no_pass:
        header += (f" {'bwd raw':>8} {'bwd clean':>9} {'pass s':>7} {'cleanup s':>9} "
                   f"{'total s':>7} {'us/node pass':>12} {'us/node total':>13}")
    header += f" {'cli s':>6} {'cli raw s':>9} {'cli art s':>9}" if args.cli else ""
    header += f" {'artifacts s':>11} {'us/param art':>12}" if args.artifacts else ""
    header += f" {'ortt art s':>10}" if args.ort_training_python else ""
    print(header)
    failures: list[str] = []
    for name in args.models:
        proto = build(name)
        forward = len(proto.graph.node)
        params = sum(t.data_type in FLOATS for t in proto.graph.initializer)
        line = f"{name:>10} {forward:>9} {params:>6}"
        if not args.no_pass:
            row = measure(proto, args.repeat)
            line += (f" {row['raw']:>8} {row['cleaned']:>9} {row['pass']:>7.2f} "
                     f"{row['cleanup']:>9.2f} {row['total']:>7.2f} {1e6 * row['pass'] / forward:>12.0f} "
                     f"{1e6 * row['total'] / forward:>13.0f}")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            onnx.save(proto, path)
            if args.cli:
                line += (f" {cli_seconds(path, args.repeat):>6.2f} {cli_seconds(path, args.repeat, '--no-cleanup'):>9.2f}"
                         f" {cli_artifacts_seconds(path, args.repeat):>9.2f}")
            if args.artifacts:
                seconds = process_seconds([sys.executable, os.path.abspath(__file__), "--artifacts-worker", path],
                                          args.repeat)
                line += f" {seconds:>11.2f} {1e6 * seconds / max(params, 1):>12.0f}"
            if args.ort_training_python:
                script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ort_training_build.py")
                try:
                    seconds = process_seconds([args.ort_training_python, script, path, "--repeat", "1"], args.repeat)
                    line += f" {seconds:>10.2f}"
                except subprocess.CalledProcessError as error:  # the peer's own failure: a row, not the end
                    line += f" {'failed':>10}"
                    last = (error.stderr or "").strip().splitlines()
                    failures.append(f"{name}: onnxruntime-training failed: {last[-1] if last else error}")
        print(line, flush=True)
    for failure in failures:
        print(failure)


if __name__ == "__main__":
    main()
