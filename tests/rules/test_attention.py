import numpy as np
import onnx
import onnxruntime as ort
import pytest

from helpers import assert_gradients, op_model, rng
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import RuleError

R = rng(3)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def check(op_type, inputs, wrt, n_outputs=1, opset=23, shapes=None, symbolic=True, **attrs):
    """Finite differences (float64 oracle) over every output, and the backward graph of the first
    output runs on onnxruntime itself. Returns (model, feeds)."""
    model = op_model(op_type, inputs, n_outputs=n_outputs, opset=opset, shapes=shapes, **attrs)
    feeds = {k: v for k, v in inputs.items() if k}
    for out, value in zip(model.graph.output, _session(model).run(None, feeds)):
        if not out.type.tensor_type.HasField("shape"):  # onnx infers none with qk_matmul_output
            out.type.tensor_type.elem_type = 1
            out.type.tensor_type.shape.dim.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in value.shape)
    result = assert_gradients(model, feeds, wrt, symbolic=symbolic)
    for name in wrt:
        assert np.any(result.fd[name] != 0)
    y = _session(model).run(None, feeds)[0]
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    _session(proto).run(None, {**feeds, autodiff.seed_name: np.ones_like(y)})
    return model, feeds, result


# Attention: B=2, Hq=2, Sq=3, Skv=4, D=4 unless said otherwise.

def qkv(hq=2, hkv=2, sq=3, skv=4, d=4, dv=4, b=2):
    return {"Q": f32(b, hq, sq, d), "K": f32(b, hkv, skv, d), "V": f32(b, hkv, skv, dv)}


@pytest.mark.parametrize(
    "attrs",
    [{}, {"scale": 0.3}, {"is_causal": 1}, {"softcap": 1.5}, {"softcap": 2.0, "is_causal": 1, "scale": 0.8}],
)
def test_attention_4d(attrs):
    check("Attention", qkv(), ["Q", "K", "V"], **attrs)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])  # grouped-query, multi-query
def test_attention_grouped(hq, hkv):
    check("Attention", qkv(hq, hkv), ["Q", "K", "V"], softcap=3.0)


def test_attention_value_head_size():
    check("Attention", qkv(dv=3), ["Q", "K", "V"], is_causal=1)


@pytest.mark.parametrize("mask_shape", [(3, 4), (2, 1, 3, 4), (1, 2, 3, 4), (2, 3, 4), (1, 1, 3, 4)])
def test_attention_float_mask(mask_shape):
    inputs = {**qkv(), "attn_mask": f32(*mask_shape)}
    check("Attention", inputs, ["Q", "K", "V", "attn_mask"])


def test_attention_float_mask_causal_softcap():
    inputs = {**qkv(), "attn_mask": f32(3, 4)}
    check("Attention", inputs, ["Q", "K", "V", "attn_mask"], is_causal=1, softcap=2.0)


def test_attention_bool_mask_with_fully_masked_row():
    mask = np.ones((3, 4), bool)
    mask[1] = False  # query 1 sees nothing: its output row is 0, its gradients 0
    mask[2, 0] = False
    inputs = {**qkv(), "attn_mask": mask}
    _, _, result = check("Attention", inputs, ["Q", "K", "V"])
    assert np.all(result.ad["Q"][:, :, 1] == 0)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_attention_3d(hq, hkv):
    d = 2
    inputs = {"Q": f32(2, 3, hq * d), "K": f32(2, 4, hkv * d), "V": f32(2, 4, hkv * 3)}
    check("Attention", inputs, ["Q", "K", "V"], q_num_heads=hq, kv_num_heads=hkv, is_causal=1)


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_past_kv(causal):
    inputs = {**qkv(skv=2), "attn_mask": f32(3, 5), "past_key": f32(2, 2, 3, 4), "past_value": f32(2, 2, 3, 4)}
    check("Attention", inputs, list(inputs), n_outputs=3, is_causal=causal)


def test_attention_past_kv_3d_grouped():
    inputs = {"Q": f32(2, 2, 8), "K": f32(2, 2, 2), "V": f32(2, 2, 2),
              "": None, "past_key": f32(2, 1, 3, 2), "past_value": f32(2, 1, 3, 2)}
    check("Attention", inputs, ["Q", "K", "V", "past_key", "past_value"], n_outputs=3,
          q_num_heads=4, kv_num_heads=1, is_causal=1)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_output(mode):
    """Every output carries a gradient (the oracle sums ⟨out_k, r_k⟩ over all four)."""
    inputs = {**qkv(4, 2), "attn_mask": f32(3, 4)}
    check("Attention", inputs, ["Q", "K", "V", "attn_mask"], n_outputs=4, qk_matmul_output_mode=mode,
          softcap=2.5)


def test_attention_symbolic_batch():
    inputs = {**qkv(), "attn_mask": f32(1, 1, 3, 4)}
    shapes = {"Q": ["N", 2, 3, 4], "K": ["N", 2, 4, 4], "V": ["N", 2, 4, 4]}
    check("Attention", inputs, ["Q", "K", "V", "attn_mask"], shapes=shapes, is_causal=1)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_attention_3d_symbolic_sequences(hq, hkv):
    """Sequence lengths symbolic, hidden sizes static, as exporters declare them: onnx's inference
    gives the recomputed probabilities the key extent 0, which the rule must not carry into its
    reshapes (onnxruntime refused the backward graph)."""
    inputs = {"Q": f32(2, 3, hq * 2), "K": f32(2, 4, hkv * 2), "V": f32(2, 4, hkv * 3), "attn_mask": f32(3, 4)}
    shapes = {"Q": ["N", "S", hq * 2], "K": ["N", "T", hkv * 2], "V": ["N", "T", hkv * 3], "attn_mask": ["S", "T"]}
    check("Attention", inputs, list(inputs), shapes=shapes, q_num_heads=hq, kv_num_heads=hkv, softcap=2.0)


def test_attention_past_kv_symbolic_sequences():
    """Past and new key lengths symbolic, grouped heads: the probabilities' key extent is computed."""
    inputs = {**qkv(4, 2, skv=2), "attn_mask": f32(3, 5), "past_key": f32(2, 2, 3, 4), "past_value": f32(2, 2, 3, 4)}
    shapes = {"Q": ["N", 4, "S", 4], "K": ["N", 2, "T", 4], "V": ["N", 2, "T", 4], "attn_mask": ["S", "P"],
              "past_key": ["N", 2, "R", 4], "past_value": ["N", 2, "R", 4]}
    check("Attention", inputs, list(inputs), n_outputs=3, shapes=shapes, is_causal=1)


def test_attention_unknown_head_size():
    """Without a scale attribute and with a symbolic head size, scale = 1/sqrt(D) is computed at run time."""
    inputs = qkv()
    shapes = {"Q": [2, 2, 3, "D"], "K": [2, 2, 4, "D"], "V": [2, 2, 4, 4]}
    check("Attention", inputs, ["Q", "K", "V"], shapes=shapes)


def test_attention_opset24_nonpad():
    """nonpad_kv_seqlen (opset 24) hides the padded keys: they get zero gradient."""
    from onnx import helper

    from helpers import make_model

    inputs = qkv(skv=5)
    node = helper.make_node("Attention", ["Q", "K", "V", "", "", "", "nonpad"], ["out0"])
    feeds = {**inputs, "nonpad": np.array([3, 5], np.int64)}
    model = make_model([node], feeds, ["out0"], opset=24)
    result = assert_gradients(model, feeds, ["Q", "K", "V"])
    assert np.all(result.ad["K"][0, :, 3:] == 0) and np.any(result.ad["K"][1, :, 3:] != 0)
    proto, autodiff = backward_model(model, "out0", ["Q", "K", "V"], seed="input")
    _session(proto).run(None, {**feeds, autodiff.seed_name: np.ones((2, 2, 3, 4), np.float32)})


@pytest.mark.parametrize("window", [{"left_window_size": 1}, {"left_window_size": 2, "right_window_size": 0}])
def test_attention_opset25_sliding_window(window):
    inputs = {**qkv(), "attn_mask": f32(3, 4)}
    check("Attention", inputs, ["Q", "K", "V", "attn_mask"], opset=25, softcap=2.0, **window)


def test_attention_against_torch():
    torch = pytest.importorskip("torch")
    inputs = {**qkv(4, 2, sq=4, skv=4), "attn_mask": f32(4, 4)}
    model = op_model("Attention", inputs, opset=23, softcap=0.0, scale=0.4, is_causal=1)
    proto, autodiff = backward_model(model, "out0", list(inputs), seed="input")
    seed = f32(2, 4, 4, 4)
    outs = _session(proto).run(None, {**inputs, autodiff.seed_name: seed})
    got = dict(zip([o.name for o in proto.graph.output], outs))
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items()}
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    bias = t["attn_mask"].masked_fill(~causal, float("-inf"))
    y = torch.nn.functional.scaled_dot_product_attention(
        t["Q"], t["K"], t["V"], attn_mask=bias, scale=0.4, enable_gqa=True)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    for k in inputs:
        np.testing.assert_allclose(got[autodiff.gradient_names[k]], t[k].grad.numpy(), rtol=1e-4, atol=1e-4)


def test_attention_unknown_rank_is_refused():
    inputs = qkv()
    model = op_model("Attention", inputs, opset=23)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    with pytest.raises(RuleError, match="rank 3 or 4"):
        backward_model(model, "out0", ["Q"], seed="input")


# RotaryEmbedding: float only (no double kernel or schema type), so besides the float32
# finite-difference check the gradients are compared with PyTorch autograd of the spec's algorithm.

def rope_torch(torch, x, cos, sin, pos, interleaved, rd, num_heads):
    shape = x.shape
    if x.dim() == 4:
        x = x.permute(0, 2, 1, 3)
    else:
        x = x.reshape(shape[0], shape[1], num_heads, -1)
    rd = rd or x.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rot = torch.stack((real, imag), -1).reshape(rot.shape) if interleaved else torch.cat((real, imag), -1)
    out = torch.cat((rot, rest), -1)
    return out.reshape(shape) if len(shape) == 3 else out.permute(0, 2, 1, 3)


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rd", [0, 4])
@pytest.mark.parametrize("with_pos", [True, False])
def test_rotary_embedding(rank, interleaved, rd, with_pos):
    torch = pytest.importorskip("torch")
    b, s, h, d = 2, 3, 2, 6 if rd else 4
    half = (rd or d) // 2
    x = f32(b, h, s, d) if rank == 4 else f32(b, s, h * d)
    if with_pos:
        pos = np.array([[0, 2, 2], [4, 1, 0]], np.int64)  # repeats: the scatter must add
        cos, sin = f32(5, half), f32(5, half)
        inputs = {"X": x, "cos_cache": cos, "sin_cache": sin, "position_ids": pos}
    else:
        cos, sin = f32(b, s, half), f32(b, s, half)
        inputs = {"X": x, "cos_cache": cos, "sin_cache": sin}
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rd}
    if rank == 3:
        attrs["num_heads"] = h
    wrt = ["X", "cos_cache", "sin_cache"]
    model, feeds, result = check("RotaryEmbedding", inputs, wrt, **attrs)
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    seed = f32(*x.shape)
    outs = dict(zip([o.name for o in proto.graph.output], _session(proto).run(None, {**feeds, autodiff.seed_name: seed})))
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items() if k in wrt}
    y = rope_torch(torch, t["X"], t["cos_cache"], t["sin_cache"], torch.tensor(pos) if with_pos else None,
                   interleaved, rd, h)
    np.testing.assert_allclose(y.detach().numpy(), outs["out0"], rtol=1e-5, atol=1e-5)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    for k in wrt:
        np.testing.assert_allclose(outs[autodiff.gradient_names[k]], t[k].grad.numpy(), rtol=1e-4, atol=1e-4)


def test_rotary_embedding_symbolic_batch():
    x = f32(2, 3, 8)
    inputs = {"X": x, "cos_cache": f32(4, 2), "sin_cache": f32(4, 2),
              "position_ids": np.array([[0, 1, 2], [1, 2, 3]], np.int64)}
    shapes = {"X": ["N", "S", 8], "position_ids": ["N", "S"]}
    check("RotaryEmbedding", inputs, ["X", "cos_cache", "sin_cache"], shapes=shapes, num_heads=2)


# Regressions found by the conformance runner on the ONNX backend cases.

def test_attention_qk_output_mode2_masked_scores_are_constant():
    """Mode 2 returns the biased scores; where the causal mask hides a key onnxruntime writes the
    dtype's lowest value (-inf in the spec), a constant: no gradient flows back from there."""
    inputs = {**qkv(skv=2), "attn_mask": f32(2, 1, 3, 5), "past_key": f32(2, 2, 3, 4),
              "past_value": f32(2, 2, 3, 4)}
    _, _, result = check("Attention", inputs, list(inputs), n_outputs=4, is_causal=1,
                         qk_matmul_output_mode=2)
    assert np.all(result.ad["attn_mask"][..., 0, 4] == 0)  # query 0 sees keys j <= 0 + 3 (past)


def _forward_free_backward(model, wrt):
    """The backward graph without the forward node, for a forward onnxruntime refuses."""
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    graph = proto.graph
    forward = [n for n in graph.node if "out0" in n.output]
    assert not any("out0" in n.input for n in graph.node), "the backward graph reads Y"
    graph.node.remove(forward[0])
    keep = [o for o in graph.output if o.name != "out0"]
    del graph.output[:]
    graph.output.extend(keep)
    return proto, autodiff


def test_attention_short_mask_is_padded():
    """A mask shorter than the keys counts as padded with -inf (onnx reference); onnxruntime
    refuses such a mask (in the forward node too), so the recomputed probabilities get a padded
    one. Checked against PyTorch without the forward node."""
    torch = pytest.importorskip("torch")
    from onnx import helper

    from helpers import make_model

    inputs = {**qkv(skv=6), "attn_mask": f32(2, 2, 3, 4)}
    nonpad = np.array([3, 5], np.int64)
    node = helper.make_node("Attention", ["Q", "K", "V", "attn_mask", "", "", "nonpad"], ["out0"])
    model = make_model([node], {**inputs, "nonpad": nonpad}, ["out0"], opset=24)
    proto, autodiff = _forward_free_backward(model, list(inputs))
    seed = f32(2, 2, 3, 4)
    got = _session(proto).run([autodiff.gradient_names[x] for x in inputs],
                              {**inputs, "nonpad": nonpad, autodiff.seed_name: seed})
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items()}
    bias = torch.cat([t["attn_mask"], torch.full((2, 2, 3, 2), float("-inf"), dtype=torch.float64)], -1)
    bias = bias.masked_fill(torch.arange(6) >= torch.tensor(nonpad)[:, None, None, None], float("-inf"))
    y = torch.nn.functional.scaled_dot_product_attention(t["Q"], t["K"], t["V"], attn_mask=bias)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    for g, k in zip(got, inputs):
        np.testing.assert_allclose(g, t[k].grad.numpy(), rtol=1e-4, atol=1e-5)
    assert np.all(got[1][:, :, 4:] == 0) and np.any(got[1][:, :, :4] != 0)  # keys 4, 5: padded away


@pytest.mark.parametrize("mask_shape", [(1, 6), (2, 1, 3, 6)])
def test_attention_opset25_nonpad_with_window(mask_shape):
    """nonpad_kv_seqlen forbids present_* outputs: the recomputing node must leave them out."""
    from onnx import helper

    from helpers import make_model

    inputs = {**qkv(skv=6), "attn_mask": f32(*mask_shape), "nonpad": np.array([4, 6], np.int64)}
    node = helper.make_node("Attention", ["Q", "K", "V", "attn_mask", "", "", "nonpad"], ["out0"],
                            is_causal=1, left_window_size=2)
    model = make_model([node], inputs, ["out0"], opset=25)
    wrt = ["Q", "K", "V", "attn_mask"]
    assert_gradients(model, inputs, wrt)
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    _session(proto).run(None, {**inputs, autodiff.seed_name: np.ones((2, 2, 3, 4), np.float32)})


# FlexAttention (ai.onnx.preview 1): onnxruntime has no kernel for the forward op, so the
# finite-difference check runs the model on the reference evaluator (float64), and the backward
# graph without the forward node runs on onnxruntime against PyTorch float64 autograd.

def _mod_graph(name, build):
    """A modifier subgraph (x) -> y of float[B, H, L, S]; ``build`` returns (nodes, initializers)."""
    from onnx import TensorProto, helper

    nodes, inits = build()
    info = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "H", "L", "S"])
    return helper.make_graph(nodes, name, [info("x")], [info("y")], initializer=inits)


def _soft_cap():
    from onnx import helper, numpy_helper

    cap = numpy_helper.from_array(np.array(2.0, np.float32), "cap")
    return [helper.make_node("Div", ["x", "cap"], ["s"]), helper.make_node("Tanh", ["s"], ["t"]),
            helper.make_node("Mul", ["t", "cap"], ["y"])], [cap]


def _causal():
    """Future keys masked with -inf, positions from the scores' own shape (as in the backend data)."""
    from onnx import helper, numpy_helper

    c = lambda n, v: numpy_helper.from_array(np.array(v, np.int64 if n != "ninf" else np.float32), n)
    inits = [c("zero", 0), c("one", 1), c("two", [2]), c("three", [3]), c("qs", [-1, 1]), c("ninf", -np.inf)]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["L1"]), helper.make_node("Squeeze", ["L1"], ["L"]),
        helper.make_node("Gather", ["shape", "three"], ["S1"]), helper.make_node("Squeeze", ["S1"], ["S"]),
        helper.make_node("Range", ["zero", "L", "one"], ["qr"]), helper.make_node("Reshape", ["qr", "qs"], ["q"]),
        helper.make_node("Range", ["zero", "S", "one"], ["k"]),
        helper.make_node("GreaterOrEqual", ["q", "k"], ["mask"]),
        helper.make_node("Where", ["mask", "x", "ninf"], ["y"]),
    ]
    return nodes, inits


def _prob_scale():
    from onnx import helper, numpy_helper

    return [helper.make_node("Mul", ["x", "half"], ["y"])], [numpy_helper.from_array(np.array(0.5, np.float32), "half")]


_MODS = {
    "soft_cap": ("score_mod", _soft_cap, lambda torch, s: 2.0 * torch.tanh(s / 2.0)),
    "causal": ("score_mod", _causal,
               lambda torch, s: s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))),
    "prob_scale": ("prob_mod", _prob_scale, lambda torch, p: 0.5 * p),
}


def flex_model(inputs, shapes=None, **attrs):
    from onnx import helper

    from helpers import make_model

    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["out0"], domain="ai.onnx.preview", **attrs)
    return make_model([node], inputs, ["out0"], opset=26, shapes=shapes, extra_opsets={"ai.onnx.preview": 1})


def flex_torch(torch, Q, K, V, scale=None, score_mod=None, prob_mod=None):
    group = Q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
    s = Q @ K.transpose(-1, -2) * (scale if scale is not None else Q.shape[-1] ** -0.5)
    p = torch.softmax(score_mod(torch, s) if score_mod else s, -1)
    return (prob_mod(torch, p) if prob_mod else p) @ V


@pytest.mark.parametrize(
    "dims,attrs,mods",
    [
        ((2, 2, 3, 4, 4, 4), {}, ()),
        ((2, 2, 3, 4, 4, 4), {"scale": 0.3}, ()),
        ((1, 4, 3, 5, 4, 4), {}, ()),            # grouped query heads (Hkv = 2)
        ((1, 4, 3, 5, 4, 3), {}, ("soft_cap",)),  # value head size 3; Hkv = 1
        ((2, 2, 4, 4, 3, 3), {}, ("causal",)),
        ((1, 2, 3, 4, 3, 3), {"scale": 0.8}, ("soft_cap", "prob_scale")),
    ],
)
def test_flex_attention(dims, attrs, mods):
    torch = pytest.importorskip("torch")
    b, hq, sq, skv, d, dv = dims
    hkv = {(1, 4, 3, 5, 4, 4): 2, (1, 4, 3, 5, 4, 3): 1}.get(dims, hq)
    inputs = {"Q": f32(b, hq, sq, d), "K": f32(b, hkv, skv, d), "V": f32(b, hkv, skv, dv)}
    graphs = {_MODS[m][0]: _mod_graph(m, _MODS[m][1]) for m in mods}
    model = flex_model(inputs, **attrs, **graphs)
    result = assert_gradients(model, inputs, list(inputs), ad_backends=("onnxruntime", "reference"))
    assert result.backend.startswith("reference") and not result.weak

    proto, autodiff = _forward_free_backward(model, list(inputs))
    seed = f32(b, hq, sq, dv)
    got = _session(proto).run([autodiff.gradient_names[x] for x in inputs], {**inputs, autodiff.seed_name: seed})
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items()}
    fns = {_MODS[m][0]: _MODS[m][2] for m in mods}
    flex_torch(torch, **t, scale=attrs.get("scale"), **fns).backward(torch.tensor(seed, dtype=torch.float64))
    for g, k in zip(got, inputs):
        np.testing.assert_allclose(g, t[k].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


def test_flex_attention_symbolic_shapes():
    """Batch, sequence lengths and head size symbolic: one graph, scale 1/sqrt(D) found at run time."""
    torch = pytest.importorskip("torch")
    shapes = {"Q": ["N", 4, "L", "D"], "K": ["N", 2, "S", "D"], "V": ["N", 2, "S", 3]}
    inputs = {"Q": f32(2, 4, 3, 4), "K": f32(2, 2, 5, 4), "V": f32(2, 2, 5, 3)}
    model = flex_model(inputs, shapes=shapes, score_mod=_mod_graph("causal", _causal))
    proto, autodiff = _forward_free_backward(model, list(inputs))
    session = _session(proto)
    for b, sq, skv, d in ((2, 3, 5, 4), (1, 4, 4, 2)):
        feeds = {"Q": f32(b, 4, sq, d), "K": f32(b, 2, skv, d), "V": f32(b, 2, skv, 3)}
        seed = f32(b, 4, sq, 3)
        got = session.run([autodiff.gradient_names[x] for x in feeds], {**feeds, autodiff.seed_name: seed})
        t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
        flex_torch(torch, **t, score_mod=_MODS["causal"][2]).backward(torch.tensor(seed, dtype=torch.float64))
        for g, k in zip(got, feeds):
            np.testing.assert_allclose(g, t[k].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_flex_attention_dtypes(dtype):
    """float64 computes in float64; float16 computes its softmax in float32 (the default precision)."""
    inputs = {k: v.astype(dtype) for k, v in qkv().items()}
    model = flex_model(inputs, prob_mod=_mod_graph("prob_scale", _prob_scale)) if dtype == np.float16 else flex_model(inputs)
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == np.float16 else {"atol": 1e-6, "rtol": 1e-5}
    result = assert_gradients(model, inputs, list(inputs), ad_backends=("onnxruntime", "reference"), **tolerance)
    assert all(result.ad[k].dtype == dtype for k in inputs)
