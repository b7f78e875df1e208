"""The whole build: the forward model read once, the train model built (finding the opset its rules
need), then the eval, accumulate and apply models from that forward model, the manifest and the
initial state."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.modelfile import from_proto, tensor_array
from onnx_autodiff.passes.opsets import build_proto_upgrading
from onnx_autodiff.toolkit.inference import onnx_inferred, take_inferred_types
from onnx_autodiff.training.generation.apply import apply_model
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.evaluation import eval_model, prepared_alike
from onnx_autodiff.training.generation.hashed_dropout import DROPOUT_SEEDS
from onnx_autodiff.training.generation.roles import Roles, analyse
from onnx_autodiff.training.generation.source import read_forward
from onnx_autodiff.training.generation.step import step_model
from onnx_autodiff.training.losses import LossSpec
from onnx_autodiff.training.manifest import FORMAT_VERSION, SEEDED_FORMAT, LoraRecord, Manifest
from onnx_autodiff.training.optimizers import make_optimizer


@dataclasses.dataclass
class Built:
    """The models a build makes, written, its manifest and the initial state (what
    :class:`~onnx_autodiff.training.artifacts.TrainingArtifacts` holds)."""

    train_model: onnx.ModelProto
    eval_model: onnx.ModelProto
    inference_model: onnx.ModelProto
    checkpoint: dict[str, np.ndarray]
    manifest: Manifest
    accumulate_model: onnx.ModelProto | None
    apply_model: onnx.ModelProto | None
    left_out: list[str]  # constants the default did not train
    base_dir: str | None  # where the models' external tensors are read from


def build_artifacts(model, config: ArtifactsConfig) -> Built:
    """The training artifacts of ``model`` (an onnx.ModelProto, onnx_ir.Model or path) for ``config``."""
    target = config.runtime
    spec = make_optimizer(config.optimizer, **dict(config.optimizer_options or {}))
    forward = read_forward(model, config, target)
    base_dir = forward.base_dir
    loss_spec = LossSpec(config.loss, config.output, config.labels)

    def build_train(candidate: onnx.ModelProto):
        # converted once (where the source stages have not), then typed by onnx's inference; a copy
        # is kept for the models built from it after (the analysis of the default parameters lifts
        # weight Constants into initializers of the model to train alone), and it is the model
        # prepared for training
        inferred = onnx_inferred(candidate)
        given = candidate is forward.proto and forward.model is not None
        model = forward.model if given else from_proto(candidate, base_dir)
        if inferred is not None:
            take_inferred_types(model, inferred)
            candidate = inferred
        copies = ForwardCopies(model.clone() if _built_again(model, config) else None, candidate, base_dir)
        roles = analyse(candidate, forward.requires_grad, forward.frozen_params, config.freeze_batchnorm,
                        config.registry, base_dir, model, forward.quantization)
        return candidate, roles, copies, step_model(model, "train", roles, loss_spec, spec, config)

    # The train model's build finds the opset its rules need (converting the forward model where a
    # rule asks for a newer one), and every other model is built from that forward model.
    proto, roles, copies, train = build_proto_upgrading(forward.proto, build_train, config.upgrade_opset)
    batch_inputs = [v.name for v in proto.graph.input if v.name not in {t.name for t in proto.graph.initializer}]
    evaluated, evaluation = train.evaluation or eval_model(copies.take(last=not config.gradient_accumulation), roles,
                                                           loss_spec, target, config.check_output)
    injected = forward.lora
    manifest = Manifest(
        format=FORMAT_VERSION,
        inputs=tuple(batch_inputs),
        labels=tuple(train.labels),
        params=tuple(roles.params),
        buffers=tuple(roles.buffers),
        optimizer=spec,
        max_grad_norm=config.max_grad_norm,
        train=train.signature,
        eval=evaluation,
        target=target.name,
        class_axis=loss_spec.class_axis,
        modules=forward.modules,
        constants=forward.constants,
        lora=None if injected is None else LoraRecord(injected.config, injected.config.scale, tuple(injected.adapters)),
        lr_schedule=config.lr_schedule,
        qat=config.qat,
    )
    accumulate = applied = None
    if config.gradient_accumulation:
        accumulate = step_model(copies.take(last=True), "accumulate", roles, loss_spec, spec, config)
        accumulators = [key for key, _, _ in accumulate.signature.carry[: len(roles.params)]]
        applied, apply_signature = apply_model(proto, roles, spec, config.max_grad_norm, train.state, accumulators,
                                               target, config.check_output)
        manifest = dataclasses.replace(manifest, accumulate=accumulate.signature, apply=apply_signature)
    if set(DROPOUT_SEEDS) & set(manifest.train.coefficients):  # (the accumulate model's are the same)
        manifest = dataclasses.replace(manifest, format=SEEDED_FORMAT)
    return Built(train.model, evaluated, forward.inference, initial_state(proto, roles, train.state, base_dir), manifest,
                 accumulate.model if accumulate else None, applied, roles.left_out, base_dir)


def initial_state(proto: onnx.ModelProto, roles: Roles, state: dict[str, list[str]], base_dir: str | None) -> dict:
    """The checkpoint: the parameters' and buffers' initial values (external ones mapped from their
    file, not read yet), the optimiser state's zeros."""
    checkpoint = {}
    inits = {t.name: t for t in proto.graph.initializer}
    for name in [*roles.params, *roles.buffers]:
        checkpoint[name] = tensor_array(inits[name], base_dir)
    for param, names in state.items():
        for key in names:
            checkpoint[key] = np.zeros_like(checkpoint[param])
    return checkpoint


def _built_again(model: ir.Model, config: ArtifactsConfig) -> bool:
    """Whether a model after the train model is built from the forward ``model``: the accumulate
    model, or an eval model where the train model's forward is not the eval model's (its
    BatchNormalization in training mode, where its statistics are trained)."""
    batchnorm = not config.freeze_batchnorm and any(
        node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") for node in model.graph)
    observed = config.qat is not None and config.qat.activations
    return config.gradient_accumulation or not prepared_alike(model, batchnorm or observed, config.runtime)


class ForwardCopies:
    """The forward model as the train model's build started from it, for the models built from it
    after (the eval model where it is not cut out of the train model, the accumulate model): a copy
    of the onnx-ir model kept before the train model's build; converted from ``proto`` again where
    none was kept."""

    def __init__(self, model: ir.Model | None, proto: onnx.ModelProto, base_dir: str | None) -> None:
        self.model, self.proto, self.base_dir = model, proto, base_dir

    def take(self, last: bool) -> ir.Model:
        """The forward model, for one model to build (the kept copy itself where ``last``)."""
        if self.model is None:
            return from_proto(self.proto, self.base_dir)
        model = self.model if last else self.model.clone()
        if last:
            self.model = None
        return model
