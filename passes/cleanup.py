"""The ordered passes that shrink a generated backward graph without changing its results.

``cleanup_passes()`` returns one :class:`CleanupPass`, a composition of passes that each live in a
file of their own: bounded constant folding (:class:`~onnx_autodiff.passes.fold.FoldPass`,
onnxscript's folder), one sweep of the onnxscript rewrite rules of
:mod:`onnx_autodiff.passes.rewrite_rules` (:class:`~onnx_autodiff.passes.rewrites.RewriteRulesPass`),
one rule set per family (no-ops: x·1, x/1, x+0, x−0, a Sum with zeros, Identity,
Reshape/Expand/Flatten/Tile/Reduce* that change nothing, Squeeze∘Unsqueeze; zero gradients
propagating; transpose pairs, Transpose of a MatMul, Transposes into Einsum equations, Concat of
Transposes; Reshape of a Reshape, Concat of merging Reshapes; exact Casts) followed by the lowering
for the target runtime (:mod:`~onnx_autodiff.passes.rewrite_rules.lowering`: Transpose→Gemm, bias
sums by a product with ones, ...), dead-node removal (:class:`~onnx_autodiff.passes.unused.RemoveUnusedPass`)
and common-subexpression elimination (:class:`~onnx_autodiff.passes.cse.CommonSubexpressionPass`),
repeated to a fixed point by ``ir.passes.PassManager`` (so a second run changes nothing); then the
main graph's Constant nodes become initializers (:class:`~onnx_autodiff.passes.lift.LiftConstantsPass`),
and a topological sort where the graph is out of order (:class:`~onnx_autodiff.passes.sort.SortPass`).
The rewrites decide from shapes: onnx's shape inference starts each round, where some value still
lacks a shape (for a few values, each one's node is inferred alone first). Each step costs time
linear in the graph's size.

Values being differentiated are never folded: a training loop feeds new values of them every
step, so ``Transpose(W)`` folded into a constant would be stale. The pass learns them from the
model's metadata alone: the entry :data:`~onnx_autodiff.passes.metadata.DIFFERENTIATED_KEY`, a JSON list of names that
:class:`~onnx_autodiff.AutodiffPass` records, and :data:`~onnx_autodiff.passes.metadata.KEPT_KEY`;
and from the ``keep`` option. Such initializers are treated as graph inputs while the pass runs.
(Output names say nothing: a model whose metadata was dropped needs ``keep``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import onnx_ir as ir
from onnx_autodiff.passes import progress
from onnx_autodiff.passes.cse import CommonSubexpressionPass
from onnx_autodiff.passes.fold import FOLD_LIMIT, FoldPass
from onnx_autodiff.passes.lift import LiftConstantsPass
from onnx_autodiff.passes.metadata import differentiated, kept
from onnx_autodiff.passes.outline import OutlinePass
from onnx_autodiff.passes.rewrite_rules import RuleIndex, cleanup_rules, lowering_rules
from onnx_autodiff.passes.rewrite_rules.lowering import DEFAULT_TARGET
from onnx_autodiff.passes.rewrites import RewriteRulesPass
from onnx_autodiff.passes.sort import SortPass
from onnx_autodiff.passes.unused import RemoveUnusedPass
from onnx_autodiff.toolkit import all_graphs
from onnx_autodiff.toolkit.inference import infer_shapes


@dataclasses.dataclass
class CleanupResult(ir.passes.PassResult):
    """What one call of :class:`CleanupPass` did: the model and ``modified`` (as every
    ``PassResult``) and how many rounds it took (a fixed point is reached before ``max_rounds``)."""

    rounds: int = 0


class CleanupPass(ir.passes.InPlacePass):
    """Shrinks a model (its graph, subgraphs and functions) without changing what it computes.

    ``keep`` names further initializers never to fold (see the module's docstring); ``fold=False``
    skips constant folding; ``fold_limit`` bounds the size of folded tensors (elements);
    ``cse=False`` skips common-subexpression elimination; ``rules``: onnxscript ``RewriteRule`` or
    ``RewriteRuleSet`` objects applied in every round after the project's own
    (:func:`~onnx_autodiff.passes.rewrite_rules.cleanup_rules`), on each node whose op ends their
    pattern. Mul by zeros folds to zeros even where the other factor is not finite, as gradients assume.
    ``target``: the runtime whose lowering rules (:func:`~onnx_autodiff.passes.rewrite_rules.lowering_rules`)
    turn the rules' canonical forms into the ones it runs fastest, applied last in each round;
    None keeps canonical graphs.

    Calling the pass returns a :class:`CleanupResult` (``rounds``). ``ir.passes.PassManager``
    returns a plain ``PassResult`` of its own: in a pipeline, read the pass's ``last_result`` (or
    ``rounds``, a view of it: 0 before the first call).
    """

    def __init__(self, keep: Sequence[str] = (), fold: bool = True, fold_limit: int = FOLD_LIMIT,
                 cse: bool = True, max_rounds: int = 8, rules: Sequence = (),
                 target: str | None = DEFAULT_TARGET) -> None:
        super().__init__()
        lowering = () if target is None else (lowering_rules(target),)
        self.rules = RuleIndex([cleanup_rules(), *rules, *lowering])
        self.target = target
        self.keep = [keep] if isinstance(keep, str) else list(keep)
        self.fold = fold
        self.fold_limit = fold_limit
        self.cse = cse
        self.max_rounds = max_rounds
        self.last_result: CleanupResult | None = None

    @property
    def rounds(self) -> int:
        """How many rounds the last call took (0 before the first call)."""
        return 0 if self.last_result is None else self.last_result.rounds

    def protected(self, model: ir.Model) -> list[ir.Value]:
        """The initializers treated as graph inputs: those the model's metadata names, differentiated
        (:func:`~onnx_autodiff.passes.metadata.differentiated`) or kept
        (:data:`~onnx_autodiff.passes.metadata.KEPT_KEY`), and ``keep``."""
        graph = model.graph
        names = set(self.keep) | set(differentiated(model)) | set(kept(model))
        return [v for name, v in graph.initializers.items() if name in names]

    def call(self, model: ir.Model) -> CleanupResult:
        protected = self.protected(model)
        hidden = _Hidden(protected)
        graphs = _graph_lister(model)
        one_round = _Round(
            hidden,
            fold=FoldPass(limit=self.fold_limit, graphs=graphs) if self.fold else None,
            rewrite=RewriteRulesPass(self.rules, graphs=graphs),
            remove_unused=RemoveUnusedPass(),
            cse=CommonSubexpressionPass() if self.cse else None,
        )
        try:
            modified = ir.passes.PassManager([one_round], steps=self.max_rounds, early_stop=True)(model).modified
        finally:
            hidden.show()
            for value in protected:
                if value.name not in model.graph.initializers:
                    model.graph.register_initializer(value)  # the caller may still feed it
                    modified = True
        modified |= LiftConstantsPass()(model).modified
        modified |= SortPass()(model).modified
        if one_round.fold is not None:
            one_round.fold.drop_notes(graphs(model))
        self.last_result = CleanupResult(model, modified, one_round.count)
        return self.last_result


class _Round(ir.passes.InPlacePass):
    """One round of the cleanup, a step of its ``PassManager``: shape inference (with the hidden
    initializers shown to it alone), folding, the rules' sweep, dead-node removal and
    common-subexpression elimination; ``count`` counts the rounds.

    The manager stops at the first round that changes nothing (``early_stop``). A round after the
    first stops early, unmodified, where nothing was folded or rewritten: the previous round ended
    with the dead-node removal and the common-subexpression elimination, which leave nothing for a
    second sweep of their own (a merge or a removal makes no node dead or equal to another), so with
    nothing folded or rewritten since they would find nothing either. This is why the round is one
    pass of its own rather than the five passes in the manager's list: the manager would run them
    all in the last round (each a walk over the whole graph) only to find nothing."""

    def __init__(self, hidden: _Hidden, fold: FoldPass | None, rewrite: RewriteRulesPass,
                 remove_unused: RemoveUnusedPass, cse: CommonSubexpressionPass | None) -> None:
        super().__init__()
        self.hidden = hidden
        self.fold = fold
        self.rewrite = rewrite
        self.remove_unused = remove_unused
        self.cse = cse
        self.count = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count += 1
        stage = f"cleanup, round {self.count}"
        # Shapes first in every round: each but the first follows one that changed the graph (else
        # the manager stops), and folding can make more shapes known (a Reshape to a folded Shape).
        progress.report(stage, 0, 5)
        self.hidden.show()
        infer_shapes(model, missing_only=True)
        self.hidden.hide()
        progress.report(stage, 1, 5)
        changed = self.fold is not None and self.fold(model).modified
        progress.report(stage, 2, 5)
        changed |= self.rewrite(model).modified
        if not changed and self.count > 1:
            return ir.passes.PassResult(model, modified=False)
        progress.report(stage, 3, 5)
        changed |= self.remove_unused(model).modified
        progress.report(stage, 4, 5)
        if self.cse is not None:
            changed |= self.cse(model).modified
        return ir.passes.PassResult(model, modified=changed)


class _Hidden:
    """Initializers whose data is taken away while the rounds run, so that nothing folds through
    them (``show`` gives it back)."""

    def __init__(self, values: list[ir.Value]) -> None:
        self.values = values
        self.tensors: dict[ir.Value, ir.TensorProtocol | None] = {}

    def hide(self) -> None:
        self.tensors = {v: v.const_value for v in self.values}
        for value in self.values:
            value.const_value = None

    def show(self) -> None:
        for value, tensor in self.tensors.items():
            value.const_value = tensor


def _graph_lister(model: ir.Model) -> Callable[[ir.Model], list[ir.Graph]]:
    """What lists the model's graphs for the passes: without a subgraph, the list made once (nothing
    in the cleanup adds one), else :func:`~onnx_autodiff.toolkit.all_graphs` each time."""
    graphs = all_graphs(model)
    if len(graphs) == 1 + len(model.functions):
        return lambda _: graphs
    return all_graphs


def cleanup_passes(*, keep: Sequence[str] = (), fold: bool = True, fold_limit: int = FOLD_LIMIT,
                   cse: bool = True, outline: bool = False, rules: Sequence = (),
                   target: str | None = DEFAULT_TARGET) -> list[ir.passes.PassBase]:
    """Passes to run after :class:`AutodiffPass` (see :class:`CleanupPass` for the options;
    ``rules``: extra onnxscript rewrite rules, applied with the project's; ``target``: the runtime
    the graph is lowered for, None for canonical graphs).

    ``outline=True`` ends with :class:`~onnx_autodiff.passes.outline.OutlinePass`: each rule's
    backward nodes become one call of a model-local function of standard ops.
    """
    passes: list[ir.passes.PassBase] = [CleanupPass(keep=keep, fold=fold, fold_limit=fold_limit, cse=cse, rules=rules,
                                                    target=target)]
    if outline:
        passes.append(OutlinePass())
    return passes
