"""The apply model: the optimiser's step by the accumulated gradients, scaled."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from training.generation.build_models import typed
from test_training import mlp

from onnx_autodiff.training.generation.apply import apply_model
from onnx_autodiff.training.generation.roles import analyse
from onnx_autodiff.training.optimizers import SGD
from onnx_autodiff.training.targets import ONNXRUNTIME


def test_the_apply_model_steps_by_the_scaled_accumulators():
    proto, model = typed(mlp())
    roles = analyse(proto, None, None, False, model=model)
    accumulators = [f"{p}.grad_acc" for p in roles.params]
    applied, signature = apply_model(proto, roles, SGD(lr=0.1), None, {}, accumulators, ONNXRUNTIME)
    assert [r.input for r in signature.reads] == accumulators and signature.loss is None
    assert list(signature.scalars) == ["lr", "step", "grad_scale"]
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    sums = {acc: np.ones_like(initial[p]) for p, acc in zip(roles.params, accumulators)}
    feeds = {**{p: initial[p] for p in roles.params}, **sums, "lr": np.array(0.5, np.float32),
             "step": np.array(1, np.int64), "grad_scale": np.array(0.25, np.float32)}
    session = ort.InferenceSession(applied.SerializeToString(), providers=["CPUExecutionProvider"])
    *new, kept = session.run(None, feeds)
    assert kept
    for p, value in zip(roles.params, new):
        np.testing.assert_allclose(value, initial[p] - 0.5 * 0.25, rtol=1e-6)
