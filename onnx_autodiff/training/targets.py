"""The runtimes training artifacts are built for.

A :class:`Target` carries its lowering rules (what the cleanup rewrites the canonical forms into)
and what its kernels can do, which the build steps ask instead of testing a runtime by name. A new
target is one ``Target(...)`` (with its rewrite rules) registered in :data:`TARGETS`
(:func:`register_target`), from a module of its own or here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from onnxscript.rewriter import RewriteRule, RewriteRuleSet

from onnx_autodiff.passes.rewrite_rules.lowering import onnxruntime_rules, webgpu_target_rules
from onnx_autodiff.training.optimizers import GROUP_LIMIT
from onnx_autodiff.training.registry import Registry


@dataclasses.dataclass(frozen=True)
class Target:
    """A runtime the train, eval, accumulate and apply models are lowered for.

    ``name``: what the manifest records (None: canonical standard forms, no lowering).
    ``rules``: its lowering rules, applied last in each round of the cleanup (None: none).
    ``grouped_updates``: the optimiser updates parameters in groups of
    :data:`~onnx_autodiff.training.optimizers.GROUP_LIMIT` rows (one Concat of many inputs each),
    else one by one.
    ``lowered_optimizer``: the lowering applies to the optimiser's nodes too, which are added after
    the backward's cleanup in forms onnxruntime runs as they are.
    ``batchnorm_in_standard_ops``: BatchNormalization's training mode is computed in standard ops
    (its kernel lacks the mode).
    ``hashed_dropout``: Dropout's training mode draws its masks from a hash of the step and the
    micro-batch, fed as inputs (its kernel lacks the mode; every runtime then draws the same masks).
    ``nbits_kernel``: a model's own MatMulNBits stays the kernel in the train models unless the
    LoRA config says otherwise (elsewhere it is read through DequantizeLinear, held once).
    ``frozen_base_reads``: frozen bases stored in another type are read the way the runtime holds
    them once (in pieces, at each use: :mod:`~onnx_autodiff.training.generation.frozen_reads`).
    """

    name: str | None
    rules: Callable[[], Sequence[RewriteRule]] | None = None
    grouped_updates: bool = True
    lowered_optimizer: bool = False
    batchnorm_in_standard_ops: bool = False
    hashed_dropout: bool = False
    nbits_kernel: bool = False
    frozen_base_reads: bool = True

    def lowering_rules(self) -> RewriteRuleSet:
        """Its lowering rules as one set (what the cleanup's ``target`` resolves to)."""
        return RewriteRuleSet(list(self.rules()) if self.rules is not None else [])

    @property
    def lowering(self) -> Target | None:
        """What the cleanup passes take as their ``target``: this target, or None where it lowers nothing."""
        return self if self.rules is not None else None

    @property
    def group_limit(self) -> int | None:
        """The rows of one grouped update (None: one update per parameter)."""
        return GROUP_LIMIT if self.grouped_updates else None

    @property
    def lowers_training_forward(self) -> bool:
        """Whether the train models' forward differs from the eval model's beyond the layers'
        training mode (a lowered training mode, or the optimiser's lowering over the whole model)."""
        return self.batchnorm_in_standard_ops or self.hashed_dropout or self.lowered_optimizer


ONNXRUNTIME = Target("onnxruntime", rules=onnxruntime_rules)
# onnxruntime-web's WebGPU provider runs every compute node of the models built for it: its
# BatchNormalization has no training mode ("trainingMode is not supported yet"), its Dropout none
# either, the grouped update's Concat of thousands of inputs is not known to run there, the step's
# finite check (a Sum) needs the lowering too, and it runs the MatMulNBits kernel on the GPU.
WEBGPU = Target("webgpu", rules=webgpu_target_rules, grouped_updates=False, lowered_optimizer=True,
                batchnorm_in_standard_ops=True, hashed_dropout=True, nbits_kernel=True)
CANONICAL = Target(None, frozen_base_reads=False)  # standard forms: no runtime's lowering, no runtime's reads

# The targets by name: what ``target="name"`` and the command line's --target read.
TARGETS: Registry[Target] = Registry("target")


def register_target(target: Target) -> Target:
    """Registers ``target`` under its name."""
    return TARGETS.register(target.name, target)


register_target(ONNXRUNTIME)
register_target(WEBGPU)
# What the build lowers for unless told otherwise; the manifest leaves it out of artifacts.json.
DEFAULT = ONNXRUNTIME


def resolve_target(target: str | Target | None) -> Target:
    """``target`` as a :class:`Target`: one of :data:`TARGETS` by name, a Target as it is, None
    for :data:`CANONICAL`."""
    if isinstance(target, Target):
        return target
    if target is None:
        return CANONICAL
    if target not in TARGETS:
        known = ", ".join(repr(name) for name in TARGETS)
        raise ValueError(f"unknown lowering target {target!r}: the known targets are {known} (or None, no lowering)")
    return TARGETS[target]
