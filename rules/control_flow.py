"""Control flow: the backward of a node holding subgraphs is a node of the same kind whose
subgraphs hold the VJPs of the forward ones (recomputing their forward values).

Gradients flow to the outer-scope values the subgraphs read (``captures=True``) and, for Loop and
Scan, to the loop-carried and scanned inputs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_autodiff.rules import shapes
from onnx_autodiff.rules.builder import FLOAT_TYPES
from onnx_autodiff.rules.registry import rule


def _typed_like(values, likes):
    for value, like in zip(values, likes):
        value.type, value.shape = like.type, like.shape
    return values


def _branch_vjp(op, branch, dYs, wanted, name):
    """A subgraph with no inputs computing Σ dY·∂out/∂w for the wanted outer values w."""
    body = op.child()
    outputs, nodes = body.inline(branch, [])
    grads = body.differentiate(nodes, list(zip(outputs, dYs)), wanted)
    grads = [shapes.zeros_like(body, w) if g is None else g for g, w in zip(grads, wanted)]
    graph = body.graph([], grads, name=name)
    _typed_like(graph.outputs, wanted)
    return graph


@rule("If", differentiable=(), captures=True)
def if_(op, node, *dYs):
    """Y = then_branch() if cond else else_branch(); the backward is an If of the branches' VJPs."""
    wanted = list(op.wanted_captures)
    then_branch = _branch_vjp(op, shapes.attr(node, "then_branch"), dYs, wanted, "then_grad")
    else_branch = _branch_vjp(op, shapes.attr(node, "else_branch"), dYs, wanted, "else_grad")
    grads = op.If(node.inputs[0], then_branch=then_branch, else_branch=else_branch, _outputs=len(wanted))
    grads = grads if isinstance(grads, tuple) else (grads,)
    return dict(zip(wanted, _typed_like(grads, wanted)))


def _fresh_inputs(op, likes):
    return [ir.Value(name=op.namer.fresh(), type=v.type, shape=v.shape) for v in likes]


def _scalar(op, value, index: int):
    return op.Gather(value, op.const(np.array(index, np.int64)))


@rule("Loop", differentiable=("v_initial",), captures=True)
def loop(op, node, *dYs):
    """v_final, scans = Loop(M, cond, v_initial; body(i, cond, v) -> (cond', v', scan_i)).

    The backward runs the loop again, stacking each iteration's inputs, then a reverse Loop
    recomputes each iteration's body from its stacked inputs and applies the body's VJP: the
    carried gradients flow backwards and the captured values' gradients are summed.
    """
    body = shapes.attr(node, "body")
    carried = len(node.inputs) - 2
    scans = len(node.outputs) - carried
    wanted = list(op.wanted_captures)

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
    values = [reverse.Gather(s, index) for s in (stacked_cond, *stacked_v)]
    recomputed, nodes = reverse.inline(body, [index, *values])
    seeds = [(recomputed[1 + k], dv) for k, dv in zip(floats, dv_in)]
    seeds += [(recomputed[1 + carried + j], reverse.Gather(dY, index))
              for j, dY in enumerate(dYs[carried:]) if dY is not None]
    xs = [values[1 + k] for k in floats] + wanted
    grads = reverse.differentiate(nodes, seeds, xs)
    dv_out = [g if g is not None else shapes.zeros_like(reverse, v) for g, v in zip(grads, xs)]
    acc_out = [a if g is None else reverse.Add(a, g) for a, g in zip(acc_in, grads[len(floats):])]
    reverse_graph = reverse.graph(
        [step, keep_going, *dv_in, *acc_in],
        [reverse.const(np.array(True)), *dv_out[: len(floats)], *acc_out],
        name="loop_grad",
    )
    dv_init = [dYs[k] if dYs[k] is not None else shapes.zeros_like(op, node.outputs[k]) for k in floats]
    acc_init = [shapes.zeros_like(op, w) for w in wanted]
    results = op.Loop(count, None, *dv_init, *acc_init, body=reverse_graph, _outputs=len(floats) + len(wanted))
    results = results if isinstance(results, tuple) else (results,)
    grads = {w: g for w, g in zip(wanted, results[len(floats):])}
    grads["v_initial"] = [None] * carried
    for k, g in zip(floats, results):
        grads["v_initial"][k] = g
    return grads
