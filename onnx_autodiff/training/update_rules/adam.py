"""Adam and AdamW (decoupled weight decay, amsgrad), as torch.optim.Adam and torch.optim.AdamW."""

from __future__ import annotations

import dataclasses

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training.update_rules.base import Optimizer, register_optimizer


@register_optimizer
@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam: g += wd·p; m = lerp(m, g, 1 − β1); v = β2·v + (1 − β2)·g²;
    p −= lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + eps) (√max(v) with amsgrad)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    name = "adam"
    decoupled = False

    def __post_init__(self):
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1) or self.eps < 0 or self.weight_decay < 0:
            raise TrainingError(f"{type(self).__name__} needs 0 <= betas < 1, eps >= 0 and weight_decay >= 0")

    @classmethod
    def from_options(cls, **options) -> Adam:
        if "betas" in options:  # (a JSON list, or the command line's numbers)
            options["betas"] = tuple(float(b) for b in options["betas"])
        return cls(**options)

    def state_names(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])

    def coefficient_formulas(self) -> dict[str, list]:
        b1, b2 = self.betas
        lr = ["float32", "lr"]
        bc2_sqrt = ["sqrt", ["-", 1.0, ["pow", float(b2), "step"]]]  # √(1 − β2^t)
        formulas = {
            # lr/bc1 · m / (√v/√bc2 + eps) = (lr·√bc2/bc1) · m / (√v + eps·√bc2)
            "step_size": ["/", ["*", lr, bc2_sqrt], ["-", 1.0, ["pow", float(b1), "step"]]],
            "eps_scaled": ["*", bc2_sqrt, float(self.eps)],
        }
        if self.weight_decay and self.decoupled:
            formulas["decay"] = ["-", 1.0, ["*", lr, float(self.weight_decay)]]
        return formulas

    def update(self, op, p, g, states, scalars):
        b1, b2 = self.betas
        m, v = states[0], states[1]
        if self.weight_decay and not self.decoupled:
            g = op.Add(g, op.Mul(p, op.const(self.weight_decay, like=p)))
        if self.weight_decay and self.decoupled:
            decay = scalars.input("decay", p)
            p_decayed = op.Mul(p, decay)
        else:
            p_decayed = p
        m = op.Add(m, op.Mul(op.Sub(g, m), scalars.literal("1-b1", float(1 - b1), p)))
        v = op.Add(op.Mul(v, scalars.literal("b2", float(b2), p)),
                   op.Mul(op.Mul(g, g), scalars.literal("1-b2", float(1 - b2), p)))
        outs = [m, v]
        second = v
        if self.amsgrad:
            second = op.Max(states[2], v)
            outs.append(second)
        # lr/bc1 · m / (√v/√bc2 + eps) = (lr·√bc2/bc1) · m / (√v + eps·√bc2): one pass fewer
        eps = scalars.input("eps_scaled", p)
        step_size = scalars.input("step_size", p)
        denom = op.Add(op.Sqrt(second), eps)
        new_p = op.Sub(p_decayed, op.Mul(op.Div(m, denom), step_size))
        return [new_p, *outs]


@register_optimizer
@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW: p ·= 1 − lr·wd (decoupled weight decay), then Adam without wd."""

    weight_decay: float = 1e-2
    name = "adamw"
    decoupled = True
