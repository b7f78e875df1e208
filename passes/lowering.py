"""The runtime lowering alone, for a model whose other nodes are already in their final form."""

from __future__ import annotations

import onnx_ir as ir
from onnx_autodiff.passes import rewrites
from onnx_autodiff.passes.rewrite_rules import RuleIndex, lowering_rules
from onnx_autodiff.passes.sort import SortPass
from onnx_autodiff.passes.unused import remove_unused
from onnx_autodiff.toolkit import all_graphs
from onnx_autodiff.toolkit.inference import infer_shapes


class LoweringPass(ir.passes.InPlacePass):
    """The lowering rules of ``target`` alone (:func:`~onnx_autodiff.passes.rewrite_rules.lowering_rules`),
    swept over the graphs, subgraphs and functions until none applies, removing the nodes they
    leave unread: for a model whose other nodes are already in their final form (a train model's
    optimiser step, built after the cleanup of its backward graph), where a whole cleanup would
    find nothing else to do."""

    def __init__(self, target: str, max_rounds: int = 8) -> None:
        super().__init__()
        self.rules = RuleIndex([lowering_rules(target)])
        self.target = target
        self.max_rounds = max_rounds

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for _ in range(self.max_rounds):
            infer_shapes(model, missing_only=True)  # the rules decide from shapes
            if rewrites.Rewriter(model, all_graphs(model), self.rules).run() == 0:
                break
            remove_unused(model)
            modified = True
        if modified:
            SortPass()(model)
        return ir.passes.PassResult(model, modified=modified)
