"""Conformance runner: every gradient rule against the ONNX backend test data and the float64 oracle.

For each backend test case (``onnx.backend.test.case.node``, single-node and expanded function
bodies) and each float differentiable input of the op under test, the runner builds the backward
graph with the rules of a registry, runs it on onnxruntime with seed ``dy = r`` (r ~ N(0, 1),
fixed seed) and compares the VJP with :func:`onnx_autodiff.conformance.oracle.fd_vjp`. The
weight-carrying models of ``pytorch-converted`` and ``pytorch-operator`` are checked with respect
to their float initializers.

Statuses, per case and input:

``pass``                within tolerance (``error`` is the worst scaled element error, ≤ 1)
``fail``                outside tolerance (``error`` > 1; the message names the worst element)
``no-rule``             the op (or an op of an expanded body) has no rule
``not-differentiable``  the rule declares the op, or every float input, non-differentiable
``refused``             a rule refused the node with a RuleError (unsupported attribute, ...)
``oracle-skip``         no trustworthy reference value (random op, no element checkable, ...)
``error``               the pass crashed, produced an invalid graph, or onnxruntime cannot run it

Symbolic dimensions. Each input that passed or failed is checked again on
:func:`~onnx_autodiff.conformance.symbolic.symbolic_model` of the model it was judged on (every
graph-input dimension a name): its backward graph must pass onnx.checker (full check) and strict
shape inference, run, and give the static VJP within the same tolerance (``Result.symbolic``:
pass, fail, or needs-static when onnx's inference or the runtime refuses the symbolic forward
model). A symbolic failure fails the sweep; ``--no-symbolic`` skips the re-check.

Exporter-style retry. The backend data feeds at run time some inputs that exporters write as
initializers or Constant nodes (Resize scales/sizes/roi, Slice starts/ends/axes/steps, Pad axes,
Col2Im shapes, DFT axis, ...), and rules that need them as constants refuse. When a rule refuses
an input of a node case, the runner retries with every input it does not check (integer inputs
and float inputs the rule declares non-differentiable) turned into initializers holding the
case's data; the function is the same, so the oracle (and stored references) are unchanged. Such
results list those inputs in ``Result.constants`` and count as pass/fail on their own merits; the
reports mark them (column ``pass*``, ⚑) and count them in the header.

Runtimes. The backward graph runs on onnxruntime; only when onnxruntime cannot run the forward
model itself (batchwise RNN layouts, some Attention inputs) does the reference evaluator run it,
and the result's ``oracle`` field ends with "AD on reference". When the oracle's float64 runtime
and onnxruntime disagree on the forward function (MaxUnpool with an output_shape), the rule is
checked against onnxruntime's own function by float32 differences (a weak check, said so in the
message).

Command line: ``onnx-autodiff conformance [--op OP ...] [--case NAME ...] [--jobs N]
[--report PATH] [--limit N] [--no-symbolic] [--references [FILE] | --save-references FILE]`` (also
``python -m onnx_autodiff.conformance.runner``).

Stored references. The oracle's answers depend only on the case, the seed and the onnx version
(and the time budget, which caps the sampled coordinates), so a sweep can store them
(``--save-references FILE``: per case and input the finite-difference estimates, kink intervals
and flags of the sampled coordinates, the oracle backend and weak flag; see :class:`References`)
and later sweeps compare the backward graphs with them instead of running finite differences
(``--references [FILE]``, by default the packaged ``conformance/references/oracle.npz``). Cases
missing from the file, or whose model, inputs or cotangents changed (fingerprint), run the live
oracle and are listed. tests/conformance/test_conformance_references.py checks every eligible
case this way. Regenerate the packaged file after an onnx upgrade or a change to the oracle or
the case collection (from the repository root; about 15 minutes on 2 cores)::

    rm -f conformance/references/oracle.npz
    python -m onnx_autodiff conformance --jobs 2 --save-references conformance/references/oracle.npz

The parts: :mod:`~onnx_autodiff.conformance.cases` (collecting and selecting cases),
:mod:`~.judge` (one case: prepare, forward, backward with the retry, oracle, verdict),
:mod:`~.symbolic` (the re-check on symbolic dimensions),
:mod:`~.order2` (second order), :mod:`~.references` (stored references), :mod:`~.sweep` (many
cases in worker processes), :mod:`~.report` (summaries, Markdown and JSON reports) and
:mod:`~.cli` (the command line). This module is their public face.
"""

import argparse
import sys
from collections.abc import Sequence

from onnx_autodiff.conformance.cases import (
    MODEL_SUITES,
    Case,
    UsageError,
    cache_dir,
    load_model_cases,
    load_node_cases,
    select_cases,
)
from onnx_autodiff.conformance.cli import add_arguments, run
from onnx_autodiff.conformance.judge import (
    DEFAULT_BUDGET,
    FORWARD_AGREEMENT,
    MAX_COORDS,
    STATUSES,
    TOLERANCES,
    Result,
    explicit_defaults,
    run_case,
    with_constants,
)
from onnx_autodiff.conformance.order2 import ORDER2_PREFIX, first_order_case, order2_verdicts, run_case_order2
from onnx_autodiff.conformance.references import (
    DEFAULT_REFERENCES,
    ORACLE_REVISION,
    REFERENCES_DIR,
    References,
    StoredOracle,
)
from onnx_autodiff.conformance.report import case_status, eligible_line, format_table, summarize, totals, write_reports
from onnx_autodiff.conformance.sweep import run_cases

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_REFERENCES",
    "FORWARD_AGREEMENT",
    "MAX_COORDS",
    "MODEL_SUITES",
    "ORACLE_REVISION",
    "ORDER2_PREFIX",
    "REFERENCES_DIR",
    "STATUSES",
    "TOLERANCES",
    "Case",
    "References",
    "Result",
    "StoredOracle",
    "UsageError",
    "add_arguments",
    "cache_dir",
    "case_status",
    "eligible_line",
    "explicit_defaults",
    "first_order_case",
    "format_table",
    "load_model_cases",
    "load_node_cases",
    "main",
    "order2_verdicts",
    "run",
    "run_case",
    "run_case_order2",
    "run_cases",
    "select_cases",
    "summarize",
    "totals",
    "with_constants",
    "write_reports",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onnx-autodiff conformance", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
