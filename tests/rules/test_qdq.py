"""Fake quantization (QuantizeLinear → DequantizeLinear, rules/qdq.py): the straight-through gradient
and the LSQ scale gradients against PyTorch's fake-quantize ops (per tensor, per channel, blocked
through per-channel on blocks), against float64 finite differences of a surrogate whose exact
derivative they are, and the measured case of issue 43.

The QDQ output is piecewise constant in x, so finite differences of the model itself give 0 inside
the range, not the straight-through 1: the surrogate
    s·(clip(round(x/s) + z, qmin, qmax) − z) + s₀·clip(x/s + z, qmin − ½, qmax + ½)
(s₀ a constant equal to s) has the same value jumps and, away from the rounding boundaries, the
derivatives the rule computes: dx = inside, ds = (q − z) − inside·x/s (LSQ). Every test point
keeps x/s at least 0.1 from a half-integer, so neither the rounding nor the clip edge is crossed."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from helpers import assert_gradients, assert_valid_model
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import RuleError, autodiff_pass, cleanup_passes
from onnx_autodiff.conformance.check import ad_vjp, backward_model, compare
from onnx_autodiff.conformance.oracle import Evaluator, fd_vjp, random_cotangents
from onnx_autodiff.conformance.symbolic import symbolic_model
from onnx_autodiff.rules.qdq import RANGES

TYPES = {name: (getattr(TensorProto, name.upper()), *RANGES[getattr(ir.DataType, name.upper())])
         for name in ("int8", "uint8", "int16", "uint16", "int4", "uint4", "int2", "uint2")}
FLOAT = TensorProto.FLOAT


def levels(rng, shape, low, high):
    """x/s values k + f: k an integer in the range [low, high] of round(x/s) or up to 6 beyond each
    end (clipped), |f| ≤ 0.4 (at least 0.1 from every rounding boundary and from the clip edges)."""
    low, high = np.broadcast_to(low, shape), np.broadcast_to(high, shape)
    region = rng.integers(0, 3, shape)
    k = np.where(region == 0, rng.integers(low - 6, low + 6),
                 np.where(region == 1, rng.integers(high - 5, high + 7), rng.integers(low, high + 1)))
    return k + rng.uniform(-0.4, 0.4, shape)


def spread(value, shape, axis=None, block=None):
    """A scale or zero point over x's shape, as QuantizeLinear reads it (numpy)."""
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    if block:
        return np.take(np.repeat(value, block, axis=axis), np.arange(shape[axis]), axis=axis)
    dims = [1] * len(shape)
    dims[axis] = -1
    return value.reshape(dims)


def integer_tensor(name, values, qtype):
    values = np.asarray(values)
    return helper.make_tensor(name, qtype, values.shape, values.astype(np.int64).ravel().tolist())


def qdq_model(shape, kind, scale, zero, *, axis=None, block=None, opset=21, fed=("x", "s"), dq_scale=None,
              output_dtype=False, q_read=False, check=True):
    """y = DequantizeLinear(QuantizeLinear(x, s, z), s, z), written as onnxruntime's quantizer
    writes it (one scale and one zero point read by both nodes). ``dq_scale``: the
    DequantizeLinear reads a scale "s2" of its own; ``output_dtype``: no zero point, the type given
    by the attribute (opset 21); ``fed``: the values that are graph inputs (the others initializers);
    ``q_read``: q is a graph output too."""
    qtype = TYPES[kind][0]
    attrs = {"axis": axis} if axis is not None else {}
    if block:
        attrs["block_size"] = block
    arrays = {"s": np.asarray(scale, np.float32)}
    if dq_scale is not None:
        arrays["s2"] = np.asarray(dq_scale, np.float32)
    inputs = [helper.make_tensor_value_info("x", FLOAT, shape)]
    inputs += [helper.make_tensor_value_info(n, FLOAT, a.shape) for n, a in arrays.items() if n in fed]
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items() if n not in fed]
    q_attrs = dict(attrs, output_dtype=qtype) if output_dtype else attrs
    zp = [] if output_dtype or zero is None else ["z"]
    if zp:
        inits.append(integer_tensor("z", zero, qtype))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", *zp], ["q"], name="quantize", **q_attrs),
             helper.make_node("DequantizeLinear", ["q", "s2" if dq_scale is not None else "s", *zp], ["y"],
                              name="dequantize", **attrs)]
    outputs = [helper.make_tensor_value_info("y", FLOAT, shape)]
    if q_read:
        outputs.append(helper.make_tensor_value_info("q", qtype, shape))
    graph = helper.make_graph(nodes, "qdq", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets,
                              ir_version=max(4, helper.find_min_ir_version_for(opsets, ignore_unknown=True)))
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def feeds_of(model, **arrays):
    fed = {i.name for i in model.graph.input}
    return {k: np.asarray(v, np.float32) for k, v in arrays.items() if k in fed}


def run_backward(model, feeds, wrt, r):
    """The forward output y and the gradients the backward graph gives for seed dy = r (onnxruntime)."""
    proto, autodiff = backward_model(model, "y", wrt, seed="input")
    assert_valid_model(proto)
    outputs = Evaluator(proto, backends=("onnxruntime",))({**feeds, autodiff.seed_name: r})
    named = dict(zip([o.name for o in proto.graph.output], outputs))
    return named["y"], {x: named[autodiff.gradient_names[x]] for x in wrt}


def close(got, want, what, rtol=1e-5, atol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)
    return float(np.abs(got - want).max(initial=0.0))


# --- against PyTorch -------------------------------------------------------------------------


@pytest.mark.parametrize("kind, zero", [("int8", 0), ("int8", -5), ("uint8", 128), ("uint8", 3),
                                        ("int16", 7), ("uint16", 100), ("int4", 0), ("uint4", 8)])
def test_per_tensor_against_torch(kind, zero):
    """torch.fake_quantize_per_tensor_affine (forward, STE dx) and
    torch._fake_quantize_learnable_per_tensor_affine (LSQ ds)."""
    _, qmin, qmax = TYPES[kind]
    rng = np.random.default_rng(qmax + zero)
    scale = np.float32(0.05)
    x = (levels(rng, (4, 7), qmin - zero, qmax - zero) * scale).astype(np.float32)
    r = rng.standard_normal(x.shape).astype(np.float32)
    model = qdq_model(x.shape, kind, scale, zero, opset=21)
    y, grads = run_backward(model, feeds_of(model, x=x, s=scale), ["x", "s"], r)

    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_tensor_affine(xt, float(scale), zero, qmin, qmax)
    (dx,) = torch.autograd.grad(yt, xt, torch.tensor(r))
    close(y, yt.detach(), "forward")
    close(grads["x"], dx, "dx (STE)")
    # The learnable per-tensor op's backward reads a negative zero point as (int)(z + 0.5) (−5 as
    # −4, unlike its forward); its per-channel op, on x as one channel, does not.
    learnable = [torch._fake_quantize_learnable_per_channel_affine]
    if zero >= 0:
        learnable.append(torch._fake_quantize_learnable_per_tensor_affine)
    for function in learnable:
        xl, sl = torch.tensor(x[None], requires_grad=True), torch.tensor([scale], requires_grad=True)
        extra = (0,) if function is torch._fake_quantize_learnable_per_channel_affine else ()
        yl = function(xl, sl, torch.tensor([float(zero)]), *extra, qmin, qmax, 1.0)
        dxl, ds = torch.autograd.grad(yl, [xl, sl], torch.tensor(r[None]))
        close(yl.detach()[0], yt.detach(), f"forward ({function.__name__})")
        close(grads["x"], dxl[0], f"dx ({function.__name__})")
        close(grads["s"], ds.reshape(()), f"ds (LSQ, {function.__name__})", rtol=1e-4)
    assert 0 < np.count_nonzero(grads["x"]) < x.size  # some inside, some clipped


@pytest.mark.parametrize("kind", ["int8", "uint8"])
@pytest.mark.parametrize("shape, axis", [((6, 3, 2, 2), 0), ((2, 5, 4), 1), ((3, 8), -1)])
def test_per_channel_against_torch(kind, shape, axis):
    """torch.fake_quantize_per_channel_affine and torch._fake_quantize_learnable_per_channel_affine."""
    _, qmin, qmax = TYPES[kind]
    rng = np.random.default_rng(len(shape) + qmax)
    channels = shape[axis]
    scale = rng.uniform(0.01, 0.2, channels).astype(np.float32)
    zero = rng.integers(-4, 5, channels) + (128 if kind == "uint8" else 0)
    x = (levels(rng, shape, spread(qmin - zero, shape, axis), spread(qmax - zero, shape, axis))
         * spread(scale, shape, axis)).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    model = qdq_model(shape, kind, scale, zero, axis=axis, opset=13)
    y, grads = run_backward(model, feeds_of(model, x=x, s=scale), ["x", "s"], r)

    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_channel_affine(xt, torch.tensor(scale), torch.tensor(zero, dtype=torch.int32),
                                                axis % len(shape), qmin, qmax)
    (dx,) = torch.autograd.grad(yt, xt, torch.tensor(r))
    xl, sl = torch.tensor(x, requires_grad=True), torch.tensor(scale, requires_grad=True)
    yl = torch._fake_quantize_learnable_per_channel_affine(xl, sl, torch.tensor(zero, dtype=torch.float32),
                                                           axis % len(shape), qmin, qmax, 1.0)
    dxl, ds = torch.autograd.grad(yl, [xl, sl], torch.tensor(r))
    close(y, yt.detach(), "forward")
    close(grads["x"], dx, "dx (STE)")
    close(grads["x"], dxl, "dx (learnable)")
    close(grads["s"], ds, "ds (LSQ)", rtol=1e-4)


def torch_blocked(x, scale, zero, axis, block, qmin, qmax, r):
    """Blocked fake quantization through torch's per-channel ops: x padded to whole blocks along
    ``axis``, each (block, other position) pair one channel. Returns y, dx (STE) and ds (LSQ)."""
    xm, sm, zm, rm = (np.moveaxis(np.asarray(a), axis, 0) for a in (x, scale, zero, r))
    length, blocks, rest = xm.shape[0], sm.shape[0], xm.shape[1:]
    pad = np.zeros((blocks * block - length, *rest), np.float32)

    def channels(a):  # [blocks·block, *rest] → [block, blocks·prod(rest)]
        return np.concatenate([a, pad]).reshape(blocks, block, -1).transpose(1, 0, 2).reshape(block, -1)

    def back(a):
        a = a.reshape(block, blocks, *rest).transpose(1, 0, *range(2, 2 + len(rest)))
        return np.moveaxis(a.reshape(blocks * block, *rest)[:length], 0, axis)

    xt = torch.tensor(channels(xm), requires_grad=True)
    st = torch.tensor(sm.reshape(-1), requires_grad=True)
    zt = torch.tensor(zm.reshape(-1), dtype=torch.float32)
    yt = torch._fake_quantize_learnable_per_channel_affine(xt, st, zt, 1, qmin, qmax, 1.0)
    dx, ds = torch.autograd.grad(yt, [xt, st], torch.tensor(channels(rm)))
    xs = torch.tensor(channels(xm), requires_grad=True)
    ys = torch.fake_quantize_per_channel_affine(xs, st.detach(), zt.to(torch.int32), 1, qmin, qmax)
    (dxs,) = torch.autograd.grad(ys, xs, torch.tensor(channels(rm)))
    np.testing.assert_array_equal(dx.numpy(), dxs.numpy())
    return back(ys.detach().numpy()), back(dx.numpy()), np.moveaxis(ds.numpy().reshape(sm.shape), 0, axis)


@pytest.mark.parametrize("kind, symmetric", [("int4", True), ("int4", False), ("uint4", False)])
@pytest.mark.parametrize("shape, axis", [((64, 5), 0), ((5, 64), 1), ((80, 3), 0), ((3, 40, 2), 1)])
def test_blocked_against_torch(kind, symmetric, shape, axis):
    """int4 weights quantized in blocks of 32 along the reduction axis (MatMul's [K, N] along 0,
    a [N, K] weight along 1), the last block short where 32 does not divide K."""
    block = 32
    _, qmin, qmax = TYPES[kind]
    rng = np.random.default_rng(shape[axis] + qmax + symmetric)
    blocks = -(-shape[axis] // block)
    scale_shape = tuple(blocks if i == axis else d for i, d in enumerate(shape))
    scale = rng.uniform(0.02, 0.3, scale_shape).astype(np.float32)
    zero = np.zeros(scale_shape, np.int64) if symmetric else rng.integers(qmin + 2, qmax - 1, scale_shape)
    zs = spread(zero, shape, axis, block)
    x = (levels(rng, shape, qmin - zs, qmax - zs) * spread(scale, shape, axis, block)).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    model = qdq_model(shape, kind, scale, zero, axis=axis, block=block, opset=21)
    y, grads = run_backward(model, feeds_of(model, x=x, s=scale), ["x", "s"], r)
    want_y, want_dx, want_ds = torch_blocked(x, scale, zero, axis, block, qmin, qmax, r)
    close(y, want_y, "forward")
    close(grads["x"], want_dx, "dx (STE)")
    close(grads["s"], want_ds, "ds (LSQ)", rtol=1e-4)
    assert 0 < np.count_nonzero(grads["x"]) < x.size


def test_output_dtype_form_against_torch():
    """Opset 21's output_dtype attribute and no zero point: int4 from the attribute."""
    rng = np.random.default_rng(4)
    scale = np.float32(0.1)
    x = (levels(rng, (5, 6), -8, 7) * scale).astype(np.float32)
    r = rng.standard_normal(x.shape).astype(np.float32)
    model = qdq_model(x.shape, "int4", scale, None, output_dtype=True)
    y, grads = run_backward(model, feeds_of(model, x=x, s=scale), ["x", "s"], r)
    xl, sl = torch.tensor(x, requires_grad=True), torch.tensor([scale], requires_grad=True)
    yl = torch._fake_quantize_learnable_per_tensor_affine(xl, sl, torch.tensor([0.0]), -8, 7, 1.0)
    dx, ds = torch.autograd.grad(yl, [xl, sl], torch.tensor(r))
    close(y, yl.detach(), "forward")
    close(grads["x"], dx, "dx")
    close(grads["s"], ds.reshape(()), "ds", rtol=1e-4)


def test_a_quantized_layer_against_torch():
    """A layer as QAT writes it: int8 per-tensor activations and int8 per-channel weights, each a
    QDQ pair, into MatMul; the gradients of x, W and both scales against torch's learnable
    fake-quantize modules (the activation asymmetric, uint8)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 6)).astype(np.float32) * 2
    w = rng.standard_normal((6, 5)).astype(np.float32)
    a_scale, a_zero = np.float32(0.02), 120
    w_scale = (np.abs(w).max(axis=0) / 150).astype(np.float32)  # the largest weights clipped at ±127·s
    init = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(a_scale, "sa"),
            numpy_helper.from_array(w_scale, "sw"), integer_tensor("za", a_zero, TensorProto.UINT8),
            integer_tensor("zw", np.zeros(5, np.int64), TensorProto.INT8)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sa", "za"], ["qa"]),
             helper.make_node("DequantizeLinear", ["qa", "sa", "za"], ["xa"]),
             helper.make_node("QuantizeLinear", ["w", "sw", "zw"], ["qw"], axis=1),
             helper.make_node("DequantizeLinear", ["qw", "sw", "zw"], ["wq"], axis=1),
             helper.make_node("MatMul", ["xa", "wq"], ["y"])]
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", FLOAT, (4, 5))], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    r = rng.standard_normal((4, 5)).astype(np.float32)
    wrt = ["x", "w", "sa", "sw"]
    _, grads = run_backward(model, {"x": x}, wrt, r)

    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    sa, sw = torch.tensor([a_scale], requires_grad=True), torch.tensor(w_scale, requires_grad=True)
    xa = torch._fake_quantize_learnable_per_tensor_affine(xt, sa, torch.tensor([float(a_zero)]), 0, 255, 1.0)
    wq = torch._fake_quantize_learnable_per_channel_affine(wt, sw, torch.zeros(5), 1, -128, 127, 1.0)
    want = torch.autograd.grad(xa @ wq, [xt, wt, sa, sw], torch.tensor(r))
    for name, expected in zip(wrt, want):
        close(grads[name], expected.numpy().reshape(np.shape(grads[name])), name, rtol=1e-4)
    assert np.count_nonzero(grads["w"] == 0) > 0 and np.count_nonzero(grads["x"] == 0) > 0


# --- against float64 finite differences of the surrogate -------------------------------------


def surrogate_model(model, kind, scale, zero, *, axis=None, block=None, dq_scale=None):
    """The QDQ model's surrogate (module docstring): same inputs, float ops only, so the oracle
    runs it in float64. Blocked scales spread by a one-hot MatMul (2-D x only)."""
    _, qmin, qmax = TYPES[kind]
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rank = len(shape)
    fed = list(model.graph.input)
    numbers = {"s0": scale, "zf": 0 if zero is None else zero, "lo": qmin, "hi": qmax, "lo_": qmin - 0.5, "hi_": qmax + 0.5}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in numbers.items()]
    inits += [t for t in model.graph.initializer if t.name in ("s", "s2")]
    if dq_scale is not None:
        inits.append(numpy_helper.from_array(np.asarray(dq_scale, np.float32), "s20"))
    nodes = []

    def spread_node(name):
        value = np.asarray(scale)
        if value.size == 1:
            nodes.append(helper.make_node("Reshape", [name, "scalar"], [f"{name}_x"]))
            return f"{name}_x"
        if block:
            length = shape[axis]
            one_hot = (np.arange(length)[:, None] // block == np.arange(value.shape[axis])[None, :]).astype(np.float32)
            if f"onehot{axis}" not in [t.name for t in inits]:
                inits.append(numpy_helper.from_array(one_hot if axis == 0 else one_hot.T, f"onehot{axis}"))
            args = [f"onehot{axis}", name] if axis == 0 else [name, f"onehot{axis}"]
            nodes.append(helper.make_node("MatMul", args, [f"{name}_x"]))
            return f"{name}_x"
        dims = [1] * rank
        dims[axis] = -1
        if "per_axis" not in [t.name for t in inits]:
            inits.append(numpy_helper.from_array(np.array(dims, np.int64), "per_axis"))
        nodes.append(helper.make_node("Reshape", [name, "per_axis"], [f"{name}_x"]))
        return f"{name}_x"

    inits.append(numpy_helper.from_array(np.zeros(0, np.int64), "scalar"))
    S, S0, Z = spread_node("s"), spread_node("s0"), spread_node("zf")
    S2, S20 = (spread_node("s2"), spread_node("s20")) if dq_scale is not None else (S, S0)
    nodes += [helper.make_node("Div", ["x", S], ["v"]), helper.make_node("Round", ["v"], ["rounded"]),
              helper.make_node("Add", ["rounded", Z], ["u"]), helper.make_node("Clip", ["u", "lo", "hi"], ["c"]),
              helper.make_node("Sub", ["c", Z], ["level"]), helper.make_node("Mul", ["level", S2], ["y1"]),
              helper.make_node("Add", ["v", Z], ["w"]), helper.make_node("Clip", ["w", "lo_", "hi_"], ["cw"]),
              helper.make_node("Mul", ["cw", S20], ["y2"]), helper.make_node("Add", ["y1", "y2"], ["y"])]
    graph = helper.make_graph(nodes, "surrogate", fed, [helper.make_tensor_value_info("y", FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def assert_straight_through(model, surrogate, feeds, wrt, atol=1e-4, rtol=1e-3):
    """The rule's gradients (onnxruntime, float32) equal float64 central differences of the
    surrogate, for the same cotangent; the same at symbolic input dimensions; the backward graph
    valid. Returns the largest absolute difference per variable."""
    cotangents = random_cotangents(model, feeds, 0)
    ad = ad_vjp(model, feeds, wrt, cotangents)
    fd = fd_vjp(surrogate, feeds, wrt, cotangents)
    assert not fd.weak, fd.notes
    differences = {}
    for name in wrt:
        detail = fd.details[name]
        error = compare(ad[name], detail, atol, rtol)
        assert error <= 1.0 and detail.checkable.any(), f"{name}: error {error}\nAD {ad[name]}\nFD {fd[name]}"
        checked = detail.checkable
        differences[name] = float(np.abs(np.asarray(ad[name], np.float64)[checked] - detail.value[checked]).max())
    symbolic = ad_vjp(symbolic_model(model), feeds, wrt, cotangents)
    for name in wrt:
        np.testing.assert_allclose(symbolic[name], ad[name], rtol=1e-6, atol=1e-6, err_msg=f"symbolic {name}")
    assert_valid_model(backward_model(model, "y", wrt, seed="input")[0])
    assert_valid_model(backward_model(symbolic_model(model), "y", wrt, seed="input")[0])
    return differences


FD_CASES = {
    # name: (shape, kind, zero, axis, block, opset)
    "per_tensor_int8": ((3, 5), "int8", 0, None, None, 13),
    "per_tensor_uint8_zero": ((2, 3, 4), "uint8", 100, None, None, 19),
    "per_tensor_int16": ((4, 3), "int16", -32760, None, None, 21),
    "per_tensor_uint4": ((4, 3), "uint4", 5, None, None, 21),
    "per_tensor_int2": ((4, 3), "int2", 0, None, None, 25),
    "per_axis_int8": ((2, 4, 3), "int8", "random", 1, None, 13),
    "per_axis_uint8_last": ((3, 4), "uint8", "random", -1, None, 21),
    "blocked_int4_rows": ((40, 3), "int4", 0, 0, 16, 21),
    "blocked_uint4_columns": ((3, 24), "uint4", "random", 1, 8, 21),
}


@pytest.mark.parametrize("case", list(FD_CASES))
def test_against_finite_differences(case):
    shape, kind, zero, axis, block, opset = FD_CASES[case]
    _, qmin, qmax = TYPES[kind]
    rng = np.random.default_rng(len(case))
    if axis is None:
        scale_shape = ()
    elif block:
        scale_shape = tuple(-(-d // block) if i == axis % len(shape) else d for i, d in enumerate(shape))
    else:
        scale_shape = (shape[axis],)
    # scales of 0.3 and more: a step of 1e-4 in s moves x/s by under 0.05 (the largest |x/s| is ~140)
    scale = rng.uniform(0.3, 1.0, scale_shape).astype(np.float32)
    if zero == "random":
        zero = rng.integers(qmin + 1, qmax, scale_shape) if qmax > 15 else rng.integers(qmin, qmax + 1, scale_shape)
    zero = np.broadcast_to(np.asarray(zero, np.int64), scale_shape)
    zs = spread(zero, shape, axis, block)
    low, high = qmin - zs, qmax - zs
    if kind.endswith("16"):  # near the low edge only: a step in s moves a large x/s across a boundary
        high = low + 30
    x = (levels(rng, shape, low, high) * spread(scale, shape, axis, block)).astype(np.float32)
    model = qdq_model(shape, kind, scale, zero, axis=axis, block=block, opset=opset)
    surrogate = surrogate_model(model, kind, scale, zero, axis=None if axis is None else axis % len(shape), block=block)
    differences = assert_straight_through(model, surrogate, feeds_of(model, x=x, s=scale), ["x", "s"])
    assert max(differences.values()) < 1e-3


def test_requantization_against_finite_differences():
    """The DequantizeLinear reads a scale of its own: dx = s'/s inside, and its scale's gradient
    (q − z'), an exact derivative, checked on the model itself too."""
    rng = np.random.default_rng(5)
    shape, scale, dq_scale = (3, 6), np.float32(0.4), np.float32(0.7)
    x = (levels(rng, shape, -128, 127) * scale).astype(np.float32)
    model = qdq_model(shape, "int8", scale, 0, dq_scale=dq_scale, fed=("x", "s", "s2"), opset=19)
    surrogate = surrogate_model(model, "int8", scale, 0, dq_scale=dq_scale)
    feeds = feeds_of(model, x=x, s=scale, s2=dq_scale)
    assert_straight_through(model, surrogate, feeds, ["x", "s", "s2"])
    assert_gradients(model, feeds, ["s2"])


def test_constant_scale_gets_no_gradient_nodes():
    """Only x asked for, the scale an initializer: no scale-gradient node survives the cleanup."""
    model = qdq_model((4, 5), "int8", np.float32(0.1), 0, fed=("x",), opset=19)
    result = ir.from_proto(model)
    ir.passes.PassManager([autodiff_pass(of="y", wrt=["x"], seed="input"), *cleanup_passes()])(result)
    added = [n.op_type for n in ir.to_proto(result).graph.node][2:]
    assert sorted(added) == ["Clip", "Div", "Equal", "Round", "Where"], added


# --- the issue's measured case, matching, refusals --------------------------------------------


def test_issue_case_gradient_is_r_masked():
    """grad of sum(r · DequantizeLinear(QuantizeLinear(x))) with respect to x was 0 everywhere
    (the pair not differentiable); it is r where x/s + z rounds inside [qmin, qmax], 0 elsewhere."""
    rng = np.random.default_rng(43)
    scale, zero = np.float32(0.05), 10
    x = (levels(rng, (6, 8), -128 - zero, 127 - zero) * scale).astype(np.float32)
    r = rng.standard_normal(x.shape).astype(np.float32)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"]),
             helper.make_node("Mul", ["dq", "r"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "issue43", [helper.make_tensor_value_info("x", FLOAT, x.shape)],
                              [helper.make_tensor_value_info("loss", FLOAT, [])],
                              [numpy_helper.from_array(scale, "s"), integer_tensor("z", zero, TensorProto.INT8),
                               numpy_helper.from_array(r, "r")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    result = ir.from_proto(model)
    ir.passes.PassManager([autodiff_pass(of="loss", wrt=["x"]), *cleanup_passes()])(result)
    proto = ir.to_proto(result)
    assert_valid_model(proto)
    (grad,) = Evaluator(proto, backends=("onnxruntime",))({"x": x})[1:]
    inside = (np.rint(x / scale) + zero >= -128) & (np.rint(x / scale) + zero <= 127)
    assert 0 < inside.sum() < inside.size
    np.testing.assert_array_equal(grad, np.where(inside, r, 0))


def test_reference_evaluator_agrees():
    """The backward graph gives the same numbers on onnx's reference evaluator (opset 21, blocked)."""
    rng = np.random.default_rng(2)
    shape, block = (3, 20), 8
    scale = rng.uniform(0.1, 0.3, (3, 3)).astype(np.float32)
    x = (levels(rng, shape, -8, 7) * spread(scale, shape, 1, block)).astype(np.float32)
    model = qdq_model(shape, "int4", scale, np.zeros((3, 3), np.int64), axis=1, block=block)
    proto, autodiff = backward_model(model, "y", ["x", "s"], seed="input")
    feeds = {"x": x, "s": scale, autodiff.seed_name: rng.standard_normal(shape).astype(np.float32)}
    on_ort = Evaluator(proto, backends=("onnxruntime",))(feeds)
    on_reference = Evaluator(proto, backends=("reference",))(feeds)
    for a, b in zip(on_ort, on_reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_opset_10_pair_is_upgraded():
    """QuantizeLinear-10 has no Round to pair with: the passes upgrade the model to opset 11."""
    rng = np.random.default_rng(10)
    scale = np.float32(0.5)
    x = (levels(rng, (3, 4), -128, 127) * scale).astype(np.float32)
    model = qdq_model(x.shape, "int8", scale, 0, opset=10, fed=("x",))
    r = rng.standard_normal(x.shape).astype(np.float32)
    _, grads = run_backward(model, {"x": x}, ["x"], r)
    inside = (np.rint(x / scale) >= -128) & (np.rint(x / scale) <= 127)
    np.testing.assert_array_equal(grads["x"], np.where(inside, r, 0))


def test_float16_input():
    """x and the scale in float16 (opset 19): the mask computed in float32, the gradients cast back."""
    rng = np.random.default_rng(16)
    scale = np.float16(0.25)
    x = (levels(rng, (4, 4), -128, 127) * np.float32(scale)).astype(np.float16)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s"], ["y"])]
    graph = helper.make_graph(nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, x.shape),
                                              helper.make_tensor_value_info("s", TensorProto.FLOAT16, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, x.shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    r = rng.standard_normal(x.shape).astype(np.float16)
    proto, autodiff = backward_model(model, "y", ["x", "s"], seed="input")
    assert_valid_model(proto)
    outputs = Evaluator(proto, backends=("onnxruntime",))({"x": x, "s": np.asarray(scale), autodiff.seed_name: r})
    named = dict(zip([o.name for o in proto.graph.output], outputs))
    dx, ds = named[autodiff.gradient_names["x"]], named[autodiff.gradient_names["s"]]
    assert dx.dtype == np.float16 and ds.dtype == np.float16
    v = x.astype(np.float32) / np.float32(scale)
    inside = (np.rint(v) >= 0) & (np.rint(v) <= 255)  # uint8: no zero point
    np.testing.assert_array_equal(dx, np.where(inside, r, 0).astype(np.float16))
    level = np.clip(np.rint(v), 0, 255)
    want = np.sum(r.astype(np.float32) * np.where(inside, np.rint(v) - v, level))
    np.testing.assert_allclose(np.float32(ds), want, rtol=2e-3, atol=2e-2)


def test_contrib_domain_pair():
    """onnxruntime's com.microsoft QuantizeLinear/DequantizeLinear (its quantizer's int16 QDQ below
    opset 21): the same rule, against torch."""
    rng = np.random.default_rng(21)
    scale, zero = np.float32(0.001), 30
    x = (levels(rng, (3, 5), -32768 - zero, 32767 - zero) * scale).astype(np.float32)
    r = rng.standard_normal(x.shape).astype(np.float32)
    model = qdq_model(x.shape, "int16", scale, zero, opset=19, check=False)  # (int16: opset 21 in ai.onnx)
    for node in model.graph.node:
        node.domain = "com.microsoft"
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    y, grads = run_backward(model, feeds_of(model, x=x, s=scale), ["x", "s"], r)
    xl, sl = torch.tensor(x[None], requires_grad=True), torch.tensor([scale], requires_grad=True)
    yl = torch._fake_quantize_learnable_per_channel_affine(xl, sl, torch.tensor([float(zero)]), 0, -32768, 32767, 1.0)
    dx, ds = torch.autograd.grad(yl, [xl, sl], torch.tensor(r[None]))
    close(y, yl.detach()[0], "forward")
    close(grads["x"], dx[0], "dx")
    close(grads["s"], ds.reshape(()), "ds", rtol=1e-4)
    assert 0 < np.count_nonzero(grads["x"]) < x.size


def test_q_read_elsewhere_is_not_a_pair():
    """Where q is read by more than the DequantizeLinear (here a graph output) the pair is no unit:
    the ops alone stop the gradient, as before."""
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    model = qdq_model(x.shape, "int8", np.float32(0.1), 0, fed=("x",), q_read=True, opset=19)
    proto, autodiff = backward_model(model, "y", ["x"], seed="input")
    outputs = Evaluator(proto, backends=("onnxruntime",))({"x": x, autodiff.seed_name: np.ones_like(x)})
    named = dict(zip([o.name for o in proto.graph.output], outputs))
    assert not named[autodiff.gradient_names["x"]].any()


def test_float8_is_refused_with_the_nodes_named():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="quantize"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dequantize")]
    graph = helper.make_graph(nodes, "f8", [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.float32(0.5), "s"),
                               helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    with pytest.raises(RuleError) as raised:
        backward_model(model, "y", ["x"], seed="input")
    message = str(raised.value)
    for part in ("QuantizeLinear 'quantize'", "DequantizeLinear 'dequantize'", "FLOAT8E4M3FN", "ai.onnx", "opset 19"):
        assert part in message, message
