"""Control flow: the backward of a node holding subgraphs is a node of the same kind whose
subgraphs hold the VJPs of the forward ones (recomputing their forward values).

Gradients flow to the outer-scope values the subgraphs read (``captures=True``) and, for Loop and
Scan, to the loop-carried and scanned inputs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import RuleError
from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import FLOAT_TYPES, shapes


def _branch_vjp(op, branch, dYs, wanted, name):
    """A subgraph with no inputs computing Σ dY·∂out/∂w for the wanted outer values w."""
    body = op.child()
    outputs, nodes = body.inline(branch, [])
    grads = body.differentiate(nodes, list(zip(outputs, dYs)), wanted)
    grads = [shapes.zeros(body, w) if g is None else g for g, w in zip(grads, wanted)]
    graph = body.graph([], grads, name=name)
    shapes.typed_like(graph.outputs, wanted)
    return graph


@rule("If", differentiable=(), captures=True)
def if_(op, node, *dYs, captures):
    """Y = then_branch() if cond else else_branch(); the backward is an If of the branches' VJPs."""
    wanted = list(captures)
    cond = shapes.number(node.inputs[0])
    if cond is not None:
        # Known before run time: only the branch taken is differentiated (the other one may not
        # even be shaped consistently with it, as in function bodies written for several ranks).
        branch = shapes.attr(node, "then_branch" if cond else "else_branch")
        outputs, nodes = op.inline(branch, [])
        grads = op.differentiate(nodes, list(zip(outputs, dYs)), wanted)
        return {w: g for w, g in zip(wanted, grads) if g is not None}
    then_branch = _branch_vjp(op, shapes.attr(node, "then_branch"), dYs, wanted, "then_grad")
    else_branch = _branch_vjp(op, shapes.attr(node, "else_branch"), dYs, wanted, "else_grad")
    grads = op.If(node.inputs[0], then_branch=then_branch, else_branch=else_branch, _outputs=len(wanted))
    grads = grads if isinstance(grads, tuple) else (grads,)
    return dict(zip(wanted, shapes.typed_like(grads, wanted)))


def _fresh_inputs(op, likes):
    return [ir.Value(name=op.namer.fresh(), type=v.type, shape=v.shape) for v in likes]


def _scalar(op, value, index: int):
    return op.Gather(value, op.const(np.array(index, np.int64)))


@rule("Loop", differentiable=("v_initial",), captures=True)
def loop(op, node, *dYs, captures):
    """v_final, scans = Loop(M, cond, v_initial; body(i, cond, v) -> (cond', v', scan_i)).

    The backward runs the loop again, stacking each iteration's inputs, then a reverse Loop
    recomputes each iteration's body from its stacked inputs and applies the body's VJP: the
    carried gradients flow backwards and the captured values' gradients are summed.
    """
    body = shapes.attr(node, "body")
    carried = len(node.inputs) - 2
    wanted = list(captures)

    # 1. The forward loop again, with each iteration's (i, cond, v) stacked as extra scan outputs.
    stash_body = op.child()
    inputs = _fresh_inputs(stash_body, body.inputs)
    outputs, _ = stash_body.inline(body, inputs)
    stash_graph = stash_body.graph(inputs, [*outputs, *inputs], name="loop_stash")
    stash = op.Loop(*node.inputs, body=stash_graph, _outputs=len(node.outputs) + 2 + carried)
    stacked_iter, stacked_cond, *stacked_v = stash[len(node.outputs):]
    count = _scalar(op, op.Shape(stacked_iter), 0)

    # 2. The reverse loop over the stacked iterations.
    floats = [k for k in range(carried) if body.inputs[2 + k].dtype in FLOAT_TYPES]
    reverse = op.child()
    step, keep_going = _fresh_inputs(reverse, body.inputs[:2])
    dv_in = _fresh_inputs(reverse, [body.inputs[2 + k] for k in floats])
    acc_in = _fresh_inputs(reverse, wanted)
    index = reverse.Sub(reverse.Sub(count, reverse.const(np.array(1, np.int64))), step)
    values = shapes.typed_like([reverse.Gather(s, index) for s in (stacked_cond, *stacked_v)], body.inputs[1:])
    recomputed, nodes = reverse.inline(body, [index, *values])
    seeds = [(recomputed[1 + k], dv) for k, dv in zip(floats, dv_in)]
    seeds += [(recomputed[1 + carried + j], reverse.Gather(dY, index))
              for j, dY in enumerate(dYs[carried:]) if dY is not None]
    xs = [values[1 + k] for k in floats] + wanted
    grads = reverse.differentiate(nodes, seeds, xs)
    dv_out = [g if g is not None else shapes.zeros(reverse, v) for g, v in zip(grads, xs)]
    acc_out = [a if g is None else reverse.Add(a, g) for a, g in zip(acc_in, grads[len(floats):])]
    reverse_graph = reverse.graph(
        [step, keep_going, *dv_in, *acc_in],
        [reverse.const(np.array(True)), *dv_out[: len(floats)], *acc_out],
        name="loop_grad",
    )
    dv_init = [dYs[k] if dYs[k] is not None else shapes.zeros(op, node.outputs[k]) for k in floats]
    acc_init = [shapes.zeros(op, w) for w in wanted]
    # (cond given, though a for loop may omit it: onnx.reference's Loop then runs no iteration)
    results = op.Loop(count, op.const(np.array(True)), *dv_init, *acc_init, body=reverse_graph,
                      _outputs=len(floats) + len(wanted))
    results = results if isinstance(results, tuple) else (results,)
    shapes.typed_like(results, [*(node.inputs[2 + k] for k in floats), *wanted])
    grads = {w: g for w, g in zip(wanted, results[len(floats):])}
    grads["v_initial"] = [None] * carried
    for k, g in zip(floats, results):
        grads["v_initial"][k] = g
    return grads


def _reverse0(op, x):
    """x reversed along axis 0."""
    if op.opset >= 10:
        return op.Slice(x, [-1], [np.iinfo(np.int64).min], [0], [-1])
    # Slice has no steps before opset 10: gather at T-1, ..., 0, counted by a Loop.
    count = _scalar(op, op.Shape(x), 0)
    body = op.child()
    step, carried = (ir.Value(name=op.namer.fresh(), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
                     for _ in range(2))
    go = ir.Value(name=op.namer.fresh(), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    index = body.Sub(body.Sub(count, body.const(np.array(1, np.int64))), step)
    # Loop needs a carried value before opset 11: carry the count along unchanged.
    counter = body.graph([step, go, carried], [body.const(np.array(True)), carried, index], name="reversed_indices")
    _, indices = op.Loop(count, op.const(np.array(True)), count, body=counter, _outputs=2)
    return op.Gather(x, indices, axis=0)


def _to_front(op, x, axis: int, reverse: bool, rank: int | None):
    """x with ``axis`` moved to the front, reversed along it when the scan runs backwards."""
    if axis != 0:
        if rank is None:
            raise RuleError(f"the rank of '{x.name}' is needed to move its scan axis")
        axis = shapes.normalize_axis(axis, rank)
        x = op.Transpose(x, perm=[axis, *(d for d in range(rank) if d != axis)])
    return _reverse0(op, x) if reverse else x


def _from_front(op, x, axis: int, reverse: bool, rank: int | None):
    """The inverse of :func:`_to_front`."""
    x = _reverse0(op, x) if reverse else x
    if axis != 0:
        axis = shapes.normalize_axis(axis, rank)
        perm = [axis, *(d for d in range(rank) if d != axis)]
        x = op.Transpose(x, perm=shapes.inverse_perm(perm))
    return x


@rule("Scan", differentiable=("initial_state_and_scan_inputs",), captures=True, since=9)
def scan(op, node, *dYs, captures):
    """states, scans = Scan(states, xs; body(state, x_t) -> (state', y_t)) along each scan axis.

    As for Loop: the states of every step are stacked by a second forward Scan, then a reverse
    Loop applies the body's VJP step by step, emitting each step's input gradients as scan outputs.
    """
    body = shapes.attr(node, "body")
    n_in = shapes.attr(node, "num_scan_inputs")
    n_state = len(node.inputs) - n_in
    n_out = len(node.outputs) - n_state
    in_axes = shapes.attr(node, "scan_input_axes", [0] * n_in)
    in_dirs = shapes.attr(node, "scan_input_directions", [0] * n_in)
    out_axes = shapes.attr(node, "scan_output_axes", [0] * n_out)
    out_dirs = shapes.attr(node, "scan_output_directions", [0] * n_out)
    wanted = list(captures)
    states, xs = list(node.inputs[:n_state]), list(node.inputs[n_state:])
    fronts = [_to_front(op, x, a, d, shapes.rank(x)) for x, a, d in zip(xs, in_axes, in_dirs)]

    # 1. The states entering every step, stacked by a forward Scan over the normalised inputs.
    stash_body = op.child()
    inputs = _fresh_inputs(stash_body, body.inputs)
    outputs, _ = stash_body.inline(body, inputs)
    stash_graph = stash_body.graph(inputs, [*outputs[:n_state], *inputs[:n_state]], name="scan_stash")
    stash = op.Scan(*states, *fronts, body=stash_graph, num_scan_inputs=n_in, _outputs=2 * n_state)
    stash = stash if isinstance(stash, tuple) else (stash,)
    stacked = stash[n_state:]
    count = _scalar(op, op.Shape(fronts[0]), 0)

    # 2. A reverse Loop over the steps.
    floats_s = [k for k in range(n_state) if body.inputs[k].dtype in FLOAT_TYPES]
    floats_x = [j for j in range(n_in) if body.inputs[n_state + j].dtype in FLOAT_TYPES]
    d_outs = [None if dY is None else _to_front(op, dY, a, d, shapes.rank(node.outputs[n_state + m]))
              for m, (dY, a, d) in enumerate(zip(dYs[n_state:], out_axes, out_dirs))]
    reverse = op.child()
    step = ir.Value(name=reverse.namer.fresh(), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    keep_going = ir.Value(name=reverse.namer.fresh(), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    ds_in = _fresh_inputs(reverse, [body.inputs[k] for k in floats_s])
    acc_in = _fresh_inputs(reverse, wanted)
    index = reverse.Sub(reverse.Sub(count, reverse.const(np.array(1, np.int64))), step)
    step_states = shapes.typed_like([reverse.Gather(s, index) for s in stacked], body.inputs[:n_state])
    step_xs = shapes.typed_like([reverse.Gather(x, index) for x in fronts], body.inputs[n_state:])
    recomputed, nodes = reverse.inline(body, [*step_states, *step_xs])
    seeds = [(recomputed[k], ds) for k, ds in zip(floats_s, ds_in)]
    seeds += [(recomputed[n_state + m], reverse.Gather(d, index)) for m, d in enumerate(d_outs) if d is not None]
    targets = [step_states[k] for k in floats_s] + [step_xs[j] for j in floats_x] + wanted
    grads = reverse.differentiate(nodes, seeds, targets)
    grads = [g if g is not None else shapes.zeros(reverse, t) for g, t in zip(grads, targets)]
    n_s, n_x = len(floats_s), len(floats_x)
    acc_out = [reverse.Add(a, g) for a, g in zip(acc_in, grads[n_s + n_x:])]
    reverse_graph = reverse.graph(
        [step, keep_going, *ds_in, *acc_in],
        [reverse.const(np.array(True)), *grads[:n_s], *acc_out, *grads[n_s:n_s + n_x]],
        name="scan_grad",
    )
    ds_init = [dYs[k] if dYs[k] is not None else shapes.zeros(op, node.outputs[k]) for k in floats_s]
    acc_init = [shapes.zeros(op, w) for w in wanted]
    results = op.Loop(count, op.const(np.array(True)), *ds_init, *acc_init, body=reverse_graph,
                      _outputs=n_s + len(wanted) + n_x)
    results = results if isinstance(results, tuple) else (results,)
    shapes.typed_like(results[: n_s + len(wanted)], [*(states[k] for k in floats_s), *wanted])
    for g, j in zip(results[n_s + len(wanted):], floats_x):
        g.dtype = xs[j].dtype
    gradients: dict = {w: g for w, g in zip(wanted, results[n_s:n_s + len(wanted)])}
    per_input = [None] * len(node.inputs)
    for k, g in zip(floats_s, results[:n_s]):
        per_input[k] = g
    for j, g in zip(floats_x, results[n_s + len(wanted):]):
        # The reverse loop stacked the steps last-to-first.
        per_input[n_state + j] = _from_front(op, _reverse0(op, g), in_axes[j], in_dirs[j], shapes.rank(xs[j]))
    gradients["initial_state_and_scan_inputs"] = per_input
    return gradients


def _zeros_opset8(op, x):
    """Zeros shaped like x without ConstantOfShape (opset 9)."""
    shape = shapes.static_shape(x)
    if shape is not None and x.dtype is not None:
        return op.const(np.zeros(shape), dtype=x.dtype)
    return op.Mul(x, 0.0)


def _reverse_axis1_opset8(op, x, like):
    """x reversed along axis 1 (the sequence axis of Scan-8), by a Scan that reads it backwards."""
    body = op.child()
    element = ir.Value(name=op.namer.fresh(), type=like.type, shape=like.shape)
    graph = body.graph([element], [body.Identity(element)], name="reversed")
    return op.Scan(None, x, body=graph, num_scan_inputs=1, directions=[1])


@rule("Scan", differentiable=("initial_state_and_scan_inputs",), captures=True, until=8)
def scan_batched(op, node, *dYs, captures):
    """states, scans = Scan-8(states, xs; body(state, x_t) -> (state', y_t)), every input and
    output with a leading batch axis and the sequence on axis 1.

    A second forward Scan stacks the states entering each step; a reverse Scan applies the body's
    VJP step by step for each batch element, carrying the state gradients and each element's
    captured-value gradients (summed over the batch at the end), and emitting the scanned inputs'
    gradients.
    """
    if node.inputs[0] is not None:
        raise RuleError("Scan before opset 9 with sequence_lens is not supported: convert the model "
                        "with onnx.version_converter (Scan-9 has no batch axis)")
    body = shapes.attr(node, "body")
    n_in = shapes.attr(node, "num_scan_inputs")
    states, xs = list(node.inputs[1:len(node.inputs) - n_in]), list(node.inputs[len(node.inputs) - n_in:])
    n_state, n_out = len(states), len(node.outputs) - len(states)
    directions = shapes.attr(node, "directions", [0] * n_in)
    wanted = list(captures)

    # 1. The states entering every step, stacked (batch, T, ...) by a second forward Scan.
    stacked = []
    if n_state:  # (a Scan without states, such as the reversal below, needs no stash)
        stash_body = op.child()
        inputs = _fresh_inputs(stash_body, body.inputs)
        outputs, _ = stash_body.inline(body, inputs)
        stash_graph = stash_body.graph(inputs, [*outputs[:n_state], *inputs[:n_state]], name="scan_stash")
        stash = op.Scan(None, *states, *xs, body=stash_graph, num_scan_inputs=n_in, directions=directions,
                        _outputs=2 * n_state)
        stash = stash if isinstance(stash, tuple) else (stash,)
        stacked = list(stash[n_state:])

    # 2. A reverse Scan over the steps, per batch element.
    floats_s = [k for k in range(n_state) if body.inputs[k].dtype in FLOAT_TYPES]
    floats_x = [j for j in range(n_in) if body.inputs[n_state + j].dtype in FLOAT_TYPES]
    seeded = [m for m in range(n_out) if dYs[n_state + m] is not None]
    reverse = op.child()
    ds_in = _fresh_inputs(reverse, [body.inputs[k] for k in floats_s])
    acc_in = _fresh_inputs(reverse, wanted)
    step_xs = _fresh_inputs(reverse, body.inputs[n_state:])
    step_states = _fresh_inputs(reverse, body.inputs[:n_state])
    step_dys = _fresh_inputs(reverse, [body.outputs[n_state + m] for m in seeded])
    recomputed, nodes = reverse.inline(body, [*step_states, *step_xs])
    seeds = [(recomputed[k], ds) for k, ds in zip(floats_s, ds_in)]
    seeds += [(recomputed[n_state + m], dy) for m, dy in zip(seeded, step_dys)]
    targets = [step_states[k] for k in floats_s] + [step_xs[j] for j in floats_x] + wanted
    grads = reverse.differentiate(nodes, seeds, targets)
    grads = [g if g is not None else _zeros_opset8(reverse, t) for g, t in zip(grads, targets)]
    n_s, n_x = len(floats_s), len(floats_x)
    acc_out = [reverse.Add(a, g) for a, g in zip(acc_in, grads[n_s + n_x:])]
    reverse_graph = reverse.graph([*ds_in, *acc_in, *step_xs, *step_states, *step_dys],
                                  [*grads[:n_s], *acc_out, *grads[n_s:n_s + n_x]], name="scan_grad")
    ds_init = [dYs[k] if dYs[k] is not None else _zeros_opset8(op, node.outputs[k]) for k in floats_s]
    batch = op.Slice(op.Shape(states[0] if states else xs[0]), starts=[0], ends=[1])
    acc_init = [op.Expand(op.unsqueeze(_zeros_opset8(op, w), [0]), op.Concat(batch, op.Shape(w), axis=0))
                for w in wanted]
    # Iteration t read position t of a forward input, T-1-t of a reversed one; the reverse Scan
    # runs t = T-1 .. 0, so it reads forward inputs, stacked states and dYs backwards.
    scanned = [*xs, *stacked, *(dYs[n_state + m] for m in seeded)]
    reverse_dirs = [1 - d for d in directions] + [1] * (len(stacked) + len(seeded))
    results = op.Scan(None, *ds_init, *acc_init, *scanned, body=reverse_graph, num_scan_inputs=len(scanned),
                      directions=reverse_dirs, _outputs=n_s + len(wanted) + n_x)
    results = results if isinstance(results, tuple) else (results,)
    gradients: dict = {w: op.reduce_sum(acc, [0], keepdims=False)
                       for w, acc in zip(wanted, results[n_s:n_s + len(wanted)])}
    per_input = [None] * (len(node.inputs) - 1)
    for k, g in zip(floats_s, results[:n_s]):
        per_input[k] = g
    for j, g in zip(floats_x, results[n_s + len(wanted):]):
        # Emitted in the reverse Scan's order, t = T-1 .. 0: a forward input's gradient is reversed.
        per_input[n_state + j] = g if directions[j] else _reverse_axis1_opset8(op, g, body.inputs[n_state + j])
    gradients["initial_state_and_scan_inputs"] = per_input
    return gradients
