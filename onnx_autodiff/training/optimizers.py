"""Optimisers as graphs: SGD, Adam and AdamW specs (torch.optim semantics) and their update nodes."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.rules.builder import Namer, OpBuilder
from onnx_autodiff.training.values import dim_value, fresh_value

OPTIMIZERS = ("sgd", "adam", "adamw")


# Optimisers: hyper-parameters are constants of the graph; lr and step are inputs of every step.


@dataclasses.dataclass(frozen=True)
class SGD:
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


@dataclasses.dataclass(frozen=True)
class Adam:
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

    def state_names(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW: p ·= 1 − lr·wd (decoupled weight decay), then Adam without wd."""

    weight_decay: float = 1e-2
    name = "adamw"
    decoupled = True


def make_optimizer(optimizer, **options):
    """An optimiser spec from a name ("sgd", "adam", "adamw") and torch-style options, or as given."""
    if isinstance(optimizer, (SGD, Adam)):
        return dataclasses.replace(optimizer, **options) if options else optimizer
    classes = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
    if not isinstance(optimizer, str) or optimizer.lower() not in classes:
        raise TrainingError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)} or an SGD/Adam/AdamW instance")
    cls = classes[optimizer.lower()]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TrainingError(f"{cls.__name__} has no option {unknown}; its options are {sorted(fields)}")
    if "betas" in options:
        options["betas"] = tuple(float(b) for b in options["betas"])
    return cls(**options)


def optimizer_to_json(spec) -> dict:
    return {"name": spec.name, **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}}


def optimizer_from_json(data: dict):
    data = dict(data)
    return make_optimizer(data.pop("name"), **data)


def step_kept(op: OpBuilder, grads, loss: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """(kept, Σ‖g‖²): kept is True when the loss (when given) and the float32 sum of the squared
    gradients are finite, i.e. no gradient is NaN or ±Inf (nor so large that its square is)."""
    float32 = ir.DataType.FLOAT
    squares = []
    for g in grads:  # in float32 (float16 squares overflow early); a double sum cast down
        square = op.ReduceSumSquare(g if g.dtype in (float32, ir.DataType.DOUBLE) else op.Cast(g, to=float32), keepdims=0)
        squares.append(op.Cast(square, to=float32) if g.dtype == ir.DataType.DOUBLE else square)
    total = op.Sum(*squares) if len(squares) > 1 else squares[0]
    checked = total if loss is None else op.Add(total, op.Abs(op.Cast(loss, to=float32)))
    return op.Less(op.Abs(checked), op.const(float("inf"), dtype=float32)), total  # Less is False for NaN


def emit_update(op: OpBuilder, spec, params, grads, lr: ir.Value, step: ir.Value, namer: Namer, max_grad_norm,
                 state_names=None, loss: ir.Value | None = None):
    """Optimiser nodes: returns (state inputs per param, new params, new states per param, kept).

    ``kept`` is a bool scalar, True when the step counts: the loss (when given) and the sum of
    the squared gradients are finite. When it is False every new value equals its old one (the
    gradients enter as zeros and the coefficients as those of an identity update), so a trainer
    may write the new values over the old ones and still keep nothing of a failed step; every
    update also waits for it, so the updates run after the whole backward pass.
    """
    float32, double = ir.DataType.FLOAT, ir.DataType.DOUBLE
    kept, total = step_kept(op, grads, loss)
    if max_grad_norm is not None:
        # torch.nn.utils.clip_grad_norm_: g ·= min(max_norm / (‖g‖₂ + 1e-6), 1) over all gradients
        coef = op.Min(op.Div(op.const(float(max_grad_norm), dtype=float32), op.Add(op.Sqrt(total), 1e-6)), 1.0)
        grads = [op.Mul(g, op.CastLike(coef, g)) for g in grads]
    # scalar coefficients in float64, like torch's Python-float arithmetic, then cast per dtype
    lr_d = op.Cast(lr, to=double)
    t = op.Cast(step, to=double)
    coefficients: dict = {}

    def scalar(key, build, like, identity=None):
        """A coefficient in ``like``'s dtype, ``build()`` computing it in float64 or a number;
        ``identity``: its value when the step is not kept."""
        if (key, like.dtype) not in coefficients:
            value = op.const(build, like=like) if isinstance(build, float) else op.Cast(build(), to=like.dtype)
            if identity is not None:
                value = op.Where(kept, value, op.const(identity, like=like))
            coefficients[(key, like.dtype)] = value
        return coefficients[(key, like.dtype)]

    def d(x):
        return op.const(float(x), dtype=double)

    def gated(g, p):  # zeros when the step is not kept: a NaN gradient must not reach the state
        return op.Where(kept, g, scalar("zero", 0.0, p))

    states, new_params, new_states = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        shape = [dim_value(x) for x in p.shape]
        if state_names is None:
            inputs = [fresh_value(namer, f"{p.name}.{s}", p.dtype, shape) for s in spec.state_names()]
        else:
            inputs = [ir.Value(name=n, type=ir.TensorType(p.dtype), shape=ir.Shape(shape)) for n in state_names[i]]
            namer.taken.update(state_names[i])
        states.append(inputs)
        outs = []
        if isinstance(spec, SGD):
            if spec.weight_decay:
                g = op.Add(g, op.Mul(p, op.const(spec.weight_decay, like=p)))
            g = gated(g, p)
            if spec.momentum:
                buf = inputs[0]
                m = scalar("momentum", float(spec.momentum), p, identity=1.0)
                if spec.dampening:
                    keep = scalar("dampening", float(1 - spec.dampening), p, identity=0.0)
                    mixed = op.Add(op.Mul(buf, m), op.Mul(g, keep))
                    buf = op.Where(op.Equal(step, op.const(1, dtype=step.dtype)), g, mixed)
                else:
                    buf = op.Add(op.Mul(buf, m), g)  # buf = 0 before step 1: exactly g
                outs.append(buf)
                g = op.Add(g, op.Mul(buf, op.const(spec.momentum, like=p))) if spec.nesterov else buf
            new_p = op.Sub(p, op.Mul(g, scalar("lr", lambda: lr_d, p, identity=0.0)))
        else:
            b1, b2 = spec.betas
            m, v = inputs[0], inputs[1]
            if spec.weight_decay and not spec.decoupled:
                g = op.Add(g, op.Mul(p, op.const(spec.weight_decay, like=p)))
            g = gated(g, p)
            if spec.weight_decay and spec.decoupled:
                decay = scalar("decay", lambda: op.Sub(d(1), op.Mul(lr_d, d(spec.weight_decay))), p, identity=1.0)
                p_decayed = op.Mul(p, decay)
            else:
                p_decayed = p
            m = op.Add(m, op.Mul(op.Sub(g, m), scalar("1-b1", float(1 - b1), p, identity=0.0)))
            v = op.Add(op.Mul(v, scalar("b2", float(b2), p, identity=1.0)),
                       op.Mul(op.Mul(g, g), scalar("1-b2", float(1 - b2), p, identity=0.0)))
            outs += [m, v]
            second = v
            if spec.amsgrad:
                second = op.Max(inputs[2], v)
                outs.append(second)
            # lr/bc1 · m / (√v/√bc2 + eps) = (lr·√bc2/bc1) · m / (√v + eps·√bc2): one pass fewer
            def bc2_sqrt():
                return op.Sqrt(op.Sub(d(1), op.Pow(d(b2), t)))

            eps = scalar("eps", lambda: op.Mul(bc2_sqrt(), d(spec.eps)), p)
            step_size = scalar("step_size", lambda: op.Div(op.Mul(lr_d, bc2_sqrt()), op.Sub(d(1), op.Pow(d(b1), t))), p,
                               identity=0.0)
            denom = op.Add(op.Sqrt(second), eps)
            new_p = op.Sub(p_decayed, op.Mul(op.Div(m, denom), step_size))
        new_params.append(new_p)
        new_states.append(outs)
    return states, new_params, new_states, kept
