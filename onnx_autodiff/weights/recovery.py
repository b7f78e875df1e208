"""Parameter recovery: which initializers of an exported file are (copies of) the module's parameters.

``torch.onnx.export`` with ``optimize=True`` and the TorchScript exporter with constant folding
store some parameters under other names and layouts:

- ``nn.Linear`` weights folded into their transpose (``val_29`` is ``q_proj.weight.T``,
  ``onnx::MatMul_559`` likewise);
- a tied parameter stored twice (GPT-2's embedding as ``lm_head.weight`` for the Gather and as
  a folded transpose for the head's MatMul);
- distinct parameters with equal values stored once (every RMSNorm weight is ones at
  initialisation: one initializer for all, or ``Identity`` nodes of one in TorchScript files);
- zero biases dropped (a Gemm's C, a Conv's B).

:func:`recover_parameters` reads, in this order, the dynamo exporter's node metadata (the
``%p_…`` placeholders of ``pkg.torch.onnx.fx_node`` with ``pkg.torch.onnx.name_scopes``, and the
optimizer's ``folded_from`` and ``original_node_name`` marks), the TorchScript node paths
(``/model/layers.0/self_attn/q_proj/MatMul``), and last value identity (a constant equal to a
parameter or to its transpose). Each read of an initializer is claimed for one module parameter
with the transform from the module's tensor (identity or transpose). :class:`RecoverParametersPass`
then rewrites the model so that each parameter is one initializer of its own: a shared tensor is
split (the split parameters named by their module names), a dropped bias is restored as zeros,
and, with ``tie=True``, every other copy
of a parameter is read from it (through a ``Transpose`` where the copy is transposed), so that the
gradients of its uses add, as in PyTorch. Training the stored transpose of a weight is training the weight: SGD, Adam and
AdamW are elementwise.

What cannot be recovered stays constant and is listed with the reason: a value computed from a
parameter and other values when exported (positions folded through an embedding, batch-norm
statistics folded into a Conv's weights), and buffers (rotary caches, masks).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import re
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.passes.metadata import MODULE_NAMES, MODULE_TRANSPOSED, module_names
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, captured_values, shapes

EXPORTER_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
ORIGINAL_NAME = "pkg.torch.onnx.original_node_name"
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
FX_NODE = "pkg.torch.onnx.fx_node"
NAME_SCOPES = "pkg.torch.onnx.name_scopes"

_PLACEHOLDER = re.compile(r"%(p_[A-Za-z0-9_]+)")
_TARGET = re.compile(r"target=torch\.ops\.([A-Za-z0-9_.]+)")
# fx targets whose weight operand an exporter stores transposed (MatMul(x, Wᵀ))
_TRANSPOSING = ("aten.linear", "aten.t", "aten.permute", "aten.transpose", "aten.numpy_T")
_PRODUCTS = {"MatMul": 1, "Gemm": 1}
# the products whose bias the optimizer drops when it is zero, by the fx calls they come from
# (onnxscript's no-op rules remove Add(y, 0) for a scalar 0 only: a linear's MatMul keeps its Add)
_BIASED = {"Gemm": ("aten.linear", "aten.addmm"),
           "Conv": ("aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d")}
# the inputs (by position) that hold a layer's weight, bias, scale or shift: a float tensor read
# there is trained whatever its name (an LSTM's gates reordered by the exporter, a Conv with a
# batch normalization folded into it), as it is stored when the module's own cannot be recovered
WEIGHT_INPUTS = {
    "Conv": {1: "W", 2: "B"}, "ConvTranspose": {1: "W", 2: "B"}, "Gemm": {0: "A", 1: "B", 2: "C"},
    "MatMul": {0: "A", 1: "B"}, "LSTM": {1: "W", 2: "R", 3: "B", 7: "P"}, "GRU": {1: "W", 2: "R", 3: "B"},
    "RNN": {1: "W", 2: "R", 3: "B"}, "BatchNormalization": {1: "scale", 2: "B"},
    "LayerNormalization": {1: "Scale", 2: "B"}, "InstanceNormalization": {1: "scale", 2: "B"},
    "GroupNormalization": {1: "scale", 2: "bias"},
}
# what producers put between a stored weight and its layer (paddle2onnx reshapes biases, a float16
# weight is cast): the weight is still the layer's
_VIEWS = frozenset({"Identity", "Cast", "Reshape", "Transpose", "Squeeze", "Unsqueeze"})
_AS_STORED = " as stored"


def weight_read(value: ir.Value) -> str | None:
    """Which layer input reads ``value`` as its weight ("Conv W", "LSTM R", ...), directly or
    through :data:`_VIEWS` (their data input), inside subgraphs too; None when none does."""
    pending, seen = [value], {value}
    while pending:
        for node, index in pending.pop(0).uses():
            if node.domain not in ("", "ai.onnx"):
                continue
            slot = WEIGHT_INPUTS.get(node.op_type, {}).get(index)
            if slot is not None:
                return f"{node.op_type} {slot}"
            if node.op_type in _VIEWS and index == 0 and node.outputs[0] not in seen:
                seen.add(node.outputs[0])
                pending.append(node.outputs[0])
    return None


def mangled(name: str) -> str:
    """The name torch.export gives a parameter's placeholder (``p_`` + this), lower-cased as it
    sometimes does (``LayerNorm`` -> ``layernorm``): compare placeholders lower-cased."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name).lower()


@dataclasses.dataclass(frozen=True)
class Parameter:
    """A module parameter: its module name (a ``state_dict()`` key), the initializer that holds it
    (``transposed``: the stored tensor is the module's transposed), the module's shape, how it was
    found, the other initializers that hold a copy of it, and the other module names of a tied one."""

    name: str
    initializer: str
    transposed: bool
    shape: tuple[int, ...]
    found_by: str
    copies: tuple[tuple[str, bool], ...] = ()
    aliases: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"name": self.name, "initializer": self.initializer, "transposed": self.transposed,
                "shape": list(self.shape), "found_by": self.found_by,
                "copies": [list(c) for c in self.copies], "aliases": list(self.aliases)}

    @property
    def module(self) -> bool:
        """Whether the stored tensor is (a transform of) the module's own parameter; False for a
        weight trained as the exporter stored it (:func:`weight_read`), fused or reordered."""
        return _AS_STORED not in self.found_by

    def module_value(self, stored: np.ndarray) -> np.ndarray:
        """The module's tensor from the stored one."""
        return stored.T if self.transposed else stored


@dataclasses.dataclass
class Recovery:
    """The parameters found (in the model's initializer order) and the float constants left as
    they are, each with the reason (initializer name -> reason)."""

    parameters: list[Parameter]
    constants: dict[str, str]
    torch_export: bool


@dataclasses.dataclass
class _Claim:
    """One read of an initializer, claimed for a module parameter."""

    node: ir.Node | None  # None: read only where no claim is made (inside a subgraph)
    index: int
    value: ir.Value
    name: str
    transposed: bool
    found_by: str


def is_torch_export(model: ir.Model | onnx.ModelProto) -> bool:
    """Written by torch.onnx.export: dynamo (its marks and node metadata) or TorchScript (its
    ``/module/path/Op`` node names). A ModelProto is read as it is (no conversion to onnx-ir)."""
    graph = model.graph
    if isinstance(model, onnx.ModelProto):
        def marked(entries, key):
            return any(entry.key == key for entry in entries)

        initializers = {t.name for t in graph.initializer}
        # (onnx-ir reads an initializer's marks from its graph input or value_info entry)
        return (any(v.name in initializers and marked(v.metadata_props, EXPORTER_KIND)
                    for v in (*graph.input, *graph.value_info))
                or any(marked(n.metadata_props, FX_NODE) or n.name.startswith("/") for n in graph.node))
    return _dynamo_export(graph) or any((n.name or "").startswith("/") for n in graph)


def _dynamo_export(graph: ir.Graph) -> bool:
    return any(EXPORTER_KIND in v.metadata_props for v in graph.initializers.values()) or any(
        FX_NODE in n.metadata_props for n in graph)


def recover_parameters(model: ir.Model) -> Recovery:
    """The module parameters of ``model`` (see the module doc); ``model`` is not changed."""
    return _analyse(model)[0]


@dataclasses.dataclass
class _Restored:
    """A zero bias that the exporter's optimizer removed from ``node`` (a Gemm or Conv)."""

    node: ir.Node
    name: str
    size: int
    dtype: ir.DataType


def _names_by_call(claims: list[_Claim]) -> dict[str, set[str]]:
    """fx_node record -> the module names that the reads of its nodes are claimed for."""
    names: dict[str, set[str]] = {}
    for claim in claims:
        fx = claim.node.metadata_props.get(FX_NODE) if claim.node is not None else None
        if fx is not None:
            names.setdefault(fx, set()).add(claim.name)
    return names


def _folded_biases(graph: ir.Graph, claims: list[_Claim], placeholders: Mapping[str, str]) -> list[_Restored]:
    """The biases of linear, addmm and convolution calls that no node reads any more: the
    optimizer drops a Gemm's C and a Conv's B when they are zeros; PyTorch trains them all the same."""
    claimed = _names_by_call(claims)
    restored, seen = [], set()
    for node in graph:
        fx = node.metadata_props.get(FX_NODE)
        if fx is None or fx in seen or node.op_type not in _BIASED:
            continue
        target = _fx_target(fx)
        if not target.startswith(_BIASED[node.op_type]) or (len(node.inputs) > 2 and node.inputs[2] is not None):
            continue
        weight = node.inputs[1]
        dims = stored_shape(weight) if weight is not None else ()
        if len(dims) < 2 or (node.op_type == "Gemm" and len(dims) != 2):
            continue
        names = [_module_name(p, node, placeholders) for p in dict.fromkeys(_PLACEHOLDER.findall(fx))]
        free = [n for n in names if n not in claimed.get(fx, set())]
        if len(free) != 1 or len(names) < 2:
            continue
        transposed = node.op_type == "Conv" or int(shapes.attr(node, "transB", 0))
        size = dims[0 if transposed else 1]  # a Conv's output channels lead its weight
        seen.add(fx)
        restored.append(_Restored(node, free[0], size, weight.dtype))
    return restored


def _analyse(model: ir.Model) -> tuple[Recovery, list[_Claim], list[_Restored]]:
    graph = model.graph
    floats = {v for v in graph.initializers.values() if v.dtype in FLOAT_TYPES}
    torch_export = is_torch_export(model)
    claims: list[_Claim] = []
    restored: list[_Restored] = []
    digests: dict = {}
    constants: dict[str, str] = {}
    if torch_export:
        placeholders = _placeholder_names(graph)
        open_reads = []
        for node in graph:
            for index, value in enumerate(node.inputs):
                if value in floats:
                    claim = _claim(node, index, value, placeholders)
                    if claim is not None:
                        claims.append(claim)
                    elif FX_NODE in node.metadata_props:
                        open_reads.append((node, index, value))
        # an fx call spread over several nodes (a linear's MatMul and Add): what the others read is
        # not this read's
        taken = _names_by_call(claims)
        for node, index, value in open_reads:
            fx = node.metadata_props[FX_NODE]
            claim = _claim(node, index, value, placeholders, taken.get(fx, set()))
            if claim is not None:
                claims.append(claim)
        for node in graph:  # TorchScript's Identity of a shared tensor, under the module name
            if node.op_type == "Identity" and node.inputs[0] in floats and _module_like(node.outputs[0].name):
                claims.append(_Claim(node, 0, node.inputs[0], node.outputs[0].name, False, "Identity node"))
        claimed = {c.value for c in claims}
        # read only inside a subgraph, say: as it is (by its mark; by its name in a TorchScript file)
        dynamo = _dynamo_export(graph)
        for value in graph.initializers.values():
            if value in floats and value not in claimed and value.uses() and (
                    value.metadata_props.get(EXPORTER_KIND) == "PARAMETER" or (not dynamo and _module_like(value.name))):
                claims.append(_Claim(None, -1, value, value.name, False, "exporter mark"
                                     if EXPORTER_KIND in value.metadata_props else "name"))
        _claim_by_value(graph, floats, claims, digests)
        _claim_weights_as_stored(graph, floats, claims)
        restored = _folded_biases(graph, claims, placeholders)
    else:
        for node in graph:
            for index, value in enumerate(node.inputs):
                if value in floats:
                    claims.append(_Claim(node, index, value, value.name, False, "name"))
            # (read inside a subgraph: claimed as it is, no read to rewrite)
            claims.extend(_Claim(None, -1, value, value.name, False, "name") for value in captured_values(node)
                          if value in floats)
    parameters = _parameters(graph, claims, digests if torch_export else None)
    parameters.extend(Parameter(r.name, r.name, False, (r.size,), "restored (a zero bias the exporter folded away)")
                      for r in restored)
    held = {p.initializer for p in parameters} | {c for p in parameters for c, _ in p.copies}
    for value in graph.initializers.values():
        if value in floats and value.name not in held:
            constants[value.name] = _why_constant(value, torch_export)
    return Recovery(parameters, constants, torch_export), claims, restored


def _placeholder_names(graph: ir.Graph) -> dict[str, str]:
    """Placeholder (``p_…``) -> module name, from the initializers' marks and folding records."""
    names = {}
    for value in graph.initializers.values():
        original = value.metadata_props.get(ORIGINAL_NAME)
        if original and value.metadata_props.get(EXPORTER_KIND) == "PARAMETER":
            names[original.lower()] = value.name
        for source in _folded_from(value):
            names.setdefault("p_" + mangled(source), source)
    return names


def _folded_from(value: ir.Value) -> list[str]:
    return _listed(value.metadata_props.get(FOLDED_FROM))


def _listed(text: str | None) -> list[str]:
    """The strings of a Python list literal as the exporter writes metadata ("['', 'lm']")."""
    try:
        items = ast.literal_eval(text) if text else []
    except (ValueError, SyntaxError):
        return []
    return [s for s in items if isinstance(s, str)] if isinstance(items, (list, tuple)) else []


def _claim(node: ir.Node, index: int, value: ir.Value, placeholders: Mapping[str, str],
           taken: set[str] = frozenset()) -> _Claim | None:
    """Whose parameter this read of ``value`` is, from the dynamo metadata or the TorchScript path
    (``taken``: module names that other nodes of the same fx call read)."""
    fx = node.metadata_props.get(FX_NODE)
    if fx is not None:
        return _claim_from_fx(node, index, value, fx, placeholders, taken)
    own_kind = value.metadata_props.get(EXPORTER_KIND)
    if own_kind == "PARAMETER":
        return _Claim(node, index, value, value.name, False, "exporter mark")
    if own_kind is not None:
        return None  # a buffer or a constant of the exporter
    if _module_like(value.name):
        return _Claim(node, index, value, value.name, False, "name")
    scope = _torchscript_scope(node)
    if scope is not None and _PRODUCTS.get(node.op_type) == index and len(stored_shape(value)) == 2:
        transposed = node.op_type == "MatMul" or not int(shapes.attr(node, "transB", 0))
        return _Claim(node, index, value, f"{scope}.weight", transposed, "node path")
    return None


def _fx_target(fx: str) -> str:
    """``aten.linear.default`` from an fx_node record ('' when it names none)."""
    match = _TARGET.search(fx)
    return match[1] if match else ""


def _claim_from_fx(node, index, value, fx: str, placeholders, taken) -> _Claim | None:
    args = list(dict.fromkeys(_PLACEHOLDER.findall(fx)))
    if not args:
        return None  # reads no parameter: a buffer, a mask, a folded constant
    if taken:
        args = [a for a in args if _module_name(a, node, placeholders) not in taken]
    mine = _placeholder_of(node, index, value, args, placeholders)
    if mine is None:
        return None
    name = _module_name(mine, node, placeholders)
    target = _fx_target(fx)
    own = value.metadata_props.get(ORIGINAL_NAME)
    folded = _folded_from(value)
    if own == mine or (own is not None and value.metadata_props.get(EXPORTER_KIND) == "PARAMETER"):
        return _Claim(node, index, value, name, False, "exporter mark" if own == mine else "fx_node")
    if value.name == name or name in module_names(value):
        return _Claim(node, index, value, name, value.metadata_props.get(MODULE_TRANSPOSED) == "1", "fx_node")
    if len(folded) == 1 and "p_" + mangled(folded[0]) == mine.lower():
        if target.startswith(_TRANSPOSING) and len(stored_shape(value)) == 2:
            return _Claim(node, index, value, name, True, "folded_from")
        return None  # folded by a transform that is not recorded
    return None  # computed from the parameter and other values: not the parameter


def _placeholder_of(node, index, value, args: list[str], placeholders) -> str | None:
    """Which of the fx node's parameter placeholders this input is."""
    own = value.metadata_props.get(ORIGINAL_NAME)
    if own in args:
        return own
    # the names the value is known by: the sources it was folded from, the module names a
    # rewrite marked it with (a split or restored parameter, whose fx call may read no other)
    known = ["p_" + mangled(s) for s in (*_folded_from(value), *module_names(value))]
    direct = [a for a in args if a.lower() in known]
    if len(direct) == 1:
        return direct[0]
    if len(args) == 1:
        return args[0]
    # several placeholders, none named by the input itself: match the node's parameter-like inputs
    # in order with the placeholders that no input names (a LayerNormalization's shared weight and bias)
    named = {value.metadata_props.get(ORIGINAL_NAME) for value in node.inputs if value is not None}
    free = [a for a in args if a not in named]
    anonymous = [i for i, v in enumerate(node.inputs)
                 if v is not None and v.is_initializer() and v.dtype in FLOAT_TYPES
                 and v.metadata_props.get(ORIGINAL_NAME) not in args]
    if len(free) == len(anonymous) and index in anonymous:
        return free[anonymous.index(index)]
    return None


def _module_name(placeholder: str, node: ir.Node, placeholders: Mapping[str, str]) -> str:
    if placeholder.lower() in placeholders:
        return placeholders[placeholder.lower()]
    body = placeholder[2:].lower()
    for scope in reversed(_scopes(node)):
        if scope and body.startswith(mangled(scope) + "_"):
            return f"{scope}.{placeholder[2 + len(mangled(scope)) + 1:]}"
    return body


def _scopes(node: ir.Node) -> list[str]:
    return _listed(node.metadata_props.get(NAME_SCOPES))


def _torchscript_scope(node: ir.Node) -> str | None:
    """``/model/layers.0/self_attn/q_proj/MatMul`` -> ``model.layers.0.self_attn.q_proj``."""
    name = node.name or ""
    if not name.startswith("/") or name.count("/") < 2:
        return None
    return ".".join(name.split("/")[1:-1])


def _module_like(name: str | None) -> bool:
    """A parameter's path (``model.layers.0.mlp.up_proj.weight``), not an exporter's name."""
    return bool(name) and "." in name and not name.startswith(("onnx::", "/", "val_")) and "::" not in name \
        and name.rsplit(".", 1)[-1].isidentifier()


def stored_shape(value: ir.Value) -> tuple[int, ...]:
    """An initializer's shape, from its tensor (a value_info may declare less); -1 for an unknown
    dimension of a value without one."""
    tensor = value.const_value
    if tensor is not None:
        return tuple(int(d) for d in tensor.shape)
    return tuple(d if isinstance(d, int) else -1 for d in value.shape) if value.shape is not None else ()


def _claim_by_value(graph: ir.Graph, floats: set[ir.Value], claims: list[_Claim], digests: dict) -> None:
    """A constant that no metadata claims, equal to a claimed tensor or to its transpose, is a
    copy of that parameter. Tensors of one repeated value (ones, zeros) prove nothing."""
    claimed: dict[ir.Value, _Claim] = {}
    for claim in claims:
        claimed.setdefault(claim.value, claim)
    known: dict[tuple, _Claim] = {}
    for value, claim in claimed.items():
        digest = _digest(value, False, digests)
        if digest is not None:
            known.setdefault(digest, claim)
    for value in sorted(floats - set(claimed), key=lambda v: v.name):
        for transposed in (False, True):
            digest = _digest(value, transposed, digests)
            source = known.get(digest) if digest is not None else None
            if source is None or not _equal(value, transposed, source.value, False):
                continue
            for node, index in value.uses():
                claims.append(_Claim(node, index, value, source.name, source.transposed != transposed, "value identity"))
            break


def _claim_weights_as_stored(graph: ir.Graph, floats: set[ir.Value], claims: list[_Claim]) -> None:
    """A float initializer that nothing else claims, read as a layer's weight (:func:`weight_read`),
    is a parameter under its own name, trained as stored: the TorchScript exporter's reordered LSTM
    gates (``onnx::LSTM_209``), a Conv with a batch normalization folded into it (``onnx::Conv_12``).
    Not a tensor the exporter marked as a buffer or constant, nor one folded from a parameter that
    was recovered (training it apart would untie them)."""
    claimed = {c.value for c in claims}
    recovered = {c.name for c in claims}
    for value in graph.initializers.values():
        if value not in floats or value in claimed or value.metadata_props.get(EXPORTER_KIND, "PARAMETER") != "PARAMETER" \
                or any(s in recovered for s in _folded_from(value)):
            continue
        slot = weight_read(value)
        if slot is None:
            continue
        how = f"{slot}{_AS_STORED}"
        if any(_fused_batch_norm(node, value) for node, _ in value.uses()):
            how += " (a batch normalization folded into it: trained fused)"
        claims.extend(_Claim(node, index, value, value.name, False, how) for node, index in value.uses())


_SAMPLES = 256


def _digest(value: ir.Value, transposed: bool, cache: dict) -> tuple | None:
    """What equal tensors share, cheaply: dtype, shape and an even sample of the elements in
    that orientation (a match is confirmed by :func:`_equal`, which reads them all); None for a
    tensor of one repeated value. Memoised in ``cache``: a weight stored beside the model is
    read a few pages at a time, not whole."""
    key = (value, transposed)
    if key not in cache:
        cache[key] = _sampled(value, transposed)
    return cache[key]


def _oriented(value: ir.Value, transposed: bool) -> np.ndarray | None:
    tensor = value.const_value
    if tensor is None or tensor.size < 2 or (transposed and len(tensor.shape) != 2):
        return None
    array = tensor.numpy()
    return array.T if transposed else array


def _sampled(value: ir.Value, transposed: bool) -> tuple | None:
    tensor = value.const_value
    # a weight stored beside the model, mapped here: its mapping is let go once sampled (the pages
    # read around each sample would otherwise stay resident, the whole of a small tensor)
    mapped_here = isinstance(tensor, ir.ExternalTensor) and tensor.raw is None
    array = _oriented(value, transposed)
    try:
        if array is None:
            return None
        positions = np.unique(np.linspace(0, array.size - 1, min(_SAMPLES, array.size)).astype(np.int64))
        sample = array[np.unravel_index(positions, array.shape)]
        if (sample == sample[0]).all() and (array == sample[0]).all():
            return None
        return array.dtype.str, array.shape, sample.tobytes()
    finally:
        array = None
        if mapped_here:
            with contextlib.suppress(BufferError):  # a view of it still held elsewhere: it stays mapped
                tensor.release()


def _equal(a: ir.Value, a_transposed: bool, b: ir.Value, b_transposed: bool) -> bool:
    x, y = _oriented(a, a_transposed), _oriented(b, b_transposed)
    return x is not None and y is not None and x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)


def _parameters(graph: ir.Graph, claims: list[_Claim], digests: dict | None) -> list[Parameter]:
    """The claims grouped by module name; ``digests``: tie equal tensors (None: never, a model
    that no exporter wrote)."""
    order = {v: i for i, v in enumerate(graph.initializers.values())}
    stored: dict[str, dict[tuple[ir.Value, bool], str]] = {}
    for claim in claims:
        stored.setdefault(claim.name, {}).setdefault((claim.value, claim.transposed), claim.found_by)
    parameters = []
    for name, holders in stored.items():
        ranked = sorted(holders, key=lambda h: (h[0].name != name, h[1], order.get(h[0], 0)))
        value, transposed = ranked[0]
        dims = stored_shape(value)
        parameters.append(Parameter(name, value.name, transposed, tuple(reversed(dims)) if transposed else dims,
                                    holders[ranked[0]], tuple((v.name, t) for v, t in ranked[1:])))
    _merge_ties(graph, parameters, digests)
    parameters[:] = [p for p in parameters if p is not None]
    parameters.sort(key=lambda p: (order.get(graph.initializers.get(p.initializer), 0), p.name))
    return parameters


def _merge_ties(graph: ir.Graph, parameters: list, digests: dict | None) -> None:
    """Two module names found for one tensor are one tied parameter (GPT-2's embedding and head in
    a TorchScript file): the first keeps the tensor, the other becomes an alias. One tensor is
    one initializer read under both names, or two initializers of equal values (up to a
    transpose). Equal values that the exporter stored once for distinct parameters (its
    placeholders say so, or TorchScript's Identity nodes) stay apart."""
    first: dict = {}
    for i, p in enumerate(parameters):
        value = graph.initializers[p.initializer]
        keys = [c for c, _ in [(p.initializer, p.transposed), *p.copies]]
        digest = _digest(value, p.transposed, digests) if digests is not None else None
        if digest is not None:
            keys.append(digest)
        owner = next((first[k] for k in keys if k in first), None)
        q = parameters[owner] if owner is not None else None
        if q is not None and digest is not None and first.get(digest) == owner and q.initializer != p.initializer \
                and not _equal(value, p.transposed, graph.initializers[q.initializer], q.transposed):
            q = None  # equal samples, other values
        if q is None or q.shape != p.shape or (
                p.initializer == q.initializer and p.transposed == q.transposed and p.found_by in _DISTINCT):
            for k in keys:
                first.setdefault(k, i)
            continue
        extra = tuple(c for c in [(p.initializer, p.transposed), *p.copies]
                      if c[0] != q.initializer and c not in q.copies)
        parameters[owner] = dataclasses.replace(q, copies=q.copies + extra, aliases=q.aliases + (p.name, *p.aliases))
        parameters[i] = None


# evidence that a shared tensor holds distinct parameters of equal values
_DISTINCT = ("fx_node", "exporter mark", "Identity node")


def _why_constant(value: ir.Value, torch_export: bool) -> str:
    kind = value.metadata_props.get(EXPORTER_KIND)
    if kind is not None and kind != "PARAMETER":
        return f"exporter {kind.lower()}"
    if not value.uses():
        return "read by no node"
    if any(_fused_batch_norm(node, value) for node, _ in value.uses()):
        return ("a Conv's weight or bias with a batch normalization fused into it by the exporter: not recoverable "
                "(export in training mode or with optimize=False to train them)")
    sources = _folded_from(value)
    if sources and any(_module_like(s) for s in sources):
        named = [s for s in sources if _module_like(s)]
        return (f"computed from {', '.join(named)} and constants when exported (optimize=True folded it): "
                "not recoverable")
    return "exporter constant" if torch_export else "constant"


def _fused_batch_norm(node: ir.Node, value: ir.Value) -> bool:
    if node.op_type != "Conv":
        return False
    fx = node.metadata_props.get(FX_NODE)
    if fx is not None:
        return "batch_norm" in _fx_target(fx)
    return (value.name or "").startswith("onnx::Conv")


class RecoverParametersPass(ir.passes.InPlacePass):
    """Each recovered parameter one initializer of its own (see the module doc); the recovery as
    found before the rewrite is ``recovery``, and ``recovered`` the parameters as they are after it.

    tie: every copy of a parameter becomes a Transpose/Identity of it (train models); False keeps
    the copies as initializers (the exported model's layout), their values set from the parameter.
    """

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.tie = tie
        self.recovery: Recovery | None = None
        self.recovered: list[Parameter] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.recovery, claims, restored = _analyse(model)
        namer = Namer.for_graph(graph, prefix="recovered")
        by_name = {p.name: p for p in self.recovery.parameters}
        alias_of = {a: p.name for p in self.recovery.parameters for a in p.aliases}
        homes: dict[str, ir.Value] = {}  # module name -> its own initializer
        owner: dict[ir.Value, str] = {}  # initializer -> the parameter it now holds
        modified = bool(restored)
        for r in restored:
            homes[r.name] = _restore_bias(graph, namer, r)
            owner[homes[r.name]] = r.name
        # a shared tensor stays the parameter's whose name it has (or the first one's)
        for p in sorted(self.recovery.parameters, key=lambda p: p.name != p.initializer):
            if p.name in homes:
                continue
            value = graph.initializers[p.initializer]
            if value not in owner:
                owner[value] = p.name
                homes[p.name] = value
        for claim in claims:  # the Identity's output name is the split parameter's
            output = claim.node.outputs[0] if claim.found_by == "Identity node" else None
            if output is not None and not output.is_graph_output():
                namer.taken.discard(output.name)
                output.name = namer.fresh(f"{claim.name}.shared")
        for p in self.recovery.parameters:
            if p.name in homes:
                continue
            shared = graph.initializers[p.initializer]
            copy = ir.Value(name=namer.fresh(p.name), type=shared.type, shape=shared.shape,
                            const_value=ir.Tensor(np.array(shared.const_value.numpy()), name=None))
            graph.register_initializer(copy)
            homes[p.name], owner[copy] = copy, p.name
            modified = True
        transposes: dict[tuple[str, bool], ir.Value] = {}
        for claim in claims:
            name = alias_of.get(claim.name, claim.name)
            p = by_name[name]
            home = homes[name]
            if claim.node is None or (claim.value is home and claim.transposed == p.transposed):
                continue  # (no node: a read inside a subgraph, left as it is)
            if claim.value is not home and not self.tie and claim.value.name != p.initializer \
                    and owner.get(claim.value) is None:
                continue  # a copy kept in the file's layout
            if claim.found_by == "Identity node":
                modified |= _replace_identity(graph, claim.node, home)
                continue
            source = home
            if claim.transposed != p.transposed:
                key = (name, claim.transposed)
                if key not in transposes:
                    node = ir.node("Transpose", [home], {"perm": [1, 0]}, name=namer.fresh(f"{name}.T"))
                    node.outputs[0].name = namer.fresh(f"{name}.T")
                    node.outputs[0].type = home.type
                    node.outputs[0].shape = ir.Shape(list(reversed(list(home.shape))))
                    graph.insert_before(next(iter(graph)), node)
                    transposes[key] = node.outputs[0]
                source = transposes[key]
            if claim.node.inputs[claim.index] is not source:
                claim.node.replace_input_with(claim.index, source)
                modified = True
        claimed = {c.value for c in claims}
        for value in list(graph.initializers.values()):
            if value in claimed and not value.uses() and not value.is_graph_output():
                graph.initializers.pop(value.name)
        self.recovered = []
        kept = set(graph.initializers)
        for p in self.recovery.parameters:
            home = homes[p.name]
            copies = tuple(c for c in p.copies if c[0] in kept and c[0] != home.name)
            self.recovered.append(dataclasses.replace(p, initializer=home.name, copies=copies))
            if self.recovery.torch_export:
                home.metadata_props[MODULE_NAMES] = json.dumps([p.name, *p.aliases])
                home.metadata_props[MODULE_TRANSPOSED] = str(int(p.transposed))
        return ir.passes.PassResult(model, modified=modified)


def _restore_bias(graph: ir.Graph, namer: Namer, restored: _Restored) -> ir.Value:
    """A zero bias under the parameter's name, as the product's C (Gemm) or B (Conv) input."""
    bias = ir.Value(name=namer.fresh(restored.name), type=ir.TensorType(restored.dtype), shape=ir.Shape([restored.size]),
                    const_value=ir.Tensor(np.zeros(restored.size, restored.dtype.numpy())))
    graph.register_initializer(bias)
    restored.node.resize_inputs(3)
    restored.node.replace_input_with(2, bias)
    return bias


def _replace_identity(graph: ir.Graph, node: ir.Node, home: ir.Value) -> bool:
    """TorchScript's ``Identity(shared)`` under a split parameter's name: its reads now read ``home``."""
    output = node.outputs[0]
    if output.is_graph_output():
        return False
    for user, index in list(output.uses()):
        user.replace_input_with(index, home)
    graph.remove(node, safe=True)
    return True
