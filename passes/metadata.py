"""What the passes tell each other through a model: its metadata keys and their readers."""

from __future__ import annotations

import json
from collections.abc import Iterable

import onnx_ir as ir

# Node metadata "<op type>:<forward node>": the forward node whose rule emitted a backward node
# (set by the engine, kept by the rewrites, read by OutlinePass and by readers of the graph).
GRAD_OF = "onnx_autodiff.grad_of"

# Model metadata: a JSON list of the values being differentiated, which the cleanup never folds.
DIFFERENTIATED_KEY = "onnx_autodiff.differentiated"

# Initializer metadata set by RecoverParametersPass: the module parameter names the tensor holds (a
# JSON list; a tied parameter has several) and whether it holds the module's tensor transposed
# ("1", a folded weight.T) or as it is ("0"); read by the default parameters and by LoRA's targets.
MODULE_NAMES = "onnx_autodiff.module_names"
MODULE_TRANSPOSED = "onnx_autodiff.module_transposed"


# Model metadata: a JSON list of initializers that the cleanup never folds although nothing
# differentiates them: the stored forms of LoRA's frozen bases, which a merge replaces in place.
KEPT_KEY = "onnx_autodiff.kept"


def module_names(value: ir.Value) -> list[str]:
    """The module names :data:`MODULE_NAMES` records on ``value`` (none: [])."""
    return _names(value.metadata_props.get(MODULE_NAMES))


def grad_of_tag(node: ir.Node) -> str:
    """The GRAD_OF metadata of the backward nodes a rule emits for ``node``."""
    return f"{node.op_type}:{node.name or node.outputs[0].name}"


def record_differentiated(model: ir.Model, names: Iterable[str]) -> None:
    """Add ``names`` to the model's list of differentiated values (read by the cleanup)."""
    _add_names(model, DIFFERENTIATED_KEY, names)


def differentiated(model: ir.Model) -> list[str]:
    """The names recorded under :data:`DIFFERENTIATED_KEY` (empty when there are none)."""
    return _names(model.metadata_props.get(DIFFERENTIATED_KEY))


def record_kept(model: ir.Model, names: Iterable[str]) -> None:
    """Add ``names`` to the model's list of initializers kept unfolded (read by the cleanup)."""
    _add_names(model, KEPT_KEY, names)


def kept(model: ir.Model) -> list[str]:
    """The names recorded under :data:`KEPT_KEY` (empty when there are none)."""
    return _names(model.metadata_props.get(KEPT_KEY))


def _add_names(model: ir.Model, key: str, names: Iterable[str]) -> None:
    recorded = _names(model.metadata_props.get(key))
    recorded += [n for n in names if n not in recorded]
    model.metadata_props[key] = json.dumps(recorded)


def _names(text: str | None) -> list[str]:
    """A JSON list of names as metadata holds it; [] for none or anything else."""
    try:
        names = json.loads(text or "[]")
    except ValueError:
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
