"""Learning-rate schedules: the factor of the optimiser's learning rate at each step.

The three of transformers' ``get_scheduler`` that fine-tuning uses, with its formulas, so that a
run here steps the learning rates a transformers or PyTorch run steps (``LambdaLR`` of the same
factor; onnxruntime-training's ``LinearLRScheduler`` is "linear"):

- ``constant``: the learning rate, after a linear warmup from 0 over ``warmup_steps``;
- ``linear``: after the warmup, down to 0 at ``total_steps``;
- ``cosine``: after the warmup, half a cosine wave down to 0 at ``total_steps``.

``step`` counts the optimiser steps taken before the one the factor is for (the first step's is
``factor(0)``: 0 with a warmup, as transformers' first step).
"""

from __future__ import annotations

import dataclasses
import math

from onnx_autodiff.errors import TrainingError

SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """``kind`` (one of :data:`SCHEDULES`) with ``warmup_steps`` of linear warmup; ``total_steps``:
    the steps of the whole run, where "linear" and "cosine" reach 0 (they need it)."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise TrainingError(f"the learning-rate schedule must be one of {', '.join(SCHEDULES)}, not {self.kind!r}")
        if not _count(self.warmup_steps):
            raise TrainingError(f"warmup_steps must be a whole number >= 0, not {self.warmup_steps!r}")
        if self.kind != "constant" and self.total_steps is None:
            raise TrainingError(f"the {self.kind} schedule decays to 0 at the run's last step: give total_steps")
        if self.total_steps is not None and not (_count(self.total_steps) and self.total_steps > 0):
            raise TrainingError(f"total_steps must be a whole number > 0, not {self.total_steps!r}")

    def factor(self, step: int) -> float:
        """The learning rate's factor for the optimiser step after ``step`` steps."""
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if self.kind == "constant":
            return 1.0
        remaining = self.total_steps - self.warmup_steps
        if self.kind == "linear":
            return max(0.0, (self.total_steps - step) / max(1, remaining))
        progress = (step - self.warmup_steps) / max(1, remaining)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def to_json(self) -> dict:
        return {"kind": self.kind, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}

    @classmethod
    def from_json(cls, document: dict) -> LRSchedule:
        return cls(document["kind"], document.get("warmup_steps", 0), document.get("total_steps"))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
