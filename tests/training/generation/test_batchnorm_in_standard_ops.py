"""BatchNormInStandardOpsPass: BatchNormalization's training mode in standard ops computes what
onnxruntime's kernel computes (output and running statistics)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from training.generation.build_models import bn_dropout_model, forward

from onnx_autodiff.modelfile import to_proto
from onnx_autodiff.training.generation.batchnorm_in_standard_ops import BatchNormInStandardOpsPass
from onnx_autodiff.training.generation.training_mode import TrainingModePass


def run(model: ir.Model, outputs: list[ir.Value], feeds: dict) -> list[np.ndarray]:
    model.graph.outputs[:] = outputs
    session = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_statistics_in_standard_ops_equal_the_kernels():
    rng = np.random.default_rng(1)
    feeds = {"X": rng.standard_normal((6, 4)).astype(np.float32)}
    proto = bn_dropout_model()
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    feeds.update((name, initial[name]) for name in ("W", "gamma", "beta", "mean", "var"))
    results = []
    for lowered in (False, True):
        model, roles = forward(proto)
        mode = TrainingModePass(roles, training=True)(model)
        updates = mode.updates
        if lowered:
            result = BatchNormInStandardOpsPass(mode.namer, updates)(model)
            assert result.modified and not any(n.op_type == "BatchNormalization" for n in model.graph)
            updates = result.updates
        bn_out = next(n for n in model.graph if n.op_type == "Dropout").inputs[0]  # the normalised values
        results.append(run(model, [bn_out, updates["mean"], updates["var"]], feeds))
    for kernel, standard in zip(*results):
        np.testing.assert_allclose(standard, kernel, rtol=1e-5, atol=1e-6)
