"""What the passes tell each other through a model: its metadata keys and their readers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import onnx_ir as ir

# Node metadata "<op type>:<forward node>": the forward node whose rule emitted a backward node
# (set by the engine, kept by the rewrites, read by OutlinePass and by readers of the graph). It
# is a label for people and a key that groups a rule's nodes; programs read the fields below
# through :func:`provenance`, never by parsing it.
GRAD_OF = "onnx_autodiff.grad_of"

# Node metadata beside GRAD_OF, the same provenance as data: the forward node's op type, and its
# domain where that is not the default ONNX domain (absent: ""). Set and kept with GRAD_OF.
GRAD_OF_OP = "onnx_autodiff.grad_of_op"
GRAD_OF_DOMAIN = "onnx_autodiff.grad_of_domain"
PROVENANCE_KEYS = (GRAD_OF, GRAD_OF_OP, GRAD_OF_DOMAIN)

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


@dataclasses.dataclass(frozen=True)
class Provenance:
    """The forward node whose rule emitted a backward node: its op type, its domain ("" for the
    default ONNX domain) and the GRAD_OF label that groups the rule's nodes."""

    op_type: str
    domain: str
    tag: str

    @classmethod
    def of(cls, node: ir.Node) -> Provenance:
        """The provenance of the backward nodes a rule emits for the forward ``node``."""
        domain = "" if node.domain == "ai.onnx" else node.domain
        return cls(node.op_type, domain, grad_of_tag(node))

    def metadata(self) -> dict[str, str]:
        """The node metadata entries that record it."""
        entries = {GRAD_OF: self.tag, GRAD_OF_OP: self.op_type}
        if self.domain:
            entries[GRAD_OF_DOMAIN] = self.domain
        return entries

    def is_op(self, op_type: str, domain: str = "") -> bool:
        return self.op_type == op_type and self.domain == domain


def provenance(node: ir.Node) -> Provenance | None:
    """The :class:`Provenance` a backward node carries (None: none). A node tagged by a version
    from before :data:`GRAD_OF_OP` carries GRAD_OF alone: its op type is then GRAD_OF's part
    before the first ":" (such versions recorded no domain)."""
    props = node.metadata_props
    tag = props.get(GRAD_OF)
    if tag is None:
        return None
    op_type = props.get(GRAD_OF_OP)
    if op_type is None:
        op_type = tag.split(":", 1)[0]
    return Provenance(op_type, props.get(GRAD_OF_DOMAIN, ""), tag)


def mark(node: ir.Node, origin: Provenance | None, overwrite: bool = False) -> None:
    """Record ``origin`` on ``node``; a node that already carries a provenance keeps it unless
    ``overwrite`` (the entries are set and kept together)."""
    if origin is None or (GRAD_OF in node.metadata_props and not overwrite):
        return
    entries = origin.metadata()
    for key in PROVENANCE_KEYS:  # set in place: entries already there keep their order
        if key in entries:
            node.metadata_props[key] = entries[key]
        else:
            node.metadata_props.pop(key, None)


def unmark(node: ir.Node) -> None:
    """Drop the provenance entries of ``node``."""
    for key in PROVENANCE_KEYS:
        node.metadata_props.pop(key, None)


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
