"""Attention (opset 23+), RotaryEmbedding (opset 23+) and FlexAttention (ai.onnx.preview 1).

Attention: the probabilities P are recomputed by a second Attention node with
qk_matmul_output_mode=3 (so every masking rule of the runtime, causal offset, boolean and float
masks, fully-masked rows giving P = 0, applies unchanged), then the usual backward:
S0 = scale·QKᵀ, T = softcap(S0), S = T + bias, P = softmax(S), Y = PV;
dV = Pᵀ dY, dP = dY Vᵀ, dS = P ⊙ (dP − Σ_k dP ⊙ P), dmask = dS (summed to the mask's shape),
dS0 = dS ⊙ (1 − tanh²(S0/c)), dQ = scale·dS0 K, dK = scale·dS0ᵀ Q; K and V are the present
(past ⊕ new) tensors, split back into past_key/past_value and K/V. Grouped-query attention is
handled by viewing Q as [B, kv_heads, group·Sq, D], which makes the sum over the query heads
sharing one kv head a plain MatMul. Gradients flowing into present_key/present_value and into
qk_matmul_output (modes 0-3, as onnxruntime defines them: 0 = scale·QKᵀ before softcap,
1 = after softcap, 2 = after adding the bias, 3 = P) are added at the matching point.
Mode 2's scores are constant where a key is masked (-inf, onnxruntime writes the dtype's lowest),
so no gradient comes from there. A mask shorter than the keys is padded with -inf/False for the
recomputing node (the spec's rule; onnxruntime refuses short masks). A boolean mask and
nonpad_kv_seqlen get no gradient; opset 24's nonpad_kv_seqlen and opset 25's
sliding window only mask more positions, which the recomputed P already reflects.

RotaryEmbedding: a rotation of pairs by +θ; dX is the rotation by −θ (the same op with −sin).
dcos = Σ_heads (dY₁x₁ + dY₂x₂), dsin = Σ_heads (dY₂x₁ − dY₁x₂), scatter-added into the cache rows
picked by position_ids.

FlexAttention: Y = prob_mod(softmax(score_mod(scale·QKᵀ)))·V with user subgraphs for the two
modifiers. The rule writes the op in standard ops (the modifiers inlined, the softmax in its
precision, grouped heads viewed as for Attention) and differentiates that: the modifiers' own ops
carry the gradient, whatever they compute.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.math import gate
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import infer_node_shapes, may_be_float, shapes


def _padded(values, n):
    return list(values) + [None] * (n - len(values))


def _heads_first(op, x, heads):
    """[B, S, H·D] -> [B, H, S, D]."""
    return op.Transpose(op.Reshape(x, [0, 0, heads, -1]), perm=[0, 2, 1, 3])


def _heads_last(op, x):
    """[B, H, S, D] -> [B, S, H·D]."""
    return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), [0, 0, -1])


@rule("Attention", differentiable=("Q", "K", "V", "attn_mask", "past_key", "past_value"), since=23)
def attention(op, node, *dys):
    """Y = softmax(softcap(scale·QKᵀ) + mask + causal)·V, with a kv cache and grouped heads."""
    Q, K, V, mask, past_k, past_v = _padded(node.inputs, 7)[:6]
    dY, dpk, dpv, dqk = _padded(dys, 4)
    mode = shapes.attr(node, "qk_matmul_output_mode", 0)
    softcap = shapes.attr(node, "softcap", 0.0)
    r = shapes.rank(Q)
    if r not in (3, 4):
        raise RuleError(f"Attention needs Q of known rank 3 or 4 (got {r}); run shape inference")
    if r == 3:
        hq, hkv = shapes.attr(node, "q_num_heads"), shapes.attr(node, "kv_num_heads")
        if not hq or not hkv:
            raise RuleError("3-D Attention needs q_num_heads and kv_num_heads")
        Q4, K4, V4 = (_heads_first(op, x, h) for x, h in ((Q, hq), (K, hkv), (V, hkv)))
    else:
        Q4, K4, V4 = Q, K, V
        hq, hkv = shapes.extent(op, Q, 1), shapes.extent(op, K, 1)
    Kp = K4 if past_k is None else op.Concat(past_k, K4, axis=2)
    Vp = V4 if past_v is None else op.Concat(past_v, V4, axis=2)
    total = _total(op, K4, past_k, Kp) if mask is not None else None

    if mode == 3 and len(node.outputs) == 4:
        P = node.outputs[3]
    else:
        # Every attribute but the mode, window sizes (opset 25) included: the same masking.
        attrs = {a: shapes.attr(node, a) for a in node.attributes if a != "qk_matmul_output_mode"}
        inputs = _padded(node.inputs, 7)
        if mask is not None:
            inputs[3] = _pad_mask(op, mask, total)
        outs = op.Attention(*inputs, qk_matmul_output_mode=3, _outputs=4, **attrs)
        if inputs[6] is not None:  # present_* may not be combined with nonpad_kv_seqlen
            for unused in outs[1:3]:
                unused.name = ""
        P = outs[3]
    # onnx's inference gives the scores a wrong key extent unless _keys_inferred (0 where symbolic),
    # and every value computed from them would inherit it: they are viewed in the computed shape then.
    scores_shape = None
    if not _keys_inferred(V, past_k, r):
        keys = total if total is not None else _total(op, K4, past_k, Kp)
        scores_shape = shapes.shape_from(op, shapes.shape_between(op, Q4, 0, 3), keys)

    def as_scores(x):
        return x if scores_shape is None else op.Reshape(x, scores_shape)

    P = as_scores(P)

    scale = shapes.attr(node, "scale")
    if scale is None:
        d = shapes.dims(Q4) if r == 4 else None
        head = d[3] if d is not None else None
        if r == 3 and shapes.dims(Q) is not None and isinstance(shapes.dims(Q)[2], int):
            head = shapes.dims(Q)[2] // hq
        if isinstance(head, int):
            scale = 1.0 / float(np.sqrt(head))
        else:
            size = op.Cast(op.Slice(op.Shape(Q4), [3], [4]), to=int(Q.dtype))
            scale = op.Reciprocal(op.Sqrt(size))

    # Grouped view: query head h uses kv head h // group, so [B, Hq, Sq, *] -> [B, Hkv, group·Sq, *].
    grouped = not (isinstance(hq, int) and isinstance(hkv, int) and hq == hkv)
    to_groups = (lambda x: op.Reshape(x, shapes.shape_from(op, 0, hkv, -1, 0))) if grouped else (lambda x: x)
    Qg, Pg = to_groups(Q4), to_groups(P)
    if dY is not None and r == 3:
        dY = _heads_first(op, dY, hq)
    dYg = to_groups(dY) if dY is not None else None
    dqkg = to_groups(dqk) if dqk is not None else None

    def add(a, b):
        return b if a is None else a if b is None else op.Add(a, b)

    dVp = op.MatMul(op.Transpose(Pg, perm=[0, 1, 3, 2]), dYg) if dYg is not None else None
    dP = op.MatMul(dYg, op.Transpose(Vp, perm=[0, 1, 3, 2])) if dYg is not None else None
    if mode == 3:
        dP = add(dP, dqkg)
    dS = None
    if dP is not None:
        dS = op.Mul(Pg, op.Sub(dP, op.ReduceSum(op.Mul(dP, Pg), [-1], keepdims=1)))
    if mode == 2 and dqkg is not None:
        # Masked scores come out as a constant (-inf, or the dtype's lowest in onnxruntime).
        if Q.dtype is None:
            raise RuleError("Attention with qk_matmul_output_mode=2 needs Q's element type; run shape inference")
        lowest = op.const(np.finfo(Q.dtype.numpy()).min, dtype=Q.dtype)
        scores = to_groups(as_scores(node.outputs[3]))
        dS = add(dS, gate(op, op.Greater(scores, lowest), dqkg))
    dT = add(dS, dqkg) if mode == 1 else dS
    if dT is not None and softcap:
        S0 = op.Mul(op.MatMul(Qg, op.Transpose(Kp, perm=[0, 1, 3, 2])), scale)
        th = op.Tanh(op.Div(S0, float(softcap)))
        dT = op.Mul(dT, op.Sub(1.0, op.Mul(th, th)))
    dS0 = add(dT, dqkg) if mode == 0 else dT

    grads = {}
    if dS0 is not None:
        dQ = op.Reshape(op.Mul(op.MatMul(dS0, Kp), scale), op.Shape(Q4))
        dKp = op.Mul(op.MatMul(op.Transpose(dS0, perm=[0, 1, 3, 2]), Qg), scale)
        grads["Q"] = _heads_last(op, dQ) if r == 3 else dQ
    else:
        dKp = None
    dKp, dVp = add(dKp, dpk), add(dVp, dpv)
    for name, past, grad in (("K", past_k, dKp), ("V", past_v, dVp)):
        if grad is None:
            continue
        if past is not None:
            split = shapes.extent(op, past, 2)
            split = [split] if isinstance(split, int) else split
            grads[f"past_{'key' if name == 'K' else 'value'}"] = op.Slice(grad, [0], split, [2])
            grad = op.Slice(grad, split, [2**62], [2])
        grads[name] = _heads_last(op, grad) if r == 3 else grad
    if dS is not None and mask is not None and may_be_float(mask) and mask.dtype == Q.dtype:
        grads["attn_mask"] = _mask_gradient(op, dS, mask, P, Q4, total)
    return grads


def _total(op, K4, past_k, Kp):
    """The number of keys, past included: an int when static."""
    k, past = shapes.dims(K4), shapes.dims(past_k) if past_k is not None else (0, 0, 0)
    if k is not None and past is not None and isinstance(k[2], int) and isinstance(past[2], int):
        return k[2] + past[2]
    return shapes.extent(op, Kp, 2)


def _keys_inferred(V, past_k, r):
    """Whether onnx's Attention inference gives the scores (qk_matmul_output) their true key
    extent: it reads V's sequence extent as a number (0 where symbolic) and adds past_key's only
    where both are known."""
    seq = (shapes.dims(V) or (None,) * r)[r - 2]
    past = (shapes.dims(past_k) or (None,) * 4)[2] if past_k is not None else 0
    return isinstance(seq, int) and isinstance(past, int)


def _pad_mask(op, mask, total):
    """A mask shorter than the keys, padded with -inf / False (onnxruntime refuses short masks)."""
    m = shapes.dims(mask)
    if mask.dtype is None:
        return mask
    if m is not None and isinstance(m[-1], int) and isinstance(total, int):
        if m[-1] >= total:
            return mask
        pads = [0] * (2 * len(m) - 1) + [total - m[-1]]
    else:
        r = shapes.rank(mask)
        if r is None:
            return mask
        total = op.const(np.array([total], np.int64)) if isinstance(total, int) else total
        width = op.Max(op.Sub(total, op.Slice(op.Shape(mask), [-1], [2**62])), [0])
        pads = op.Concat(op.const(np.zeros(2 * r - 1, np.int64)), width, axis=0)
    fill = False if mask.dtype == ir.DataType.BOOL else -np.inf
    return op.Pad(mask, pads, op.const(np.array(fill, mask.dtype.numpy())), mode="constant")


def _mask_gradient(op, dS, mask, P, Q4, total):
    """dS in P's layout, cut to the mask's key length (a short mask was padded) and summed to its shape."""
    dS = op.Reshape(dS, op.Shape(P))
    m, q = shapes.dims(mask), shapes.dims(Q4)
    if m is None or m[-1] != total:
        dS = op.Slice(dS, [0], op.Slice(op.Shape(mask), [-1], [2**62]), [-1])
    like = dS
    if q is not None:
        like = ir.Value(name=None, shape=ir.Shape([q[0], q[1], q[2], m[-1] if m is not None else None]))
    return shapes.unbroadcast(op, dS, mask, like)


def _pairs(op, x, interleaved):
    """The two halves rotated against each other: [..., d] -> ([..., d/2], [..., d/2])."""
    if interleaved:
        a, b = op.Split(op.Reshape(x, [0, 0, 0, -1, 2]), axis=-1, num_outputs=2, _outputs=2)
        return op.squeeze(a, [-1]), op.squeeze(b, [-1])
    return op.Split(x, axis=-1, num_outputs=2, _outputs=2)


@rule("RotaryEmbedding", differentiable=("X", "cos_cache", "sin_cache"), since=23)
def rotary_embedding(op, node, dY):
    """Y = (x₁cos − x₂sin, x₁sin + x₂cos) on the rotated part; dX = the same rotation by −θ."""
    X, cos, sin, pos = _padded(node.inputs, 4)
    attrs = {a: shapes.attr(node, a) for a in ("interleaved", "num_heads", "rotary_embedding_dim")}
    grads = {"X": op.RotaryEmbedding(dY, cos, op.Neg(sin), pos, **attrs)}
    r = shapes.rank(X)
    if r not in (3, 4):
        raise RuleError(f"RotaryEmbedding needs X of known rank 3 or 4 (got {r}); run shape inference")
    # Both to [B, S, H, D], the layout the caches broadcast in.
    if r == 4:
        x, g = (op.Transpose(v, perm=[0, 2, 1, 3]) for v in (X, dY))
    else:
        heads = attrs["num_heads"]
        if not heads:
            raise RuleError("3-D RotaryEmbedding needs num_heads")
        x, g = (op.Reshape(v, [0, 0, heads, -1]) for v in (X, dY))
    rd = attrs["rotary_embedding_dim"]
    if rd:
        x, g = (op.Slice(v, [0], [rd], [-1]) for v in (x, g))
    x1, x2 = _pairs(op, x, attrs["interleaved"])
    g1, g2 = _pairs(op, g, attrs["interleaved"])
    dcos = op.ReduceSum(op.Add(op.Mul(g1, x1), op.Mul(g2, x2)), [2], keepdims=0)
    dsin = op.ReduceSum(op.Sub(op.Mul(g2, x1), op.Mul(g1, x2)), [2], keepdims=0)
    for name, cache, grad in (("cos_cache", cos, dcos), ("sin_cache", sin, dsin)):
        if pos is not None:  # rows of the cache gathered by position: scatter-add back
            grads[name] = op.ScatterND(shapes.zeros(op, cache), op.unsqueeze(pos, [-1]), grad,
                                       reduction="add")
        else:
            d = shapes.dims(X)
            like = None if d is None else [d[0], d[2] if r == 4 else d[1], (shapes.dims(cache) or [None])[-1]]
            like = ir.Value(name=None, shape=ir.Shape(like)) if like is not None else grad
            grads[name] = shapes.unbroadcast(op, grad, cache, like)
    return grads


def _inline_mod(op, graph, x):
    """``graph``(x) emitted into ``op``, its initializers as Constant nodes (inlined nodes would
    otherwise read initializers of a graph that is not there)."""
    constants = {name: op.Constant(value=init.const_value) for name, init in graph.initializers.items()}
    (out,), nodes = op.inline(graph, [x])
    for node in nodes:
        for i, value in enumerate(node.inputs):
            if value is not None and value.producer() is None and value.name in constants:
                node.replace_input_with(i, constants[value.name])
    return out


_FLEX_PRECISION = {int(ir.DataType.FLOAT), int(ir.DataType.DOUBLE), int(ir.DataType.FLOAT16),
                   int(ir.DataType.BFLOAT16)}


@rule("FlexAttention", "ai.onnx.preview", differentiable=("Q", "K", "V"))
def flex_attention(op, node, dY):
    """Y = prob_mod(softmax(score_mod(scale·QKᵀ)))·V over rank-4 inputs, grouped kv heads."""
    Q, K, V = node.inputs
    if any(shapes.rank(x) not in (4, None) for x in (Q, K, V)):
        raise RuleError("FlexAttention needs rank-4 Q, K and V")
    if Q.dtype is None or V.dtype is None:
        raise RuleError("FlexAttention needs the element types of Q and V; run shape inference")
    precision = shapes.attr(node, "softmax_precision")
    if precision is not None and precision not in _FLEX_PRECISION:
        raise RuleError(f"FlexAttention: softmax_precision {precision} is not a float type")
    compute = ir.DataType(precision) if precision is not None else (
        Q.dtype if Q.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE) else ir.DataType.FLOAT)
    score_mod, prob_mod = shapes.attr(node, "score_mod"), shapes.attr(node, "prob_mod")
    hq, hkv = shapes.extent(op, Q, 1), shapes.extent(op, K, 1)
    grouped = not (isinstance(hq, int) and isinstance(hkv, int) and hq == hkv)

    def build(f):
        scale = shapes.attr(node, "scale")
        if scale is None:
            e = shapes.extent(f, Q, 3)
            sqrt_scale = (float(e) ** -0.25 if isinstance(e, int)
                          else f.Pow(f.Cast(e, to=int(Q.dtype)), f.const(np.array(-0.25, Q.dtype.numpy()))))
        else:
            sqrt_scale = float(np.sqrt(np.float32(scale)))
        # Query head h reads kv head h // group: [B, Hq, L, *] viewed as [B, Hkv, group·L, *].
        to_kv = (lambda x: f.Reshape(x, shapes.shape_from(f, 0, hkv, -1, 0))) if grouped else (lambda x: x)
        to_q = (lambda x: f.Reshape(x, shapes.shape_from(f, 0, hq, -1, 0))) if grouped else (lambda x: x)
        kt = f.Transpose(f.Mul(K, sqrt_scale), perm=[0, 1, 3, 2])
        scores = to_q(f.MatMul(to_kv(f.Mul(Q, sqrt_scale)), kt))
        if compute != Q.dtype:
            scores = f.Cast(scores, to=int(compute))
        if score_mod is not None:
            scores = _inline_mod(f, score_mod, scores)
        probs = f.Softmax(scores, axis=-1)
        if prob_mod is not None:
            probs = _inline_mod(f, prob_mod, probs)
        v = V if compute == V.dtype else f.Cast(V, to=int(compute))
        Y = to_q(f.MatMul(to_kv(probs), v))
        return Y if compute == V.dtype else f.Cast(Y, to=int(V.dtype))

    fwd = op.child()
    Y = build(fwd)
    infer_node_shapes(fwd.nodes, [Q, K, V], op.opset)
    grads = fwd.differentiate(list(fwd.nodes), [(Y, dY)], [Q, K, V])
    op.nodes.extend(fwd.nodes)
    return {name: g for name, g in zip(("Q", "K", "V"), grads) if g is not None}
