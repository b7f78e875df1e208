"""The one module that reads onnxscript's private API.

onnxscript's rewriter keeps private what the cleanup's indexed sweep and the pattern gradient rules
need: the pattern a rule matches (``_target_pattern``), the pattern's node outputs
(``_pattern_ir.NodeOutputPattern``) and the error a check raises to fail a match
(``_basics.MatchFailureError``). Everything else uses its public names. A release that moves these
breaks here alone; :data:`SUPPORTED` says which releases are known to work, and
``tests/test_onnxscript_compat.py`` checks the installed one against it.
"""

from __future__ import annotations

from onnxscript.rewriter._basics import MatchFailureError
from onnxscript.rewriter._pattern_ir import NodeOutputPattern

__all__ = ["SUPPORTED", "MatchFailureError", "NodeOutputPattern", "pattern_nodes", "pattern_outputs"]

# onnxscript releases from the first up to, not including, the second: the full suite runs on 0.7.
# 0.5 lacks the folder's FOLDED_FROM_KEY; on 0.6.2 the passes' tests pass, but torch's exporter
# leaves some ops as onnxscript torch_lib functions (aten_special_erf) that no rule knows.
SUPPORTED = ((0, 7), (0, 8))


def pattern_outputs(rule) -> list:
    """The node patterns an onnxscript RewriteRule's pattern ends in (no public accessor in 0.7)."""
    return list(getattr(getattr(rule, "_target_pattern", None), "output_nodes", None) or [])


def pattern_nodes(rule) -> list:
    """Every node pattern of an onnxscript RewriteRule's pattern."""
    pattern = getattr(rule, "_target_pattern", None)
    return [] if pattern is None else list(pattern)
