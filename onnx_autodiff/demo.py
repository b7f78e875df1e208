"""The demo: differentiate an embedded classifier, check it numerically, train it on onnxruntime."""

from __future__ import annotations

import os
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

FEATURES, HIDDEN, CLASSES, SAMPLES = 16, 32, 4, 256


def classifier_model(seed: int = 0, loss: bool = True) -> onnx.ModelProto:
    """An MLP 16-32-4 with Gemm and Relu; with ``loss``, it also takes ``labels`` and outputs the
    mean cross-entropy loss before the logits, else it is the forward model alone (logits)."""
    rng = np.random.default_rng(seed)

    def init(name, *shape, scale):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1),
    ]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", FEATURES])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])]
    if loss:
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"))
        inputs.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
        outputs.insert(0, helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    graph = helper.make_graph(
        nodes,
        "classifier",
        inputs,
        outputs,
        [
            init("W1", HIDDEN, FEATURES, scale=(2 / FEATURES) ** 0.5),
            init("b1", HIDDEN, scale=0.0),
            init("W2", CLASSES, HIDDEN, scale=(1 / HIDDEN) ** 0.5),
            init("b2", CLASSES, scale=0.0),
        ],
    )
    opsets = [helper.make_opsetid("", 18)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))


def blobs(seed: int = 1, samples: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """Four Gaussian clusters in 16 dimensions."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CLASSES, FEATURES)) * 1.5
    labels = rng.integers(0, CLASSES, samples)
    X = centres[labels] + rng.standard_normal((samples, FEATURES))
    return X.astype(np.float32), labels.astype(np.int64)


def write_example(directory: str | os.PathLike, samples: int = 768, validation: int = 256) -> list[str]:
    """Writes the classifier's forward model (``model.onnx``, logits only) and the four-cluster data
    split into ``train.npz`` and ``val.npz`` (arrays ``X`` and ``labels``) to ``directory``, ready
    for ``onnx-autodiff train``; returns the paths written."""
    from onnx_autodiff.files import write_atomically
    from onnx_autodiff.training.values import npz_writer

    os.makedirs(directory, exist_ok=True)
    X, labels = blobs(seed=1, samples=samples)
    cut = samples - validation
    files = {
        "model.onnx": classifier_model(loss=False).SerializeToString(deterministic=True),
        "train.npz": npz_writer({"X": X[:cut], "labels": labels[:cut]}),
        "val.npz": npz_writer({"X": X[cut:], "labels": labels[cut:]}),
    }
    paths = []
    for name, data in files.items():
        paths.append(os.path.join(directory, name))
        write_atomically(paths[-1], data)
    return paths


def run_demo(steps: int = 60, learning_rate: float = 0.5, out=print) -> int:
    from onnx_autodiff.conformance import fd_vjp
    from onnx_autodiff.modelfile import from_proto, to_proto
    from onnx_autodiff.passes import AutodiffPass, cleanup_passes

    forward = classifier_model()
    params = ["W1", "b1", "W2", "b2"]
    start = time.perf_counter()
    autodiff = AutodiffPass(of="loss", wrt=params)
    model = ir.passes.PassManager([autodiff, *cleanup_passes()])(from_proto(forward)).model
    build_ms = (time.perf_counter() - start) * 1e3
    training = to_proto(model)
    onnx.checker.check_model(training, full_check=True)

    X, labels = blobs()
    weights = {t.name: numpy_helper.to_array(t).copy() for t in forward.graph.initializer}
    session = ort.InferenceSession(feedable(training, params).SerializeToString(), providers=["CPUExecutionProvider"])
    grad_names = [autodiff.last_result.gradient_names[p] for p in params]

    def step(batch):
        loss, logits, *grads = session.run(["loss", "logits", *grad_names], {**batch, **weights})
        return float(loss), logits, dict(zip(params, grads))

    small = {"X": X[:8], "labels": labels[:8]}
    _, _, ad = step(small)
    fd = fd_vjp(forward, small, params, [np.float32(1.0), None])
    error = max(
        float(np.max(np.abs(ad[p] - fd[p])) / max(1.0, float(np.max(np.abs(fd[p]))))) for p in params
    )

    batch = {"X": X, "labels": labels}
    loss_before, logits, _ = step(batch)
    accuracy_before = float(np.mean(logits.argmax(1) == labels))
    for _ in range(steps):
        _, _, grads = step(batch)
        for p in params:
            weights[p] -= learning_rate * grads[p]
    loss_after, logits, _ = step(batch)
    accuracy_after = float(np.mean(logits.argmax(1) == labels))

    out("onnx-autodiff demo: MLP 16-32-4 with cross-entropy, embedded, differentiated and trained")
    out(f"  nodes          {len(forward.graph.node)} forward, {len(training.graph.node) - len(forward.graph.node)} backward (after cleanup)")
    out(f"  build time     {build_ms:.1f} ms")
    out(f"  gradient check max scaled error {error:.2e} vs float64 finite differences")
    out(f"  training       {steps} SGD steps, lr {learning_rate}, {len(X)} samples, onnxruntime {ort.__version__}")
    out(f"  loss           {loss_before:.4f} -> {loss_after:.4f}")
    out(f"  accuracy       {accuracy_before:.1%} -> {accuracy_after:.1%}")
    ok = error < 1e-3 and loss_after < loss_before
    out("  result         " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


def feedable(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """The model with the initializers ``names`` turned into inputs, so each step feeds new weights."""
    fed = onnx.ModelProto()
    fed.CopyFrom(model)
    kept = [t for t in fed.graph.initializer if t.name not in names]
    for tensor in fed.graph.initializer:
        if tensor.name in names:
            fed.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    del fed.graph.initializer[:]
    fed.graph.initializer.extend(kept)
    return fed
