"""CausalConvWithState and LinearAttention (opset 27).

Neither schema admits float64, so the finite-difference oracle can only run them in float32 (a
weak check, tolerance 3e-2). Each case is therefore also compared, at 1e-4, with PyTorch float64
autograd of the spec's algorithm (written here from the operator's documentation, step by step).
Every backward graph runs on onnxruntime.
"""

import numpy as np
import onnxruntime as ort
import pytest

from onnx import helper

from helpers import assert_gradients, make_model, rng
from onnx_autodiff.conformance.check import ad_vjp, backward_model
from onnx_autodiff.conformance.oracle import random_cotangents
from onnx_autodiff.errors import RuleError

R = rng(11)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def op_model(op_type, inputs, shapes=None, **attrs):
    """One node with outputs out0, out1 over ``inputs``: a list of (name, array), "" skipping an
    optional input, or a dict without skipped inputs."""
    inputs = list(inputs.items()) if isinstance(inputs, dict) else inputs
    node = helper.make_node(op_type, [k for k, _ in inputs], ["out0", "out1"], **attrs)
    return make_model([node], {k: v for k, v in inputs if k}, ["out0", "out1"], shapes=shapes, opset=27)


def check(op_type, inputs, torch_fn, shapes=None, atol=1e-4, rtol=1e-3, symbolic=True, **attrs):
    """Both outputs carry gradients: AD (onnxruntime) against float32 finite differences and
    against PyTorch float64 autograd of ``torch_fn(torch, **tensors) -> (output, present_state)``."""
    model = op_model(op_type, inputs, shapes=shapes, **attrs)
    feeds = {k: v for k, v in (inputs.items() if isinstance(inputs, dict) else inputs) if k}
    wrt = list(feeds)
    assert_gradients(model, feeds, wrt, symbolic=symbolic)
    torch = pytest.importorskip("torch")
    cotangents = random_cotangents(model, feeds, seed=1)
    ad = ad_vjp(model, feeds, wrt, cotangents)
    t = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in feeds.items()}
    outs = torch_fn(torch, **t)
    sum((o * torch.tensor(r.astype(np.float64))).sum() for o, r in zip(outs, cotangents)).backward()
    for k in wrt:
        expected = t[k].grad.numpy()
        assert np.any(expected != 0)
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(ad[k], expected, atol=atol * scale, rtol=rtol, err_msg=k)
    return model, feeds


# CausalConvWithState: B=2, C=3, L=5, k=3 unless said otherwise.

def causal_conv_torch(torch, input, weight, bias=None, past_state=None, activation="none"):
    b, c, _ = input.shape
    k = weight.shape[2]
    past = past_state if past_state is not None else torch.zeros(b, c, k - 1, dtype=input.dtype)
    padded = torch.cat([past, input], 2)
    y = torch.nn.functional.conv1d(padded, weight, bias, groups=c)
    if activation in ("silu", "swish"):
        y = y * torch.sigmoid(y)
    return y, padded[:, :, padded.shape[2] - (k - 1):]


def conv_inputs(b=2, c=3, length=5, k=3, bias=False, past=False):
    inputs = [("input", f32(b, c, length)), ("weight", f32(c, 1, k))]
    if bias or past:
        inputs.append(("bias", f32(c)) if bias else ("", None))
    if past:
        inputs.append(("past_state", f32(b, c, k - 1)))
    return inputs


@pytest.mark.parametrize("activation", ["none", "silu", "swish"])
@pytest.mark.parametrize("bias,past", [(False, False), (True, False), (False, True), (True, True)])
def test_causal_conv(activation, bias, past):
    check("CausalConvWithState", conv_inputs(bias=bias, past=past),
          lambda torch, **t: causal_conv_torch(torch, **t, activation=activation), activation=activation,
          symbolic=False)  # see test_causal_conv_symbolic_kernel


@pytest.mark.parametrize("length,k", [(1, 4), (2, 5), (6, 1)])  # a decode step, input shorter than the state, k=1
def test_causal_conv_lengths(length, k):
    inputs = conv_inputs(length=length, k=k, bias=True, past=k > 1)
    check("CausalConvWithState", inputs, causal_conv_torch, symbolic=False)  # see test_causal_conv_symbolic_kernel


@pytest.mark.parametrize("bias,past", [(False, False), (True, True)])
def test_causal_conv_symbolic_kernel(bias, past):
    """Every extent symbolic but the channel count: it is the group attribute of the op's Conv, in
    ONNX's function body for the op (which onnxruntime runs) as in this rule. With symbolic channels
    onnxruntime finds no implementation of the forward, so the cases above skip the symbolic check."""
    shapes = {"input": ["N", 3, "L"], "weight": ["C", 1, "K"], "bias": ["C"], "past_state": ["N", 3, "P"]}
    inputs = conv_inputs(bias=bias, past=past)
    check("CausalConvWithState", inputs, causal_conv_torch, shapes={k: shapes[k] for k, _ in inputs if k},
          symbolic=False)


def test_causal_conv_symbolic_batch_and_length():
    """One backward graph serves every batch size and length."""
    torch = pytest.importorskip("torch")
    inputs = dict(conv_inputs(bias=True, past=True))
    shapes = {"input": ["N", 3, "L"], "past_state": ["N", 3, 2]}
    model = op_model("CausalConvWithState", inputs, shapes=shapes, activation="silu")
    wrt = ["input", "weight", "bias", "past_state"]
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    session = _session(proto)
    for b, length in ((2, 5), (3, 1), (1, 7)):
        feeds = {"input": f32(b, 3, length), "weight": inputs["weight"], "bias": inputs["bias"],
                 "past_state": f32(b, 3, 2)}
        dy = f32(b, 3, length)
        got = session.run([autodiff.gradient_names[x] for x in wrt], {**feeds, autodiff.seed_name: dy})
        t = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in feeds.items()}
        y, _ = causal_conv_torch(torch, **t, activation="silu")
        y.backward(torch.tensor(dy.astype(np.float64)))
        for x, g in zip(wrt, got):
            np.testing.assert_allclose(g, t[x].grad.numpy(), atol=1e-4, rtol=1e-3, err_msg=x)


def test_causal_conv_float16():
    """float16 in and out; compared with float64 autograd at float16 precision."""
    inputs = {k: v.astype(np.float16) for k, v in conv_inputs(bias=True, past=True)}
    torch = pytest.importorskip("torch")
    model = op_model("CausalConvWithState", inputs, activation="silu")
    cotangents = random_cotangents(model, inputs, seed=1)
    ad = ad_vjp(model, inputs, list(inputs), cotangents)
    t = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in inputs.items()}
    outs = causal_conv_torch(torch, **t, activation="silu")
    sum((o * torch.tensor(r.astype(np.float64))).sum() for o, r in zip(outs, cotangents)).backward()
    for k in inputs:
        assert ad[k].dtype == np.float16
        np.testing.assert_allclose(ad[k], t[k].grad.numpy(), atol=1e-2 * max(1, np.abs(t[k].grad.numpy()).max()),
                                   rtol=1e-2, err_msg=k)


def test_causal_conv_unknown_activation_refused():
    model = op_model("CausalConvWithState", conv_inputs(), activation="relu")
    with pytest.raises(RuleError, match="activation"):
        backward_model(model, "out0", ["input"], seed="input")


def test_causal_conv_unknown_channels_refused():
    model = op_model("CausalConvWithState", conv_inputs(), shapes={"input": ["N", "C", "L"], "weight": ["C", 1, 3]})
    with pytest.raises(RuleError, match="channel count"):
        backward_model(model, "out0", ["input"], seed="input")


# LinearAttention: B=2, T=4, d_k=3, d_v=2; heads (Hq, Hkv) = (2, 2) unless said otherwise.

def linear_attention_torch(torch, query, key, value, past_state=None, decay=None, beta=None, *,
                           hq, hkv, scale=0.0):
    """The spec's recurrence, one token at a time, in float64."""
    b, t, _ = query.shape
    dk, dv = query.shape[-1] // hq, value.shape[-1] // hkv
    q = query.reshape(b, t, hq, dk).transpose(1, 2)
    k = key.reshape(b, t, hkv, dk).transpose(1, 2)
    v = value.reshape(b, t, hkv, dv).transpose(1, 2)
    state = past_state if past_state is not None else torch.zeros(b, hkv, dk, dv, dtype=query.dtype)
    scale = scale or dk ** -0.5
    outs = []
    for i in range(t):
        if decay is not None:
            g = decay[:, i].reshape(b, hkv, -1)  # per head (…, 1) or per key dimension (…, d_k)
            state = state * torch.exp(g)[..., None]
        v_t = v[:, :, i]
        if beta is not None:
            retrieved = torch.einsum("bhdm,bhd->bhm", state, k[:, :, i])
            v_t = beta[:, i].reshape(b, -1, 1) * (v_t - retrieved)
        state = state + k[:, :, i, :, None] * v_t[:, :, None, :]
        shared = state.repeat_interleave(hq // hkv, dim=1)
        outs.append(scale * torch.einsum("bhd,bhdm->bhm", q[:, :, i], shared))
    return torch.stack(outs, 1).reshape(b, t, -1), state


def la_inputs(update, hq=2, hkv=2, t=4, dk=3, dv=2, b=2, past=False, decay_per_head=False, beta_width=None):
    """(name, array) pairs in the schema's order, ("", None) for a skipped optional input."""
    inputs = [("query", f32(b, t, hq * dk)), ("key", f32(b, t, hkv * dk) / 2), ("value", f32(b, t, hkv * dv))]
    gated, delta = update in ("gated", "gated_delta"), update in ("delta", "gated_delta")
    inputs.append(("past_state", f32(b, hkv, dk, dv)) if past else ("", None))
    width = hkv if decay_per_head else hkv * dk
    inputs.append(("decay", -np.abs(f32(b, t, width)) / 2) if gated else ("", None))
    if delta:
        inputs.append(("beta", 1 / (1 + np.exp(-f32(b, t, beta_width or hkv)))))  # a sigmoid gate, as models feed it
    while inputs[-1][0] == "":
        inputs.pop()
    return inputs


def check_la(update, attrs=(), **kw):
    inputs = la_inputs(update, **kw)
    hq, hkv = kw.get("hq", 2), kw.get("hkv", 2)
    attrs = dict(attrs)
    fn = lambda torch, **t: linear_attention_torch(torch, **t, hq=hq, hkv=hkv, scale=attrs.get("scale", 0.0))
    return check("LinearAttention", inputs, fn, q_num_heads=hq, kv_num_heads=hkv, update_rule=update, **attrs)


@pytest.mark.parametrize("update", ["linear", "gated", "delta", "gated_delta"])
@pytest.mark.parametrize("past", [False, True])
def test_linear_attention(update, past):
    check_la(update, past=past)


def test_linear_attention_gated_per_head_decay():
    check_la("gated", decay_per_head=True)


@pytest.mark.parametrize("decay_per_head,beta_width", [(True, 1), (False, 1), (True, None)])
def test_linear_attention_gated_delta_widths(decay_per_head, beta_width):
    check_la("gated_delta", decay_per_head=decay_per_head, beta_width=beta_width, past=True)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])  # grouped-query, multi-query
def test_linear_attention_grouped(hq, hkv):
    check_la("gated_delta", hq=hq, hkv=hkv, past=True)


def test_linear_attention_decode_step_and_scale():
    check_la("gated_delta", {"scale": 0.3}, t=1, past=True)


def test_linear_attention_symbolic_batch_and_time():
    """One backward graph serves every batch size and sequence length."""
    torch = pytest.importorskip("torch")
    inputs = dict(la_inputs("gated_delta", past=True))
    shapes = {k: ["N", "T", v.shape[2]] for k, v in inputs.items() if k != "past_state"}
    shapes["past_state"] = ["N", 2, 3, 2]
    model = op_model("LinearAttention", inputs, shapes=shapes,
                     q_num_heads=2, kv_num_heads=2)
    wrt = list(inputs)
    proto, autodiff = backward_model(model, "out1", wrt, seed="input")  # through present_state
    session = _session(proto)
    for b, t in ((2, 4), (3, 1), (1, 6)):
        feeds = dict(la_inputs("gated_delta", past=True, b=b, t=t))
        ds = f32(b, 2, 3, 2)
        got = session.run([autodiff.gradient_names[x] for x in wrt], {**feeds, autodiff.seed_name: ds})
        tt = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in feeds.items()}
        _, state = linear_attention_torch(torch, **tt, hq=2, hkv=2)
        state.backward(torch.tensor(ds.astype(np.float64)))
        for x, g in zip(wrt, got):
            expected = tt[x].grad.numpy() if tt[x].grad is not None else np.zeros_like(g)  # query: no path
            np.testing.assert_allclose(g, expected, atol=1e-4, rtol=1e-3, err_msg=x)


def test_linear_attention_float16():
    """float16 in and out (computed in float32 inside, like the reference kernel)."""
    torch = pytest.importorskip("torch")
    inputs = {k: v.astype(np.float16) for k, v in la_inputs("gated_delta", past=True)}
    model = op_model("LinearAttention", inputs, q_num_heads=2, kv_num_heads=2)
    cotangents = random_cotangents(model, inputs, seed=1)
    ad = ad_vjp(model, inputs, list(inputs), cotangents)
    t = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in inputs.items()}
    outs = linear_attention_torch(torch, **t, hq=2, hkv=2)
    sum((o * torch.tensor(r.astype(np.float64))).sum() for o, r in zip(outs, cotangents)).backward()
    for k in inputs:
        expected = t[k].grad.numpy()
        assert ad[k].dtype == np.float16
        np.testing.assert_allclose(ad[k], expected, atol=1e-2 * max(1, np.abs(expected).max()), rtol=1e-2, err_msg=k)


def test_linear_attention_inputs_must_match_update_rule():
    inputs = la_inputs("linear") + [("", None), ("decay", f32(2, 4, 6))]
    model = op_model("LinearAttention", inputs, q_num_heads=2, kv_num_heads=2, update_rule="linear")
    with pytest.raises(RuleError, match="decay omitted"):
        backward_model(model, "out0", ["query"], seed="input")
