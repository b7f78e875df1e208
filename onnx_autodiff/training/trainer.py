"""The Trainer: runs training artifacts on onnxruntime with parameters and state kept as OrtValues.

It composes the parts, each in a module of its own: :class:`~.sessions.Sessions` (options,
providers, shared frozen weights), :class:`~.state.TrainingState` (the trained values on the
device and the step count), :class:`~.stepper.Stepper` (the steps, one
:class:`~.runner.StepRunner` per model) and :class:`~.export.Exporter` (the trained model and
adapters in other tools' forms).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training import distributed
from onnx_autodiff.training.artifacts import TrainingArtifacts
from onnx_autodiff.training.export import Exporter
from onnx_autodiff.training.manifest import Manifest
from onnx_autodiff.training.sessions import Sessions, default_providers
from onnx_autodiff.training.state import TrainingState
from onnx_autodiff.training.stepper import Stepper
from onnx_autodiff.training.values import load_arrays


class Trainer:
    """Runs training artifacts on onnxruntime; parameters, state and buffers stay on the device.

    ``step(batch)`` takes the batch as a dict or in the order of ``batch_names`` (model inputs, then
    labels) and returns the loss; ``accumulate(batch)`` / ``apply()`` do the same in micro-batches
    (artifacts built with ``gradient_accumulation=True``); ``evaluate(batch)`` runs the eval model;
    ``export()`` returns the inference model with the trained initializers.

    A step whose loss or gradients are not finite (NaN or ±Inf; the models' ``kept`` flag checks the
    loss and the sum of the squared gradients, in the graph) keeps nothing of the step: with ``nonfinite="raise"`` (the default) it raises a
    :class:`TrainingError` naming the step; with ``nonfinite="skip"`` it returns the loss and counts
    the step in ``skipped_steps`` (not in ``step_count``), as AMP's gradient scaler does; a
    non-finite micro-batch then makes ``apply()`` skip the whole step. A checkpoint holding NaN or
    Inf is refused.

    Frozen weights stored in a file (a LoRA base read with external data) are held once: with the
    default ``session_options`` on the CPU, each weight of at least ``FROZEN_IN_PLACE`` bytes is
    mapped from its file, read when a step first needs it, and shared by the train, eval and
    accumulate sessions, which pre-pack no constant (a packed copy per kernel reading it).

    ``comm``: an MPI communicator (mpi4py) of several ranks trains data-parallel: each rank steps on
    its slice of the global batch, the gradients are summed over the ranks before the one update
    they all apply (see :mod:`onnx_autodiff.training.distributed`); the artifacts need
    ``gradient_accumulation=True``.
    """

    def __init__(self, artifacts: TrainingArtifacts | str | os.PathLike, lr: float | None = None,
                 providers: Sequence | None = None, session_options=None, checkpoint: Mapping | None = None,
                 nonfinite: str = "raise", comm=None) -> None:
        if nonfinite not in ("raise", "skip"):
            raise TrainingError(f"nonfinite must be 'raise' or 'skip', not {nonfinite!r}")
        if not isinstance(artifacts, TrainingArtifacts):
            artifacts = TrainingArtifacts.load(artifacts)
        self.artifacts = artifacts
        self.manifest: Manifest = artifacts.manifest
        self.optimizer = artifacts.optimizer
        self.lr = float(self.optimizer.lr if lr is None else lr)
        self.sessions = Sessions(artifacts, default_providers() if providers is None else providers, session_options)
        self.providers, self.device = self.sessions.providers, self.sessions.device
        self.session_options = self.sessions.options
        self.comm = comm if distributed.size(comm) > 1 else None
        self.state = TrainingState(artifacts, self.device)
        self.steps = Stepper(artifacts, self.state, self.sessions, nonfinite, self.comm)
        self.exporter = Exporter(artifacts, self.state)
        if self.comm is None:
            self.steps.runner("train")
        elif artifacts.accumulate_model is None:
            raise TrainingError("data-parallel training sums the ranks' gradients between the accumulate and apply "
                                "models: generate the artifacts with gradient_accumulation=True")
        self.load_state_dict(checkpoint if checkpoint is not None else artifacts.checkpoint)
        if self.comm is not None:  # every rank starts from rank 0's state
            distributed.broadcast(self.comm, [self.state.value(key).numpy() for key in self.artifacts.checkpoint])

    @property
    def layout(self) -> dict:
        """The manifest as ``artifacts.json`` holds it (a new dict at each call)."""
        return self.artifacts.layout

    @property
    def batch_names(self) -> list[str]:
        return list(self.manifest.train.batch)

    @property
    def step_count(self) -> int:
        """The optimiser steps taken (kept), as the checkpoint's ``__step__`` records them."""
        return self.state.step_count

    @step_count.setter
    def step_count(self, count: int) -> None:
        self.state.step_count = count

    @property
    def skipped_steps(self) -> int:
        """The steps not taken because they were not finite (``nonfinite="skip"``)."""
        return self.steps.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self.steps.skipped_steps = count

    @property
    def nonfinite(self) -> str:
        """What a step that is not finite does: "raise" or "skip"."""
        return self.steps.nonfinite

    @nonfinite.setter
    def nonfinite(self, mode: str) -> None:
        self.steps.nonfinite = mode

    # training

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next optimiser step (see :meth:`learning_rate_after`)."""
        return self.learning_rate_after(self.step_count)

    def learning_rate_after(self, steps: int) -> float:
        """The learning rate of the optimiser step taken after ``steps`` steps: ``lr``, times the
        factor of the manifest's ``lr_schedule``."""
        schedule = self.manifest.lr_schedule
        return self.lr if schedule is None else self.lr * schedule.factor(steps)

    def step(self, batch, lr: float | None = None) -> float:
        """One optimiser step on ``batch`` at ``lr`` (None: :attr:`learning_rate`); returns the loss
        (before the update).

        Data-parallel (``comm`` of several ranks): ``batch`` is this rank's slice of the global
        batch (possibly empty, where the last batch of an epoch does not split among the ranks),
        the update is the one of the whole batch, and the loss returned is the whole batch's (the
        ranks' losses weighted by their examples)."""
        return self.steps.step(batch, self.learning_rate if lr is None else lr)

    def accumulate(self, batch) -> float:
        """Adds the gradients of ``batch`` to the accumulators; returns its loss."""
        return self.steps.accumulate(batch)

    def apply(self, lr: float | None = None) -> None:
        """One optimiser step with the mean of the accumulated gradients (with ranks: of all ranks',
        each rank having accumulated as many micro-batches of equal size)."""
        self.steps.apply(self.learning_rate if lr is None else lr)

    def evaluate(self, batch) -> dict[str, np.ndarray]:
        """The eval model on ``batch`` (inputs and labels): {"loss": ..., model outputs...}."""
        return self.steps.evaluate(batch)

    def merge_cost(self, batch) -> dict[str, float]:
        """The eval loss of ``batch`` with the LoRA adapters as trained ("adapted") and with them
        merged into their bases as ``export()`` writes them ("merged"): what merging costs, the
        rounding of a float16 base or the quantizing again of a quantized one (a float base's is
        float rounding). The merged loss runs the eval model with the merged initializers and B = 0."""
        lora = self.manifest.lora
        if not lora:
            raise TrainingError("merge_cost needs LoRA adapters (the artifacts have none)")
        adapted = float(self.evaluate(batch)["loss"])
        model, merged = self.exporter.merged_eval_model()
        session = self.sessions.open(model, replaced=merged)  # the merged weights, not the shared stored ones
        loss = self.steps.runner("eval").loss_of(session, batch, zeroed={a.B for a in lora.adapters})
        return {"adapted": adapted, "merged": loss}

    # state

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: self.state.host(name) for name in self.manifest.params}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, optimiser state and buffers as numpy arrays, with ``__step__``."""
        return self.state.state_dict()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Loads parameters, optimiser state and buffers; checks every value before changing any."""
        self.state.load_state_dict(state)
        self.steps.clear_pending()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        self.state.save(path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        self.load_state_dict(load_arrays(path))

    # the trained model in other tools' forms

    def export(self, path: str | os.PathLike | None = None, merge: bool = True,
               external_data: bool | None = None) -> onnx.ModelProto:
        """The inference (forward) model with the trained parameters and buffers as initializers,
        also written to ``path`` when given (never half-written).

        The file gets its tensors in ``path``.data beside it when ``external_data``, when the
        model is over protobuf's 2 GB or when the artifacts keep tensors in external files
        (``None``: those two); the proto returned then names that data file instead of holding
        the tensors. Without ``path`` the proto holds every tensor (up to 2 GB).

        With LoRA adapters, ``merge=True`` gives the input model's graph and initializer names with
        each adapted weight W replaced by W + scale·A·B; ``merge=False`` keeps the adapter nodes and
        ``<W>.lora_A``/``<W>.lora_B`` initializers (without dropout), W unchanged."""
        return self.exporter.export(path, merge, external_data)

    def export_adapter_model(self, path: str | os.PathLike | None = None, external_data: bool | None = None) -> onnx.ModelProto:
        """The inference model with the LoRA adapters as graph inputs ``<W>.lora_A`` [in, lora_rank]
        and ``<W>.lora_B`` [lora_rank, out] for onnxruntime's multi-LoRA: one session runs the
        adapter that ``RunOptions.add_active_adapter`` names (files of :meth:`save_onnx_adapter`,
        of any rank and alpha: B carries the scale) or, with none active, the base model (the
        inputs' defaults are empty, rank 0). The other trained parameters are initializers as in
        :meth:`export`; ``path`` and ``external_data`` as there."""
        return self.exporter.export_adapter_model(path, external_data)

    def module_state_dict(self) -> dict[str, np.ndarray]:
        """The module's parameters by module name, in the module's layout (a folded ``weight.T``
        transposed back; a tied parameter under each of its names), as PyTorch's
        ``module.state_dict()`` keys them: for a model exported from PyTorch, so that a checkpoint
        can be compared with the module or loaded into it (``load_state_dict(..., strict=False)``
        after ``torch.from_numpy``). Trained parameters have their current values (LoRA's merged
        into their base), the others the model's. An empty dict for models not exported from PyTorch."""
        return self.exporter.module_state_dict()

    def load_module_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Sets the trained parameters from a module's ``state_dict()`` (arrays by module name, in
        the module's layout; extra keys are ignored). Checks every value before changing any."""
        self.exporter.load_module_state_dict(state)

    def save_peft_adapter(self, directory: str | os.PathLike, strip: str | None = None,
                          prefix: str = "base_model.model.", config: Mapping | None = None) -> dict:
        """Writes the LoRA adapters as a peft adapter directory (``adapter_model.safetensors``,
        ``adapter_config.json``), for ``peft.PeftModel.from_pretrained(base_model, directory)``;
        returns the config written. The keys are ``<prefix><module>.lora_A.weight`` [r, in] and
        ``...lora_B.weight`` [out, r], ``<module>`` the module name recovered from the export less
        ``.weight`` and less ``strip``: the prefix of the exported module's names that the model
        peft wraps lacks (None: the wrapper's attribute when every parameter lies under one, e.g.
        ``lm.`` of a module that calls ``self.lm``, a transformers model; "": the names as they are).
        ``config``: more or other ``adapter_config.json`` entries (task_type, base_model_name_or_path).
        Needs module names (a model exported from PyTorch) and adapters alone (no trained extras)."""
        return self.exporter.save_peft_adapter(directory, strip, prefix, config)

    def load_peft_adapter(self, directory: str | os.PathLike, strip: str | None = None,
                          prefix: str = "base_model.model.") -> None:
        """Sets the LoRA adapters from a peft adapter directory (one peft saved, or
        :meth:`save_peft_adapter`), names mapped as there; the rank, the scale (lora_alpha / r),
        every key and shape are checked before anything changes. The optimiser state and the step
        count stay as they are."""
        self.exporter.load_peft_adapter(directory, strip, prefix)

    def save_onnx_adapter(self, path: str | os.PathLike, adapter_version: int = 1, model_version: int = 1) -> None:
        """Writes the LoRA adapters in onnxruntime's ``.onnx_adapter`` format (``onnxruntime.AdapterFormat``)
        for the model :meth:`export_adapter_model` writes: A, and B multiplied by alpha / r, under
        the model's input names (``<W>.lora_A``, ``<W>.lora_B``). Never half-written."""
        self.exporter.save_onnx_adapter(path, adapter_version, model_version)
