"""Which carried values a model may write over their old ones: an analysis of the model's graph.

A model carries state (parameters, optimiser state, accumulators): it reads the old value of a key
and returns the new one. Written into the old value's buffer, the new value costs no second copy
of the state, but only where no node reads the old value after the writer has started. The trainer
binds such outputs to their inputs' buffers and gives the others a spare buffer, swapped in after
a kept run. The analysis needs nothing but the model, so the build may record its result with the
artifacts.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import onnx

from onnx_autodiff.toolkit import proto_graphs

# Elementwise writers: each output element is computed from the input elements at its own index,
# so the node may write into the buffer of an input it reads.
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Identity"}

# Kernels whose output may be a view of their input's buffer in onnxruntime (no copy).
_VIEWS = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def in_place_keys(proto: onnx.ModelProto, carry: Sequence[tuple[str, str, str]]) -> set[str]:
    """The carried keys (``carry``: key, input, output) whose new value may be written over the
    old one in a run of ``proto``: the node writing the new value is elementwise, a Split that
    reads no view of the old value (a grouped update's), or an If each of whose branches writes it
    so, and every other node reading the old value is one of its ancestors, so it has run before
    (onnxruntime runs nodes in a dependency order, and an If's branch once the If may run)."""
    safe = _writable(proto.graph, {out: name for _, name, out in carry})
    return {key for key, _, out in carry if out in safe}


def in_place_order(proto: onnx.ModelProto, carry: Sequence[tuple[str, str, str]]) -> tuple[str, ...]:
    """:func:`in_place_keys` in ``carry``'s order, as the manifest records them."""
    found = in_place_keys(proto, carry)
    return tuple(key for key, _, _ in carry if key in found)


def _writable(graph: onnx.GraphProto, writes: Mapping[str, str]) -> set[str]:
    """The new values of ``writes`` (new value's name -> old value's name) that a run of ``graph``
    may write over the old ones (see :func:`in_place_keys`)."""
    nodes = graph.node
    wanted = set(writes.values())
    reads, producer, readers = [], {}, {}
    for position, node in enumerate(nodes):
        names = _reads(node) if node.attribute else node.input
        reads.append(names)
        for name in wanted.intersection(names):
            readers.setdefault(name, []).append(position)
        for name in node.output:
            producer[name] = position
    # a bit per node that writes a new value; per node, the bits of the writers it is an ancestor
    # of (or is), in one pass from the last node back (the graph is in a dependency order)
    writers = sorted({producer[out] for out in writes if out in producer})
    bit = {writer: 1 << i for i, writer in enumerate(writers)}
    below = [0] * len(nodes)
    get = producer.get
    for position in range(len(nodes) - 1, -1, -1):
        mask = below[position] | bit.get(position, 0)
        if mask:
            for name in reads[position]:
                found = get(name)
                if found is not None:
                    below[found] |= mask
    safe, by_if = set(), {}
    viewed = _view_edges(graph)
    for out, name in writes.items():
        writer = producer.get(out)
        if writer is None or any(r != writer and not below[r] & bit[writer] for r in readers.get(name, ())):
            continue
        node = nodes[writer]
        if node.op_type in _ELEMENTWISE:
            safe.add(out)
        elif node.op_type == "Split" and node.domain in ("", "ai.onnx") and not set(node.input) & _views(viewed, name):
            # a grouped update's (optimizers.split_back, after the If): it reads the group's new
            # value or a copy of its old values (their Concat), never their buffers, which their
            # readers, all ancestors, are done with
            safe.add(out)
        elif node.op_type == "If" and node.domain in ("", "ai.onnx"):
            by_if.setdefault(writer, {})[out] = name
    for writer, outs in by_if.items():  # each branch must write the value in place itself
        node = nodes[writer]
        position = {out: i for i, out in enumerate(node.output)}
        for attribute in node.attribute:
            branch = attribute.g
            inner = [branch.output[position[out]].name for out in outs]
            once = {n for n, count in collections.Counter(inner).items() if count == 1}  # one value returned twice: neither
            ok = _writable(branch, {n: name for n, name in zip(inner, outs.values()) if n in once})
            outs = {out: name for out, n, name in zip(outs, inner, outs.values()) if n in ok}
        safe.update(outs)
    return safe


def _view_edges(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Value -> the outputs of the nodes of ``graph`` that may be views of it."""
    edges: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type in _VIEWS and node.input:
            edges.setdefault(node.input[0], []).extend(node.output)
    return edges


def _views(edges: Mapping[str, list[str]], name: str) -> set[str]:
    """``name`` and the values that may share its buffer (views of it, transitively; ``edges``:
    :func:`_view_edges`)."""
    found, pending = {name}, [name]
    while pending:
        for view in edges.get(pending.pop(), ()):
            if view not in found:
                found.add(view)
                pending.append(view)
    return found


def _reads(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads: its inputs and the outer values its subgraphs use."""
    names = set(node.input)
    if not node.attribute:
        names.discard("")
        return names
    for attribute in node.attribute:
        for sub in [attribute.g] if attribute.HasField("g") else attribute.graphs:
            for graph in proto_graphs(sub):
                for inner in graph.node:
                    names.update(inner.input)
    names.discard("")
    return names
