"""Exceptions raised by onnx-autodiff; every one names what went wrong and what to do."""

from __future__ import annotations


class AutodiffError(Exception):
    """Base class of every error onnx-autodiff raises on purpose."""


class MissingRuleError(AutodiffError):
    """Nodes on the path from the variables to the output have no gradient rule; ``nodes`` holds
    (name, op type, domain, opset) of each."""

    def __init__(self, message: str, nodes=()) -> None:
        super().__init__(message)
        self.nodes = list(nodes)


class NotDifferentiableError(AutodiffError):
    """A requested variable or output cannot carry a gradient (integer type, declared non-differentiable)."""


class UnknownValueError(AutodiffError):
    """A name given as ``of`` or ``wrt`` does not exist in the graph."""


class RuleError(AutodiffError):
    """A rule refused a node (unsupported attribute or shape) or returned something malformed."""


class OpsetTooOldError(RuleError):
    """A rule's gradient needs a newer default-domain opset than the model imports; ``needed`` is
    the lowest that serves (the passes then convert the model: :mod:`onnx_autodiff.passes.opsets`)."""

    def __init__(self, message: str, needed: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed


class UnsupportedModelError(AutodiffError):
    """The model itself cannot be processed (cycle, missing opset, malformed graph)."""


def names_summary(names, first: int = 6) -> str:
    """``a, b, c`` or, for long lists, the first few and how many more (a message stays one line)."""
    names = list(names)
    shown = ", ".join(names[:first])
    return shown if len(names) <= first else f"{shown} and {len(names) - first} more"


def describe_node(node, opset: int | None) -> str:
    """One phrase naming a node: its name, op type, domain and opset."""
    name = node.name or "<unnamed>"
    domain = node.domain or "ai.onnx"
    return f"node '{name}' (op {node.op_type}, domain {domain}, opset {opset})"


class TrainingError(AutodiffError):
    """Training cannot be set up or a step cannot be taken (unknown loss or optimiser, bad option or
    model, a checkpoint that does not fit, a step whose loss or update is not finite)."""


class BatchError(TrainingError):
    """A batch fed to a Trainer does not match the model (missing input, wrong shape or type, empty)."""


class TrainingOpsetError(TrainingError, OpsetTooOldError):
    """Training needs a newer default-domain opset than the model imports (BatchNormalization's or
    Dropout's training mode): an OpsetTooOldError too, so that generate_artifacts converts the model
    where its upgrade_opset allows, as it does for a rule."""
