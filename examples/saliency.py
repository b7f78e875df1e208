"""Saliency maps: the gradient of a classifier's top logit with respect to its input image.

Trains a small MLP on scikit-learn's bundled handwritten digits (no download) with a gradient
graph made by onnx-autodiff, then builds ONE ONNX model that returns, for a batch of images, the
logits and d(top logit)/d(image), and runs it on onnxruntime. With matplotlib installed it saves
the images next to their saliency maps as a PNG.

Run: pip install ".[examples]" && python examples/saliency.py [--out saliency.png]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import autodiff_pass, cleanup_passes, vjp


def classifier(seed: int = 0, hidden: int = 64) -> onnx.ModelProto:
    """X [N, 64] → Gemm → Tanh → Gemm → logits [N, 10]."""
    rng = np.random.default_rng(seed)
    weights = {
        "W1": rng.standard_normal((hidden, 64)) / 8.0, "b1": np.zeros(hidden),
        "W2": rng.standard_normal((10, hidden)) / np.sqrt(hidden), "b2": np.zeros(10),
    }
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
         helper.make_node("Tanh", ["h"], ["a"]),
         helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1)],
        "digits",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def with_loss(model: onnx.ModelProto) -> onnx.ModelProto:
    """The classifier plus labels and a mean cross-entropy output 'loss'."""
    training = onnx.ModelProto()
    training.CopyFrom(model)
    training.graph.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
    training.graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]))
    training.graph.output.insert(0, helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return training


def train(model: onnx.ModelProto, X, y, steps: int = 300, lr: float = 0.5, momentum: float = 0.9):
    """Full-batch SGD with momentum, gradients from the generated graph on onnxruntime."""
    params = [t.name for t in model.graph.initializer]
    grads_model = ir.passes.PassManager([autodiff_pass(of="loss", wrt=params), *cleanup_passes()])(
        ir.from_proto(with_loss(model))
    ).model
    proto = ir.to_proto(grads_model)
    weights = {t.name: numpy_helper.to_array(t).copy() for t in proto.graph.initializer if t.name in params}
    for t in [t for t in proto.graph.initializer if t.name in params]:
        proto.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        proto.graph.initializer.remove(t)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    velocity = {k: np.zeros_like(v) for k, v in weights.items()}
    outputs = ["loss", *(f"grad_{p}" for p in params)]
    for step in range(steps):
        loss, *grads = session.run(outputs, {"X": X, "labels": y, **weights})
        for name, grad in zip(params, grads):
            velocity[name] = momentum * velocity[name] + grad
            weights[name] -= lr * velocity[name]
        if step % 100 == 0:
            print(f"step {step:4d}  loss {loss:.4f}")
    trained = onnx.ModelProto()
    trained.CopyFrom(model)
    for tensor in trained.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(weights[tensor.name], tensor.name))
    return trained


def top_logit_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The classifier with a second output 'top': the largest logit of each image."""
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    extended.graph.node.append(helper.make_node("ReduceMax", ["logits", "one"], ["top"], keepdims=0))
    extended.graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    extended.graph.output.append(helper.make_tensor_value_info("top", TensorProto.FLOAT, ["N"]))
    return extended


def saliency_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Outputs logits, 'top' and grad_X = d top / d X for every image of the batch."""
    # Each image's top logit depends on that image only, so the gradient of their sum is per image.
    return vjp(top_logit_model(model), of="top", wrt=["X"], seed="ones")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="saliency.png", help="where to save the picture")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("this example needs scikit-learn: pip install '.[examples]'", file=sys.stderr)
        return 1
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(X))
    train_idx, test_idx = order[:1400], order[1400:]
    model = train(classifier(), X[train_idx], y[train_idx], steps=args.steps)

    saliency = saliency_model(model)
    onnx.checker.check_model(saliency, full_check=True)
    session = ort.InferenceSession(saliency.SerializeToString(), providers=["CPUExecutionProvider"])
    logits, top, grad = session.run(["logits", "top", "grad_X"], {"X": X[test_idx]})
    accuracy = float(np.mean(logits.argmax(1) == y[test_idx]))
    print(f"test accuracy {accuracy:.1%} on {len(test_idx)} images; saliency shape {grad.shape}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no picture saved")
        return 0
    shown = 6
    figure, axes = plt.subplots(2, shown, figsize=(2 * shown, 4.4))
    for k in range(shown):
        axes[0, k].imshow(X[test_idx][k].reshape(8, 8), cmap="gray_r")
        axes[0, k].set_title(f"predicted {logits[k].argmax()}")
        limit = np.abs(grad[k]).max() or 1.0
        axes[1, k].imshow(grad[k].reshape(8, 8), cmap="RdBu_r", vmin=-limit, vmax=limit)
        axes[1, k].set_title("d top logit / d pixel", fontsize=8)
        for row in (0, 1):
            axes[row, k].axis("off")
    figure.tight_layout()
    figure.savefig(args.out, dpi=80)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
