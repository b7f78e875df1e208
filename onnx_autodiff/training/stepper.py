"""A trainer's steps: train steps, micro-batches and their apply (across MPI ranks), evaluation."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training import distributed
from onnx_autodiff.training.artifacts import TrainingArtifacts
from onnx_autodiff.training.runner import StepRunner
from onnx_autodiff.training.sessions import ORT_TYPES, Sessions
from onnx_autodiff.training.state import TrainingState


class Stepper:
    """Steps the state with the artifacts' models, each run by a :class:`StepRunner` made when
    first used: :meth:`step`, or micro-batches (:meth:`accumulate`) and then :meth:`apply`, and
    :meth:`evaluate`. A step that is not finite keeps nothing: it raises (``nonfinite="raise"``)
    or is counted in ``skipped_steps`` ("skip"). With ranks (``comm``), every rank accumulates its
    slice of the batch and the gradients are summed over the ranks before the update they all apply."""

    def __init__(self, artifacts: TrainingArtifacts, state: TrainingState, sessions: Sessions,
                 nonfinite: str, comm) -> None:
        self.artifacts, self.state, self.sessions = artifacts, state, sessions
        self.manifest = artifacts.manifest
        # the carried keys that follow from the checked ones (see StepRunner), named while the
        # artifacts still hold their checkpoint
        self.optimizer_state = set(artifacts.checkpoint) - set(self.manifest.params) - set(self.manifest.buffers)
        self.nonfinite, self.comm = nonfinite, comm
        self.skipped_steps = 0
        self.runners: dict[str, StepRunner] = {}
        self._micro_batches = 0
        self._poisoned = False  # skip mode: a pending micro-batch was not finite
        self._failure: str | None = None  # with ranks: what was not finite here, told when all decide

    def runner(self, kind: str) -> StepRunner:
        """The runner of the "train", "eval", "accumulate" or "apply" model."""
        if kind not in self.runners:
            proto = {"train": self.artifacts.train_model, "eval": self.artifacts.eval_model,
                     "accumulate": self.artifacts.accumulate_model, "apply": self.artifacts.apply_model}[kind]
            if proto is None:
                raise TrainingError(f"these artifacts have no {kind} model: generate them with gradient_accumulation=True")
            self.runners[kind] = StepRunner(proto, self.manifest.signature(kind), kind, self.state, self.sessions,
                                            self.optimizer_state)
        return self.runners[kind]

    def clear_pending(self) -> None:
        """Drops the micro-batches accumulated so far (the state they were taken on is gone)."""
        self._micro_batches = 0
        self._poisoned = False

    def step(self, batch, lr: float) -> float:
        """One optimiser step on ``batch``; returns the loss (see :meth:`Trainer.step`)."""
        if self._micro_batches:
            raise TrainingError("accumulated gradients are pending: call apply() before step()")
        if self.comm is not None:
            rows = _rows(batch)
            counts = self.comm.allgather(rows)  # the last batch of an epoch may not split evenly
            loss = self.accumulate(batch) if rows else self._accumulate_nothing()
            self.apply(lr, share=rows * len(counts) / sum(counts))
            return sum(n * value for n, value in zip(counts, self.comm.allgather(loss))) / sum(counts)
        runner, number = self.runner("train"), self.state.step_count + 1
        loss, finite = runner.run(batch, {"lr": lr, "step": number, "micro_batch": 0})
        if finite:
            self.state.step_count += 1
        elif self.nonfinite == "skip":
            self.skipped_steps += 1
        else:
            raise _not_finite(f"step {number}", loss, runner, batch)
        return loss

    def accumulate(self, batch) -> float:
        """Adds the gradients of ``batch`` to the accumulators; returns its loss."""
        runner = self.runner("accumulate")
        if self._micro_batches == 0:
            self._zero_accumulators()
        number = self.state.step_count + 1
        loss, finite = runner.run(batch, {"step": number, "micro_batch": self._micro_batches})
        if not finite and self.nonfinite == "raise" and self.comm is None:  # with ranks: all decide in apply()
            raise _not_finite(f"micro-batch {self._micro_batches + 1} of step {number}", loss, runner, batch)
        if not finite and self.comm is not None and not self._poisoned:
            self._failure = f"micro-batch {self._micro_batches + 1}: {_cause(loss, runner, batch)}"
        self._poisoned |= not finite
        self._micro_batches += 1
        return loss

    def apply(self, lr: float, share: float = 1.0) -> None:
        """One optimiser step with the mean of the accumulated gradients. ``share``: this rank's
        examples over the mean number per rank (1 when they split evenly)."""
        if self._micro_batches == 0:
            raise TrainingError("apply() needs accumulate() first: no gradient has been accumulated")
        runner, number = self.runner("apply"), self.state.step_count + 1
        ranks = distributed.size(self.comm)
        if self.comm is not None:
            self._combine_ranks(number, share)
        scalars = {"lr": lr, "step": number, "grad_scale": 1.0 / (self._micro_batches * ranks)}
        finite = not self._poisoned and runner.run(None, scalars)[1]
        if not finite and self.nonfinite == "raise":
            raise _not_finite(f"step {number}", None, runner, None)
        if finite:
            self.state.step_count += 1
        else:
            self.skipped_steps += 1
        self._micro_batches = 0
        self._poisoned, self._failure = False, None

    def evaluate(self, batch) -> dict[str, np.ndarray]:
        """The eval model on ``batch``: {"loss": ..., model outputs...}."""
        return self.runner("eval").evaluate(batch)

    def _zero_accumulators(self) -> None:
        runner = self.runner("accumulate")  # the accumulators come first in carry, one per parameter read
        for (acc, _, _), (param, _) in zip(runner.carry, runner.reads):
            value = self.state.value(param)
            self.state.set(acc, np.zeros(value.shape(), ORT_TYPES[value.data_type()]))

    def _accumulate_nothing(self) -> float:
        """A rank without examples in this step: zero gradients, its share of the update none."""
        self._zero_accumulators()
        self._micro_batches = 1
        return 0.0

    def _combine_ranks(self, number: int, share: float) -> None:
        """Sums the ranks' accumulated gradients and averages the buffers, each weighted by its
        rank's ``share`` of the examples, in place; when a micro-batch was not finite on some rank,
        every rank skips the step (or raises, naming those ranks)."""
        failed = distributed.failed_ranks(self.comm, self._poisoned)
        if failed:
            if self.nonfinite == "raise":
                here = f" (here, {self._failure})" if self._failure else ""
                self._micro_batches, self._poisoned, self._failure = 0, False, None
                raise TrainingError(f"step {number}: not finite on rank {', '.join(map(str, failed))} of "
                                    f"{self.comm.Get_size()}{here}; nothing was updated on any rank")
            self._poisoned = True  # every rank skips the step
            return
        buffers = self.manifest.buffers
        accumulators = [key for key, _, _ in self.runner("accumulate").carry if key not in buffers]
        distributed.sum_in_place(self.comm, [self.state.value(key).numpy() for key in accumulators], share)
        distributed.mean_in_place(self.comm, [self.state.value(key).numpy() for key in buffers], share)


def _not_finite(what: str, loss: float | None, runner: StepRunner, batch) -> TrainingError:
    """The error for a step that was not kept, naming what was not finite."""
    return TrainingError(f"{what}: {_cause(loss, runner, batch)}. Nothing was updated; "
                         "Trainer(..., nonfinite='skip') skips such steps instead")


def _cause(loss: float | None, runner: StepRunner, batch) -> str:
    """What was not finite in a step that was not kept."""
    if loss is None or math.isfinite(loss):
        cause = ("the update is not finite: " if loss is None else f"the loss is {loss:g} but ")
        cause += "a gradient (or the new value of a parameter) is NaN or Inf"
    else:
        cause = f"the loss is {loss}"
    feeds = runner.feeds(batch) if batch is not None else []
    bad = [f"'{name}'" for name, array in feeds
           if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all()]
    if bad:
        cause += f"; batch input {', '.join(bad)} holds NaN or Inf"
    return cause


def _rows(batch) -> int:
    """The number of examples in ``batch`` (the length of its first array)."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else (
        batch[0] if isinstance(batch, (list, tuple)) else batch)
    return len(np.asarray(first)) if np.ndim(first) else 1
