"""The eval model: cut out of the finished train model where it can be, or built; both compute the
same."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from training.generation.build_models import bn_dropout_model, forward
from test_training import batches, mlp

from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.evaluation import eval_model, prepared_alike
from onnx_autodiff.training.generation.step import step_model
from onnx_autodiff.training.generation.training_mode import TrainingModePass
from onnx_autodiff.training.losses import LossSpec
from onnx_autodiff.training.optimizers import SGD
from onnx_autodiff.training.targets import ONNXRUNTIME, WEBGPU


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def test_the_cut_eval_model_computes_the_built_one():
    spec = LossSpec("cross_entropy", None, None)
    model, roles = forward(mlp())
    train = step_model(model, "train", roles, spec, SGD(lr=0.1), ArtifactsConfig())
    assert train.evaluation is not None
    cut, signature = train.evaluation
    model, _ = forward(mlp())
    built, built_signature = eval_model(model, roles, spec, ONNXRUNTIME)
    assert signature == built_signature
    X, y = next(batches())
    initial = {t.name: np.frombuffer(t.raw_data, np.float32).reshape(t.dims) for t in mlp().graph.initializer}
    feeds = {"X": X, "labels": y, **initial}
    for a, b in zip(run(cut, feeds), run(built, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_the_train_forward_differs_in_training_mode_and_on_lowering_targets():
    model, roles = forward(mlp())
    TrainingModePass(roles, training=True)(model)
    assert prepared_alike(model, {}, ONNXRUNTIME) and not prepared_alike(model, {}, WEBGPU)
    model, roles = forward(bn_dropout_model())
    mode = TrainingModePass(roles, training=True)(model)
    assert not prepared_alike(model, mode.updates, ONNXRUNTIME)
