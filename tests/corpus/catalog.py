"""The corpus's manifest and the independent weight list.

``weights(model)`` applies the corpus's rule, written here from the ONNX graph alone (it reads
nothing of the package): a weight is a float tensor of 16 or more elements, held by an initializer
(of the main graph or of a subgraph) or by a ``Constant`` node, whose value reaches an input of
Conv, ConvTranspose, Gemm, MatMul, LSTM, GRU or BatchNormalization through any chain of
Identity, Cast, Reshape, Transpose, Unsqueeze and Squeeze nodes, into If/Loop/Scan branches (a
branch reads an outer value by its name) and out of them (a branch output is its node's output).
Concat, Slice and Split pass a weight on too: paddle2onnx writes an LSTM's W, R and B as the two
directions' Constants concatenated and sliced into ONNX's gate order, and those are the weights.

A weight is named by the tensor that holds it: the initializer's name, or for a ``Constant`` node
the name of the node's output (the value the graph reads).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

HERE = Path(__file__).parent
MANIFEST = HERE / "manifest.json"

CONSUMERS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU", "BatchNormalization"}
PASS_THROUGH = {"Identity", "Cast", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Slice", "Split"}
JOINS = {"Concat"}  # every input is data
FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
MIN_ELEMENTS = 16


def _graphs(graph: onnx.GraphProto, owner=None):
    """(graph, the node that owns it or None) for ``graph`` and every subgraph in it."""
    yield graph, owner
    for node in graph.node:
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                yield from _graphs(sub, node)


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t
    return None


def _candidates(model: onnx.ModelProto):
    """(name, kind, shape) of every float tensor of at least MIN_ELEMENTS elements."""
    for graph, _ in _graphs(model.graph):
        for init in graph.initializer:
            if init.data_type in FLOATS and int(np.prod(init.dims)) >= MIN_ELEMENTS:
                yield init.name, "initializer", list(init.dims)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                t = _constant_tensor(node)
                if t is not None and t.data_type in FLOATS and int(np.prod(t.dims)) >= MIN_ELEMENTS:
                    yield node.output[0], "constant", list(t.dims)


def _reaches(model: onnx.ModelProto) -> set[str]:
    """Names of the values whose data reaches a consumer op through pass-through chains."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    branch_outputs: dict[str, list[str]] = {}  # a subgraph output's name -> its owner's outputs
    for graph, owner in _graphs(model.graph):
        for node in graph.node:
            for name in node.input:
                if name:
                    consumers.setdefault(name, []).append(node)
        if owner is not None and owner.op_type == "If":
            for i, out in enumerate(graph.output):
                if i < len(owner.output):
                    branch_outputs.setdefault(out.name, []).append(owner.output[i])
    memo: dict[str, bool] = {}

    def reaches(name: str, seen=frozenset()) -> bool:
        if name in memo:
            return memo[name]
        if name in seen:
            return False
        seen = seen | {name}
        found = any(reaches(out, seen) for out in branch_outputs.get(name, ()))
        for node in consumers.get(name, ()):
            if found:
                break
            if node.op_type in CONSUMERS:
                found = True
            elif (node.op_type in PASS_THROUGH and node.input[0] == name) or node.op_type in JOINS:
                found = any(reaches(out, seen) for out in node.output if out)
        memo[name] = found
        return found

    return {name for name in consumers if reaches(name)} | {n for n in branch_outputs if reaches(n)}


def weights(model: onnx.ModelProto) -> list[dict]:
    """The weights of ``model`` by the corpus's rule, in file order: name, kind, shape."""
    reached = _reaches(model)
    seen, rows = set(), []
    for name, kind, shape in _candidates(model):
        if name in reached and name not in seen:
            seen.add(name)
            rows.append({"name": name, "kind": kind, "shape": shape})
    return rows


def weight_value(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of the weight ``name`` (initializer or Constant output) anywhere in ``model``."""
    for graph, _ in _graphs(model.graph):
        for init in graph.initializer:
            if init.name == name:
                return numpy_helper.to_array(init)
        for node in graph.node:
            if node.op_type == "Constant" and node.output[0] == name:
                return numpy_helper.to_array(_constant_tensor(node))
    raise KeyError(name)


def op_types(model: onnx.ModelProto, constants: bool = False) -> dict[str, int]:
    """The multiset of op types over the main graph and every subgraph; left out unless asked,
    what stores weights rather than computes: Constants, and Identities of an initializer (an
    exporter's alias of a deduplicated weight, e.g. optimum's equal LayerNorm biases, which
    training unties: the trained file then stores each under its own name)."""
    counts: dict[str, int] = {}
    stored = {t.name for t in model.graph.initializer}
    for graph, _ in _graphs(model.graph):
        for node in graph.node:
            alias = node.op_type == "Identity" and len(node.input) == 1 and node.input[0] in stored
            if (node.op_type != "Constant" and not alias) or constants:
                key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def load_manifest() -> dict:
    return json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}


def record(key: str, entry: dict) -> None:
    """Add or replace ``key``'s entry in the manifest, with the weights computed from its file."""
    model = onnx.load(str(HERE / entry["file"]))
    entry = dict(entry, weights=weights(model), ops=op_types(model), opset=next(
        o.version for o in model.opset_import if o.domain in ("", "ai.onnx")))
    manifest = load_manifest()
    manifest[key] = entry
    text = json.dumps(dict(sorted(manifest.items())), indent=1)
    # shapes on one line: [\n  1,\n  3\n ] -> [1, 3]
    text = re.sub(r"\[\s+(-?\d+(?:,\s+-?\d+)*)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    MANIFEST.write_text(text + "\n")
