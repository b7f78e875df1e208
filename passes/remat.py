"""Rematerialisation: recompute cheap elementwise values where they are read late instead of
keeping them alive in between (less peak memory for a little more compute).

In a forward+backward graph the backward nodes read forward values long after the forward is
done, so each such value stays alive across the whole gap. When a cheap elementwise op made the
value from inputs that stay alive through the gap anyway (the input of a Relu or Gelu, which its
own backward reads), a copy of the op placed just before the late reads gives the same value
while only the inputs are kept. Run it last: common-subexpression elimination (in
``cleanup_passes``) would merge the copy back into the original.

onnxruntime does the same merge when it loads a model (its basic graph optimisations include
common-subexpression elimination), so there the pass saves memory only with
``graph_optimization_level = ORT_DISABLE_ALL`` (the benchmark CNN: 66.5 to 62.3 MB peak);
runtimes that keep the graph as written profit directly.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.toolkit import Namer

CHEAP = frozenset({
    "Abs", "Add", "Cast", "Div", "Exp", "Gelu", "Identity", "LeakyRelu", "Mul", "Neg",
    "Reciprocal", "Relu", "Sigmoid", "Sqrt", "Sub", "Tanh",
})
MIN_GAP = 8  # nodes between the early and the late reads that make a copy worthwhile


class RematerializePass(ir.passes.InPlacePass):
    """Copies each cheap elementwise node whose output is read early and again late (after a gap
    of at least ``min_gap`` nodes) to just before the late reads, when its inputs are alive there
    anyway; the late reads then take the copy. Results are unchanged."""

    def __init__(self, min_gap: int = MIN_GAP) -> None:
        super().__init__()
        self.min_gap = min_gap

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        namer = Namer.for_graph(graph, prefix="remat")
        position = {node: float(i) for i, node in enumerate(graph)}
        always = set(graph.inputs) | set(graph.initializers.values()) | set(graph.outputs)
        copies = 0
        for node in list(graph):
            if node.op_type not in CHEAP or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
                continue
            value = node.outputs[0]
            late = self._late_uses(value, position, always)
            if late is None:
                continue
            start = position[late[0][0]]
            if not all(v is None or self._alive_at(v, start, position, always) for v in node.inputs):
                continue
            copy = ir.Node(
                node.domain, node.op_type, list(node.inputs),
                attributes=list(node.attributes.values()), num_outputs=1,
                name=namer.fresh(f"remat_{node.name or node.op_type}"),
            )
            out = copy.outputs[0]
            out.name = namer.fresh(f"{value.name}_remat")
            out.type, out.shape = value.type, value.shape
            graph.insert_before(late[0][0], copy)
            position[copy] = start - 0.5
            for user, index in late:
                user.replace_input_with(index, out)
            copies += 1
        return ir.passes.PassResult(model, modified=copies > 0)

    def _late_uses(self, value: ir.Value, position, always):
        """The reads after the widest gap between reads (at least one read before it), or None."""
        if value in always:
            return None
        uses = list(value.uses())
        if any(user not in position for user, _ in uses):
            return None  # read inside a subgraph: leave it
        uses.sort(key=lambda use: position[use[0]])
        points = [position[user] for user, _ in uses]
        gaps = [(points[j] - points[j - 1], j) for j in range(1, len(points))]
        if not gaps:
            return None
        widest, j = max(gaps)
        return uses[j:] if widest > self.min_gap else None

    @staticmethod
    def _alive_at(value: ir.Value, point: float, position, always) -> bool:
        """Whether the value is kept until ``point`` anyway (a graph input, initializer or output,
        or read at or after ``point``)."""
        if value in always or value.const_value is not None:
            return True
        return any(position.get(user, -1.0) >= point for user, _ in value.uses())


def rematerialize_pass(min_gap: int = MIN_GAP) -> RematerializePass:
    """The :class:`RematerializePass`; run it after :func:`cleanup_passes`."""
    return RematerializePass(min_gap)
