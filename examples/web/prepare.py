"""Writes what the browser demo trains: digits-classifier artifacts and a train/test split.

    python examples/web/prepare.py [--out examples/web/build]

OUT/artifacts/ gets the training artifacts of an MLP 64-64-10 (Gemm, ReLU; cross-entropy, AdamW)
with the checkpoint as checkpoint.safetensors, which the JavaScript trainer reads, and
OUT/artifacts-webgpu/ the same lowered for onnxruntime-web's WebGPU provider (target "webgpu",
the page's ?backend=webgpu); OUT/train.safetensors
and OUT/test.safetensors (a quarter) hold X (8×8 images as 64 floats in [0, 1]) and labels (int64)
and, in their metadata, where the digits come from. Nothing is downloaded: the digits are scikit-learn's
bundled handwritten ones (load_digits) when scikit-learn is installed, else generated here, each
digit drawn as pen strokes under a random affine transform and stroke width and counted into 8×8
blocks of a 32×32 bitmap, as load_digits' own images were made. The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training import generate_artifacts
from onnx_autodiff.files import write_atomically
from onnx_autodiff.training.values import safetensors_writer

BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build")
LEARNING_RATE = 3e-3


def classifier(seed: int = 0, hidden: int = 64) -> onnx.ModelProto:
    """An MLP 64 → hidden (ReLU) → 10 logits, He-initialised with a fixed seed."""
    rng = np.random.default_rng(seed)

    def weight(name, rows, columns, gain):
        return numpy_helper.from_array((rng.standard_normal((rows, columns)) * (gain / columns) ** 0.5).astype(np.float32), name)

    def zeros(name, size):
        return numpy_helper.from_array(np.zeros(size, np.float32), name)

    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
         helper.make_node("Relu", ["h"], ["a"]),
         helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1)],
        "digits",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [weight("W1", hidden, 64, 2), zeros("b1", hidden), weight("W2", 10, hidden, 1), zeros("b2", 10)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


# Pen strokes of each digit in a unit box (x to the right, y down): polylines of points, arcs as
# (centre x, centre y, radius x, radius y, first angle, last angle) in degrees (0 = right, 90 = down).
def _arc(cx, cy, rx, ry, first, last, points=16):
    angles = np.radians(np.linspace(first, last, points))
    return np.stack([cx + rx * np.cos(angles), cy + ry * np.sin(angles)], 1)


STROKES = {
    0: [_arc(0.5, 0.5, 0.24, 0.38, 0, 360)],
    1: [np.array([[0.36, 0.26], [0.52, 0.1], [0.52, 0.9]])],
    2: [np.concatenate([_arc(0.5, 0.32, 0.22, 0.2, 200, 390), [[0.26, 0.9], [0.76, 0.9]]])],
    3: [_arc(0.48, 0.3, 0.22, 0.2, 200, 450), _arc(0.48, 0.7, 0.24, 0.2, 270, 520)],
    4: [np.array([[0.64, 0.9], [0.64, 0.1], [0.24, 0.64], [0.78, 0.64]])],
    5: [np.concatenate([[[0.74, 0.1], [0.34, 0.1], [0.3, 0.46]], _arc(0.5, 0.66, 0.24, 0.24, 230, 505)])],
    6: [np.concatenate([_arc(0.7, 0.55, 0.4, 0.45, 250, 180), _arc(0.5, 0.68, 0.2, 0.22, 180, 540)])],
    7: [np.array([[0.24, 0.12], [0.76, 0.12], [0.44, 0.9]])],
    8: [_arc(0.5, 0.29, 0.17, 0.19, 0, 360), _arc(0.5, 0.7, 0.22, 0.2, 0, 360)],
    9: [_arc(0.5, 0.32, 0.2, 0.21, 0, 360), np.array([[0.7, 0.32], [0.62, 0.9]])],
}


def generated_digits(samples: int = 1800, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Digits drawn from ``STROKES``: images [samples, 64] of counts 0..16 and int64 labels."""
    rng = np.random.default_rng(seed)
    grid = np.arange(32, dtype=np.float32)
    pixels = (np.stack(np.meshgrid(grid, grid, indexing="xy"), -1).reshape(-1, 2) + 0.5) / 32
    labels = np.arange(samples, dtype=np.int64) % 10
    images = np.empty((samples, 64), np.float32)
    for digit, strokes in STROKES.items():  # every sample of a digit at once: its strokes have the same points
        rows = np.flatnonzero(labels == digit)
        n = len(rows)
        angle = np.radians(rng.uniform(-12, 12, n))
        shear = rng.uniform(-0.3, 0.3, n)
        scale = rng.uniform(0.75, 1.1, (n, 2, 1))
        cos, sin = np.cos(angle), np.sin(angle)
        # rotation · shear, each row scaled: x' = scale · R · [[1, shear], [0, 1]] · x
        matrix = scale * np.stack([np.stack([cos, cos * shear - sin], -1), np.stack([sin, sin * shear + cos], -1)], 1)
        shift = rng.uniform(-0.08, 0.08, (n, 1, 2))
        a, b = [], []
        for stroke in strokes:
            points = (stroke + rng.normal(0, 0.02, (n, *stroke.shape)) - 0.5) @ matrix.transpose(0, 2, 1) + 0.5 + shift
            a.append(points[:, :-1])
            b.append(points[:, 1:])
        a, b = np.concatenate(a, 1).astype(np.float32)[:, None], np.concatenate(b, 1).astype(np.float32)[:, None]
        # squared distance of every pixel centre to every segment (x and y apart: numpy is slow to
        # sum an axis of two); ink within the pen's half width
        (ax, ay), (dx, dy) = np.moveaxis(a, -1, 0), np.moveaxis(b - a, -1, 0)
        px, py = pixels[None, :, None, 0] - ax, pixels[None, :, None, 1] - ay
        t = np.clip((px * dx + py * dy) / np.maximum(dx * dx + dy * dy, 1e-12), 0, 1)
        squared = ((px - t * dx) ** 2 + (py - t * dy) ** 2).min(-1)
        ink = squared < rng.uniform(0.045, 0.085, (n, 1)) ** 2
        images[rows] = ink.reshape(n, 8, 4, 8, 4).sum((2, 4)).reshape(n, 64)
    return images, labels


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    """Images [N, 64] of counts 0..16, labels and where they come from."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        images, labels = generated_digits(seed=seed)
        return images, labels, "generated"
    data = load_digits()
    return data.data.astype(np.float32), data.target.astype(np.int64), "scikit-learn"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=BUILD, help="the directory to write (default: %(default)s)")
    args = parser.parse_args(argv)
    images, labels, source = digits()
    order = np.random.default_rng(0).permutation(len(images))  # the test quarter mixes every writer and digit
    X, labels = images[order] / np.float32(16), labels[order]
    test = len(X) // 4
    os.makedirs(args.out, exist_ok=True)
    for directory, target in (("artifacts", "onnxruntime"), ("artifacts-webgpu", "webgpu")):
        artifacts = generate_artifacts(classifier(), loss="cross_entropy", optimizer="adamw",
                                       optimizer_options={"lr": LEARNING_RATE, "weight_decay": 1e-4}, target=target)
        artifacts.save(os.path.join(args.out, directory), checkpoint_format="safetensors")  # what js/ reads
    for name, rows in (("train", slice(test, None)), ("test", slice(None, test))):  # named as the models' inputs
        split = {"X": X[rows], "labels": labels[rows]}
        write_atomically(os.path.join(args.out, f"{name}.safetensors"), safetensors_writer(split, {"source": source}))
    print(f"wrote {args.out}: {source} digits, {len(X) - test} train / {test} test")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
