"""Constant lifting: the main graph's Constant nodes become initializers; weights stored as Constant
nodes (paddle2onnx, silero's If branches) become main-graph initializers, and go back after training."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Collection, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import UnsupportedModelError
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, graph_and_subgraphs, shapes, subgraphs


class LiftConstantsPass(ir.passes.InPlacePass):
    """Turn the main graph's Constant nodes into initializers (one node fewer each).

    Only the main graph, from IR version 4 on: before it an initializer must also be a graph
    input, and functions have no initializers. A Constant that is a graph output stays a node.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if (model.ir_version or 0) < 4:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        lifted = False
        for node in list(graph):
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attributes) != 1:
                continue
            out = node.outputs[0]
            tensor = shapes.constant(out, computed=False)
            if out.is_graph_output() or tensor is None or not out.name or out.name in graph.initializers:
                continue
            if out.const_value is not None:
                tensor = out.const_value
            else:
                tensor = ir.tensor(tensor)
            init = ir.Value(name=out.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                            const_value=tensor)
            out.replace_all_uses_with(init)
            graph.remove(node, safe=True)
            graph.register_initializer(init)
            lifted = True
        return ir.passes.PassResult(model, modified=lifted)


@dataclasses.dataclass(frozen=True)
class ConstantSite:
    """A Constant node that stored a lifted weight: the control-flow nodes from the main graph down
    to its graph (each by its first output's name, with the attribute that holds the subgraph) and
    its output's name there."""

    path: tuple[tuple[str, str], ...]
    output: str

    def to_json(self) -> dict:
        return {"path": [list(step) for step in self.path], "output": self.output}

    @classmethod
    def from_json(cls, entry: dict) -> ConstantSite:
        return cls(tuple((node, attribute) for node, attribute in entry["path"]), entry["output"])

    def describe(self) -> str:
        where = "".join(f" in {attribute} of '{node}'" for node, attribute in reversed(self.path))
        return f"Constant '{self.output}'{where}"


@dataclasses.dataclass(frozen=True)
class LiftedWeight:
    """A main-graph initializer made from one or more Constant nodes (one tensor, in branches of
    which one runs)."""

    initializer: str
    sites: tuple[ConstantSite, ...]

    def to_json(self) -> dict:
        return {"initializer": self.initializer, "sites": [site.to_json() for site in self.sites]}

    @classmethod
    def from_json(cls, entry: dict) -> LiftedWeight:
        return cls(entry["initializer"], tuple(map(ConstantSite.from_json, entry["sites"])))


@dataclasses.dataclass
class _Found:
    node: ir.Node
    graph: ir.Graph
    path: tuple[tuple[ir.Node, str], ...]
    tensor: ir.TensorProtocol


class LiftWeightConstantsPass(ir.passes.InPlacePass):
    """Float Constant nodes that may hold weights become main-graph initializers, so that the
    default parameters (:mod:`~onnx_autodiff.passes.parameters`) treat them as they treat
    initializers, and gradients reach them: a Constant inside an If, Loop or Scan body is then an
    outer value the body reads, which the control-flow rules differentiate.

    Lifted: every float Constant of more than one element, and a one-element one that a layer
    reads as its weight (:func:`~onnx_autodiff.weights.recovery.weight_read`); other one-element
    Constants are exponents, epsilons and scale factors and stay. A Constant that is its graph's
    output becomes an Identity of the initializer. ``lifted`` lists, per initializer, the nodes it
    came from, which :func:`write_back` sets again.

    Two Constants become one initializer when they lie in different branches of one If (only one
    of them runs per call: the producer duplicated a tensor both branches read, as silero's
    per-sample-rate branches do) and hold the same bytes, and either have the same output name or
    hold more than one distinct value. Equal bytes alone are not enough elsewhere: weights that
    merely start equal (zeros, ones) would be tied, and a uniform tensor ties only under one name.
    From IR version 4 on (before it an initializer must also be a graph input).
    """

    def __init__(self, only: Collection[str] | None = None) -> None:
        super().__init__()
        self.only = None if only is None else frozenset(only)  # Constants' output names (None: all)
        self.lifted: list[LiftedWeight] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnx_autodiff.weights.recovery import weight_read

        self.lifted = []
        if (model.ir_version or 0) < 4:
            return ir.passes.PassResult(model, modified=False)
        found = [f for f in _float_constants(model.graph, ())
                 if (f.tensor.size > 1 or weight_read(f.node.outputs[0])) and (self.only is None or f.node.outputs[0].name in self.only)]
        if not found:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        defined = _defined_names(graph)
        namer = Namer.for_graph(graph, prefix="lifted")
        for group in _groups(found):
            names = collections.Counter(f.node.outputs[0].name for f in group)
            # the first member's name, or another's, where no value outside the group has it
            own = next((n for n in names if defined[n] == names[n]), None)
            name = own or namer.fresh(group[0].node.outputs[0].name)
            tensor = group[0].tensor
            init = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
            graph.register_initializer(init)
            sites = []
            for f in group:
                sites.append(ConstantSite(tuple((_node_key(n), a) for n, a in f.path), f.node.outputs[0].name))
                _replace_constant(f, init)
            self.lifted.append(LiftedWeight(name, tuple(sites)))
        return ir.passes.PassResult(model, modified=True)


def _float_constants(graph: ir.Graph, path: tuple) -> list[_Found]:
    """The float Constant nodes of ``graph`` and its subgraphs, depth first in node order."""
    found = []
    for node in graph:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attributes) == 1:
            tensor = _constant_tensor(node)
            if tensor is not None and tensor.dtype in FLOAT_TYPES and node.outputs[0].name:
                found.append(_Found(node, graph, path, tensor))
        if not subgraphs(node):  # (the toolkit's fast test: most nodes hold none)
            continue
        for attribute in sorted(node.attributes.values(), key=lambda a: a.name != "then_branch"):
            held = [attribute.value] if attribute.type == ir.AttributeType.GRAPH else (
                attribute.value if attribute.type == ir.AttributeType.GRAPHS else [])
            for sub in held:
                found += _float_constants(sub, (*path, (node, attribute.name)))
    return found


def _constant_tensor(node: ir.Node) -> ir.TensorProtocol | None:
    attribute = next(iter(node.attributes.values()))
    if attribute.name == "value":
        return attribute.value
    if attribute.name in ("value_float", "value_floats"):
        return ir.tensor(np.asarray(attribute.value, np.float32))
    return None


def _node_key(node: ir.Node) -> str:
    """How a site names a control-flow node: its first output's name (unique where its name need not be)."""
    return node.outputs[0].name


def _defined_names(graph: ir.Graph) -> collections.Counter:
    """How many values of the model (every graph) each name defines."""
    count: collections.Counter = collections.Counter()
    for held in graph_and_subgraphs(graph):
        count.update(v.name for v in held.inputs)
        count.update(list(held.initializers))
        count.update(out.name for node in held for out in node.outputs)
    return count


def _exclusive(a: tuple, b: tuple) -> bool:
    """Whether two sites lie in different branches of one If (never both run in one call)."""
    for (node_a, attr_a), (node_b, attr_b) in zip(a, b):
        if node_a is not node_b:
            return False
        if attr_a != attr_b:
            return node_a.op_type == "If"
    return False


def _groups(found: list[_Found]) -> list[list[_Found]]:
    """The Constants grouped into one initializer each (see :class:`LiftWeightConstantsPass`), in
    the order of their first member."""
    groups: list[list[_Found]] = []
    by_bytes: dict[tuple, list[list[_Found]]] = {}
    for f in found:
        array = f.tensor.numpy() if f.path else None
        key = (f.tensor.dtype, tuple(array.shape), hashlib.sha256(array.tobytes()).digest()) if array is not None else None
        home = None
        for group in by_bytes.get(key, []) if key is not None else []:
            if all(_exclusive(f.path, g.path) for g in group) and (
                    np.unique(array).size > 1 or f.node.outputs[0].name == group[0].node.outputs[0].name) \
                    and np.array_equal(array, group[0].tensor.numpy()):
                home = group
                break
        if home is None:
            home = []
            groups.append(home)
            if key is not None:
                by_bytes.setdefault(key, []).append(home)
        home.append(f)
    return groups


def _replace_constant(found: _Found, init: ir.Value) -> None:
    """The Constant's reads read ``init``; a Constant that is its graph's output becomes Identity(init)."""
    node, graph = found.node, found.graph
    out = node.outputs[0]
    if out.is_graph_output():
        identity = ir.node("Identity", [init], name=node.name)
        graph.insert_after(node, identity)
        out.replace_all_uses_with(identity.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        identity.outputs[0].name, identity.outputs[0].type, identity.outputs[0].shape = out.name, out.type, out.shape
        return
    out.replace_all_uses_with(init)
    graph.remove(node, safe=True)


def write_back(graph: onnx.GraphProto, lifted: Sequence[LiftedWeight], values: dict[str, np.ndarray]) -> None:
    """Sets the Constant nodes of a model as its producer stored it (``graph``, a GraphProto) to
    the ``values`` of the initializers ``lifted`` from them, in the attribute each had (``value``
    or ``value_floats``) and its dtype."""
    for weight in lifted:
        value = values.get(weight.initializer)
        if value is None:
            continue
        for site in weight.sites:
            node = _site_node(graph, site)
            attribute = node.attribute[0]
            if attribute.name == "value":
                dtype = onnx.helper.tensor_dtype_to_np_dtype(attribute.t.data_type)
                attribute.t.CopyFrom(onnx.numpy_helper.from_array(np.asarray(value, dtype), attribute.t.name))
            elif attribute.name == "value_float":
                attribute.f = float(np.asarray(value).reshape(()))
            else:
                del attribute.floats[:]
                attribute.floats.extend(np.asarray(value, np.float32).reshape(-1).tolist())


def lifted_in(proto: onnx.ModelProto, lifted: Sequence[LiftedWeight], names) -> onnx.ModelProto:
    """``proto`` with the weights among ``names`` (initializers ``lifted`` from Constant nodes) as
    initializers again, the other Constant nodes as they are: for a pass that needs a weight
    stored as an initializer (LoRA's adapters beside their base)."""
    outputs = {site.output for weight in lifted if weight.initializer in names for site in weight.sites}
    if not outputs:
        return proto
    model = ir.from_proto(proto)
    LiftWeightConstantsPass(only=outputs)(model)
    return ir.to_proto(model)


def read_back(graph: onnx.GraphProto, lifted: Sequence[LiftedWeight], names) -> dict[str, np.ndarray]:
    """The values of the lifted initializers among ``names`` as the Constant nodes of ``graph``
    hold them (each from its first site; :func:`write_back`'s reverse)."""
    found = {}
    for weight in lifted:
        if weight.initializer in names:
            attribute = _site_node(graph, weight.sites[0]).attribute[0]
            found[weight.initializer] = onnx.numpy_helper.to_array(attribute.t) if attribute.name == "value" else \
                np.asarray(attribute.f if attribute.name == "value_float" else list(attribute.floats), np.float32)
    return found


def _site_node(graph: onnx.GraphProto, site: ConstantSite) -> onnx.NodeProto:
    for node_output, attribute_name in site.path:
        node = next((n for n in graph.node if n.output and n.output[0] == node_output), None)
        graph = next((a.g for a in node.attribute if a.name == attribute_name), None) if node is not None else None
        if graph is None:
            break
    node = next((n for n in graph.node if n.op_type == "Constant" and list(n.output) == [site.output]), None) \
        if graph is not None else None
    if node is None:
        raise UnsupportedModelError(f"the model has no {site.describe()} to write the trained weight back into "
                                    "(it is not the model the weights were lifted from)")
    return node
