"""step_model: a train or accumulate model and its signature, for each target."""

from __future__ import annotations

from training.generation.build_models import bn_dropout_model, forward
from test_training import mlp

from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.hashed_dropout import DROPOUT_SEEDS
from onnx_autodiff.training.generation.step import step_model
from onnx_autodiff.training.losses import LossSpec
from onnx_autodiff.training.optimizers import AdamW

LOSS = LossSpec("cross_entropy", None, None)


def built(proto, kind, **options):
    model, roles = forward(proto)
    return roles, step_model(model, kind, roles, LOSS, AdamW(lr=0.01), ArtifactsConfig(**options))


def test_a_train_model_carries_parameters_state_and_buffers():
    roles, step = built(bn_dropout_model(), "train")
    signature = step.signature
    assert signature.batch == ("X", "labels") and step.labels == ["labels"]
    keys = [c.key for c in signature.carry]
    assert keys == [*roles.params, *(s for p in roles.params for s in step.state[p]), *roles.buffers]
    assert list(signature.scalars)[:2] == ["lr", "step"] and set(signature.coefficients) < set(signature.scalars)
    inputs = [v.name for v in step.model.graph.input]
    outputs = [v.name for v in step.model.graph.output]
    assert inputs[:2] == ["X", "labels"] and outputs[0] == signature.loss and outputs[-1] == signature.kept
    assert step.evaluation is None  # (BatchNormalization and Dropout in training mode: the eval model is built apart)


def test_an_accumulate_model_reads_the_parameters_and_carries_the_sums():
    roles, step = built(mlp(), "accumulate")
    signature = step.signature
    assert [r.input for r in signature.reads] == roles.params
    assert [c.key for c in signature.carry] == [f"{p}.grad_acc" for p in roles.params]
    assert signature.scalars == {} and signature.coefficients == {} and step.state == {}


def test_the_webgpu_train_model_reads_the_dropout_seeds():
    _, step = built(bn_dropout_model(), "train", target="webgpu")
    signature = step.signature
    assert {key: signature.coefficients[key] for key in DROPOUT_SEEDS} == DROPOUT_SEEDS
    assert set(DROPOUT_SEEDS) <= set(signature.scalars)
    assert not {n.op_type for n in step.model.graph.node} & {"BatchNormalization", "Dropout"}
