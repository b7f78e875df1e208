"""Spectral ops: DFT (opset 17 and 20 forms) and STFT.

Both are linear. For a complex-linear map F, the gradient of the real and imaginary parts is
F^H dY (the conjugate transpose), and for the DFT matrix F^H = conj ∘ F ∘ conj: so
dX = conj(DFT(conj(dY))) with the forward's own inverse flag (the inverse DFT's 1/n comes along).
- real input: only the real part of that (conj does not change it);
- onesided (RFFT): the missing bins carry no gradient, so dY is zero-padded to the full length;
- dft_length different from the input length: the adjoint of zero-padding is a slice, of
  truncation a zero-pad;
- IRFFT (onesided=1, inverse=1): y = Re Σ_k c_k X_k e^{+2πikm/n} / n with c_k = 1 for the
  bins that appear once (0 and n/2) and 2 for the others, so dX_k = c_k/n · RFFT(dy)_k. Only
  input lengths K = n//2 + 1 are accepted: onnxruntime 1.32 computes something else for other
  dft_length values.
STFT: the frames are windowed slices of the signal, each transformed by a DFT of frame_length:
dframes = conj(DFT(conj(dY))), dsignal = overlap-add of window·dframes (frame_step apart, done
with ceil(frame_length/frame_step) Pads and one Sum), dwindow = Σ dframes·frames.
"""

from __future__ import annotations

import math

import numpy as np

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

BIG = 2**62


def _int(value, what: str):
    """A constant scalar input as a Python int, None when absent; refuses a run-time value."""
    if value is None:
        return None
    number = shapes.number(value)
    if number is None:
        raise RuleError(f"the gradient needs a constant {what}; it is computed at run time here")
    return int(number)


def _dft(op, x, axis: int, inverse=0, onesided=0, length=None):
    """DFT in the form of the model's opset (axis an attribute before 20, an input from 20)."""
    if op.opset >= 20:
        return op.DFT(x, length, op.const(np.array(axis, np.int64)), inverse=inverse, onesided=onesided)
    return op.DFT(x, length, axis=axis, inverse=inverse, onesided=onesided)


def _conj(op, x):
    return op.Mul(x, op.const(np.array([1.0, -1.0]), like=x))


def _pad_end(op, x, axis: int, rank: int, amount, before=0):
    """Zeros appended (and ``before`` prepended) along ``axis``; amount an int or 1-element value."""
    if isinstance(amount, int):
        if amount == 0 and before == 0:
            return x
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = before, amount
        return op.Pad(x, pads)
    pads = op.Concat(op.const(np.zeros(rank + axis, np.int64)), amount,
                     op.const(np.zeros(rank - axis - 1, np.int64)), axis=0)
    return op.Pad(x, pads)


def _fit(op, x, axis: int, rank: int, have, want):
    """x, ``have`` long along axis, cut or zero-padded at the end to ``want``."""
    if isinstance(have, int) and isinstance(want, int):
        if have > want:
            return op.Slice(x, [0], [want], [axis])
        return _pad_end(op, x, axis, rank, want - have)
    want = [want] if isinstance(want, int) else want
    have = [have] if isinstance(have, int) else have
    x = op.Slice(x, [0], want, [axis])
    return _pad_end(op, x, axis, rank, op.Max(op.Sub(want, have), [0]))


@rule("DFT", differentiable=("input",), since=17)
def dft(op, node, dY):
    """Y = DFT_n(X) along axis (inverse: /n and conjugate kernel); dX = conj(DFT(conj(dY)))."""
    X = node.inputs[0]
    length = node.inputs[1] if len(node.inputs) > 1 else None
    inverse, onesided = shapes.attr(node, "inverse", 0), shapes.attr(node, "onesided", 0)
    d = shapes.dims(X)
    if d is None or d[-1] not in (1, 2):
        raise RuleError("the DFT gradient needs the input's rank and its last dimension (1 or 2) known")
    r = len(d)
    if op.opset >= 20:
        axis = _int(node.inputs[2] if len(node.inputs) > 2 else None, "axis")
        axis = -2 if axis is None else axis
    else:
        axis = shapes.attr(node, "axis", 1)
    axis = shapes.normalize_axis(axis, r)
    N = shapes.extent(op, X, axis)
    n = _int(length, "dft_length") if shapes.number(length) is not None else None
    if length is not None and n is None:
        n = op.Reshape(op.Cast(length, to=7), [1])
    elif n is None:
        n = 2 * (N - 1) if inverse and onesided and isinstance(N, int) else N

    if inverse and onesided:
        if not (isinstance(N, int) and isinstance(n, int) and N == n // 2 + 1):
            raise RuleError(
                "the IRFFT gradient (onesided=1, inverse=1) needs static lengths with input length "
                "dft_length//2 + 1 (onnxruntime computes other cases differently)"
            )
        spectrum = _dft(op, dY, axis, onesided=1)
        weights = np.full(N, 2.0 / n)
        weights[0] = 1.0 / n
        if n % 2 == 0:
            weights[-1] = 1.0 / n
        return {"input": op.Mul(spectrum, op.const(weights.reshape([N] + [1] * (r - 1 - axis)), dtype=X.dtype))}

    if onesided:  # the bins above n//2 were dropped: they send nothing back
        kept = n // 2 + 1 if isinstance(n, int) else shapes.extent(op, node.outputs[0], axis)
        dY = _fit(op, dY, axis, r, kept, n)
    g = _dft(op, _conj(op, dY), axis, inverse=inverse)
    g = _fit(op, g, axis, r, n, N)
    return {"input": op.Slice(g, [0], [1], [-1]) if d[-1] == 1 else _conj(op, g)}


@rule("STFT", differentiable=("signal", "window"), since=17)
def stft(op, node, dY):
    """Y[b, f, k] = Σ_m w[m]·x[b, f·step + m]·e^{-2πikm/M}; overlap-add of the frames' adjoint DFT."""
    signal, step, window, frame_length = list(node.inputs) + [None] * (4 - len(node.inputs))
    step = _int(step, "frame_step")
    d = shapes.dims(signal)
    if d is None or len(d) != 3 or d[-1] not in (1, 2):
        raise RuleError("the STFT gradient needs the signal's shape [batch, length, 1 or 2] known")
    channels = d[-1]
    M = _int(frame_length, "frame_length") if frame_length is not None else None
    if M is None and window is not None:
        M = (shapes.dims(window) or [None])[0]
    if M is None and frame_length is None and window is None:
        M = d[1]
    if not isinstance(M, int):
        raise RuleError("the STFT gradient needs a static frame length (a constant frame_length or a static window)")
    if shapes.attr(node, "onesided", 1):
        dY = _pad_end(op, dY, 2, 4, M - (M // 2 + 1))
    spectrum = _dft(op, _conj(op, dY), 2)  # [B, F, M, 2]
    dframes = op.Slice(spectrum, [0], [1], [-1]) if channels == 1 else _conj(op, spectrum)
    grads = {}
    if window is not None:
        frames = op.Gather(signal, _frame_indices(op, dY, d[1], M, step), axis=1)  # [B, F, M, C]
        grads["window"] = op.ReduceSum(op.Mul(dframes, frames), [0, 1, 3], keepdims=0)
        dframes = op.Mul(dframes, op.Reshape(window, [M, 1]))
    frames = shapes.extent(op, node.outputs[0], 1)
    grads["signal"] = _overlap_add(op, dframes, frames, signal, M, step, channels)
    return grads


def _frame_indices(op, dY, length, M, step):
    """[F, M] positions f·step + m of each frame's samples in the signal."""
    if isinstance(length, int):
        count = (length - M) // step + 1
        return np.arange(count)[:, None] * step + np.arange(M)[None, :]
    count = op.Squeeze(op.Slice(op.Shape(dY), [1], [2]), [0])
    starts = op.Mul(op.Range(op.const(np.array(0, np.int64)), count, op.const(np.array(1, np.int64))), [step])
    return op.Add(op.unsqueeze(starts, [1]), np.arange(M, dtype=np.int64)[None, :])


def _overlap_add(op, dframes, frames, signal, M, step, channels):
    """Σ_f frame f placed at f·step: frames padded to r·step, cut in r chunks, shifted, summed."""
    r = math.ceil(M / step)
    padded = _pad_end(op, dframes, 2, 4, r * step - M)
    chunks = op.Reshape(padded, [0, 0, r, step, channels])
    shifted = [_pad_end(op, op.Gather(chunks, np.array(j, np.int64), axis=2), 1, 4, r - 1 - j, before=j)
               for j in range(r)]
    total = shifted[0] if r == 1 else op.Sum(*shifted)
    flat = op.Reshape(total, [0, -1, channels])  # [B, (F + r - 1)·step, C]
    have = (frames + r - 1) * step if isinstance(frames, int) else op.Mul(op.Add(frames, [r - 1]), [step])
    return _fit(op, flat, 1, 3, have, shapes.extent(op, signal, 1))
