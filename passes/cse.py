"""Common-subexpression elimination as the cleanup does it: onnx-ir's
CommonSubexpressionEliminationPass on the main graph, with the duplicates removed at once."""

from __future__ import annotations

import onnx_ir as ir

# Ops whose equal calls may give different results: never merged.
_NONDETERMINISTIC = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial"})
CSE_TENSOR_LIMIT = 10  # elements: larger Constant tensors (weights) are not compared


class CommonSubexpressionPass(ir.passes.InPlacePass):
    """:func:`eliminate_common_subexpressions` on the model's main graph (as onnx-ir's pass: not
    in functions); modified when a node went or a duplicate's readers moved."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=eliminate_common_subexpressions(model.graph))


def eliminate_common_subexpressions(graph: ir.Graph) -> bool:
    """onnx-ir's CommonSubexpressionEliminationPass on ``graph`` (the same merges), with the
    duplicates removed at once: that pass removes them one by one, and each removal copies the
    list of graph outputs (quadratic in a model with thousands of gradient outputs). On the
    backward model of the 20,001-node chain (66,675 nodes, 6,667 graph outputs), onnx-ir's pass
    takes 6.15 s and this 0.39 s, for the same 60,007 nodes (collector paused, onnx-ir 1.1,
    each on its own copy of the backward model that autodiff_pass makes of build_time.py's res20001).

    Where a duplicate's graph output would need an Identity of the kept node's output (the kept
    one is a graph output too: equal gradients), the duplicate stays and only its readers move:
    the Identity saves no node, and the folder turns it back into the duplicate, so the rounds
    would never reach a fixed point."""
    first: dict[tuple, ir.Node] = {}
    duplicates: list[ir.Node] = []
    moved = False
    positions: dict[ir.Value, list[int]] | None = None
    for node in graph:
        key = _cse_key(node)
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        if any(out.is_graph_output() for out in node.outputs):
            if positions is None:
                positions = {}
                for i, out in enumerate(graph.outputs):
                    positions.setdefault(out, []).append(i)
            if any(len(positions.get(old, ())) > (0 if new.is_graph_output() else 1)
                   for old, new in zip(node.outputs, kept.outputs)):
                for old, new in zip(node.outputs, kept.outputs):
                    for user, index in list(old.uses()):
                        user.replace_input_with(index, new)
                        moved = True
                continue
            for old, new in zip(node.outputs, kept.outputs):  # kept's outputs take their names
                for i in positions.pop(old, ()):
                    new.name = old.name
                    graph.outputs[i] = new
                    positions[new] = [i]
        ir.convenience.replace_all_uses_with(node.outputs, kept.outputs)
        duplicates.append(node)
    if duplicates:
        graph.remove(duplicates, safe=True)
    return moved or bool(duplicates)


def _cse_key(node: ir.Node) -> tuple | None:
    """What makes two nodes equal for onnx-ir's CSE (None: never merged: subgraphs, large
    tensors, random ops)."""
    attributes = []
    for name, attribute in node.attributes.data.items():  # (the dict the UserDict holds: asked of every node)
        value = attribute.value
        if attribute.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return None
        if attribute.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
            value = tuple(value)
        elif attribute.type is ir.AttributeType.TENSOR:
            if value.size > CSE_TENSOR_LIMIT:
                return None
            array = value.numpy()
            value = (array.shape, str(array.dtype), array.tobytes())
        attributes.append((name, value))
    if node.op_type in _NONDETERMINISTIC and node.domain == "":
        return None
    attributes.sort()
    return (node.op_identifier(), len(node.outputs), tuple(map(id, node.inputs)), tuple(attributes))
