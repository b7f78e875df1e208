"""The ordered passes that shrink a generated backward graph without changing its results."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common


def cleanup_passes() -> list[ir.passes.PassBase]:
    """Passes to run after :class:`AutodiffPass`: dead-node removal, CSE, topological order."""
    return [
        common.RemoveUnusedNodesPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.TopologicalSortPass(),
    ]
