"""The default variables: the parameters a framework would train, not the constants an exporter stored.

A float initializer is a parameter when some node reads it where a gradient flows (a
differentiable input of its rule, or an outer value a subgraph reads), and

- in a model that :class:`~onnx_autodiff.weights.recovery.RecoverParametersPass` rewrote (its
  initializers carry module names): it carries them;
- in a model exported from PyTorch (``torch.onnx.export``, dynamo or TorchScript): it holds a
  module parameter as :func:`~onnx_autodiff.weights.recovery.recover_parameters` finds them, as it is
  or transposed (a folded ``weight.T``, a tied copy, one tensor the exporter stored for several
  parameters of equal values); buffers and the constants the exporter created (exponents,
  epsilons, scale factors, causal masks, rotary caches) are not;
- in any other model: it has more than one element (a one-element initializer is an exponent,
  an epsilon, a scale factor or a bound) or a layer reads it as its weight, bias, scale or shift
  (:func:`~onnx_autodiff.weights.recovery.weight_read`), and every element is finite and below half
  the dtype's largest magnitude (a tensor holding -inf or -3.4e38 is an attention mask).

Weights stored as float ``Constant`` nodes (paddle2onnx; silero's ``If`` branches) are lifted into
initializers first (:class:`~onnx_autodiff.passes.lift.LiftWeightConstantsPass`) and follow the
same rule.

Name other initializers explicitly (``wrt=``, ``--wrt``, ``requires_grad=``) to differentiate them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import AutodiffError
from onnx_autodiff.passes.metadata import MODULE_NAMES
from onnx_autodiff.weights.quantized import frozen_bases
from onnx_autodiff.passes.lift import LiftWeightConstantsPass
from onnx_autodiff.passes.patterns import Match, grouped
from onnx_autodiff.weights.recovery import is_torch_export, recover_parameters, stored_shape, weight_read
from onnx_autodiff.rules import GradRegistry, default_registry
from onnx_autodiff.toolkit import FLOAT_TYPES, captured_values, graph_and_subgraphs, shapes


@dataclasses.dataclass
class DefaultParameters:
    """The chosen parameters, and why each other float initializer was left out (name -> reason)."""

    parameters: list[ir.Value]
    left_out: dict[str, str]


def default_parameters(model: ir.Model, registry: GradRegistry | None = None) -> DefaultParameters:
    """The float initializers of ``model.graph`` that the default differentiates (see the module doc).

    Weight Constants are lifted into initializers of ``model`` first (in place, as
    :class:`~onnx_autodiff.passes.lift.LiftWeightConstantsPass` does), so that every value
    returned is an initializer the caller can differentiate; the model computes the same."""
    LiftWeightConstantsPass()(model)
    graph = model.graph
    floats = [v for v in graph.initializers.values() if v.dtype in FLOAT_TYPES]
    read = _read_where_gradients_flow(model, registry or default_registry())
    held = _held_parameters(model)
    parameters, left_out = [], {}
    for value in floats:
        reason = _why_not_a_parameter(value, value in read, held)
        if reason is None:
            parameters.append(value)
        else:
            left_out[value.name] = reason
    left_out.update(quantized_weights(graph))
    return DefaultParameters(parameters, left_out)


def quantized_weights(graph: ir.Graph) -> dict[str, str]:
    """The integer initializers that hold a quantized weight (the data of a DequantizeLinear, the
    packed weight of com.microsoft.MatMulNBits), each with why it is frozen: a gradient cannot
    change an integer tensor; LoRA trains adapters beside it."""
    found = {}
    for name, node in frozen_bases(graph).items():
        stored = graph.initializers[name]
        if stored.dtype in FLOAT_TYPES:  # a float16 base read through Cast: a float, not quantized
            continue
        what = (f"{shapes.attr(node, 'bits', 4)}-bit MatMulNBits" if node.op_type == "MatMulNBits"
                else f"{stored.dtype.name.lower()} DequantizeLinear")
        found[name] = f"quantized weight ({what}): frozen, LoRA trains adapters on it"
    return found


def _held_parameters(model: ir.Model) -> dict[str, str] | None:
    """Initializer -> why it is no parameter (absent: it is one), for a rewritten or exported
    model; None for any other model."""
    graph = model.graph
    if any(MODULE_NAMES in v.metadata_props for v in graph.initializers.values()):
        return {v.name: "exporter constant" for v in graph.initializers.values() if MODULE_NAMES not in v.metadata_props}
    if not is_torch_export(model):  # (before the analysis, which claims every read of any model)
        return None
    return recover_parameters(model).constants


def _why_not_a_parameter(value: ir.Value, read: bool, held: dict[str, str] | None) -> str | None:
    if not read:
        return "read by no differentiable input"
    if held is not None:
        return held.get(value.name)
    if value.const_value is None or (value.const_value.size <= 1 and weight_read(value) is None):
        return "one-element constant"
    if not _finite_and_moderate(value.const_value):
        return "mask (infinite or extreme values)"
    return None


def _finite_and_moderate(tensor: ir.TensorProtocol, step: int = 1 << 22) -> bool:
    """Every element finite and below half the dtype's largest magnitude. Read a slice at a time,
    and a tensor stored beside the model is let go of afterwards (its file's pages no longer
    count in memory): a multi-GB model is never held whole."""
    array = tensor.numpy().reshape(-1)
    limit = np.finfo(array.dtype).max / 2 if array.dtype.kind == "f" else np.inf
    ok = all(np.isfinite(part).all() and np.abs(part).max() < limit
             for part in (array[i:i + step] for i in range(0, array.size, step)))
    del array
    if isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):  # someone else holds a view: it stays mapped
            tensor.release()
    return ok


def _read_where_gradients_flow(model: ir.Model, registry: GradRegistry) -> set[ir.Value]:
    """The initializers that a node's rule, or a pattern rule's match (a weight read through a
    QuantizeLinear → DequantizeLinear pair), differentiates."""
    initializers = set(model.graph.initializers.values())
    found: set[ir.Value] = set()
    units = grouped(list(model.graph), registry.patterns(), model.opset_imports.get("", 1), set)
    for unit in units:
        if isinstance(unit, Match):
            names = unit.rule.inputs[0]
            found.update(v for name, v in zip(names, unit.inputs) if v in initializers and name in unit.rule.differentiable)
            continue
        opset = model.opset_imports.get(unit.domain or "", 1)
        rule = registry.lookup(unit, opset)
        names = _input_names(rule, unit, opset)
        for i, value in enumerate(unit.inputs):
            if value in initializers and (names is None or (i < len(names) and names[i] in rule.differentiable)):
                found.add(value)
        found.update(v for v in captured_values(unit) if v in initializers)
    return found


def _input_names(rule, node: ir.Node, opset: int) -> list[str] | None:
    """The schema's input names, or None where no rule says (every input then counts as read)."""
    if rule is None:
        return None
    try:
        return rule.input_names(node, opset)
    except AutodiffError:
        return None



@dataclasses.dataclass(frozen=True)
class ParameterRow:
    """One line of ``onnx-autodiff params``: a module parameter (or a float constant, ``name``
    None) with the tensor that stores it, the transform from the module's tensor to the stored
    one, the module's shape, whether the defaults train it and why not."""

    name: str | None
    initializer: str
    transform: str
    shape: tuple[int, ...]
    trained: bool
    why: str
    found_by: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


def parameter_rows(model: ir.Model, registry: GradRegistry | None = None) -> list[ParameterRow]:
    """The module parameters that recovery finds in ``model`` (which is not changed) and the float
    constants, with what the default training does with each: the parameters' rows first, in the
    file's initializer order, then the constants'."""
    from onnx_autodiff.weights.recovery import RecoverParametersPass

    lift = LiftWeightConstantsPass()
    if _holds_constants(model):  # (the model is left as it is: the weights are lifted in a copy)
        model = model.clone()
        lift(model)
    where = {w.initializer: "; ".join(site.describe() for site in w.sites) for w in lift.lifted}
    recovery = recover_parameters(model)
    rewritten = model.clone() if recovery.torch_export else model
    if recovery.torch_export:
        rewrite = RecoverParametersPass(tie=True)
        rewrite(rewritten)
        homes = {p.name: p.initializer for p in rewrite.recovered}
    else:
        homes = {p.name: p.initializer for p in recovery.parameters}
    default = default_parameters(rewritten, registry)
    trained = {v.name for v in default.parameters}
    statistics = _running_statistics(rewritten.graph)
    shared: dict[str, int] = {}
    for p in recovery.parameters:
        shared[p.initializer] = shared.get(p.initializer, 0) + 1
    rows = []
    for p in recovery.parameters:
        stored = p.initializer if p.initializer in model.graph.initializers else "(none: restored as zeros)"
        transform = "transpose" if p.transposed else "identity"
        notes = [f"shared with {shared[p.initializer] - 1} other parameter(s) of equal value: trained apart"] \
            if shared[p.initializer] > 1 else []
        notes += [f"tied: also {a}" for a in p.aliases] + [f"copy in {c}" for c, _ in p.copies]
        home = homes.get(p.name)
        why = "" if home in trained else default.left_out.get(home, "not chosen")
        found_by = p.found_by
        if p.initializer in where:
            found_by = where[p.initializer] if found_by == "name" else f"{found_by} ({where[p.initializer]})"
        if home in statistics:
            why = statistics[home]
        rows.append(ParameterRow(p.name, stored, transform, p.shape, home in trained and home not in statistics,
                                 "; ".join([why, *notes]) if why else "; ".join(notes), found_by))
    for name, reason in [*recovery.constants.items(), *quantized_weights(model.graph).items()]:
        reason = f"{reason} ({where[name]})" if name in where else reason
        rows.append(ParameterRow(None, name, "", stored_shape(model.graph.initializers[name]), False, reason))
    return rows


def _running_statistics(graph: ir.Graph) -> dict[str, str]:
    """BatchNormalization's mean and variance initializers, which training updates and never
    trains (:func:`onnx_autodiff.training.generate_artifacts`), each with that reason."""
    found = {}
    for node in graph:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            for value in node.inputs[3:5]:
                if value is not None and value.is_initializer():
                    found[value.name] = "BatchNormalization running statistic: updated in training mode, not trained"
    return found


def _holds_constants(model: ir.Model) -> bool:
    return any(node.op_type == "Constant" for graph in graph_and_subgraphs(model.graph) for node in graph)
