"""SGD with momentum, dampening, Nesterov momentum and weight decay, as torch.optim.SGD."""

from __future__ import annotations

import dataclasses

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training.update_rules.base import Optimizer, register_optimizer


@register_optimizer
@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD: g += wd·p; buf = momentum·buf + (1 − dampening)·g (buf = g on step 1);
    g = g + momentum·buf (nesterov) or buf; p −= lr·g."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    name = "sgd"

    def __post_init__(self):
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise TrainingError("SGD with nesterov=True needs momentum > 0 and dampening = 0")
        if self.momentum < 0 or self.weight_decay < 0:
            raise TrainingError("SGD momentum and weight_decay must be >= 0")

    def state_names(self) -> list[str]:
        return ["momentum_buffer"] if self.momentum else []

    def update(self, op, p, g, states, scalars):
        outs = []
        if self.weight_decay:
            g = op.Add(g, op.Mul(p, op.const(self.weight_decay, like=p)))
        if self.momentum:
            buf = states[0]
            m = scalars.literal("momentum", float(self.momentum), p)
            if self.dampening:
                keep = scalars.literal("dampening", float(1 - self.dampening), p)
                mixed = op.Add(op.Mul(buf, m), op.Mul(g, keep))
                step = scalars.step
                buf = op.Where(op.Equal(step, op.const(1, dtype=step.dtype)), g, mixed)
            else:
                buf = op.Add(op.Mul(buf, m), g)  # buf = 0 before step 1: exactly g
            outs.append(buf)
            g = op.Add(g, op.Mul(buf, op.const(self.momentum, like=p))) if self.nesterov else buf
        new_p = op.Sub(p, op.Mul(g, scalars.input("lr", p)))
        return [new_p, *outs]
