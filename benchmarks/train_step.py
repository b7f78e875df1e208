"""Train-step time on plain onnxruntime: MLP 784-256-10, AdamW, batch 64 (prints ms/step).

    python benchmarks/train_step.py [--steps 200] [--batch 64] [--optimizer adamw] [--torch]
        [--peer PYTHON]

Prints the whole train step and the optimiser step alone (the apply model: parameters, gradients
and state in, new parameters and state out), median and min over the runs, and the median in
process CPU time (all threads; other load on the machine disturbs it less). ``--torch`` also
times PyTorch eager autograd with torch.optim on the same network (the CPU speed bar), its step
and ``optimizer.step()`` alone, in the same process, taking turns with ours run by run.
The discontinued onnxruntime-training 1.19.2 runs the same step in ort_training_step.py (in a venv
of its own; see there); ``--peer PYTHON`` runs it with that interpreter before and after ours.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.toolkit import proto_graphs
from onnx_autodiff.training import Trainer, generate_artifacts


def mlp(sizes=(784, 256, 10), seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "X"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1 / fan_in**0.5
        inits += [
            numpy_helper.from_array(rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32), f"W{i}"),
            numpy_helper.from_array(rng.uniform(-bound, bound, fan_out).astype(np.float32), f"b{i}"),
        ]
        y = "logits" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [y], transB=1))
        if y != "logits":
            nodes.append(helper.make_node("Relu", [y], [f"a{i}"]))
            y = f"a{i}"
        x = y
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", sizes[-1]])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def time_steps(steps: int, repeats: int = 7, **timed) -> dict[str, tuple[float, float, float]]:
    """(median, min, median CPU) over ``repeats`` runs of the mean ms per call of each function in
    ``timed`` (CPU: process time, all threads); the functions take turns run by run, so a busy
    machine slows them alike."""
    for step in timed.values():
        for _ in range(20):
            step()
    runs: dict[str, list[float]] = {name: [] for name in timed}
    cpu: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(repeats):
        for name, step in timed.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            runs[name].append((time.perf_counter() - start) / steps * 1e3)
            cpu[name].append((time.process_time() - start_cpu) / steps * 1e3)
    return {name: (statistics.median(r), min(r), statistics.median(cpu[name])) for name, r in runs.items()}


def node_count(model: onnx.ModelProto) -> int:
    return sum(len(graph.node) for graph in proto_graphs(model.graph))


def peer(python: str) -> str:
    """ort_training_step.py's line, run by ``python`` (a venv with onnxruntime-training)."""
    script = Path(__file__).resolve().parent / "ort_training_step.py"
    done = subprocess.run([python, str(script)], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--torch", action="store_true", help="also time PyTorch eager")
    parser.add_argument("--peer", metavar="PYTHON", help="also run ort_training_step.py with this interpreter")
    args = parser.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    X = rng.standard_normal((args.batch, 784)).astype(np.float32)
    labels = rng.integers(0, 10, args.batch).astype(np.int64)
    start = time.perf_counter()
    artifacts = generate_artifacts(mlp(), loss="cross_entropy", optimizer=args.optimizer, gradient_accumulation=True)
    build = time.perf_counter() - start
    trainer = Trainer(artifacts)
    batch = {"X": X, "labels": labels}
    # the optimiser alone: the apply model's run on one micro-batch's gradients (grad_scale 1)
    updater = Trainer(artifacts)
    updater.accumulate(batch)
    apply = updater.steps.runner("apply")
    timed = {
        "step": lambda: trainer.step(batch),
        "optimizer": lambda: apply.run(None, {"lr": updater.lr, "step": 1, "grad_scale": 1.0}),
    }
    if args.torch:
        import torch

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[args.optimizer](net.parameters(), lr=1e-3)
        tx, tl = torch.from_numpy(X), torch.from_numpy(labels)

        def torch_step():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(tx), tl)
            loss.backward()
            optimizer.step()

        torch_step()  # leaves gradients for optimizer.step() alone
        timed.update(torch_step=torch_step, torch_optimizer=optimizer.step)
    before = peer(args.peer) if args.peer else None
    ms = time_steps(args.steps, **timed)
    after = peer(args.peer) if args.peer else None
    print(f"onnxruntime {ort.__version__} ({trainer.providers[0]}), MLP 784-256-10, {args.optimizer}, batch {args.batch}")
    print(f"  artifacts built in {build:.2f} s; train model {node_count(artifacts.train_model)} nodes, "
          f"apply model {node_count(artifacts.apply_model)} (with the update's If branches)")
    print(f"  ms per call, median (min) [CPU] of 7 x {args.steps}:  train step            optimiser step")
    rows = [("onnx-autodiff", "step", "optimizer")]
    if args.torch:
        rows.append((f"PyTorch {torch.__version__} eager", "torch_step", "torch_optimizer"))
    for label, whole, alone in rows:
        (m1, n1, c1), (m2, n2, c2) = ms[whole], ms[alone]
        print(f"  {label:<26} {m1:6.3f} ({n1:.3f}) [{c1:.3f}]   {m2:6.3f} ({n2:.3f}) [{c2:.3f}]")
    if args.peer:
        print(f"  before: {before}\n  after:  {after}")


if __name__ == "__main__":
    main()
