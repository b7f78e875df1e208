"""The default variables: the parameters a framework would train, not the constants an exporter stored.

A float initializer is a parameter when some node reads it where a gradient flows (a
differentiable input of its rule, or an outer value a subgraph reads), and

- in a model exported by ``torch.onnx.export`` (its initializers carry the exporter's
  ``pkg.torch.export.graph_signature.InputSpec.kind`` mark): it is marked ``PARAMETER``, as the
  module's ``named_parameters()`` are; buffers and the constants the exporter created (``val_*``:
  exponents, epsilons, scale factors, causal masks, folded weights) are not;
- in any other model: it has more than one element (a one-element initializer is an exponent,
  an epsilon, a scale factor or a bound) and every element is finite and below half the dtype's
  largest magnitude (a tensor holding -inf or -3.4e38 is an attention mask).

Name other initializers explicitly (``wrt=``, ``--wrt``, ``requires_grad=``) to differentiate them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import AutodiffError
from onnx_autodiff.rules import GradRegistry, default_registry
from onnx_autodiff.toolkit import FLOAT_TYPES, captured_values

EXPORTER_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"


@dataclasses.dataclass
class DefaultParameters:
    """The chosen parameters, and why each other float initializer was left out (name -> reason)."""

    parameters: list[ir.Value]
    left_out: dict[str, str]


def default_parameters(model: ir.Model, registry: GradRegistry | None = None) -> DefaultParameters:
    """The float initializers of ``model.graph`` that the default differentiates (see the module doc)."""
    graph = model.graph
    floats = [v for v in graph.initializers.values() if v.dtype in FLOAT_TYPES]
    read = _read_where_gradients_flow(model, registry or default_registry())
    exported = any(EXPORTER_KIND in v.metadata_props for v in graph.initializers.values())
    parameters, left_out = [], {}
    for value in floats:
        reason = _why_not_a_parameter(value, value in read, exported)
        if reason is None:
            parameters.append(value)
        else:
            left_out[value.name] = reason
    return DefaultParameters(parameters, left_out)


def _why_not_a_parameter(value: ir.Value, read: bool, exported: bool) -> str | None:
    if not read:
        return "read by no differentiable input"
    if exported:
        kind = value.metadata_props.get(EXPORTER_KIND)
        return None if kind == "PARAMETER" else f"exporter {kind.lower() if kind else 'constant'}"
    if value.const_value is None or value.const_value.size <= 1:
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

    initializers = set(model.graph.initializers.values())
    found: set[ir.Value] = set()
    for node in model.graph:
        opset = model.opset_imports.get(node.domain or "", 1)
        rule = registry.lookup(node, opset)
        names = _input_names(rule, node, opset)
        for i, value in enumerate(node.inputs):
            if value in initializers and (names is None or (i < len(names) and names[i] in rule.differentiable)):
                found.add(value)
        found.update(v for v in captured_values(node) if v in initializers)
    return found


def _input_names(rule, node: ir.Node, opset: int) -> list[str] | None:
    """The schema's input names, or None where no rule says (every input then counts as read)."""
    if rule is None:
        return None
    try:
        return rule.input_names(node, opset)
    except AutodiffError:
        return None

