"""Ops with a carried state for incremental decoding: CausalConvWithState and LinearAttention (opset 27).

Both rules write the op in standard ops and differentiate that decomposition, so the backward is
built from rules that already exist (and is differentiable again):

CausalConvWithState: P = [past_state ⊕ X] along time, Y = act(Conv(P, W, B, group=C)), and the
present state is the last k−1 positions of P. Conv's rule gives dP, dW and dB; the Concat splits
dP back into d(past_state) and dX, and the present state's gradient lands on the tail of P.

LinearAttention: the recurrence S_t = a_t ⊙ S_{t−1} + k_t ⊗ u_t, o_t = scale·q_tᵀS_t
(a_t = exp(g_t) when gated, u_t = β_t(v_t − (a_t ⊙ S_{t−1})ᵀk_t) for the delta rules, else v_t)
is a Scan over time whose rule replays it backwards. Like the reference kernel, float16/bfloat16
inputs are computed in float32; chunk_size is a tuning hint with no effect on the result.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import infer_node_shapes, shapes


def _padded(values, n):
    return list(values) + [None] * (n - len(values))


def _vjp(op, node, names, build, dYs):
    """Differentiates ``build(fwd)`` (the node's outputs in standard ops) for the seeded outputs."""
    fwd = op.child()
    outputs = build(fwd)
    inputs = [v for v in node.inputs if v is not None]
    infer_node_shapes(fwd.nodes, inputs, op.opset)
    seeds = [(y, dy) for y, dy in zip(outputs, dYs) if dy is not None]
    xs = [(name, v) for name, v in zip(names, node.inputs) if v is not None]
    grads = fwd.differentiate(list(fwd.nodes), seeds, [v for _, v in xs])
    op.nodes.extend(fwd.nodes)
    return {name: g for (name, _), g in zip(xs, grads) if g is not None}


def _activation(node):
    act = shapes.attr(node, "activation", "none")
    act = act.decode() if isinstance(act, bytes) else act
    if act not in ("none", "silu", "swish"):
        raise RuleError(f"CausalConvWithState: unknown activation '{act}' (expected none, silu or swish)")
    return act


_CONV_NAMES = ("input", "weight", "bias", "past_state")


@rule("CausalConvWithState", differentiable=_CONV_NAMES, since=27)
def causal_conv_with_state(op, node, *dYs):
    """Y = act(depthwise causal Conv1d of [past_state ⊕ X]), present_state = its last k−1 steps."""
    X, W, B, past = _padded(node.inputs, 4)
    act = _activation(node)
    # The channel count is the Conv's group, an attribute (as in ONNX's function body for the op): any
    # of the weight, input, state or bias may tell it. The kernel size may be left to the run.
    counts = [d[axis] for v, axis in ((W, 0), (X, 1), (past, 1), (B, 0))
              if (d := shapes.dims(v)) and isinstance(d[axis], int)]
    if not counts:
        raise RuleError("CausalConvWithState needs the channel count known statically (it gives the Conv's "
                        "group); run shape inference")
    if X.dtype is None:
        raise RuleError("CausalConvWithState needs the input's element type; run shape inference")
    channels, k = counts[0], shapes.dims(W)[2] if shapes.rank(W) == 3 else None
    kernel = {"kernel_shape": [k]} if isinstance(k, int) else {}

    def build(f):
        if past is None:
            steps = k - 1 if isinstance(k, int) else f.Sub(shapes.extent(f, W, 2), [1])  # the state's length
            zeros = f.ConstantOfShape(shapes.shape_from(f, shapes.extent(f, X, 0), channels, steps),
                                      value=ir.Tensor(np.zeros(1, X.dtype.numpy())))
            P = f.Concat(zeros, X, axis=2)
        else:
            P = f.Concat(past, X, axis=2)
        Y = f.Conv(P, W, B, group=channels, **kernel)
        if act != "none":
            Y = f.Mul(Y, f.Sigmoid(Y))
        length = shapes.extent(f, X, 2)
        present = f.Slice(P, [length] if isinstance(length, int) else length, [2**62], [2])
        return Y, present

    return _vjp(op, node, _CONV_NAMES, build, dYs)


_LA_NAMES = ("query", "key", "value", "past_state", "decay", "beta")
_RULES = ("linear", "gated", "delta", "gated_delta")


@rule("LinearAttention", differentiable=_LA_NAMES, since=27)
def linear_attention(op, node, *dYs):
    """Y = scale·q_tᵀS_t over the recurrence S_t = a_t⊙S_{t−1} + k_t⊗u_t; present_state = S_T."""
    q, k, v, past, decay, beta = _padded(node.inputs, 6)
    update = shapes.attr(node, "update_rule", "gated_delta")
    update = update.decode() if isinstance(update, bytes) else update
    if update not in _RULES:
        raise RuleError(f"LinearAttention: unknown update_rule '{update}' (expected one of {', '.join(_RULES)})")
    gated, delta = update in ("gated", "gated_delta"), update in ("delta", "gated_delta")
    if gated != (decay is not None) or delta != (beta is not None):
        raise RuleError(f"LinearAttention update_rule '{update}' needs decay {'given' if gated else 'omitted'} "
                        f"and beta {'given' if delta else 'omitted'}")
    hq, hkv = shapes.attr(node, "q_num_heads"), shapes.attr(node, "kv_num_heads")
    if not hq or not hkv or hq % hkv:
        raise RuleError("LinearAttention needs q_num_heads a positive multiple of kv_num_heads")
    if q.dtype is None or v.dtype is None:
        raise RuleError("LinearAttention needs its inputs' element types; run shape inference")
    group = hq // hkv
    state_dtype = past.dtype if past is not None else q.dtype
    compute = ir.DataType.FLOAT

    def build(f):
        def cast(x):
            return x if x.dtype == compute else f.Cast(x, to=int(compute))

        def time_first(x, heads):
            """[B, T, H·D] -> [T, B, H, D] (heads may be a (kv, group) pair)."""
            split = list(heads) if isinstance(heads, tuple) else [heads]
            perm = [1, 0, *range(2, 3 + len(split))]
            return f.Transpose(f.Reshape(cast(x), [0, 0, *split, -1]), perm=perm)

        qs = time_first(q, (hkv, group))                    # [T, B, Hkv, G, dk]
        ks, vs = time_first(k, hkv), time_first(v, hkv)     # [T, B, Hkv, dk|dv]
        scanned = [qs, ks, vs]
        if gated:
            scanned.append(f.Exp(time_first(decay, hkv)))   # [T, B, Hkv, dk|1]
        if delta:
            # beta's last axis is kv_num_heads or 1: [T, B, Hkv|1, 1]
            scanned.append(f.Transpose(f.Reshape(cast(beta), [0, 0, -1, 1]), perm=[1, 0, 2, 3]))
        scale = shapes.attr(node, "scale", 0.0)
        if not scale:  # 1/sqrt(head size)
            dk = shapes.dims(q)
            if dk is not None and isinstance(dk[2], int):
                scale = 1.0 / float(np.sqrt(dk[2] // hq))
            else:  # the head size is qs's last extent, known at run time only
                scale = f.Reciprocal(f.Sqrt(f.Cast(shapes.extent(f, qs, 4), to=int(compute))))
        if past is not None:
            S0 = cast(past)
        else:
            dk_ = f.Slice(f.Shape(ks), [3], [4])
            dv_ = f.Slice(f.Shape(vs), [3], [4])
            S0 = f.ConstantOfShape(f.Concat(f.Slice(f.Shape(ks), [1], [3]), dk_, dv_, axis=0),
                                   value=ir.Tensor(np.zeros(1, np.float32)))
        # A run-time scale multiplies the scanned outputs after the Scan: the products are the same.
        static_scale = isinstance(scale, float)
        step = _step(op, scale if static_scale else None, gated, delta)
        S, outs = f.Scan(S0, *scanned, body=step, num_scan_inputs=len(scanned), _outputs=2)
        S.dtype, outs.dtype = compute, compute
        if not static_scale:
            outs = f.Mul(outs, scale)
        Y = f.Reshape(f.Transpose(outs, perm=[1, 0, 2, 3, 4]), [0, 0, -1])  # [B, T, Hq·dv]
        Y = Y if q.dtype == compute else f.Cast(Y, to=int(q.dtype))
        S = S if state_dtype == compute else f.Cast(S, to=int(state_dtype))
        return Y, S

    return _vjp(op, node, _LA_NAMES, build, dYs)


def _step(op, scale, gated, delta):
    """One time step as a Scan body: (S; q, k, v[, a][, β]) -> (S', o), o scaled by ``scale`` unless
    it is None (a scale known at run time only, applied by the caller)."""
    body = op.child()
    f32 = ir.TensorType(ir.DataType.FLOAT)

    def value(rank):
        return ir.Value(name=op.namer.fresh(), type=f32, shape=ir.Shape([None] * rank))

    S, q, k, v = value(4), value(4), value(3), value(3)
    inputs = [S, q, k, v]
    if gated:
        a = value(3)
        inputs.append(a)
        S = body.Mul(S, body.unsqueeze(a, [-1]))
    k_col = body.unsqueeze(k, [-1])                          # [B, H, dk, 1]
    u = body.unsqueeze(v, [-2])                              # [B, H, 1, dv]
    if delta:
        b = value(3)
        inputs.append(b)
        retrieved = body.MatMul(body.Transpose(k_col, perm=[0, 1, 3, 2]), S)
        u = body.Mul(body.unsqueeze(b, [-1]), body.Sub(u, retrieved))
    S_next = body.Add(S, body.MatMul(k_col, u))
    o = body.MatMul(q, S_next)                               # [B, Hkv, G, dv]: the group shares S
    if scale is not None:
        o = body.Mul(o, float(scale))
    graph = body.graph(inputs, [S_next, o], name="linear_attention_step")
    for out, rank in zip(graph.outputs, (4, 4)):
        out.type, out.shape = f32, ir.Shape([None] * rank)
    return graph
