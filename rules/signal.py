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
with ceil(frame_length/frame_step) Pads and one Sum, or a ScatterElements-add where the frame
length is known at run time only), dwindow = Σ dframes·frames.
Extents the shapes leave symbolic (lengths, the real/complex last dimension, dft_length and
frame_length fed at run time) are read from Shape in the graph; static ones stay constants.
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


def _size(op, value):
    """A scalar length input: an int when constant, else a 1-element int64 value; None when absent."""
    if value is None:
        return None
    number = shapes.number(value)
    return int(number) if number is not None else op.Reshape(op.Cast(value, to=7), [1])


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
    if have is want:  # one run-time extent (the default dft_length is the input's length)
        return x
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
    if d is None or (isinstance(d[-1], int) and d[-1] not in (1, 2)):
        raise RuleError("the DFT gradient needs the input's rank known and its last dimension 1 or 2")
    r = len(d)
    if op.opset >= 20:
        axis = _int(node.inputs[2] if len(node.inputs) > 2 else None, "axis")
        axis = -2 if axis is None else axis
    else:
        axis = shapes.attr(node, "axis", 1)
    axis = shapes.normalize_axis(axis, r)
    N = shapes.extent(op, X, axis)
    n = _size(op, length)
    if n is None and inverse and onesided:
        n = 2 * (N - 1) if isinstance(N, int) else op.Mul(op.Sub(N, [1]), [2])
    elif n is None:
        n = N

    if inverse and onesided:
        if length is not None and not isinstance(n, int):
            raise RuleError("the IRFFT gradient (onesided=1, inverse=1) needs a constant dft_length")
        spectrum = _dft(op, dY, axis, onesided=1)
        return {"input": op.Mul(spectrum, _irfft_weights(op, X, N, n, r - 1 - axis))}

    if onesided:  # the bins above n//2 were dropped: they send nothing back
        kept = n // 2 + 1 if isinstance(n, int) else shapes.extent(op, dY, axis)
        dY = _fit(op, dY, axis, r, kept, n)
    g = _dft(op, _conj(op, dY), axis, inverse=inverse)
    g = _fit(op, g, axis, r, n, N)
    # An RFFT takes real input only; otherwise a symbolic last dimension is read at run time.
    channels = d[-1] if isinstance(d[-1], int) else 1 if onesided else shapes.extent(op, X, r - 1)
    return {"input": _to_input(op, g, channels)}


def _to_input(op, g, channels):
    """The gradient of a real ([..., 1]) or complex ([..., 2]) input from g = DFT(conj(dY)):
    conj(g), or its real part, which is g's; ``channels`` (1, 2 or a run-time 1-element value)
    is the input's last extent."""
    if channels == 1:
        return op.Slice(g, [0], [1], [-1])
    g = _conj(op, g)
    return g if channels == 2 else op.Slice(g, [0], channels, [-1])


def _irfft_weights(op, X, N, n, trailing: int):
    """c_k/n for the IRFFT's N input bins, shaped [N, 1, ...] (``trailing`` ones): 1/n for the bins
    that appear once in the length-n spectrum (0, and n/2 for even n), 2/n for the others.

    Only N = n//2 + 1 is accepted (onnxruntime computes the other cases differently): checked when
    both are static; a symbolic N with a constant dft_length is held to it by the weights' extent.
    A symbolic N without dft_length gives n = 2·(N - 1), even: the weights are made at run time.
    """
    if isinstance(n, int):
        if isinstance(N, int) and N != n // 2 + 1:
            raise RuleError(
                "the IRFFT gradient (onesided=1, inverse=1) needs input length dft_length//2 + 1 "
                "(onnxruntime computes other cases differently)"
            )
        weights = np.full(n // 2 + 1, 2.0 / n)
        weights[0] = 1.0 / n
        if n % 2 == 0:
            weights[-1] = 1.0 / n
        return op.const(weights.reshape([-1] + [1] * trailing), dtype=X.dtype)
    twos = shapes.fill_like(op, X, 2.0, shapes.shape_from(op, op.Sub(N, [2]), *[1] * trailing))
    ends = op.Pad(twos, [1] + [0] * trailing + [1] + [0] * trailing, op.const(np.array(1.0), like=twos))
    return op.Div(ends, shapes.cast_like(op, n, X))


@rule("STFT", differentiable=("signal", "window"), since=17)
def stft(op, node, dY):
    """Y[b, f, k] = Σ_m w[m]·x[b, f·step + m]·e^{-2πikm/M}; overlap-add of the frames' adjoint DFT."""
    signal, step, window, frame_length = list(node.inputs) + [None] * (4 - len(node.inputs))
    step = _int(step, "frame_step")
    d = shapes.dims(signal)
    if d is None or len(d) != 3 or (isinstance(d[-1], int) and d[-1] not in (1, 2)):
        raise RuleError("the STFT gradient needs a signal of rank 3 whose last dimension is 1 or 2")
    channels = shapes.extent(op, signal, 2)
    # The frame length: frame_length, else the window's extent, else the signal's length.
    M = _size(op, frame_length)
    if M is None:
        M = shapes.extent(op, window, 0) if window is not None else shapes.extent(op, signal, 1)
    if shapes.attr(node, "onesided", 1):  # the bins above M//2 were dropped: they send nothing back
        dY = _fit(op, dY, 2, 4, M // 2 + 1 if isinstance(M, int) else shapes.extent(op, dY, 2), M)
    spectrum = _dft(op, _conj(op, dY), 2)  # [B, F, M, 2]
    dframes = _to_input(op, spectrum, channels)
    frames = shapes.extent(op, node.outputs[0], 1)
    grads = {}
    # [F, M] sample positions: the window's gradient reads the frames, a run-time M scatters to them
    indices = _frame_indices(op, frames, d[1], M, step) if window is not None or not isinstance(M, int) else None
    if window is not None:
        grads["window"] = op.ReduceSum(op.Mul(dframes, op.Gather(signal, indices, axis=1)), [0, 1, 3], keepdims=0)
        dframes = op.Mul(dframes, op.Reshape(window, [M if isinstance(M, int) else -1, 1]))
    if isinstance(M, int):
        grads["signal"] = _overlap_add(op, dframes, frames, signal, M, step, channels)
    else:  # no static count of overlapping frames: each sample scatter-added where it came from
        updates = op.Reshape(dframes, shapes.shape_from(op, 0, -1, channels))  # [B, F·M, C]
        positions = op.Expand(op.Reshape(indices, [1, -1, 1]), op.Shape(updates))
        grads["signal"] = op.ScatterElements(shapes.zeros(op, signal), positions, updates, axis=1, reduction="add")
    return grads


def _frame_indices(op, frames, length, M, step):
    """[F, M] positions f·step + m of each frame's samples in the signal."""
    if isinstance(length, int) and isinstance(M, int):
        count = (length - M) // step + 1
        return np.arange(count)[:, None] * step + np.arange(M)[None, :]
    starts = op.Mul(_arange(op, frames), [step])
    return op.Add(op.unsqueeze(starts, [1]), _arange(op, M))


def _arange(op, count):
    """0, 1, ..., count - 1 as int64: an array for an int, else made at run time from a 1-element value."""
    if isinstance(count, int):
        return np.arange(count, dtype=np.int64)
    return op.Range(op.const(np.array(0, np.int64)), op.Squeeze(count, [0]), op.const(np.array(1, np.int64)))


def _overlap_add(op, dframes, frames, signal, M: int, step, channels):
    """Σ_f frame f placed at f·step: frames padded to r·step, cut in r chunks, shifted, summed."""
    r = math.ceil(M / step)
    padded = _pad_end(op, dframes, 2, 4, r * step - M)
    chunks = op.Reshape(padded, shapes.shape_from(op, 0, 0, r, step, channels))
    shifted = [_pad_end(op, op.Gather(chunks, np.array(j, np.int64), axis=2), 1, 4, r - 1 - j, before=j)
               for j in range(r)]
    total = shifted[0] if r == 1 else op.Sum(*shifted)
    flat = op.Reshape(total, shapes.shape_from(op, 0, -1, channels))  # [B, (F + r - 1)·step, C]
    have = (frames + r - 1) * step if isinstance(frames, int) else op.Mul(op.Add(frames, [r - 1]), [step])
    return _fit(op, flat, 1, 3, have, shapes.extent(op, signal, 1))
