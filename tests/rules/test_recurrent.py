"""RNN, GRU, LSTM: the decomposition against onnxruntime's kernels, the VJP against float64 central
differences of an independent numpy forward (the reference evaluator ignores activations, clip,
input_forget and sequence_lens, and onnxruntime has no float64 kernels)."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, make_model, rng
from onnx_autodiff.conformance.check import LOSS, backward_model, scalarize
from onnx_autodiff.errors import AutodiffError
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.rules.recurrent import decompose

T, N, I, H = 3, 2, 3, 2
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
OUTPUTS = {"RNN": ("Y", "Y_h"), "GRU": ("Y", "Y_h"), "LSTM": ("Y", "Y_h", "Y_c")}
DEFAULTS = {"RNN": ["tanh"], "GRU": ["sigmoid", "tanh"], "LSTM": ["sigmoid", "tanh", "tanh"]}
PARAMS = {"leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None), "elu": (1.0, None),
          "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "affine": (1.0, 0.0)}


# ----------------------------------------------------------------------------- numpy forward


def np_activation(name, alpha, beta, x):
    return {
        "sigmoid": lambda: 1 / (1 + np.exp(-x)),
        "tanh": lambda: np.tanh(x),
        "relu": lambda: np.maximum(x, 0),
        "leakyrelu": lambda: np.where(x >= 0, x, alpha * x),
        "thresholdedrelu": lambda: np.where(x > alpha, x, 0),
        "elu": lambda: np.where(x >= 0, x, alpha * (np.exp(x) - 1)),
        "scaledtanh": lambda: alpha * np.tanh(beta * x),
        "hardsigmoid": lambda: np.clip(alpha * x + beta, 0, 1),
        "affine": lambda: alpha * x + beta,
        "softsign": lambda: x / (1 + np.abs(x)),
        "softplus": lambda: np.log1p(np.exp(x)),
    }[name]()


def np_functions(kind, attrs, directions):
    names = [a.lower() for a in attrs.get("activations", DEFAULTS[kind] * directions)]
    alphas, betas = list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", []))
    functions = []
    for name in names:
        alpha, beta = PARAMS.get(name, (None, None))
        alpha = alphas.pop(0) if alpha is not None and alphas else alpha
        beta = betas.pop(0) if beta is not None and betas else beta
        functions.append((name, alpha, beta))
    k = len(DEFAULTS[kind])
    return [functions[d * k:(d + 1) * k] for d in range(directions)]


def np_forward(kind, feeds, attrs):
    """The ONNX spec's equations in float64, one time step at a time."""
    f64 = {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    layout = attrs.get("layout", 0)
    X = f64["X"].transpose(1, 0, 2) if layout else f64["X"]
    W, R = f64["W"], f64["R"]
    D, G = W.shape[0], GATES[kind]
    steps, batch = X.shape[:2]
    B = f64.get("B", np.zeros((D, 2 * G * H)))
    lens = f64.get("sequence_lens", np.full(batch, steps))
    P = f64.get("P", np.zeros((D, 3 * H)))
    states = {}
    for s in ("initial_h", "initial_c"):
        v = f64.get(s, np.zeros((D, batch, H)))
        states[s] = v.transpose(1, 0, 2) if layout and s in f64 else v
    clip = attrs.get("clip")
    functions = np_functions(kind, attrs, D)
    Y = np.zeros((steps, D, batch, H))
    Y_h, Y_c = np.zeros((D, batch, H)), np.zeros((D, batch, H))
    for d in range(D):
        fns = functions[d]

        def act(k, x):
            return np_activation(*fns[k], np.clip(x, -clip, clip) if clip is not None else x)

        reverse = attrs.get("direction", "forward") == "reverse" or d == 1
        Wd, Rd, (wb, rb), (pi, po, pf) = W[d], R[d], np.split(B[d], 2), np.split(P[d], 3)
        h, c = states["initial_h"][d], states["initial_c"][d]
        entries = np.arange(batch)
        for k in range(steps):
            # Entry b runs over t = 0 .. lens[b]-1 (backwards when reverse); done entries hold.
            active = (k < lens)[:, None]
            t = np.clip(lens - 1 - k if reverse else np.full(batch, k), 0, steps - 1)
            gates = X[t, entries] @ Wd.T + wb
            if kind == "RNN":
                h_new, c_new = act(0, gates + h @ Rd.T + rb), c
            elif kind == "GRU":
                zr = act(0, gates[:, :2 * H] + h @ Rd[:2 * H].T + rb[:2 * H])
                z, r = zr[:, :H], zr[:, H:]
                if attrs.get("linear_before_reset", 0):
                    hh = act(1, gates[:, 2 * H:] + r * (h @ Rd[2 * H:].T + rb[2 * H:]))
                else:
                    hh = act(1, gates[:, 2 * H:] + (r * h) @ Rd[2 * H:].T + rb[2 * H:])
                h_new, c_new = (1 - z) * hh + z * h, c
            else:
                g = gates + h @ Rd.T + rb
                i = act(0, g[:, :H] + pi * c)
                f = 1 - i if attrs.get("input_forget", 0) else act(0, g[:, 2 * H:3 * H] + pf * c)
                c_new = f * c + i * act(1, g[:, 3 * H:])
                h_new = act(0, g[:, H:2 * H] + po * c_new) * act(2, c_new)
            Y[t, d, entries] = np.where(active, h_new, Y[t, d, entries])
            h, c = np.where(active, h_new, h), np.where(active, c_new, c)
        Y_h[d], Y_c[d] = h, c
    if layout:
        Y, Y_h, Y_c = Y.transpose(2, 0, 1, 3), Y_h.transpose(1, 0, 2), Y_c.transpose(1, 0, 2)
    return {"Y": Y, "Y_h": Y_h, "Y_c": Y_c}


# ----------------------------------------------------------------------------- models


def make(kind, direction="forward", layout=0, bias=True, initial=True, peepholes=False,
         outputs=None, symbolic=False, seq_lens=None, constant_lens=False, opset=18, seed=0, batch=N,
         **attrs):
    """One ``kind`` node (T=3, batch 2, input 3, hidden 2) over random inputs; returns model, feeds, attrs."""
    r = rng(seed)
    D, G = (2 if direction == "bidirectional" else 1), GATES[kind]

    def rand(*shape, scale=0.6):
        return (r.standard_normal(shape) * scale).astype(np.float32)

    batch_first = (lambda s: (s[1], s[0], *s[2:])) if layout else (lambda s: s)
    feeds = {"X": rand(*batch_first((T, batch, I))), "W": rand(D, G * H, I), "R": rand(D, G * H, H)}
    if bias:
        feeds["B"] = rand(D, 2 * G * H, scale=0.3)
    if seq_lens is not None:
        feeds["sequence_lens"] = np.asarray(seq_lens, np.int32)
    if initial:
        feeds["initial_h"] = rand(*batch_first((D, batch, H)))
        if kind == "LSTM":
            feeds["initial_c"] = rand(*batch_first((D, batch, H)))
    if peepholes:
        feeds["P"] = rand(D, 3 * H)
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h"] + (["initial_c", "P"] if kind == "LSTM" else [])
    names = [n if n in feeds else "" for n in order]
    while names[-1] == "":
        names.pop()
    outputs = outputs or OUTPUTS[kind]
    node_outputs = [o if o in outputs else "" for o in OUTPUTS[kind]]
    while node_outputs[-1] == "":
        node_outputs.pop()
    attrs = dict(attrs, direction=direction, hidden_size=H)
    if layout:
        attrs["layout"] = layout
    node = helper.make_node(kind, names, node_outputs, **attrs)
    shapes = {}
    if symbolic:
        shapes = {k: list(v.shape) for k, v in feeds.items() if k in ("X", "initial_h", "initial_c")}
        for k in shapes:
            shapes[k][0 if layout else 1] = "N"
    out_shapes = {"Y": batch_first((T, D, batch, H)) if not layout else (batch, T, D, H),
                  "Y_h": batch_first((D, batch, H)), "Y_c": batch_first((D, batch, H))}
    batch_axis = {"Y": 0 if layout else 2, "Y_h": 0 if layout else 1, "Y_c": 0 if layout else 1}
    declared = {}
    for o in outputs:
        s = list(out_shapes[o])
        if symbolic:
            s[batch_axis[o]] = "N"
        declared[o] = s
    constants = {"sequence_lens": feeds.pop("sequence_lens")} if constant_lens else None
    model = make_model([node], feeds, list(outputs), shapes=shapes, opset=opset, output_shapes=declared,
                       initializers=constants)
    if constant_lens:
        feeds = dict(feeds, sequence_lens=constants["sequence_lens"])
    return model, feeds, attrs


def session(model):
    return ort.InferenceSession(time_major(model).SerializeToString(), providers=["CPUExecutionProvider"])


def time_major(model):
    """onnxruntime has no layout=1 kernels: such nodes become Transposes around a layout=0 node."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        if node.op_type not in GATES or not any(a.name == "layout" and a.i for a in node.attribute):
            nodes.append(node)
            continue
        inputs, outputs = list(node.input), list(node.output)
        for k in (0, 5, 6):
            if k < len(inputs) and inputs[k]:
                nodes.append(helper.make_node("Transpose", [inputs[k]], [inputs[k] + "_tm"], perm=[1, 0, 2]))
                inputs[k] += "_tm"
        for k, name in enumerate(outputs):
            if name:
                perm = [2, 0, 1, 3] if k == 0 else [1, 0, 2]
                nodes.append(helper.make_node("Transpose", [name + "_tm"], [name], perm=perm))
                outputs[k] += "_tm"
        attrs = [a for a in node.attribute if a.name != "layout"]
        del node.attribute[:]
        node.attribute.extend(attrs)
        node.input[:], node.output[:] = inputs, outputs
        nodes.insert(len(nodes) - sum(1 for o in outputs if o), node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def decomposition_model(model):
    """The model with its recurrent node replaced by the rule's decomposition."""
    graph = ir.from_proto(model).graph
    node = next(iter(graph))
    op = OpBuilder(model.opset_import[0].version, Namer.for_graph(graph))
    results = decompose(op, node)
    for old, new in zip(node.outputs, results):
        if old.name:
            new.name, new.type, new.shape = old.name + "_decomposed", old.type, old.shape
    graph.extend(op.nodes)
    graph.outputs[:] = [new for old, new in zip(node.outputs, results) if old.name]
    proto = ir.to_proto(graph.model if hasattr(graph, "model") else ir.Model(graph, ir_version=model.ir_version))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def check(kind, *, wrt=None, seed=0, **kw):
    """Forward: numpy == onnxruntime == decomposition; backward (run on onnxruntime) == numpy FD."""
    model, feeds, attrs = make(kind, seed=seed, **kw)
    outputs = [o.name for o in model.graph.output]
    inputs = {i.name: feeds[i.name] for i in model.graph.input}
    expected = np_forward(kind, feeds, attrs)
    actual = session(model).run(None, inputs)
    decomposed = session(decomposition_model(model)).run(None, inputs)
    for name, a, d in zip(outputs, actual, decomposed):
        np.testing.assert_allclose(a, expected[name], atol=2e-5, err_msg=f"onnxruntime {name}")
        np.testing.assert_allclose(d, a, atol=2e-5, err_msg=f"decomposition {name}")

    r = rng(seed + 1)
    cotangents = [r.standard_normal(expected[o].shape).astype(np.float32) for o in outputs]
    wrt = wrt or [k for k in feeds if k != "sequence_lens"]
    backward, autodiff = backward_model(scalarize(model, cotangents), LOSS, wrt)
    named = dict(zip([o.name for o in backward.graph.output], session(backward).run(None, inputs)))

    def loss(point):
        out = np_forward(kind, point, attrs)
        return sum(float(np.sum(out[o] * c)) for o, c in zip(outputs, cotangents))

    base = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    eps = 1e-6
    for x in wrt:
        fd = np.zeros(base[x].shape)
        for index in np.ndindex(fd.shape):
            plus, minus = dict(base), dict(base)
            plus[x], minus[x] = base[x].copy(), base[x].copy()
            plus[x][index] += eps
            minus[x][index] -= eps
            fd[index] = (loss(plus) - loss(minus)) / (2 * eps)
        ad = named[autodiff.gradient_names[x]]
        assert np.any(fd != 0), x
        scale = max(1.0, np.abs(fd).max())
        np.testing.assert_allclose(ad, fd, atol=1e-4 * scale, rtol=1e-3, err_msg=f"d/d{x}")


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_directions(kind, direction):
    check(kind, direction=direction)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_layout_1(kind):
    check(kind, direction="bidirectional", layout=1, seed=1)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_no_bias_no_initial_state(kind):
    check(kind, bias=False, initial=False, seed=2)


@pytest.mark.parametrize("kind,outputs", [("RNN", ["Y"]), ("GRU", ["Y_h"]), ("LSTM", ["Y_c"]), ("LSTM", ["Y_h", "Y_c"])])
def test_subset_of_outputs(kind, outputs):
    check(kind, outputs=outputs, direction="reverse", seed=3)


def test_gru_linear_before_reset():
    check("GRU", linear_before_reset=1, direction="bidirectional", seed=4)
    check("GRU", linear_before_reset=1, bias=False, seed=4)


@pytest.mark.parametrize("peepholes,input_forget", [(True, 0), (False, 1), (True, 1)])
def test_lstm_peepholes_input_forget(peepholes, input_forget):
    check("LSTM", peepholes=peepholes, input_forget=input_forget, direction="bidirectional", seed=5)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_symbolic_batch(kind):
    """The graph built for batch "N" holds for any batch size."""
    for batch in (2, 3):
        check(kind, symbolic=True, direction="bidirectional", peepholes=kind == "LSTM", initial=kind == "GRU",
              batch=batch, seed=6)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_clip(kind):
    check(kind, clip=0.7, seed=7)


ACTIVATIONS = [
    ("RNN", dict(activations=["Relu"])),
    ("RNN", dict(activations=["Sigmoid", "LeakyRelu"], activation_alpha=[0.3], direction="bidirectional")),
    ("GRU", dict(activations=["HardSigmoid", "Elu"], activation_alpha=[0.3, 0.8], activation_beta=[0.4])),
    ("GRU", dict(activations=["Softsign", "Softplus"])),
    ("LSTM", dict(activations=["Sigmoid", "ScaledTanh", "Affine"], activation_alpha=[1.2, 0.7],
                  activation_beta=[0.9, 0.1])),
    ("LSTM", dict(activations=["HardSigmoid", "Tanh", "ThresholdedRelu"], activation_alpha=[0.25, 0.05],
                  activation_beta=[0.45])),
]


@pytest.mark.parametrize("kind,attrs", ACTIVATIONS)
def test_activations(kind, attrs):
    check(kind, seed=8, **attrs)


@pytest.mark.parametrize("kind,direction", [("RNN", "forward"), ("GRU", "reverse"), ("LSTM", "bidirectional")])
def test_sequence_lens(kind, direction):
    check(kind, direction=direction, seq_lens=[3, 2], seed=9)


def test_sequence_lens_full_length():
    model, _, _ = make("LSTM", seq_lens=[3, 3], constant_lens=True, outputs=["Y"], seed=10)
    backward, _ = backward_model(model, "Y", ["W"])
    assert not any(n.op_type == "Less" for n in backward.graph.node), "a constant full length needs no mask"
    check("LSTM", seq_lens=[3, 3], constant_lens=True, direction="reverse", seed=10)


def test_layout_1_sequence_lens_symbolic_batch():
    check("GRU", layout=1, seq_lens=[1, 3], symbolic=True, direction="bidirectional", seed=11)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_project_oracle_defaults(kind):
    """The project's oracle (reference evaluator, float64) agrees on the default variants."""
    model, feeds, _ = make(kind, direction="bidirectional", peepholes=kind == "LSTM", seed=12)
    result = assert_gradients(model, feeds, list(feeds))
    assert not result.weak


def test_opset_14_and_10():
    check("LSTM", opset=14, layout=1, seed=13)
    check("GRU", opset=10, clip=0.7, seed=13)


def test_refusals():
    model, _, _ = make("RNN", seed=14, opset=9)
    with pytest.raises(AutodiffError, match="opset 10"):
        backward_model(model, "Y", ["W"])
    model, _, _ = make("GRU", seed=14, activations=["Sigmoid", "Gelu"])
    with pytest.raises(AutodiffError, match="unsupported GRU activation 'Gelu'"):
        backward_model(model, "Y", ["W"])
