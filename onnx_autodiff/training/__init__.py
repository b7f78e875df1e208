"""Training on plain onnxruntime: a forward model becomes train-step, eval and checkpoint artifacts.

onnxruntime-training is discontinued and the ``ai.onnx.preview.training`` optimisers do not run on
onnxruntime's inference build, so everything here is built from standard ONNX operators:

- :func:`generate_artifacts` (its options an :class:`ArtifactsConfig` or keywords; its steps
  :mod:`onnx_autodiff.training.generation`) differentiates ``loss(model(inputs), labels)`` with the
  autodiff pass and appends the optimiser update (SGD with momentum/nesterov/weight
  decay/dampening, Adam, AdamW, all matching ``torch.optim``), optionally after clipping the
  gradients by their global norm.
  The **train-step model** has the inputs ``[model inputs, labels, parameters, optimiser state,
  buffers, lr, step]`` and the outputs ``[loss, new parameters, new state, new buffers]``:
  ``lr`` is a float32 scalar, ``step`` the int64 1-based number of the step being taken (Adam's
  bias correction; SGD's first step with dampening). Buffers are BatchNormalization running
  statistics: the train model runs BatchNormalization with ``training_mode=1`` and returns the
  updated statistics; Dropout runs with ``training_mode=True`` there and ``False`` in the
  **eval model** (inputs ``[model inputs, labels, parameters, buffers]``, outputs
  ``[loss, model outputs...]``). The **checkpoint** holds the initial parameters, state and
  buffers. ``save(directory)`` writes them all with a JSON description of every name.
- Gradient accumulation (``gradient_accumulation=True``) adds two models: an *accumulate* model
  ``[batch, labels, parameters, accumulators, buffers] -> [loss, accumulators + gradients, new
  buffers]`` and an *apply* model ``[parameters, accumulators, state, lr, step, grad_scale] ->
  [new parameters, new state]`` that steps with ``grad_scale · accumulators`` (the Trainer passes
  1/k after k micro-batches, so k equal micro-batches of a mean loss step like one big batch).
- :class:`Trainer` runs these on onnxruntime, keeping parameters, state and buffers as
  ``OrtValue``\\ s on the device between steps (IO binding; outputs go to a second set of buffers
  that is swapped in only after a successful run, so a failed step changes nothing), and exports
  the trained inference model.
"""

from onnx_autodiff.errors import BatchError, TrainingError
from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training.artifacts import TrainingArtifacts, generate_artifacts
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.cli import add_arguments, run, run_training_demo
from onnx_autodiff.training.losses import LOSSES
from onnx_autodiff.training.manifest import FORMAT_VERSION, Manifest
from onnx_autodiff.training.qat import QatConfig
from onnx_autodiff.training.optimizers import (
    OPTIMIZERS,
    SGD,
    Adam,
    AdamW,
    make_optimizer,
)
from onnx_autodiff.training.trainer import Trainer, default_providers

__all__ = [
    "ArtifactsConfig", "FORMAT_VERSION", "LOSSES", "Manifest", "OPTIMIZERS", "SGD", "Adam", "AdamW", "BatchError", "LoraConfig", "QatConfig", "Trainer", "TrainingArtifacts",
    "TrainingError", "add_arguments", "default_providers", "generate_artifacts", "make_optimizer", "run",
    "run_training_demo",
]
