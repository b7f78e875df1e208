"""Recurrent layers: RNN, GRU and LSTM.

The backward of each is the VJP of its decomposition into standard ops: the input projection of
every time step at once, then a Scan over time whose body is one cell step (the recurrent
weights, biases and peepholes are outer-scope values the body reads), per direction. The
decomposition follows the ONNX spec (gate order RNN: i; GRU: z, r, h; LSTM: i, o, f, c; clip on
the input of every activation; steps past a batch entry's ``sequence_lens`` keep its state and
output zeros, a reverse direction running backwards from that entry's last step). The Scan rule
(control_flow.py) then does the real work, so these rules only build the forward again.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import FLOAT_TYPES, infer_node_shapes, shapes


_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTIVATIONS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
# Lower-cased name -> defaults of the (alpha, beta) it takes (None: takes none), as onnxruntime.
_ACTIVATION_PARAMS = {
    "sigmoid": (None, None), "tanh": (None, None), "relu": (None, None), "softsign": (None, None),
    "softplus": (None, None), "leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None),
    "elu": (1.0, None), "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "affine": (1.0, 0.0),
}


def _activations(node, per_direction: int, directions: int):
    """[(name, alpha, beta)] per direction; alphas and betas are consumed by the functions taking them."""
    names = shapes.attr(node, "activations", None) or list(_DEFAULT_ACTIVATIONS[node.op_type]) * directions
    if len(names) != per_direction * directions:
        raise RuleError(
            f"{node.op_type} needs {per_direction * directions} activations, the node lists {len(names)}"
        )
    alphas = list(shapes.attr(node, "activation_alpha", []) or [])
    betas = list(shapes.attr(node, "activation_beta", []) or [])
    result = []
    for name in names:
        if name.lower() not in _ACTIVATION_PARAMS:
            raise RuleError(f"unsupported {node.op_type} activation {name!r}")
        alpha, beta = _ACTIVATION_PARAMS[name.lower()]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        result.append((name.lower(), alpha, beta))
    return [result[d * per_direction:(d + 1) * per_direction] for d in range(directions)]


def _activate(op, function, x, clip):
    name, alpha, beta = function
    if clip is not None:
        x = op.clip(x, -clip, clip)
    if name in ("sigmoid", "tanh", "relu", "softsign", "softplus"):
        return op.emit({"softsign": "Softsign", "softplus": "Softplus"}.get(name, name.capitalize()), x)
    if name == "leakyrelu":
        return op.LeakyRelu(x, alpha=alpha)
    if name == "elu":
        return op.Elu(x, alpha=alpha)
    if name == "hardsigmoid":
        return op.HardSigmoid(x, alpha=alpha, beta=beta)
    if name == "thresholdedrelu":
        return op.Mul(x, op.Cast(op.Greater(x, alpha), to=int(x.dtype)))
    if name == "scaledtanh":
        return op.Mul(op.Tanh(op.Mul(x, beta)), alpha)
    return op.Add(op.Mul(x, alpha), beta)  # affine


def _input(node, index):
    return node.inputs[index] if len(node.inputs) > index and node.inputs[index] is not None else None


def _per_direction(op, value, directions):
    """[value[d] for each direction d] (by Split and Squeeze, whose templates need no dtype)."""
    if value is None:
        return [None] * directions
    parts = op.split(value, [1] * directions, axis=0) if directions > 1 else (value,)
    return [op.squeeze(p, [0]) for p in parts]


def _sequence_lens(node, steps):
    """The sequence_lens input, or None when absent or provably the full length everywhere."""
    lens = _input(node, 4)
    if lens is None:
        return None
    constant = shapes.constant(lens)
    if constant is not None and isinstance(steps, int) and np.all(constant == steps):
        return None
    return lens


def _cell(op, kind, h, c, xw, mask, weights, functions, clip, hidden, node):
    """One time step: (h', c', y) from the state, the projected input and the recurrent weights."""
    Rt, rb_h, P = weights["Rt"], weights.get("rb_h"), weights.get("P")
    f = functions[0]
    if kind == "RNN":
        h_new, c_new = _activate(op, f, op.Add(xw, op.MatMul(h, Rt)), clip), None
    elif kind == "GRU":
        g = functions[1]
        xw_zr, xw_h = op.split(xw, [2 * hidden, hidden], axis=1)
        Rt_zr, Rt_h = Rt
        zr = op.Add(xw_zr, op.MatMul(h, Rt_zr))
        z, r = op.split(_activate(op, f, zr, clip), [hidden, hidden], axis=1)
        if shapes.attr(node, "linear_before_reset", 0):
            recurrent = op.MatMul(h, Rt_h)
            if rb_h is not None:
                recurrent = op.Add(recurrent, rb_h)
            candidate = op.Add(xw_h, op.Mul(r, recurrent))
        else:
            candidate = op.Add(xw_h, op.MatMul(op.Mul(r, h), Rt_h))
        hh = _activate(op, g, candidate, clip)
        h_new, c_new = op.Add(hh, op.Mul(z, op.Sub(h, hh))), None  # (1 - z)·hh + z·h
    else:
        g, act_h = functions[1], functions[2]
        gates = op.Add(xw, op.MatMul(h, Rt))
        i, o, fg, cc = op.split(gates, [hidden] * 4, axis=1)
        if P is not None:
            p_i, p_o, p_f = op.split(P, [hidden] * 3, axis=0)
            i, fg = op.Add(i, op.Mul(p_i, c)), op.Add(fg, op.Mul(p_f, c))
        i = _activate(op, f, i, clip)
        fg = op.Sub(1.0, i) if shapes.attr(node, "input_forget", 0) else _activate(op, f, fg, clip)
        c_new = op.Add(op.Mul(fg, c), op.Mul(i, _activate(op, g, cc, clip)))
        if P is not None:
            o = op.Add(o, op.Mul(p_o, c_new))
        h_new = op.Mul(_activate(op, f, o, clip), _activate(op, act_h, c_new, clip))
    y = h_new
    if mask is not None:
        y = op.Where(mask, h_new, op.const(0.0, dtype=h_new.dtype))
        h_new = op.Where(mask, h_new, h)
        c_new = None if c is None else op.Where(mask, c_new, c)
    return h_new, c_new, y


def decompose(op, node):
    """Emits ``node`` (RNN, GRU or LSTM) in standard ops; returns (Y, Y_h, Y_c), Y_c None but for LSTM."""
    kind, start = node.op_type, len(op.nodes)
    if op.opset < 10:
        raise RuleError(f"the {kind} gradient is built from Scan-9 and ReverseSequence: "
                        "convert the model to opset 10 or later")
    X, W, R = node.inputs[:3]
    dtype = X.dtype if X.dtype in FLOAT_TYPES else ir.DataType.FLOAT
    B, h0 = _input(node, 3), _input(node, 5)
    c0, P = (_input(node, 6), _input(node, 7)) if kind == "LSTM" else (None, None)
    gates = _GATES[kind]
    hidden = shapes.attr(node, "hidden_size", None)
    r_shape = shapes.dims(R)
    if hidden is None and r_shape is not None and isinstance(r_shape[-1], int):
        hidden = r_shape[-1]
    if hidden is None:
        raise RuleError(f"{kind} needs hidden_size or a static shape of R")
    direction = shapes.attr(node, "direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise RuleError(f"unknown {kind} direction {direction!r}")
    directions = 2 if direction == "bidirectional" else 1
    functions = _activations(node, len(_DEFAULT_ACTIVATIONS[kind]), directions)
    clip = shapes.attr(node, "clip", None)
    layout = shapes.attr(node, "layout", 0)
    steps, batch = (shapes.dims(X) or (None, None, None))[:2][::-1 if layout else 1]
    if layout:
        X, h0, c0 = (None if v is None else op.Transpose(v, perm=[1, 0, 2]) for v in (X, h0, c0))
    lens = _sequence_lens(node, steps)
    mask = None
    if lens is not None:
        if isinstance(steps, int):
            t = op.const(np.arange(steps, dtype=np.int64))
        elif op.opset >= 11:
            zero, one = op.const(np.array(0, np.int64)), op.const(np.array(1, np.int64))
            t = op.Range(zero, op.Gather(op.Shape(X), zero), one)
        else:
            shapes.require_opset(op, 11, f"{kind} with sequence_lens and a symbolic sequence length")
        # mask[t, b, 0]: step t lies within entry b's sequence.
        lens = op.Cast(lens, to=int(ir.DataType.INT64))
        mask = op.unsqueeze(op.Less(op.unsqueeze(t, [1]), op.unsqueeze(lens, [0])), [2])
    state_type = dict(type=ir.TensorType(dtype), shape=ir.Shape([batch, hidden]))

    def zero_state():
        shape = op.Concat(op.Slice(op.Shape(X), [1], [2], [0]), op.const(np.array([hidden], np.int64)), axis=0)
        return op.Expand(op.const(0.0, dtype=dtype), shape)

    Ws, Rs, Bs, Ps, h0s, c0s = (_per_direction(op, v, directions) for v in (W, R, B, P, h0, c0))
    ys, hs, cs = [], [], []
    for d in range(directions):
        reverse = direction == "reverse" or d == 1
        xw = op.MatMul(X, op.Transpose(Ws[d], perm=[1, 0]))
        Rt = op.Transpose(Rs[d], perm=[1, 0])
        weights = {"Rt": op.split(Rt, [2 * hidden, hidden], axis=1) if kind == "GRU" else Rt}
        if B is not None:
            wb, rb = op.split(Bs[d], [gates * hidden] * 2, axis=0)
            if kind == "GRU" and shapes.attr(node, "linear_before_reset", 0):
                # Rb_h acts inside the reset gate's product; the other biases add to the input.
                weights["rb_h"] = op.Slice(rb, [2 * hidden], [3 * hidden], [0])
                rb = op.Mul(rb, op.const(np.repeat([1, 1, 0], hidden), dtype=dtype))
            xw = op.Add(xw, op.Add(wb, rb))
        if P is not None:
            weights["P"] = Ps[d]
        if reverse and lens is not None:
            # Each entry runs backwards from its own last step: reverse within the lengths.
            xw = op.ReverseSequence(xw, lens, batch_axis=1, time_axis=0)
        states = [zero_state() if v is None else v for v in ((h0s[d], c0s[d]) if kind == "LSTM" else (h0s[d],))]

        body = op.child()
        body_states = [ir.Value(name=op.namer.fresh(), **state_type) for _ in states]
        xw_t = ir.Value(name=op.namer.fresh(), type=ir.TensorType(dtype), shape=ir.Shape([batch, gates * hidden]))
        body_inputs = [*body_states, xw_t]
        m_t = None
        if mask is not None:
            bool_type = ir.TensorType(ir.DataType.BOOL)
            m_t = ir.Value(name=op.namer.fresh(), type=bool_type, shape=ir.Shape([batch, 1]))
            body_inputs.append(m_t)
        # The Scan rule rebinds the body's inputs to values of unknown shape: pass them through
        # Identity nodes, which keep their shapes, for the templates needing ranks.
        h, *rest = [body.Identity(v) for v in body_inputs]
        c = rest.pop(0) if kind == "LSTM" else None
        h_new, c_new, y = _cell(body, kind, h, c, rest[0], m_t, weights, functions[d], clip, hidden, node)
        outputs = [h_new, *([c_new] if kind == "LSTM" else []), y]
        graph = body.graph(body_inputs, outputs, name=f"{kind.lower()}_step")
        scanned = [xw] + ([mask] if mask is not None else [])
        backwards = int(reverse and lens is None)
        results = op.Scan(*states, *scanned, body=graph, num_scan_inputs=len(scanned),
                          scan_input_directions=[backwards] * len(scanned),
                          scan_output_directions=[backwards], _outputs=len(outputs))
        for value in results:
            value.dtype = dtype
        y_seq = results[-1]
        if reverse and lens is not None:
            y_seq = op.ReverseSequence(y_seq, lens, batch_axis=1, time_axis=0)
        ys.append(op.unsqueeze(y_seq, [1]))
        hs.append(op.unsqueeze(results[0], [0]))
        if kind == "LSTM":
            cs.append(op.unsqueeze(results[1], [0]))

    def join(parts, axis):
        return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=axis)

    Y, Y_h, Y_c = join(ys, 1), join(hs, 0), (join(cs, 0) if cs else None)
    if layout:
        Y = op.Transpose(Y, perm=[2, 0, 1, 3])
        Y_h, Y_c = (None if v is None else op.Transpose(v, perm=[1, 0, 2]) for v in (Y_h, Y_c))
    infer_node_shapes(op.nodes[start:], [v for v in node.inputs if v is not None], op.opset)
    return Y, Y_h, Y_c


def _vjp(op, node, dYs):
    """The VJP of the node's decomposition for the outputs that carry gradients."""
    fwd = op.child()
    outputs = decompose(fwd, node)
    seeds = [(y, dy) for y, dy in zip(outputs, dYs) if dy is not None and y is not None]
    names = list(_NAMES[node.op_type])
    xs = [(name, value) for name, value in zip(names, node.inputs)
          if value is not None and name in _DIFFERENTIABLE]
    grads = fwd.differentiate(list(fwd.nodes), seeds, [value for _, value in xs])
    op.nodes.extend(fwd.nodes)
    return {name: g for (name, _), g in zip(xs, grads) if g is not None}


_DIFFERENTIABLE = ("X", "W", "R", "B", "initial_h", "initial_c", "P")
_NAMES = {
    "RNN": ("X", "W", "R", "B", "sequence_lens", "initial_h"),
    "GRU": ("X", "W", "R", "B", "sequence_lens", "initial_h"),
    "LSTM": ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"),
}


@rule("RNN", differentiable=_DIFFERENTIABLE[:4] + ("initial_h",))
def rnn(op, node, *dYs):
    """Y, Y_h = RNN(X, W, R, B, sequence_lens, initial_h): H_t = f(X_t·Wᵀ + H_{t-1}·Rᵀ + Wb + Rb)."""
    return _vjp(op, node, dYs)


@rule("GRU", differentiable=_DIFFERENTIABLE[:4] + ("initial_h",))
def gru(op, node, *dYs):
    """Y, Y_h = GRU(...): H_t = (1 - z_t)·h_t + z_t·H_{t-1} with update, reset, hidden gates z, r, h."""
    return _vjp(op, node, dYs)


@rule("LSTM", differentiable=_DIFFERENTIABLE)
def lstm(op, node, *dYs):
    """Y, Y_h, Y_c = LSTM(...): C_t = f_t·C_{t-1} + i_t·g(c_t), H_t = o_t·h(C_t), gates i, o, f, c."""
    return _vjp(op, node, dYs)
