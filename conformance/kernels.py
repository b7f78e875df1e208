"""Float64 kernels for onnx's reference evaluator, replacing the reference kernels that compute in
float32 inside (Erf, LayerNormalization, GroupNormalization, AffineGrid; the function-bodied Gelu,
HardSwish, Mish and MeanVarianceNormalization, whose run-time bodies keep float32 constants) or
that depart from the spec (BatchNormalization-9 in inference mode, Loop).

Importing this module imports onnx.reference: the evaluator imports it when it first builds a
reference session."""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_loop import Loop as _Loop

_erf = np.vectorize(math.erf, otypes=[np.float64])


class Erf(OpRun):
    def _run(self, x):
        return (_erf(np.asarray(x, np.float64)).astype(x.dtype),)


class LayerNormalization(OpRun):
    def _run(self, X, Scale, B=None, axis=None, epsilon=None, stash_type=None):
        axis = -1 if axis is None else axis
        epsilon = 1e-5 if epsilon is None else epsilon
        axis = axis + X.ndim if axis < 0 else axis
        x = X.astype(np.float64)
        reduced = tuple(range(axis, X.ndim))
        mean = x.mean(axis=reduced, keepdims=True)
        inv_std = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=reduced, keepdims=True) + epsilon)
        y = (x - mean) * inv_std * Scale
        if B is not None:
            y = y + B
        return y.astype(X.dtype), mean.astype(X.dtype), inv_std.astype(X.dtype)


class GroupNormalization(OpRun):
    def _run(self, X, scale, bias, epsilon=None, num_groups=None, stash_type=None):
        epsilon = 1e-5 if epsilon is None else epsilon
        n, c = X.shape[:2]
        x = X.astype(np.float64).reshape(n, num_groups, -1)
        mean = x.mean(axis=2, keepdims=True)
        y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=2, keepdims=True) + epsilon)
        extra = (1,) * (X.ndim - 2)
        if self.run_params["opsets"].get("", 21) < 21:  # opset 18: scale/bias per group
            y = y * scale.reshape(1, -1, 1) + bias.reshape(1, -1, 1)
            return (y.reshape(X.shape).astype(X.dtype),)
        y = y.reshape(X.shape) * scale.reshape(1, c, *extra) + bias.reshape(1, c, *extra)
        return (y.astype(X.dtype),)


class AffineGrid(OpRun):
    def _run(self, theta, size, align_corners=None):
        spatial = [int(s) for s in size[2:]]
        axes = [
            np.linspace(-1.0, 1.0, d) if align_corners else (2 * np.arange(d) + 1) / d - 1
            for d in spatial
        ]
        mesh = np.meshgrid(*axes, indexing="ij")
        count = int(np.prod(spatial))
        homogeneous = np.stack([m.reshape(-1) for m in reversed(mesh)] + [np.ones(count)])
        grid = np.matmul(theta.astype(np.float64), homogeneous)
        grid = grid.transpose(0, 2, 1).reshape(theta.shape[0], *spatial, len(spatial))
        return (grid.astype(theta.dtype),)


class BatchNormalization(OpRun):
    # The reference BatchNormalization-9 mixes batch statistics in whenever momentum is set.
    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None,
             is_test=None, spatial=None):
        epsilon = 1e-5 if epsilon is None else epsilon
        momentum = 0.9 if momentum is None else momentum
        opset = self.run_params["opsets"].get("", 21)
        outputs = [o for o in self.onnx_node.output if o]
        training = bool(training_mode) if opset >= 14 else len(outputs) > 1 and not is_test
        shape = (1, -1) + (1,) * (x.ndim - 2)
        axes = (0, *range(2, x.ndim))
        x64 = x.astype(np.float64)
        if training:
            batch_mean, batch_var = x64.mean(axis=axes), x64.var(axis=axes)
        else:
            batch_mean, batch_var = mean.astype(np.float64), var.astype(np.float64)
        y = (x64 - batch_mean.reshape(shape)) / np.sqrt(batch_var.reshape(shape) + epsilon)
        y = (y * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)
        if not training:
            return (y,)
        running_mean = (mean * momentum + batch_mean * (1 - momentum)).astype(mean.dtype)
        running_var = (var * momentum + batch_var * (1 - momentum)).astype(var.dtype)
        if opset >= 14:
            return y, running_mean, running_var
        return (y, running_mean, running_var, batch_mean.astype(x.dtype), batch_var.astype(x.dtype))[: len(outputs)]


# The reference evaluator runs Gelu, HardSwish, Mish and MeanVarianceNormalization through
# schema function bodies built at run time, whose float constants (and so some intermediate
# results) stay float32.
class Gelu(OpRun):
    def _run(self, X, approximate=None):
        x = X.astype(np.float64)
        if approximate == "tanh":
            y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        else:
            y = 0.5 * x * (1 + _erf(x / np.sqrt(2)))
        return (y.astype(X.dtype),)


class HardSwish(OpRun):
    def _run(self, X):
        x = X.astype(np.float64)
        return ((x * np.clip(x / 6 + 0.5, 0, 1)).astype(X.dtype),)


class Mish(OpRun):
    def _run(self, X):
        x = X.astype(np.float64)
        return ((x * np.tanh(np.logaddexp(0, x))).astype(X.dtype),)


class MeanVarianceNormalization(OpRun):
    def _run(self, X, axes=None):
        x = X.astype(np.float64)
        axes = tuple(axes) if axes is not None else (0, 2, 3)
        mean = x.mean(axis=axes, keepdims=True)
        std = np.sqrt((x**2).mean(axis=axes, keepdims=True) - mean**2)
        return (((x - mean) / (std + 1e-9)).astype(X.dtype),)


class Loop(_Loop):
    # The reference kernel runs no iteration when cond is omitted (it means true) and
    # concatenates the scan outputs (np.vstack) instead of stacking them on a new first axis.
    def _run(self, M, cond, *carried, context=None, attributes=None, bindings=None, **unused):
        names = self.body.input_names
        state, scans = list(carried), [[] for _ in range(self.K)]
        going, step = True if cond is None else bool(cond), 0
        while going and (M is None or step < int(M)):
            feeds = dict(context or {})
            feeds.update({names[0]: np.array(step, np.int64), names[1]: np.array(going)})
            feeds.update(zip(names[2:], state))
            outputs = self._run_body(feeds, attributes=attributes, bindings=bindings)
            going, state = bool(outputs[0]), list(outputs[1:1 + self.N])
            for k in range(self.K):
                scans[k].append(outputs[1 + self.N + k])
            step += 1
        stacked = [np.stack(s) if s else np.zeros((0,)) for s in scans]
        return self._check_and_fix_outputs(tuple(state + stacked))


FLOAT64_KERNELS = (Erf, LayerNormalization, GroupNormalization, AffineGrid, BatchNormalization,
                   Gelu, HardSwish, Mish, MeanVarianceNormalization, Loop)
"""The OpRun classes to pass as the reference evaluator's ``new_ops``."""
