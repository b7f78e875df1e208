"""Spatial resampling: Resize and Upsample, GridSample, AffineGrid, RoiAlign.

Resize is linear in X and separable: along each resized axis Y = W·X for an (out, in) matrix W
that depends only on the axis's length and its scale or size, and dX applies Wᵀ axis by axis (one
MatMul each). W is built here in numpy where those are static; where one is known at run time
only (dynamic H×W, sizes computed from Shape), the graph computes W by applying the forward's own
Resize to an identity matrix of the run-time length. GridSample and RoiAlign depend on run-time data
(the grid, the boxes): their sampling positions and bilinear/bicubic weights are rebuilt in the
graph from the forward inputs; dX scatters (or, RoiAlign, multiplies back) the weighted dY.
AffineGrid is linear in theta: dθ = Σ dgrid ⊗ (base coordinates, 1).

Weights follow onnxruntime where the spec is loose (integer output length in align_corners and
tf_crop_and_resize, nearest rounding 'simple' before opset 11: ceil when downsampling, floor
otherwise; pytorch_half_pixel maps a length-1 output to 0). Resize weights are computed in
float64: where a source coordinate lies exactly on a nearest-rounding tie, onnxruntime's float32
forward may take the other neighbour (a kink either way). GridSample and RoiAlign recompute the
forward's own positions in the graph, so their branches agree with it.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

INT64, FLOAT = int(ir.DataType.INT64), int(ir.DataType.FLOAT)

# Resize / Upsample


def _kernel(mode: str, a: float):
    """(half width, kernel) of an interpolating filter."""
    if mode == "linear":
        return 1, lambda t: np.clip(1 - np.abs(t), 0, 1)

    def cubic(t):
        t = np.abs(t)
        near = ((a + 2) * t - (a + 3)) * t * t + 1
        far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
        return np.where(t <= 1, near, np.where(t < 2, far, 0.0))

    return 2, cubic


_ROUND = {
    "round_prefer_floor": lambda x: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: np.floor(x + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}


def _source_coords(ctm: str, n_in: int, n_out: int, scale: float, roi) -> np.ndarray:
    """The input coordinate each output index samples."""
    y = np.arange(n_out, dtype=np.float64)
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / (scale * n_in))
        return offset + (y + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if n_out > 1 else np.zeros(n_out)
    if ctm == "align_corners":
        return y * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros(n_out)
    if ctm == "asymmetric":
        return y / scale
    if ctm == "tf_crop_and_resize":
        lo, hi = roi
        if n_out == 1:
            return np.full(n_out, 0.5 * (lo + hi) * (n_in - 1))
        return lo * (n_in - 1) + y * (hi - lo) * (n_in - 1) / (n_out - 1)
    raise RuleError(f"Resize coordinate_transformation_mode={ctm!r} is not supported")


def resize_matrix(n_in, n_out, scale, mode, ctm, nearest_mode="round_prefer_floor", cubic_a=-0.75,
                  exclude_outside=False, antialias=False, roi=(0.0, 1.0)) -> np.ndarray:
    """W (n_out, n_in) with Y = W·X along one axis of Resize."""
    x = _source_coords(ctm, n_in, n_out, scale, roi)
    W = np.zeros((n_out, n_in))
    rows = np.arange(n_out)
    if mode == "nearest":
        if nearest_mode == "simple":  # Upsample and Resize-10 (onnxruntime)
            rounded = np.ceil(x) if scale < 1 else np.floor(x)
        elif nearest_mode in _ROUND:
            rounded = _ROUND[nearest_mode](x)
        else:
            raise RuleError(f"Resize nearest_mode={nearest_mode!r} is not supported")
        W[rows, np.clip(rounded, 0, n_in - 1).astype(np.int64)] = 1.0
    elif mode in ("linear", "cubic"):
        half, kernel = _kernel(mode, cubic_a)
        # Antialiasing stretches the filter by 1/scale when downsampling.
        s = min(scale, 1.0) if antialias else 1.0
        reach = math.ceil(half / s)
        taps = (np.ceil(x) - 1)[:, None] + np.arange(1 - reach, reach + 1)[None, :]
        w = kernel((taps - x[:, None]) * s)
        if antialias:
            w = w / w.sum(1, keepdims=True)
        if exclude_outside:
            w = np.where((taps < 0) | (taps > n_in - 1), 0.0, w)
            w = w / w.sum(1, keepdims=True)
        cols = np.clip(taps, 0, n_in - 1).astype(np.int64)  # edge padding
        np.add.at(W, (np.repeat(rows, taps.shape[1]), cols.ravel()), w.ravel())
    else:
        raise RuleError(f"Resize mode={mode!r} is not supported")
    if ctm == "tf_crop_and_resize":
        W[(x < 0) | (x > n_in - 1)] = 0.0  # extrapolation_value: a constant
    return W


def _given(node, index: int):
    """An optional 1-D input: its array when known before run time, the value itself when only the
    run knows it, None when it is absent or statically empty."""
    if index >= len(node.inputs) or node.inputs[index] is None:
        return None
    value = node.inputs[index]
    array = shapes.constant(value)
    if array is not None:
        return array.reshape(-1) if array.size else None
    return None if shapes.dims(value) == (0,) else value


_DIM = "dim"
_OUT, _COMMON = "out", "common"  # (in a plan's spec) the output's length; keep_aspect_ratio_policy's scale


def _entries(value, X, count: int) -> list:
    """Per element of a 1-D input read before run time: its number when known, (_DIM, axis) where
    it is X's length along that axis (sizes that exporters build from Shape(X)), else None."""
    found = _traced(value, X, 0)
    return found if found is not None and len(found) == count else [None] * count


def _traced(value, X, depth: int) -> list | None:
    """:func:`_entries` through Concat, Cast, (Un)Squeeze, Slice and Gather; None when unknown."""
    array = shapes.constant(value)
    if array is not None:
        return array.reshape(-1).tolist()
    node = value.producer() if depth < 8 else None
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    inputs = node.inputs
    if node.op_type == "Shape" and inputs[0] is X and shapes.rank(X) is not None:
        x_dims = shapes.dims(X)
        lengths = [d if isinstance(d, int) else (_DIM, j) for j, d in enumerate(x_dims)]
        return lengths[shapes.attr(node, "start", 0):shapes.attr(node, "end", None)]
    if node.op_type == "Concat":
        parts = []
        for part in inputs:
            found = _traced(part, X, depth + 1)
            if found is None:
                length = shapes.static_shape(part)
                if length is None or len(length) != 1:
                    return None
                found = [None] * length[0]
            parts += found
        return parts
    if node.op_type in ("Cast", "Unsqueeze", "Squeeze", "Identity"):
        return _traced(inputs[0], X, depth + 1)
    if node.op_type in ("Slice", "Gather"):
        data = _traced(inputs[0], X, depth + 1)
        if len(inputs) == 1:  # Slice before opset 10: attributes
            picks = [np.asarray(shapes.attr(node, name, [0])) for name in ("starts", "ends", "axes")]
        else:
            picks = [None if v is None else shapes.constant(v) for v in inputs[1:]]
        if data is None or any(p is None for p in picks):
            return None
        if node.op_type == "Gather":
            indices = [int(i) for i in picks[0].reshape(-1)]
            return [data[i] for i in indices] if all(-len(data) <= i < len(data) for i in indices) else None
        starts, ends, *rest = (p.reshape(-1) for p in picks)
        axes, steps = (rest + [np.zeros(1), np.ones(1)][len(rest):])[:2]
        if len(starts) != 1 or int(axes[0]) not in (0, -1):
            return None
        return data[int(starts[0]):int(ends[0]):int(steps[0])]
    return None


def _resize_plan(node, opset: int) -> list[tuple[int, object]]:
    """(axis, W) for every axis Resize/Upsample changes: W the (out, in) numpy matrix where the
    axis's length and scale are static, else the ``spec`` of :func:`_runtime_matrix`."""
    X = node.inputs[0]
    in_dims = shapes.dims(X)
    if in_dims is None:
        raise RuleError(f"{node.op_type}: the rank of '{X.name}' is unknown; run shape inference first")
    r = len(in_dims)
    mode = shapes.attr(node, "mode", "nearest")
    legacy = node.op_type == "Upsample" or opset < 11
    ctm = "asymmetric" if legacy else shapes.attr(node, "coordinate_transformation_mode", "half_pixel")
    nearest_mode = "simple" if legacy else shapes.attr(node, "nearest_mode", "round_prefer_floor")
    if shapes.attr(node, "antialias", 0) and mode == "nearest":
        raise RuleError("Resize: antialias is not defined for mode 'nearest'")
    axes = [shapes.normalize_axis(a, r) for a in shapes.attr(node, "axes", list(range(r)))]
    k = len(axes)
    roi = sizes = None
    if node.op_type == "Upsample" and opset < 9:
        scales = np.asarray(shapes.attr(node, "scales"), np.float64)
    elif legacy:
        scales = _given(node, 1)
    else:
        roi = _given(node, 1) if ctm == "tf_crop_and_resize" else None
        scales, sizes = _given(node, 2), _given(node, 3)
    if scales is None and sizes is None:
        raise RuleError(f"{node.op_type}: neither scales nor sizes is given")
    if roi is None:
        roi = np.array([0.0] * k + [1.0] * k)
    runtime_roi = isinstance(roi, ir.Value)
    lengths = [in_dims[a] if isinstance(in_dims[a], int) else None for a in axes]
    if sizes is not None:
        given = _entries(sizes, X, k) if isinstance(sizes, ir.Value) else [int(s) for s in sizes]
        # A size that is the input's own length along the axis keeps it: a stretch by 1.
        same = [isinstance(g, tuple) and (g[1] == a or in_dims[a] is not None and in_dims[g[1]] == in_dims[a])
                for g, a in zip(given, axes)]
        policy = shapes.attr(node, "keep_aspect_ratio_policy", "stretch")
        if policy not in ("stretch", "not_larger", "not_smaller"):
            raise RuleError(f"Resize keep_aspect_ratio_policy={policy!r} is not supported")
        static = [isinstance(g, int) and n is not None for g, n in zip(given, lengths)]
        ratios = [float(g) / n if s else None for g, n, s in zip(given, lengths, static)]
        if policy == "stretch":
            outs, scale_of = [g if s else None for g, s in zip(given, static)], ratios
        elif all(static):
            common = min(ratios) if policy == "not_larger" else max(ratios)
            scale_of = [common] * k
            outs = [int(common * n + 0.5) for n in lengths]
        else:  # one scale for all resized axes, known at run time: every axis's W is built in the graph
            given, same, static = _kept_aspect_entries(node, policy, ctm, axes), [False] * k, [False] * k
    else:
        given = _entries(scales, X, k) if isinstance(scales, ir.Value) else [float(s) for s in scales]
        given = [g if isinstance(g, float) else None for g in given]
        same = [g == 1.0 for g in given]
        static = [g is not None and n is not None for g, n in zip(given, lengths)]
        scale_of, outs = given, [None] * k
    out_dims = shapes.dims(node.outputs[0]) or [None] * r
    plan = []
    for i, axis in enumerate(axes):
        if same[i] and ctm != "tf_crop_and_resize":
            continue  # identity along this axis, whatever its size
        if not static[i] or runtime_roi:
            plan.append((axis, (i, k, given[i], sizes is not None and given[i] != _COMMON)))
            continue
        if isinstance(out_dims[axis], int):  # dY's shape decides W's rows when it is known
            outs[i] = out_dims[axis]
        scale, lo, hi = scale_of[i], float(roi[i]), float(roi[k + i])
        n_in = lengths[i]
        n_out = outs[i] if outs[i] is not None else int(np.float32(scale) * np.float32(n_in))
        W = resize_matrix(n_in, n_out, scale, mode, ctm, nearest_mode,
                          shapes.attr(node, "cubic_coeff_a", -0.75),
                          bool(shapes.attr(node, "exclude_outside", 0)),
                          bool(shapes.attr(node, "antialias", 0)), (lo, hi))
        if W.shape != (n_in, n_in) or not np.array_equal(W, np.eye(n_in)):
            plan.append((axis, W))
    return plan


def _kept_aspect_entries(node, policy: str, ctm: str, axes: list[int]) -> list:
    """The entries of :func:`_runtime_matrix`'s specs for a Resize that keeps the aspect ratio over
    run-time lengths: (_OUT, axis), the output's length, where the coordinates follow from the
    lengths alone; _COMMON, the one scale computed in the graph, where they follow from the scale
    alone (not the output's length, which rounds scale·length where a Resize by a scale floors it)."""
    if not shapes.attr(node, "antialias", 0):
        if ctm in ("align_corners", "tf_crop_and_resize"):
            return [(_OUT, a) for a in axes]
        if ctm in ("half_pixel", "asymmetric") and not shapes.attr(node, "exclude_outside", 0):
            return [_COMMON] * len(axes)
    raise RuleError(f"Resize keep_aspect_ratio_policy={policy!r} over run-time lengths of '{node.inputs[0].name}': "
                    f"the gradient supports coordinate_transformation_mode align_corners, tf_crop_and_resize, "
                    f"half_pixel and asymmetric (the last two without exclude_outside), without antialias; "
                    f"give the resized axes static lengths for the others")


def _common_scale(op, node):
    """keep_aspect_ratio_policy's one scale, as the runtimes compute it (float32): the least
    (not_larger) or the greatest (not_smaller) of sizes / length over the resized axes; shape [1]."""
    X = node.inputs[0]
    r = shapes.rank(X)
    axes = [shapes.normalize_axis(a, r) for a in shapes.attr(node, "axes", list(range(r)))]
    lengths = op.Gather(op.Shape(X), op.const(np.array(axes, np.int64)))
    ratios = op.Div(op.Cast(node.inputs[3], to=FLOAT), op.Cast(lengths, to=FLOAT))
    least = shapes.attr(node, "keep_aspect_ratio_policy") == "not_larger"
    return op.reduce("ReduceMin" if least else "ReduceMax", ratios, None)


# What the forward's Resize does to a whole tensor and not to one axis's identity matrix.
_TENSOR_ATTRIBUTES = frozenset({"axes", "keep_aspect_ratio_policy", "extrapolation_value", "scales"})


def _runtime_matrix(op, node, axis: int, spec, transposed: bool, like):
    """W (n_out, n_in) of one axis, or Wᵀ, computed in the graph: the forward's own Resize (mode,
    coordinates, rounding, filter) applied to the identity of the input's run-time length, with
    that axis's scale or size (and roi) on one side and the length kept on the other.

    W depends on shapes only, so the gradient stays linear in dY (differentiable again). ``spec``:
    (the axis's index i in 'axes', their count k, its scale or size where known before run time (a
    number, or (_DIM, j): X's length along j, or (_OUT, j): the output's; _COMMON: the one scale of
    keep_aspect_ratio_policy; else None), whether it resizes by size)."""
    i, k, entry, by_size = spec
    X = node.inputs[0]
    shapes.require_opset(op, 9, f"{node.op_type}'s gradient over a length or scale known at run time (EyeLike)")
    n = _extent(op, X, axis)
    eye = op.EyeLike(shapes.zeros(op, like, shapes.shape_from(op, n, n)))
    eye.dtype = like.dtype

    def pair(value, kept):  # (this axis's, the other's), in the order of W or of Wᵀ
        return [kept, value] if transposed else [value, kept]

    def element(index: int, j: int):  # element j of the forward's input ``index``, 1-D
        return op.Gather(node.inputs[index], op.const(np.array([j], np.int64)))

    legacy = node.op_type == "Upsample" or op.opset < 11
    if entry == _COMMON:
        # The output's round(scale·n) rows may be one more than a Resize by the scale gives
        # (floor(scale·n)): the identity extended by n copies of its last row, which clamping at the
        # edge reads anyway, gives enough of them; cut to the output's length below.
        eye = op.Pad(eye, shapes.shape_from(op, 0, 0, *pair(n, 0)), mode="edge")
        resize_by = op.Concat(*pair(_common_scale(op, node), op.const(np.array([1.0], np.float32))), axis=0)
    elif by_size:
        if isinstance(entry, tuple):  # another axis's length, or the output's
            size = _extent(op, X if entry[0] == _DIM else node.outputs[0], entry[1])
        else:
            size = entry if isinstance(entry, int) else element(3, i)
        resize_by = shapes.shape_from(op, *pair(size, n))
    elif entry is not None:
        resize_by = op.const(np.array(pair(entry, 1.0), np.float32))
    else:
        resize_by = op.Concat(*pair(element(1 if legacy else 2, i), op.const(np.array([1.0], np.float32))), axis=0)
    attributes = {name: shapes.attr(node, name) for name in node.attributes if name not in _TENSOR_ATTRIBUTES}
    if legacy:
        W = op.emit(node.op_type, eye, resize_by, **attributes)
    else:
        roi = None
        if shapes.attr(node, "coordinate_transformation_mode") == "tf_crop_and_resize":
            start, end = element(1, i), element(1, k + i)
            zero, one = (op.const(np.array([v]), like=node.inputs[1]) for v in (0.0, 1.0))
            roi = op.Concat(*pair(start, zero), *pair(end, one), axis=0)
        elif op.opset < 13:  # roi and scales are required inputs there, empty when unused
            roi = op.const(np.zeros(0, np.float32))
        scales = resize_by if not by_size else op.const(np.zeros(0, np.float32)) if op.opset < 13 else None
        W = op.Resize(eye, roi, scales, resize_by if by_size else None, **attributes)
    W.dtype = like.dtype
    if entry == _COMMON:
        rows = _extent(op, node.outputs[0], axis)
        W = op.Slice(W, [0], [rows] if isinstance(rows, int) else rows, [1 if transposed else 0])
    return W


def _extent(op, x, axis: int):
    """x's length along ``axis``: an int when static, else a 1-element int64 value. (Gather, not
    shapes.extent's Slice, whose inputs Upsample-9's opset does not have.)"""
    length = shapes.dims(x)[axis]
    return length if isinstance(length, int) else op.Gather(op.Shape(x), op.const(np.array([axis], np.int64)))


def _along(op, g, axis: int, r: int, matrix):
    """Contract axis ``axis`` of g (length W's rows) with W: that axis becomes W's columns.
    ``matrix(transposed)`` gives W or Wᵀ."""
    if axis == r - 1:
        return op.MatMul(g, matrix(False))
    if axis == r - 2:
        return op.MatMul(matrix(True), g)
    perm = list(range(r))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    return op.Transpose(op.MatMul(op.Transpose(g, perm=perm), matrix(False)), perm=perm)


def _resize_backward(op, node, dY):
    X = node.inputs[0]
    r = shapes.rank(X)
    like = X if X.dtype else dY
    dX = dY
    for axis, W in _resize_plan(node, op.opset):
        if isinstance(W, np.ndarray):
            matrix = functools.partial(_static_matrix, op, W, like=like)
        else:
            matrix = functools.partial(_runtime_matrix, op, node, axis, W, like=like)
        dX = _along(op, dX, axis, r, matrix)
    return dX


def _static_matrix(op, W: np.ndarray, transposed: bool, like):
    return op.const(W.T if transposed else W, like=like)


@rule("Resize", differentiable=("X",), since=10)
def resize(op, node, dY):
    """Y = per-axis interpolation of X (nearest/linear/cubic); dX = Wᵀ·dY along each resized axis"""
    return {"X": _resize_backward(op, node, dY)}


@rule("Upsample", differentiable=("X",), since=7, until=9)
def upsample(op, node, dY):
    """Y = Resize(X, scales) with asymmetric coordinates (nearest or linear)"""
    return {"X": _resize_backward(op, node, dY)}


# GridSample


def _cubic_weights(op, t, a: float = -0.75):
    """Weights of taps at offsets -1, 0, 1, 2 for a fraction t, and their derivatives in t."""
    def near(d):  # |d| <= 1
        return op.Add(op.Mul(op.Mul(op.Sub(op.Mul(d, a + 2), a + 3), d), d), 1.0)

    def far(d):  # 1 < |d| < 2
        return op.Sub(op.Mul(op.Add(op.Mul(op.Sub(op.Mul(d, a), 5 * a), d), 8 * a), d), 4 * a)

    def near_slope(d):
        return op.Mul(op.Sub(op.Mul(d, 3 * (a + 2)), 2 * (a + 3)), d)

    def far_slope(d):
        return op.Add(op.Mul(op.Sub(op.Mul(d, 3 * a), 10 * a), d), 8 * a)

    u = op.Sub(1.0, t)
    ds = [op.Add(t, 1.0), t, u, op.Add(u, 1.0)]  # distances to the taps
    kinds = [far, near, near, far]
    slopes = [far_slope, near_slope, near_slope, far_slope]
    signs = [1.0, 1.0, -1.0, -1.0]  # d(distance)/dt
    weights = [k(d) for k, d in zip(kinds, ds)]
    derivs = [op.Mul(s(d), sign) for s, d, sign in zip(slopes, ds, signs)]
    return weights, derivs


def _length(op, x, axis: int, like):
    """x's length along ``axis``: an int when static, else a scalar value of ``like``'s dtype."""
    n = shapes.dims(x)[axis]
    if isinstance(n, int):
        return n
    return shapes.cast_like(op, op.Gather(op.Shape(x), op.const(np.array(axis, np.int64))), like)


def _less(op, n, k: float):
    """n - k for a length that is static (a number) or known at run time (a value)."""
    return op.Sub(n, k) if isinstance(n, ir.Value) else n - k


def _num(op, x, like):
    """A number as a constant of ``like``'s dtype; a value as it is."""
    return x if isinstance(x, ir.Value) else op.const(x, like=like)


def _reflect(op, u, lo: float, hi):
    """u folded into [lo, hi] like a mirror, and d(folded)/du (±1)."""
    if isinstance(hi, ir.Value):
        # A length of 1 with align_corners spans nothing: a tiny span folds everything onto lo.
        span = op.Max(op.Sub(hi, lo), 1e-6)
    else:
        span = hi - lo
        if span <= 0:
            return op.Mul(u, 0.0), op.Mul(u, 0.0)
    a = op.Abs(op.Sub(u, lo))
    flips = op.Floor(op.Div(a, span))
    extra = op.Sub(a, op.Mul(flips, span))
    odd = op.Greater(op.Sub(flips, op.Mul(op.Floor(op.Mul(flips, 0.5)), 2.0)), 0.5)
    folded = op.Where(odd, op.Sub(hi, extra), op.Add(extra, lo))
    slope = op.Mul(op.Sign(op.Sub(u, lo)), op.Where(odd, op.const(-1.0, like=u), op.const(1.0, like=u)))
    return folded, slope


def _pad_coordinate(op, u, n, padding: str, align: bool):
    """(padded u, du_padded/du) for border/reflection; the identity for zeros. ``n``: the axis's
    length, an int or a value (see :func:`_length`)."""
    if padding == "zeros":
        return u, None
    slope = None
    if padding == "reflection":
        lo, hi = (0.0, _less(op, n, 1.0)) if align else (-0.5, _less(op, n, 0.5))
        u, slope = _reflect(op, u, lo, hi)
    inside = op.And(op.GreaterOrEqual(u, 0.0), op.LessOrEqual(u, _less(op, n, 1.0)))
    gate = shapes.cast_like(op, inside, u)
    slope = gate if slope is None else op.Mul(slope, gate)
    return op.Clip(u, op.const(0.0, like=u), _num(op, _less(op, n, 1.0), u)), slope


def _pad_index(op, i, n, padding: str, align: bool):
    """A (float) tap index made valid: clipped, reflected then clipped, or just clipped for zeros."""
    if padding == "reflection":
        lo, hi = (0.0, _less(op, n, 1.0)) if align else (-0.5, _less(op, n, 0.5))
        i, _ = _reflect(op, i, lo, hi)
    return op.Clip(i, op.const(0.0, like=i), _num(op, _less(op, n, 1.0), i))


def _product(op, factors):
    """The product of the factors that are not None (None if there is none)."""
    factors = [f for f in factors if f is not None]
    result = factors[0] if factors else None
    for f in factors[1:]:
        result = op.Mul(result, f)
    return result


def _in_range(op, i, n):
    return shapes.cast_like(op, op.And(op.GreaterOrEqual(i, 0.0), op.LessOrEqual(i, _less(op, n, 1.0))), i)


@rule("GridSample", differentiable=("X", "grid"), since=16)
def grid_sample(op, node, dY):
    """Y[n,c,p] = Σ_taps w(grid[n,p])·X[n,c,tap]; dX scatters w·dY, dgrid = Σ_c dY·Σ_taps w'·X"""
    X, grid = node.inputs
    D = shapes.known_rank(X, "X") - 2
    mode = shapes.attr(node, "mode", "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = shapes.attr(node, "padding_mode", "zeros")
    align = bool(shapes.attr(node, "align_corners", 0))
    if mode == "cubic" and D > 2:
        raise RuleError("GridSample: cubic mode over 3 spatial axes (64 taps per point) is not supported")
    if mode not in ("linear", "nearest", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise RuleError(f"GridSample mode={mode!r} padding_mode={padding!r} is not supported")

    mixed = X.dtype is not None and grid.dtype is not None and X.dtype != grid.dtype
    grid_x = op.Cast(grid, to=int(X.dtype)) if mixed else grid  # weights meet dY in X's type
    comps = op.split(grid_x, [1] * D, axis=-1, count=D)  # x, y(, z): the last spatial axis first
    taps_per_axis = []  # per spatial axis: [(index, weight, dweight/du or None, in-range mask)]
    du_dgrid = []  # per spatial axis: du/dgrid (the unnormalisation scale times the padding slope)
    sizes = []  # per spatial axis: an int, or a value when known at run time only
    for d in range(D):
        g = comps[D - 1 - d]
        n = _length(op, X, 2 + d, g)
        sizes.append(n)
        scale = op.Mul(_less(op, n, 1.0) if align else n, 0.5) if isinstance(n, ir.Value) else \
            (n - 1) / 2 if align else n / 2
        u = op.Mul(op.Add(g, 1.0), scale)
        if not align:
            u = op.Sub(u, 0.5)
        taps = []
        if mode == "cubic":
            # Bicubic pads each tap index, not the coordinate.
            slope = _num(op, scale, g)
            base = op.Floor(u)
            weights, derivs = _cubic_weights(op, op.Sub(u, base))
            for k, w, dw in zip((-1, 0, 1, 2), weights, derivs):
                i = op.Add(base, float(k))
                mask = _in_range(op, i, n) if padding == "zeros" else None
                taps.append((_pad_index(op, i, n, padding, align), w, dw, mask))
        elif mode == "nearest":
            slope = None  # the grid gets zeros
            i = op.Round(u if padding == "zeros" else _pad_index(op, u, n, padding, align))
            taps.append((_pad_index(op, i, n, "zeros", align), None, None,
                         _in_range(op, i, n) if padding == "zeros" else None))
        else:
            u, pad_slope = _pad_coordinate(op, u, n, padding, align)
            slope = _num(op, scale, g) if pad_slope is None else op.Mul(pad_slope, scale)
            i0 = op.Floor(u)
            t = op.Sub(u, i0)
            for i, w, dw in ((i0, op.Sub(1.0, t), -1.0), (op.Add(i0, 1.0), t, 1.0)):
                mask = _in_range(op, i, n) if padding == "zeros" else None
                taps.append((_pad_index(op, i, n, "zeros", align), w, dw, mask))
        taps_per_axis.append(taps)
        du_dgrid.append(slope)

    strides = []  # of the flattened spatial axes: ints, or values where a later length is one
    for d in range(D):
        stride = 1
        for n in sizes[d + 1:]:
            dynamic = isinstance(n, ir.Value) or isinstance(stride, ir.Value)
            stride = (n if stride == 1 else op.Mul(stride, n)) if dynamic else stride * n
        strides.append(stride)
    dY_flat = op.Reshape(dY, [0, 0, -1])  # (N, C, Q)
    X_flat = op.Reshape(X, [0, 0, -1])  # (N, C, P)
    out_shape = op.Shape(dY_flat)

    def flat(v):  # (N, *out, 1) -> (N, 1, Q)
        return op.Reshape(v, [0, 1, -1])

    indices, updates = [], []
    grad_terms = [[] for _ in range(D)]
    want_grid = mode != "nearest"
    for combo in itertools.product(*taps_per_axis):
        offset = shapes.accumulate(op, [i if isinstance(s, int) and s == 1 else
                                        op.Mul(i, s if isinstance(s, ir.Value) else float(s))
                                        for (i, _, _, _), s in zip(combo, strides)])
        index = op.Expand(flat(op.Cast(offset, to=INT64)), out_shape)
        masks = [m for (_, _, _, m) in combo]
        weight = _product(op, [w for (_, w, _, _) in combo] + masks)
        indices.append(index)
        updates.append(dY_flat if weight is None else op.Mul(dY_flat, flat(weight)))
        if not want_grid:
            continue
        value = op.GatherElements(X_flat, index, axis=2)
        for d in range(D):
            dw = combo[d][2]
            others = _product(op, [w for e, (_, w, _, _) in enumerate(combo) if e != d] + masks)
            term = value if others is None else op.Mul(value, flat(others))
            if isinstance(dw, float):
                term = term if dw > 0 else op.Neg(term)
            else:
                term = op.Mul(term, flat(dw))
            grad_terms[d].append(term)

    zeros = shapes.zeros(op, X_flat)
    dX_flat = op.ScatterElements(zeros, op.Concat(*indices, axis=2), op.Concat(*updates, axis=2),
                                 axis=2, reduction="add")
    grads = {"X": op.Reshape(dX_flat, op.Shape(X))}
    if want_grid:
        parts = []
        for d in reversed(range(D)):  # grid's last axis holds x (the last spatial axis) first
            total = shapes.accumulate(op, grad_terms[d])
            per_point = op.reduce_sum(op.Mul(total, dY_flat), [1])  # (N, 1, Q)
            parts.append(op.Mul(op.Reshape(per_point, op.Shape(comps[D - 1 - d])), du_dgrid[d]))
        dgrid = parts[0] if D == 1 else op.Concat(*parts, axis=-1)
        grads["grid"] = op.Cast(dgrid, to=int(grid.dtype)) if mixed else dgrid
    else:
        grads["grid"] = shapes.zeros(op, grid)
    return grads


# AffineGrid


def _base_coords(n: int, align: bool) -> np.ndarray:
    """The normalised coordinates [-1, 1] of n grid points (pixel corners or centres)."""
    if align:
        return np.linspace(-1.0, 1.0, n)
    return (2 * np.arange(n) + 1) / n - 1


@rule("AffineGrid", differentiable=("theta",), since=20)
def affine_grid(op, node, dgrid):
    """grid[n, p] = θ[n] · (x_p, y_p(, z_p), 1); dθ[n] = Σ_p dgrid[n, p] ⊗ (x_p, y_p(, z_p), 1)"""
    theta, given = node.inputs
    like = theta if theta.dtype else dgrid
    align = bool(shapes.attr(node, "align_corners", 0))
    size = shapes.constant(given)
    out = shapes.dims(node.outputs[0])
    spatial = None
    if size is not None:
        spatial = [int(s) for s in size[2:]]
    elif out is not None and all(isinstance(d, int) for d in out[1:-1]):
        spatial = list(out[1:-1])
    if spatial is None:
        D = _spatial_rank(theta, given, node.outputs[0])
    else:
        D = len(spatial)
        if align and 1 in spatial:
            raise RuleError("AffineGrid with align_corners=1 and a spatial size of 1 is ill-defined "
                            "(onnxruntime puts the point at +1, onnx.reference at -1, PyTorch at 0)")
    flat = op.Transpose(op.Reshape(dgrid, [0, -1, D]), perm=[0, 2, 1])  # (N, D, P)
    if spatial is None:
        base = _runtime_base(op, given, D, align, like)
    else:
        axes = [_base_coords(n, align) for n in spatial]
        mesh = np.meshgrid(*axes, indexing="ij")  # (z,) y, x over the spatial axes in order
        base = op.const(np.stack([m.ravel() for m in reversed(mesh)] + [np.ones(mesh[0].size)], axis=1), like=like)
    return {"theta": op.MatMul(flat, base)}


def _spatial_rank(theta, size, grid) -> int:
    """D, the number of spatial axes, from whichever shape tells it: 'size' holds D + 2 entries,
    theta is (N, D, D + 1), the grid (N, *spatial, D)."""
    length, t, g = shapes.dims(size), shapes.dims(theta), shapes.dims(grid)
    for shape, axis, excess in ((length, 0, 2), (t, 1, 0), (t, 2, 1), (g, -1, 0)):
        if shape and isinstance(shape[axis], int):
            return shape[axis] - excess
    if g is not None:
        return len(g) - 2
    raise RuleError(f"AffineGrid: the gradient needs the number of spatial axes (the length of 'size' "
                    f"('{size.name}'), theta's shape or the grid's rank); run shape inference")


def _runtime_base(op, size, D: int, align: bool, like):
    """The (P, D + 1) matrix of base coordinates (x, y(, z), 1) over the spatial lengths that the
    run-time ``size`` holds: each axis's coordinates broadcast over the grid, flattened."""
    spatial = op.Slice(size, [2], [D + 2])
    columns = []
    for d in range(D):
        n = shapes.cast_like(op, op.Gather(size, op.const(np.array(2 + d, np.int64))), like)
        i = op.Range(op.const(0.0, like=like), n, op.const(1.0, like=like))
        if align:  # -1 + 2i/(n-1); a length of 1 (ill-defined, see above) puts its point at -1
            coords = op.Sub(op.Div(op.Mul(i, 2.0), op.Max(op.Sub(n, 1.0), 1.0)), 1.0)
        else:  # (2i + 1)/n - 1
            coords = op.Sub(op.Div(op.Add(op.Mul(i, 2.0), 1.0), n), 1.0)
        along = op.Reshape(coords, [-1 if e == d else 1 for e in range(D)])
        columns.append(op.Reshape(op.Expand(along, spatial), [-1, 1]))
    return op.Concat(*reversed(columns), shapes.ones_like(op, columns[0]), axis=1)


# RoiAlign


def _roi_axis(op, start, bin_size, grid_count, n_bins: int, n_samples: int, size):
    """Per box, the dense (R, n_bins, size) averaging-interpolation matrix of one spatial axis.

    Sample s of bin b sits at start + b·bin + (s + 0.5)·bin / count (count = the box's sampling
    count; samples beyond it are masked out); each reads its two neighbours bilinearly. ``size``:
    the axis's length, an int or a value (see :func:`_length`).
    """
    b = np.arange(n_bins, dtype=np.float64)[:, None]
    s = np.arange(n_samples, dtype=np.float64)[None, :]
    like = start
    # (R, 1, 1) box terms against (n_bins, n_samples) constants.
    start, bin_size, grid_count = (op.unsqueeze(v, [1, 2]) for v in (start, bin_size, grid_count))
    pos = op.Add(op.Add(start, op.Mul(bin_size, op.const(b, like=like))),
                 op.Div(op.Mul(bin_size, op.const(s + 0.5, like=like)), grid_count))
    used = op.Less(op.const(np.broadcast_to(s, (n_bins, n_samples)), like=like), grid_count)
    # Not(Less) rather than GreaterOrEqual, which appears at opset 12.
    inside = op.Not(op.Or(op.Less(pos, -1.0), op.Greater(pos, size if isinstance(size, ir.Value) else float(size))))
    valid = shapes.cast_like(op, op.And(used, inside), like)
    pos = op.Max(pos, op.const(0.0, like=like))
    low = op.Floor(pos)
    edge = op.Not(op.Less(low, _less(op, size, 1.0)))
    last = _num(op, _less(op, size, 1.0), like)
    low = op.Where(edge, last, low)
    frac = op.Where(edge, op.const(0.0, like=like), op.Sub(pos, low))
    high = op.Min(op.Add(low, 1.0), last)
    if isinstance(size, ir.Value):
        cells = op.Range(op.const(0.0, like=like), size, op.const(1.0, like=like))
    else:
        cells = op.const(np.arange(size, dtype=np.float64), like=like)

    def spread(index, weight):  # (R, bins, samples) -> (R, bins, size)
        hit = shapes.cast_like(op, op.Equal(op.unsqueeze(index, [3]), cells), like)
        spread_weight = op.Mul(hit, op.unsqueeze(op.Mul(weight, valid), [3]))
        return op.reduce_sum(spread_weight, [2], keepdims=False)

    return op.Add(spread(low, op.Sub(1.0, frac)), spread(high, frac))


@rule("RoiAlign", differentiable=("X",), since=10)
def roi_align(op, node, dY):
    """Y[r,c] = Ay[r]·X[b_r, c]·Ax[r]ᵀ / count[r] (avg mode: bilinear samples averaged per bin);
    dX[n, c] = Σ_{r: b_r = n} Ay[r]ᵀ·dY[r, c]·Ax[r] / count[r]"""
    X, rois, batch = node.inputs
    if shapes.attr(node, "mode", "avg") != "avg":
        raise RuleError("RoiAlign: mode 'max' (a max over weighted corner values) is not supported; "
                        "only mode 'avg' is")
    shapes.require_opset(op, 11, "RoiAlign's gradient (Range, float Equal)")
    shapes.known_rank(X, "X")
    H, W = (_length(op, X, axis, rois) for axis in (2, 3))
    oh, ow = shapes.attr(node, "output_height", 1), shapes.attr(node, "output_width", 1)
    ratio = shapes.attr(node, "sampling_ratio", 0)
    scale = shapes.attr(node, "spatial_scale", 1.0)
    ctm = shapes.attr(node, "coordinate_transformation_mode", "half_pixel")
    half_pixel = op.opset >= 16 and ctm == "half_pixel"  # RoiAlign-10 is output_half_pixel
    offset = 0.5 if half_pixel else 0.0

    corners = op.split(op.Mul(rois, float(scale)), [1] * 4, axis=1, count=4)
    x1, y1, x2, y2 = (op.Reshape(op.Sub(c, offset) if offset else c, [-1]) for c in corners)
    roi_w, roi_h = op.Sub(x2, x1), op.Sub(y2, y1)
    if not half_pixel:  # malformed boxes become 1×1
        one = op.const(1.0, like=roi_w)
        roi_w, roi_h = op.Max(roi_w, one), op.Max(roi_h, one)
    if ratio > 0:
        samples_h = samples_w = ratio
        count_h = count_w = shapes.fill_like(op, roi_h, float(ratio))
    else:
        boxes = shapes.constant(rois)
        if boxes is None:
            raise RuleError("RoiAlign with sampling_ratio=0 samples a box-dependent number of points; "
                            "the gradient needs constant rois (or sampling_ratio > 0)")
        samples_h, samples_w = _max_samples(boxes, scale, offset, half_pixel, oh, ow)
        count_h, count_w = op.Ceil(op.Div(roi_h, float(oh))), op.Ceil(op.Div(roi_w, float(ow)))
    Ay = _roi_axis(op, y1, op.Div(roi_h, float(oh)), count_h, oh, samples_h, H)  # (R, oh, H)
    Ax = _roi_axis(op, x1, op.Div(roi_w, float(ow)), count_w, ow, samples_w, W)  # (R, ow, W)
    count = op.Max(op.Mul(count_h, count_w), op.const(1.0, like=count_h))
    Ay = op.Div(Ay, op.unsqueeze(count, [1, 2]))
    # Per box and channel: Ayᵀ (H, oh) · dY (oh, ow) · Ax (ow, W).
    Ay_t = op.unsqueeze(op.Transpose(Ay, perm=[0, 2, 1]), [1])
    per_box = op.MatMul(op.MatMul(Ay_t, dY), op.unsqueeze(Ax, [1]))
    # Boxes add into their image: a one-hot (N, R) matrix times the per-box gradients.
    n_images = op.Gather(op.Shape(X), op.const(0, dtype=ir.DataType.INT64))
    images = op.Range(op.const(0, dtype=ir.DataType.INT64), n_images, op.const(1, dtype=ir.DataType.INT64))
    onehot = op.Equal(op.unsqueeze(images, [1]), op.unsqueeze(op.Cast(batch, to=INT64), [0]))
    dX = op.MatMul(shapes.cast_like(op, onehot, dY), op.Reshape(per_box, [0, -1]))
    return {"X": op.Reshape(dX, op.Shape(X))}


def _max_samples(boxes, scale, offset, half_pixel, oh, ow) -> tuple[int, int]:
    """The largest per-box sampling count of each axis (sampling_ratio=0), in float32 and float64."""
    counts = []
    for dtype in (np.float32, np.float64):
        b = boxes.reshape(-1, 4).astype(dtype) * dtype(scale) - dtype(offset)
        w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
        if not half_pixel:
            w, h = np.maximum(w, 1), np.maximum(h, 1)
        counts.append((np.ceil(h / dtype(oh)).max(initial=1), np.ceil(w / dtype(ow)).max(initial=1)))
    return int(max(c[0] for c in counts)), int(max(c[1] for c in counts))
