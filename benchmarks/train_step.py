"""Train-step time on plain onnxruntime: MLP 784-256-10, AdamW, batch 64 (prints ms/step).

    python benchmarks/train_step.py [--steps 500] [--batch 64] [--optimizer adamw] [--torch]

For reference, the discontinued onnxruntime-training 1.19.2 measured 0.67-0.89 ms/step for the
same model and batch on the development machine. ``--torch`` also times PyTorch eager autograd
with torch.optim on the same network (the CPU speed bar).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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


def time_steps(step, steps: int, repeats: int = 5) -> float:
    """Median over ``repeats`` runs of the mean ms per step."""
    for _ in range(20):
        step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        runs.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--torch", action="store_true", help="also time PyTorch eager")
    args = parser.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    X = rng.standard_normal((args.batch, 784)).astype(np.float32)
    labels = rng.integers(0, 10, args.batch).astype(np.int64)
    start = time.perf_counter()
    artifacts = generate_artifacts(mlp(), loss="cross_entropy", optimizer=args.optimizer)
    build = time.perf_counter() - start
    trainer = Trainer(artifacts)
    batch = {"X": X, "labels": labels}
    ms = time_steps(lambda: trainer.step(batch), args.steps)
    print(f"onnxruntime {ort.__version__} ({trainer.providers[0]}), MLP 784-256-10, {args.optimizer}, batch {args.batch}")
    print(f"  artifacts built in {build:.2f} s; train model {len(artifacts.train_model.graph.node)} nodes")
    print(f"  onnx-autodiff train step: {ms:.3f} ms/step (median of 5 x {args.steps} steps)")
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

        print(f"  PyTorch {torch.__version__} eager step: {time_steps(torch_step, args.steps):.3f} ms/step")


if __name__ == "__main__":
    main()
