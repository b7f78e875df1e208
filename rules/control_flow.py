"""Control flow: the backward of a node holding subgraphs is a node of the same kind whose
subgraphs hold the VJPs of the forward ones (recomputing their forward values).

Gradients flow to the outer-scope values the subgraphs read (``captures=True``) and, for Loop and
Scan, to the loop-carried and scanned inputs.
"""

from __future__ import annotations

from onnx_autodiff.rules import shapes
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
