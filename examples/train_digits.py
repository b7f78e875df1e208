"""Train a classifier on scikit-learn's bundled digits with onnx-autodiff's training artifacts.

The network is defined in ONNX with onnx.helper (seeded), turned into train/eval artifacts with
AdamW and a cross-entropy loss, and trained on plain onnxruntime through the Trainer; nothing
is downloaded (load_digits ships with scikit-learn). Prints the loss and test accuracy per
epoch and the time, exports the trained model, and saves a loss/accuracy plot when matplotlib
is installed.

    pip install "onnx-autodiff[examples]"      # scikit-learn, matplotlib
    python examples/train_digits.py [--model cnn|dwcnn|mlp] [--epochs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training import Trainer, generate_artifacts


def mlp(seed: int = 0, hidden: int = 128) -> onnx.ModelProto:
    """64 → 128 (BatchNorm, ReLU, Dropout 0.2) → 10 logits."""
    rng = np.random.default_rng(seed)
    t = _Tensors(rng)
    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("BatchNormalization", ["h", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["hn"]),
        helper.make_node("Relu", ["hn"], ["a"]),
        helper.make_node("Dropout", ["a", "drop"], ["d"]),
        helper.make_node("Gemm", ["d", "W2", "b2"], ["logits"], transB=1),
    ]
    inits = [
        t.kaiming("W1", hidden, 64), t.zeros("b1", hidden), t.full("bn_scale", 1, hidden), t.zeros("bn_bias", hidden),
        t.zeros("bn_mean", hidden), t.full("bn_var", 1, hidden), t.scalar("drop", 0.2),
        t.kaiming("W2", 10, hidden, gain=1), t.zeros("b2", 10),
    ]
    return _model(nodes, inits, [64])


def cnn(seed: int = 0) -> onnx.ModelProto:
    """[1, 8, 8] → conv 16 → pool → conv 32 → pool → 128 → 64 → 10 logits."""
    rng = np.random.default_rng(seed)
    t = _Tensors(rng)
    nodes = [
        helper.make_node("Conv", ["X", "C1", "c1"], ["y1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "C2", "c2"], ["y2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1),
    ]
    inits = [
        t.kaiming("C1", 16, 1, 3, 3), t.zeros("c1", 16), t.kaiming("C2", 32, 16, 3, 3), t.zeros("c2", 32),
        t.kaiming("W1", 64, 128), t.zeros("b1", 64), t.kaiming("W2", 10, 64, gain=1), t.zeros("b2", 10),
    ]
    return _model(nodes, inits, [1, 8, 8])


def dwcnn(seed: int = 0) -> onnx.ModelProto:
    """MobileNet-style, depthwise-separable: [1, 8, 8] → conv 16 → (depthwise 3×3, pointwise → 32) →
    pool → (depthwise 3×3, pointwise → 64) → global average pool → 10 logits; BatchNorm and ReLU
    after each convolution."""
    rng = np.random.default_rng(seed)
    t = _Tensors(rng)
    nodes, inits = [], []

    def block(x, y, name, channels_in, channels_out, kernel, group=1):
        weight, conv, norm = f"{name}.weight", f"{name}.conv", f"{name}.norm"
        stats = [f"{name}.bn_{part}" for part in ("scale", "bias", "mean", "var")]
        inits.extend([t.kaiming(weight, channels_out, channels_in // group, kernel, kernel),
                      t.full(stats[0], 1, channels_out), t.zeros(stats[1], channels_out),
                      t.zeros(stats[2], channels_out), t.full(stats[3], 1, channels_out)])
        nodes.extend([helper.make_node("Conv", [x, weight], [conv], pads=[kernel // 2] * 4, group=group, name=name),
                      helper.make_node("BatchNormalization", [conv, *stats], [norm]),
                      helper.make_node("Relu", [norm], [y])])

    block("X", "a0", "stem", 1, 16, 3)
    block("a0", "a1", "dw1", 16, 16, 3, group=16)
    block("a1", "a2", "pw1", 16, 32, 1)
    nodes.append(helper.make_node("MaxPool", ["a2"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]))
    block("p1", "a3", "dw2", 32, 32, 3, group=32)
    block("a3", "a4", "pw2", 32, 64, 1)
    nodes += [helper.make_node("GlobalAveragePool", ["a4"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
              helper.make_node("Gemm", ["f", "W", "b"], ["logits"], transB=1, name="fc")]
    inits += [t.kaiming("W", 10, 64, gain=1), t.zeros("b", 10)]
    return _model(nodes, inits, [1, 8, 8])


class _Tensors:
    def __init__(self, rng):
        self.rng = rng

    def kaiming(self, name, *shape, gain=2):
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array((self.rng.standard_normal(shape) * (gain / fan_in) ** 0.5).astype(np.float32), name)

    def zeros(self, name, *shape):
        return self.full(name, 0, *shape)

    def full(self, name, value, *shape):
        return numpy_helper.from_array(np.full(shape, value, np.float32), name)

    def scalar(self, name, value):
        return numpy_helper.from_array(np.array(value, np.float32), name)


def _model(nodes, inits, sample_shape) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "digits",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", *sample_shape])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "dwcnn"], default="cnn")
    parser.add_argument("--epochs", type=int, help="default 15 (cnn) or 30 (mlp)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="digits-run", help="directory for the artifacts, trained model and plot")
    args = parser.parse_args()
    args.epochs = args.epochs or (30 if args.model == "mlp" else 15)
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        parser.exit(2, "this example needs scikit-learn: pip install 'onnx-autodiff[examples]'\n")

    start = time.perf_counter()
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X = (X - X.mean(0)) / (X.std(0) + 1e-3) if args.model == "mlp" else X.reshape(-1, 1, 8, 8)
    X_train, X_test, y_train, y_test = train_test_split(
        X, digits.target.astype(np.int64), test_size=0.25, random_state=0, stratify=digits.target
    )
    forward = {"mlp": mlp, "cnn": cnn, "dwcnn": dwcnn}[args.model]()
    artifacts = generate_artifacts(forward, loss="cross_entropy", optimizer="adamw",
                                   optimizer_options={"lr": args.lr, "weight_decay": 1e-4})
    artifacts.save(os.path.join(args.out, "artifacts"))
    built = time.perf_counter() - start
    trainer = Trainer(artifacts)
    print(f"digits: {len(X_train)} train / {len(X_test)} test, {args.model} with {len(artifacts.params)} parameter "
          f"tensors ({sum(v.size for k, v in artifacts.checkpoint.items() if k in artifacts.params)} weights), "
          f"AdamW lr {args.lr}; artifacts built in {built:.2f} s")
    rng = np.random.default_rng(0)
    history = []
    train_start = time.perf_counter()
    steps = 0
    for epoch in range(1, args.epochs + 1):
        trainer.lr = args.lr * 0.5 * (1 + np.cos(np.pi * (epoch - 1) / args.epochs))  # cosine schedule
        order = rng.permutation(len(X_train))
        losses = []
        for first in range(0, len(order) - args.batch + 1, args.batch):  # whole batches (BatchNorm)
            rows = order[first:first + args.batch]
            losses.append(trainer.step({"X": X_train[rows], "labels": y_train[rows]}))
            steps += 1
        result = trainer.evaluate({"X": X_test, "labels": y_test})
        accuracy = float(np.mean(result["logits"].argmax(1) == y_test))
        history.append((float(np.mean(losses)), float(result["loss"]), accuracy))
        print(f"epoch {epoch:3d}  train loss {history[-1][0]:.4f}  test loss {history[-1][1]:.4f}  test accuracy {accuracy:.2%}")
    seconds = time.perf_counter() - train_start

    exported_path = os.path.join(args.out, f"digits_{args.model}.onnx")
    trainer.export(exported_path)
    session = ort.InferenceSession(exported_path, providers=["CPUExecutionProvider"])
    final = float(np.mean(session.run(None, {"X": X_test})[0].argmax(1) == y_test))
    print(f"trained {steps} steps in {seconds:.2f} s ({seconds / steps * 1e3:.2f} ms/step, onnxruntime {ort.__version__}); "
          f"total time {time.perf_counter() - start:.2f} s")
    print(f"exported {exported_path}: test accuracy {final:.2%}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
    else:
        epochs = range(1, len(history) + 1)
        figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
        left.plot(epochs, [h[0] for h in history], label="train")
        left.plot(epochs, [h[1] for h in history], label="test")
        left.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
        left.legend()
        right.plot(epochs, [h[2] for h in history])
        right.set(xlabel="epoch", ylabel="accuracy", title="test accuracy")
        figure.tight_layout()
        plot = os.path.join(args.out, "digits_training.png")
        figure.savefig(plot, dpi=100)
        print(f"saved {plot}")
    return 0 if final >= 0.97 else 1


if __name__ == "__main__":
    raise SystemExit(main())
