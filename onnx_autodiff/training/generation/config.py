"""What a build of training artifacts is asked for: the options the command line and the Python API share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import onnx

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training.qat import QatConfig, qat_config
from onnx_autodiff.training.schedules import LRSchedule
from onnx_autodiff.training.targets import DEFAULT, Target, resolve_target


@dataclasses.dataclass(frozen=True)
class ArtifactsConfig:
    """The options of :func:`~onnx_autodiff.training.generate_artifacts`, which also takes each
    of them as a keyword.

    requires_grad: initializers to train (default: the model's parameters, as
    :func:`onnx_autodiff.passes.parameters.default_parameters` chooses them, that are neither in
    ``frozen_params`` nor BatchNormalization running statistics; ``left_out`` of the result
    lists the constants it did not train). Names may be module parameters' names and shell-style
    patterns where the model is a PyTorch export.
    frozen_params: initializers to keep fixed (names or patterns, as ``requires_grad``).
    loss: "cross_entropy" (logits [N, C, ...] or [batch, sequence, classes], int64 class labels,
    mean, ignore_index −100), "causal_lm" (transformers' next-token loss of logits [batch,
    sequence, vocabulary]), "ctc" (torch's ctc_loss; labels, input_lengths, target_lengths),
    "mse", "l1", "bce_with_logits" (labels shaped like the output), a
    :class:`~onnx_autodiff.training.losses.BuiltinLoss` (one of those with options, e.g.
    ``BuiltinLoss("ctc", blank=27)``), None (the model's scalar
    output ``output`` is the loss), or a custom loss: a callable ``f(op, output, *labels)`` returning
    the scalar loss built with the :class:`~onnx_autodiff.toolkit.builder.OpBuilder` ``op``, or an
    onnx.FunctionProto with inputs ``[output, *labels]`` and the loss as first output.
    optimizer: "sgd", "adam", "adamw" with ``optimizer_options`` (torch names: lr, momentum,
    dampening, nesterov, weight_decay, betas, eps, amsgrad), or an SGD/Adam/AdamW instance.
    output: the model output the loss applies to (default: the first).
    labels: the label input's name (a str) or, for a custom loss, a list of (name, numpy dtype,
    shape) (default: one input "labels" shaped and typed like the output); for a built-in loss
    the first entry's shape, where given, decides the class axis (see docs/training.md, "Losses").
    A class loss on an output made by Softmax, LogSoftmax (cross_entropy, causal_lm, ctc) or
    Sigmoid (bce_with_logits) applies to the logits under it, logging a warning that says so.
    max_grad_norm: clip the gradients by their global L2 norm (torch.nn.utils.clip_grad_norm_).
    gradient_accumulation: also build the accumulate and apply models.
    freeze_batchnorm: keep BatchNormalization in inference mode with fixed statistics.
    registry: the gradient rules (default: the shipped ones).
    upgrade_opset: when a gradient rule needs a newer opset than the model imports, convert the
    model with onnx.version_converter (one warning line); False refuses.
    lora: a :class:`~onnx_autodiff.training.lora.LoraConfig`: adds adapters to the weights of
    MatMul and Gemm and trains them alone, with what the config adds (biases, norms) and the extra
    initializers ``requires_grad`` names (e.g. a classifier head); the base weights stay constants.
    ``Trainer.export()`` merges the adapters into them (``merge=False`` keeps them apart).
    target: the runtime the train, eval, accumulate and apply models are lowered for (the
    cleanup's ``target``): "onnxruntime" (default), "webgpu" (onnxruntime-web's WebGPU provider runs
    every compute node, see :mod:`onnx_autodiff.passes.rewrite_rules.webgpu`), None (canonical
    standard forms) or a :class:`~onnx_autodiff.training.targets.Target`. The inference model is
    the input model's, whatever the target.
    lr_schedule: a :class:`~onnx_autodiff.training.schedules.LRSchedule` the trainers step the
    learning rate by (recorded in the manifest; default: the optimiser's learning rate throughout).
    qat: quantization-aware training: a scheme ("int8", "int4-weights",
    "int4-weights-int8-activations") or a :class:`~onnx_autodiff.training.qat.QatConfig`; the
    models train through fake quantization and ``Trainer.export()`` writes the quantized (QDQ)
    model (see docs/training.md, "Quantization-aware training").
    check_output: check each generated model with onnx.checker's full check (strict shape inference
    of the whole graph) instead of the structural one (see
    :func:`~onnx_autodiff.modelfile.full_output_check`).
    """

    requires_grad: Sequence[str] | str | None = None
    frozen_params: Sequence[str] | str | None = None
    loss: str | Callable | onnx.FunctionProto | None = "cross_entropy"
    optimizer: object = "adamw"
    optimizer_options: Mapping | None = None
    output: str | None = None
    labels: object = None
    max_grad_norm: float | None = None
    gradient_accumulation: bool = False
    freeze_batchnorm: bool = False
    registry: object = None
    upgrade_opset: bool = True
    lora: object = None
    target: str | Target | None = DEFAULT.name
    check_output: bool = False
    lr_schedule: LRSchedule | None = None
    qat: QatConfig | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "qat", qat_config(self.qat))
        if self.qat is not None and self.gradient_accumulation:
            raise TrainingError("quantization-aware training does not combine with gradient accumulation yet: "
                                "its observers count the optimiser's steps, which the accumulate model does not take")
        resolve_target(self.target)  # an unknown target fails here, naming the known ones, before the work
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise TrainingError(f"max_grad_norm must be > 0, not {self.max_grad_norm}")

    @property
    def runtime(self) -> Target:
        """The target as a :class:`~onnx_autodiff.training.targets.Target`."""
        return resolve_target(self.target)
