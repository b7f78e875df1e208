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
[--report PATH] [--limit N] [--references [FILE] | --save-references FILE]`` (also
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
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import hashlib
import io
import json
import math
import os
import pickle
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnx_autodiff.conformance.check import LOSS, WEAK_TOLERANCE, backward_model, compare_elements, scalarize
from onnx_autodiff.conformance.oracle import Evaluator, FDGradient, OracleResult, cotangents_for, fd_vjp, usable
from onnx_autodiff.training.values import write_atomically

STATUSES = ("pass", "fail", "no-rule", "not-differentiable", "refused", "oracle-skip", "error")
"""Every status a check can get, in report-column order."""

_CASE_PRECEDENCE = ("error", "fail", "no-rule", "refused", "pass", "oracle-skip", "not-differentiable")
"""A case's status is the first of these among its inputs' statuses."""

TOLERANCES = {
    np.dtype(np.float64): (1e-6, 1e-5),
    np.dtype(np.float32): (1e-4, 1e-3),
    np.dtype(np.float16): (1e-2, 1e-2),
}
"""(atol, rtol) per dtype of the backward computation: |ad − fd| ≤ atol·max(1, ‖fd‖∞) + rtol·|fd|."""

_FLOAT_ELEM = {TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE}
MODEL_SUITES = ("pytorch-converted", "pytorch-operator")
DEFAULT_BUDGET = 3.0
MAX_COORDS = 2000
FORWARD_AGREEMENT = 1e-3  # relative: the oracle's float64 forward vs onnxruntime's float32 one


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Case:
    """One model with inputs. ``op`` is the op under test (the suite name for whole models);
    ``kind`` is "node", "expanded" or "model"; ``base`` holds the single-node model whose rule
    decides the differentiable inputs of an expanded case."""

    name: str
    op: str
    kind: str
    model: bytes
    inputs: dict
    base: bytes | None = None
    wrt: list | None = None  # the inputs to check, when given explicitly (second-order cases)

    def proto(self) -> onnx.ModelProto:
        return onnx.load_from_string(self.model)


def cache_dir() -> Path:
    """Where collected cases are cached: $ONNX_AUTODIFF_CACHE or ~/.cache/onnx-autodiff."""
    return Path(os.environ.get("ONNX_AUTODIFF_CACHE") or Path.home() / ".cache" / "onnx-autodiff")


def _as_input(value):
    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


def _collect_node_cases() -> list[Case]:
    from onnx.backend.test.case.node import collect_testcases

    state = np.random.get_state()
    try:
        np.random.seed(0)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            collected = collect_testcases(None)
    finally:
        np.random.set_state(state)
    singles = {c.name: c for c in collected if "_expanded" not in c.name}
    cases = []
    for test in collected:
        base_name = re.sub(r"_expanded(_ver\d+)?$", "", test.name)
        base = singles.get(base_name)
        if base is None or len(base.model.graph.node) != 1:
            continue
        model = test.model
        inputs = [_as_input(v) for v in test.data_sets[0][0]]
        names = [i.name for i in model.graph.input]
        cases.append(
            Case(
                name=test.name,
                op=base.model.graph.node[0].op_type,
                kind="node" if test is base else "expanded",
                model=model.SerializeToString(),
                inputs=dict(zip(names, inputs)),
                base=None if test is base else base.model.SerializeToString(),
            )
        )
    return cases


def load_node_cases(refresh: bool = False) -> list[Case]:
    """The backend node test cases (seeded with ``np.random.seed(0)``), cached per onnx version."""
    path = cache_dir() / f"backend-node-cases-onnx{onnx.__version__}-numpy{np.__version__}.pkl"
    if path.exists() and not refresh:
        try:
            with open(path, "rb") as f:
                return [Case(**fields) for fields in pickle.load(f)]
        except Exception:  # noqa: BLE001 - a corrupt or outdated cache is rebuilt
            pass
    cases = _collect_node_cases()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # plain dicts: the cache must not depend on the module's import name (__main__)
        write_atomically(path, pickle.dumps([dataclasses.asdict(c) for c in cases], protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass  # no writable cache: collect again next time
    return cases


def _runs_on_onnxruntime(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> bool:
    try:
        Evaluator(model, backends=("onnxruntime",))(feeds)
        return True
    except Exception:  # noqa: BLE001 - load or run failure alike
        return False


def load_model_cases(suites: Sequence[str] = MODEL_SUITES) -> list[Case]:
    """Models of the onnx wheel's pytorch-converted/pytorch-operator data with float initializers.

    A model onnxruntime cannot run, or older than opset 7, is converted to opset 13 first.
    """
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    cases = []
    for suite in suites:
        for path in sorted(glob.glob(str(root / suite / "*" / "model.onnx"))):
            model = onnx.load(path)
            if not any(t.data_type in _FLOAT_ELEM for t in model.graph.initializer):
                continue
            initializers = {t.name for t in model.graph.initializer}
            names = [i.name for i in model.graph.input if i.name not in initializers]
            files = sorted(
                glob.glob(os.path.join(os.path.dirname(path), "test_data_set_0", "input_*.pb")),
                key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]),
            )
            inputs = {n: numpy_helper.to_array(onnx.load_tensor(f)) for n, f in zip(names, files)}
            default_opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
            # onnxruntime has no kernels for many opset-6 ops that backward graphs use (Sub, Less):
            # such models are converted too, as the ones it cannot run at all.
            if default_opset < 7 or not _runs_on_onnxruntime(model, inputs):
                try:
                    model = onnx.version_converter.convert_version(model, 13)
                except Exception:  # noqa: BLE001 - keep the original; the case reports the failure
                    pass
            name = f"{suite}/{os.path.basename(os.path.dirname(path))}"
            cases.append(Case(name, suite, "model", model.SerializeToString(), inputs))
    return cases


# --------------------------------------------------------------------------- one case


@dataclasses.dataclass
class Result:
    """The outcome of checking one input of one case."""

    case: str
    op: str
    kind: str
    input: str
    status: str
    error: float | None = None
    message: str = ""
    oracle: str = ""
    weak: bool = False
    counts: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    source: str = ""  # "stored": compared with stored references; "live": live oracle (reference missing)
    constants: list = dataclasses.field(default_factory=list)  # run-time inputs fed as initializers (retry)
    defaults: list = dataclasses.field(default_factory=list)  # "Op.attr=value" written out for onnx.checker


def _elem_type(value_info) -> int:
    return value_info.type.tensor_type.elem_type if value_info.type.HasField("tensor_type") else 0


def _differentiable_inputs(case: Case, model: onnx.ModelProto, registry) -> tuple[str, list[str], str]:
    """(status or "", candidate graph inputs, message) for the op under test."""
    import onnx_ir as ir

    floats = [i.name for i in model.graph.input if _elem_type(i) in _FLOAT_ELEM]
    if case.wrt is not None:
        return "", [x for x in case.wrt if x in floats], ""
    if case.kind == "model":
        return "", [t.name for t in model.graph.initializer if t.data_type in _FLOAT_ELEM], ""
    base = onnx.load_from_string(case.base) if case.base is not None else model
    graph = ir.from_proto(base).graph
    opsets = {("" if k == "ai.onnx" else k): v for k, v in ir.from_proto(base).opset_imports.items()}
    node = next(iter(graph))
    opset = opsets.get(node.domain if node.domain != "ai.onnx" else "", 1)
    rule = registry.lookup(node, opset)
    if rule is None:
        if case.kind == "expanded":  # the body's ops may all have rules: let the pass decide
            return "", floats, ""
        return "no-rule", [], f"no rule for {node.op_type} at opset {opset}"
    if rule.backward is None:
        return "not-differentiable", [], f"{node.op_type} is declared non-differentiable"
    names = rule.input_names(node, opset)
    wanted = []
    for name, value in zip(names, node.inputs):
        if name in rule.differentiable and value is not None and value.name in floats:
            if value.name not in wanted:
                wanted.append(value.name)
    if not wanted:
        return "not-differentiable", [], "no float input is differentiable"
    return "", wanted, ""


def _training_dropout(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether a Dropout node runs in training mode without a ``seed`` attribute (its mask is
    random: no finite differences). With a seed, onnxruntime draws the same mask in every run."""
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    constants.update(feeds)
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            mode = constants.get(node.input[2])
            seeded = any(a.name == "seed" for a in node.attribute)
            if (mode is None or bool(np.asarray(mode))) and not seeded:
                return True
    return False


def _seeded_dropout(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether a Dropout node may run in training mode with a ``seed`` attribute."""
    return any(node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]
               and any(a.name == "seed" for a in node.attribute)
               and bool(np.asarray(feeds.get(node.input[2], True)))
               for node in model.graph.node)


def _constant_candidates(case: Case, model: onnx.ModelProto, wrt: Sequence[str], feeds) -> list[str]:
    """The graph inputs an exporter would write as constants: those of a backend node case that
    are not checked (integer inputs, float inputs the rule declares non-differentiable)."""
    if case.kind == "model" or case.wrt is not None:
        return []
    return [i.name for i in model.graph.input if i.name not in wrt and isinstance(feeds.get(i.name), np.ndarray)]


def with_constants(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], names: Sequence[str]):
    """(model, feeds) with the inputs ``names`` turned into initializers holding their fed values."""
    const = onnx.ModelProto()
    const.CopyFrom(model)
    const.graph.initializer.extend(numpy_helper.from_array(np.asarray(feeds[n]), n) for n in names)
    if const.ir_version >= 4:  # before IR 4 an initializer must also be listed as a graph input
        kept = [i for i in const.graph.input if i.name not in names]
        del const.graph.input[:]
        const.graph.input.extend(kept)
    return const, {k: v for k, v in feeds.items() if k not in names}


def _classify(error: BaseException) -> str:
    from onnx_autodiff.errors import AutodiffError, MissingRuleError, NotDifferentiableError, RuleError

    if isinstance(error, MissingRuleError):
        return "no-rule"
    if isinstance(error, NotDifferentiableError):
        return "not-differentiable"
    if isinstance(error, RuleError) and (error.__cause__ is None or isinstance(error.__cause__, AutodiffError)):
        return "refused"  # raised on purpose (a rule's or the engine's); a crashing rule has another cause
    return "error"


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:500]}"


def _ad(model, feeds, x, cotangents, registry, backends) -> tuple[np.ndarray, str, dict]:
    """The backward graph's VJP for ``x``, the backend that ran it (the first of ``backends``
    that loads and runs it) and every output of that graph by name."""
    floats = [i for i, r in enumerate(cotangents) if r is not None]
    if len(floats) == 1:
        of = model.graph.output[floats[0]].name
        proto, autodiff = backward_model(model, of, [x], registry, seed="input")
        extra = {autodiff.seed_name: cotangents[floats[0]]}
    else:
        proto, autodiff = backward_model(scalarize(model, cotangents), LOSS, [x], registry)
        extra = {}
    failures = []
    for backend in backends:
        try:
            evaluate = Evaluator(proto, backends=(backend,))
        except RuntimeError as error:
            failures.append(f"the backward graph does not run on {backend}: {error}")
            continue
        try:
            outputs = evaluate({**feeds, **extra})
        except Exception as error:  # noqa: BLE001 - say which runtime failed
            failures.append(f"running the backward graph on {backend}: {_one_line(error)}")
            continue
        named = dict(zip((o.name for o in proto.graph.output), outputs))
        return named[autodiff.gradient_names[x]], backend, named
    raise RuntimeError("; ".join(failures))


def explicit_defaults(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, list[str]]:
    """The model with its nodes' schema-default attributes written out, and what was written, when
    that makes it pass onnx.checker (full check); else (None, []). onnx's shape inference reads some
    defaults other than the schema's (STFT's onesided, MeanVarianceNormalization-13's axes)."""
    explicit = onnx.ModelProto()
    explicit.CopyFrom(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    written = []
    for node in explicit.graph.node:
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        except Exception:  # noqa: BLE001 - an unknown op: nothing to write
            continue
        present = {a.name for a in node.attribute}
        for name, attribute in sorted(schema.attributes.items()):
            default = attribute.default_value
            if name not in present and default.type != onnx.AttributeProto.UNDEFINED:
                node.attribute.append(default)
                written.append(f"{node.op_type}.{name}={onnx.helper.get_attribute_value(default)}")
    try:
        onnx.checker.check_model(explicit, full_check=True)
    except Exception:  # noqa: BLE001
        return None, []
    return explicit, written


def _forward_trouble(exported, backend: str, cotangents, f32: float) -> str:
    """Why the exporter-style forward model cannot stand in for the case's (it does not run on the
    runtime that ran the case, or computes another function there), or ""."""
    try:
        outputs = Evaluator(exported[0], backends=(backend,))(exported[1])
    except Exception as error:  # noqa: BLE001
        return f"the forward model does not run on {backend}: {_one_line(error)}"
    if _disagree(_objective(outputs, cotangents), f32):
        return f"the forward model computes other values on {backend}"
    return ""


def _stale(stored: StoredOracle, references: References, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether a stored answer predates the float32 fallback's widening of half-precision models
    (before ORACLE_REVISION 2 that fallback differentiated float16 models in float16: noise)."""
    half = any(np.asarray(v).dtype == np.float16 or np.asarray(v).dtype.name == "bfloat16" for v in feeds.values())
    return half and stored.backend == "float32" and references.meta.get("oracle_revision", 1) < 2


def _objective(outputs, cotangents) -> float:
    """Σ_k ⟨out_k, r_k⟩ in float64 over the elements the oracle uses (see ``usable``)."""
    total = 0.0
    for out, r in zip(outputs, cotangents):
        if r is not None:
            out = np.asarray(out)
            total += float(np.sum(np.where(usable(out), out, 0).astype(np.float64) * r))
    return total


def _disagree(f0: float, f32: float) -> bool:
    return math.isfinite(f0) and abs(f0 - f32) > FORWARD_AGREEMENT * (1 + abs(f0))


def _same_forward(named: Mapping[str, np.ndarray], model, first, f32: float) -> bool:
    """Whether the backward graph recomputed the forward outputs it exposes as the forward run did."""
    if LOSS in named:
        return not _disagree(float(named[LOSS]), f32)
    return all(np.allclose(named[o.name], out, equal_nan=True)
               for o, out in zip(model.graph.output, first) if o.name in named)


def _describe_worst(errors: np.ndarray, ad: np.ndarray, detail) -> str:
    if np.all(np.isnan(errors)):
        return ""
    index = np.unravel_index(int(np.nanargmax(errors)), errors.shape)
    where = list(int(i) for i in index)
    fd = f"{detail.value[index]:.6g}"
    if detail.kink[index]:
        fd = f"[{detail.lower[index]:.6g}, {detail.upper[index]:.6g}] (kink)"
    return f"worst element {where}: AD {float(ad[index]):.6g}, FD {fd}"


def run_case(
    case: Case,
    registry=None,
    budget: float = DEFAULT_BUDGET,
    seed: int = 0,
    *,
    references: References | None = None,
    record: dict | None = None,
) -> list[Result]:
    """Check every float differentiable input of one case; one Result per input (or one per case
    when the case is not checked at all). Cases without a float input and a float output give [].

    With ``references``, the oracle's stored answers replace the finite differences when they
    exist for this case, seed and onnx version and their fingerprint (model, inputs, cotangents)
    matches; otherwise the live oracle runs (``Result.source`` says which). With ``record`` (a
    dict), the live oracle runs on every candidate input and ``record[case.name]`` receives its
    :class:`StoredOracle`."""
    from onnx_autodiff.rules import default_registry

    registry = registry if registry is not None else default_registry()
    started = time.perf_counter()

    def result(x: str, status: str, **kw) -> Result:
        return Result(case.name, case.op, case.kind, x, status, seconds=time.perf_counter() - started, **kw)

    model = case.proto()
    if any(not isinstance(v, np.ndarray) for v in case.inputs.values()):
        return []  # sequences, optionals: not tensors
    feeds = dict(case.inputs)
    float_outputs = [o for o in model.graph.output if _elem_type(o) in _FLOAT_ELEM]
    float_inputs = [i for i in model.graph.input if _elem_type(i) in _FLOAT_ELEM]
    if not float_outputs or not (float_inputs or case.kind == "model"):
        return []
    try:
        status, wrt, message = _differentiable_inputs(case, model, registry)
    except Exception as error:  # noqa: BLE001 - a broken rule lookup is reported, not raised
        return [result("*", "error", message=_one_line(error))]
    if status:
        return [result("*", status, message=message)]
    if not wrt:
        return []

    defaults: list[str] = []
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as error:  # noqa: BLE001 - the pass's output could not pass the checker either
        explicit, defaults = explicit_defaults(model)
        if explicit is None:
            return [result("*", "oracle-skip", message=f"the forward model fails onnx.checker: {_one_line(error)}")]
        model = explicit  # as exporters write them; the function is the same
    if _training_dropout(model, feeds):
        return [result("*", "oracle-skip", message="training-mode Dropout without a seed attribute is random")]
    forward_backend, failures = None, []
    for backend in ("onnxruntime", "reference"):
        try:
            forward = Evaluator(model, backends=(backend,))
            first, second = forward(feeds), forward(feeds)
            forward_backend = backend
            break
        except Exception as error:  # noqa: BLE001 - try the next runtime
            failures.append(f"{backend}: {_one_line(error)}")
    if forward_backend is None:
        return [result("*", "oracle-skip", message="the forward model does not run: " + "; ".join(failures))]
    if not all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f") for a, b in zip(first, second)):
        return [result("*", "oracle-skip", message="the model is not deterministic (random op)")]
    cotangents = cotangents_for(model, first, seed)
    # r is 0 on non-finite outputs, but 0·NaN is NaN: there AD cannot be finite, nor wrong
    nonfinite_forward = any(
        r is not None and not np.all(np.isfinite(out)) for out, r in zip(first, cotangents)
    )
    if all(r is None for r in cotangents):
        return []
    # a backward graph must run on onnxruntime unless the forward model itself does not
    backends = ("onnxruntime",) if forward_backend == "onnxruntime" else ("onnxruntime", "reference")
    f32 = _objective(first, cotangents)

    results: dict[str, Result] = {}
    ads: dict[str, tuple[np.ndarray, str]] = {}
    fed: dict[str, list[str]] = {}  # x → the inputs fed as constants for its backward graph
    written_for: dict[str, list[str]] = {}  # x → default attributes written out besides
    constants = _constant_candidates(case, model, wrt, feeds)
    seeded = _seeded_dropout(model, feeds)
    for x in wrt:
        try:
            ad, ad_backend, named = _ad(model, feeds, x, cotangents, registry, backends)
        except Exception as error:  # noqa: BLE001 - every failure of the pass is a reported status
            status, message = _classify(error), _one_line(error)
            if status == "refused" and constants:
                # exporters write these inputs as initializers or Constant nodes: retry that way
                exported, written = with_constants(model, feeds, constants), []
                try:
                    onnx.checker.check_model(exported[0], full_check=True)
                except Exception as invalid:  # noqa: BLE001 - onnx's own inference, not the rule
                    explicit, written = explicit_defaults(exported[0])
                    if explicit is None:
                        message += (f"; with {', '.join(constants)} as constants the forward model fails "
                                    f"onnx.checker: {_one_line(invalid)}")
                    exported = (explicit, exported[1])
                if exported[0] is not None and (trouble := _forward_trouble(exported, forward_backend, cotangents, f32)):
                    message += f"; with {', '.join(constants)} as constants {trouble}"
                    exported = (None, exported[1])
                if exported[0] is not None:
                    try:
                        ad, ad_backend, named = _ad(*exported, x, cotangents, registry, backends)
                        fed[x] = list(constants)
                        written_for[x] = written
                    except Exception as retry:  # noqa: BLE001
                        again = _one_line(retry)
                        note = (f"the same with {', '.join(constants)} fed as constants" if again == message
                                else f"with {', '.join(constants)} fed as constants: {again}")
                        status, message = ("error", note) if _classify(retry) == "error" else (status, f"{message}; {note}")
            if x not in fed:
                if status == "error" and forward_backend != "onnxruntime":
                    # onnxruntime rejects the forward model itself (an unsupported layout, a converted
                    # model that breaks the broadcasting rules, ...): no runtime to judge the rule with.
                    status = "oracle-skip"
                results[x] = result(x, status, message=message)
                continue
        if seeded and not _same_forward(named, model, first, f32):
            results[x] = result(x, "oracle-skip", message="the backward graph's seeded training Dropout drew "
                                "another mask than the forward run")
            continue
        ads[x] = ad, ad_backend
    oracle, reason, source, fallback = None, "", "", ""
    if ads or record is not None:
        fingerprint = _fingerprint(case.model, feeds, cotangents)
        stored = references.get(case.name, seed) if references is not None and record is None else None
        if stored is not None and stored.fingerprint == fingerprint and stored.covers(ads) and not _stale(stored, references, feeds):
            oracle, reason, source = stored.oracle(), stored.error or "", "stored"
        else:
            if references is not None and record is None:
                source = "live (stale reference)" if stored is not None and stored.fingerprint != fingerprint else "live"
            # when recording, every candidate input gets references, so a rule fixed later needs none
            need = list(wrt) if record is not None else list(ads)
            try:
                oracle = fd_vjp(
                    model, feeds, need, cotangents,
                    max_coords=MAX_COORDS, time_budget=budget, seed=seed,
                )
            except Exception as error:  # noqa: BLE001
                reason = _one_line(error)
        if oracle is not None and _disagree(oracle.f0, f32):
            reason = (f"the oracle's runtime ({oracle.backend}) and {forward_backend} disagree on the "
                      f"forward outputs: <out, r> = {oracle.f0:.6g} vs {f32:.6g}")
            oracle = None
            if forward_backend == "onnxruntime":
                # onnxruntime's semantics differ from the float64 runtime's (MaxUnpool with an
                # output_shape): the rules follow onnxruntime, so judge them by its own function
                need = list(wrt) if record is not None else list(ads)
                try:
                    oracle = fd_vjp(model, feeds, need, cotangents, max_coords=MAX_COORDS, time_budget=budget,
                                    seed=seed, backends=("float32",))
                    if _disagree(oracle.f0, f32):
                        oracle = None
                    else:
                        fallback, source = reason, source and "live"
                except Exception:  # noqa: BLE001 - keep the disagreement as the reason
                    oracle = None
        if record is not None:
            dtypes = {x: np.asarray(ad).dtype for x, (ad, _) in ads.items()}
            record[case.name] = StoredOracle.from_oracle(fingerprint, oracle, reason, dtypes)
        for x, (ad, ad_backend) in ads.items():
            common = {"source": source, "constants": fed.get(x, []), "defaults": defaults + written_for.get(x, [])}
            if oracle is None:
                results[x] = result(x, "oracle-skip", message=reason, **common)
                continue
            detail = oracle.details[x]
            counts = detail.counts()
            atol, rtol = TOLERANCES.get(np.asarray(ad).dtype, TOLERANCES[np.dtype(np.float32)])
            if oracle.weak:
                atol, rtol = max(atol, WEAK_TOLERANCE), max(rtol, WEAK_TOLERANCE)
            common.update(oracle=oracle.backend, weak=oracle.weak, counts=counts)
            if ad_backend != "onnxruntime":
                common["oracle"] += f"; AD on {ad_backend}"
            try:
                errors = compare_elements(ad, detail, atol, rtol)
            except ValueError as error:
                results[x] = result(x, "error", message=str(error), **common)
                continue
            if nonfinite_forward:
                masked = ~np.isfinite(np.asarray(ad, np.float64)) & ~np.isnan(errors)
                errors = np.where(masked, np.nan, errors)
                counts["checked"] -= int(masked.sum())
                counts["nonfinite_ad"] = int(masked.sum())
            if counts["checked"] == 0 and counts["size"] > 0:
                skipped = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k not in ("size", "evaluated"))
                results[x] = result(x, "oracle-skip", message=f"no element could be checked ({skipped})", **common)
                continue
            worst = float(np.nanmax(errors)) if counts["checked"] else 0.0
            status = "pass" if worst <= 1.0 else "fail"
            notes = [_describe_worst(errors, ad, detail)] if status == "fail" else []
            if fallback:
                notes.append(f"{fallback}: checked against onnxruntime's own function in float32 (weak)")
            if counts.get("one_sided"):
                notes.append(f"{counts['one_sided']} element(s) by one-sided differences (the output length "
                             "changes on the other side)")
            if seeded:
                notes.append("training Dropout with a seed: the same mask in every run, checked as fixed")
            results[x] = result(x, status, error=worst, message="; ".join(n for n in notes if n), **common)
    return [results[x] for x in wrt]


# --------------------------------------------------------------------------- second order

ORDER2_PREFIX = "order2:"


def first_order_case(case: Case, x: str, registry=None, seed: int = 0) -> Case:
    """The case whose model computes the VJP for ``x`` (its only output) and whose check is with
    respect to ``x``: a second-order check of the rules. The seed ``dy`` is a graph input fed with
    the first-order cotangent r (or, for several float outputs, Σ⟨out_k, r_k⟩ is differentiated).
    Raises what the pass raises when the first-order graph cannot be built."""
    model = case.proto()
    feeds = dict(case.inputs)
    try:
        outputs = Evaluator(model, backends=("onnxruntime",))(feeds)
    except Exception:  # noqa: BLE001 - as in run_case: the reference evaluator runs what onnxruntime cannot
        outputs = Evaluator(model, backends=("reference",))(feeds)
    cotangents = cotangents_for(model, outputs, seed)
    floats = [i for i, r in enumerate(cotangents) if r is not None]
    if len(floats) == 1:
        proto, autodiff = backward_model(model, model.graph.output[floats[0]].name, [x], registry, seed="input")
        feeds[autodiff.seed_name] = cotangents[floats[0]]
    else:
        proto, autodiff = backward_model(scalarize(model, cotangents), LOSS, [x], registry)
    grad = next(o for o in proto.graph.output if o.name == autodiff.gradient_names[x])
    kept = onnx.ValueInfoProto()
    kept.CopyFrom(grad)
    del proto.graph.output[:]
    proto.graph.output.append(kept)
    return Case(f"{ORDER2_PREFIX}{case.name}[{x}]", case.op, case.kind, proto.SerializeToString(), feeds, wrt=[x])


def run_case_order2(case: Case, registry=None, budget: float = DEFAULT_BUDGET, seed: int = 0, **options) -> list[Result]:
    """Second-order check of one case: for each input x checked at first order, the derivative of
    the first-order graph's VJP with respect to x (rules applied to the backward templates),
    against finite differences of that first-order graph. Results carry the original case name;
    a first-order graph that cannot be built gives that status with a "first order:" message."""
    from onnx_autodiff.rules import default_registry

    registry = registry if registry is not None else default_registry()
    started = time.perf_counter()
    model = case.proto()
    if any(not isinstance(v, np.ndarray) for v in case.inputs.values()):
        return []
    if not any(_elem_type(o) in _FLOAT_ELEM for o in model.graph.output):
        return []
    if not any(_elem_type(i) in _FLOAT_ELEM for i in model.graph.input) and case.kind != "model":
        return []
    status, wrt, message = _differentiable_inputs(case, model, registry)
    if status:
        return [Result(case.name, case.op, case.kind, "*", status, message=f"first order: {message}")]
    try:  # as in run_case: no oracle for a model that fails the checker or is random
        onnx.checker.check_model(model, full_check=True)
        if _training_dropout(model, case.inputs):
            raise ValueError("training-mode Dropout is random")
    except Exception as error:  # noqa: BLE001
        return [Result(case.name, case.op, case.kind, "*", "oracle-skip", message=f"first order: {_one_line(error)}")]
    results = []
    for x in wrt:
        try:
            second = first_order_case(case, x, registry, seed)
        except Exception as error:  # noqa: BLE001 - the first-order graph is a prerequisite
            results.append(Result(case.name, case.op, case.kind, x, _classify(error),
                                  message=f"first order: {_one_line(error)}",
                                  seconds=time.perf_counter() - started))
            continue
        for r in run_case(second, registry, budget, seed, **options):
            results.append(dataclasses.replace(r, case=case.name, input=x if r.input in ("*", x) else r.input))
    return results


def order2_verdicts(results: Sequence[Result]) -> list[dict]:
    """Per op type: whether its rule is twice differentiable on the backend cases (every check
    passes or has no trustworthy reference, at least one passes) and, if not, why."""
    by_op: dict[str, list[Result]] = {}
    for r in results:
        by_op.setdefault(r.op, []).append(r)
    verdicts = []
    for op, rs in sorted(by_op.items()):
        statuses = {r.status for r in rs}
        first = [r for r in rs if r.message.startswith("first order:") and r.status != "oracle-skip"]
        bad = [r for r in rs if r.status in ("fail", "error", "no-rule", "refused") and r not in first]
        if statuses <= {"not-differentiable"}:
            verdict = "not differentiable"
        elif first and len(first) == len(rs):
            verdict = "no first order"
        elif bad:
            verdict = "no"
        elif "pass" in statuses:
            verdict = "yes"
        else:
            verdict = "unchecked"
        reasons: dict[str, int] = {}
        for r in bad or (first if verdict == "no first order" else []) or ([r for r in rs if r.status == "oracle-skip"] if verdict == "unchecked" else []):
            reason = f"{r.status}: {_reason(r.message)}"
            reasons[reason] = reasons.get(reason, 0) + 1
        verdicts.append({"op": op, "verdict": verdict, "checks": len(rs),
                         **{s: sum(r.status == s for r in rs) for s in STATUSES},
                         "reasons": [f"{text} (×{n})" if n > 1 else text for text, n in reasons.items()]})
    return verdicts


def _reason(message: str) -> str:
    """A message without the run-specific parts (element indices, values, node numbers)."""
    def value(match: re.Match) -> str:
        ad = match.group(1).rstrip(",")
        return f"wrong value (AD {ad})" if ad in ("nan", "inf", "-inf") else "wrong value"

    text = re.sub(r"worst element \[[^\]]*\]: AD (\S+), FD .*", value, message)
    text = re.sub(r"(bwd_\w+?)_\d+", r"\1", text)
    return text[:240]


# --------------------------------------------------------------------------- stored references

REFERENCES_DIR = Path(__file__).with_name("references")
DEFAULT_REFERENCES = REFERENCES_DIR / "oracle.npz"
"""The stored oracle answers shipped with the package (regenerate: see the module docstring)."""

ORACLE_REVISION = 2
"""Stored in saved references; 2: half-precision models widened to float32 in the fallback, one-sided flags."""

_FLAGS = ("kink", "unstable", "discontinuous", "nonfinite", "shape_changed", "one_sided")
_REFERENCE_FORMAT = 1


def _fingerprint(model: bytes, feeds: Mapping[str, np.ndarray], cotangents) -> str:
    """A short hash of what the oracle's answer depends on besides the seed: model, point, r."""
    digest = hashlib.sha256(model)
    for name in sorted(feeds):
        value = np.asarray(feeds[name])
        digest.update(f"{name}:{value.dtype}:{value.shape}".encode())
        digest.update(repr(value.tolist()).encode() if value.dtype.kind == "O" else np.ascontiguousarray(value).tobytes())
    for r in cotangents:
        digest.update(b"-" if r is None else f"{r.dtype}:{r.shape}".encode() + np.ascontiguousarray(r).tobytes())
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class StoredOracle:
    """The oracle's answer for one case: per input its :class:`FDGradient` (evaluated coordinates
    only), or ``error`` when the oracle could not evaluate the model."""

    fingerprint: str
    backend: str = ""
    weak: bool = False
    f0: float = float("nan")
    error: str | None = None
    details: dict = dataclasses.field(default_factory=dict)
    float32: dict = dataclasses.field(default_factory=dict)  # input → values storable in float32

    @classmethod
    def from_oracle(cls, fingerprint: str, oracle: OracleResult | None, error: str, dtypes: Mapping) -> StoredOracle:
        if oracle is None:
            return cls(fingerprint, error=error or "the oracle failed")
        # float32 keeps 7 digits: enough below the float32 tolerances (1e-4, 1e-3), not below float64's
        single = {x: np.dtype(dtypes.get(x, np.float64)) != np.float64 for x in oracle.details}
        return cls(fingerprint, oracle.backend, oracle.weak, oracle.f0, None, dict(oracle.details), single)

    def covers(self, inputs: Iterable[str]) -> bool:
        return self.error is not None or all(x in self.details for x in inputs)

    def oracle(self) -> OracleResult | None:
        if self.error is not None:
            return None
        return OracleResult({x: d.value for x, d in self.details.items()}, details=self.details,
                            backend=self.backend, weak=self.weak, f0=self.f0)


class References:
    """Stored oracle answers keyed by (case, onnx version, seed), in one compressed ``.npz``.

    The file holds a JSON index (``index.json``, as bytes) and six flat arrays shared by all
    entries: ``index`` (evaluated flat coordinates, delta-encoded uint32; absent when every
    coordinate was evaluated), ``flags`` (uint8 bits: kink, unstable, discontinuous, nonfinite,
    shape_changed, one_sided), ``value32``/``value64`` (the central estimates of evaluated coordinates,
    float32 where the checked gradient is float32 or float16) and ``lower``/``upper`` (the
    one-sided slopes at kinks, float64). Loading needs no pickle.
    """

    def __init__(self, entries: Mapping[tuple[str, str, int], StoredOracle] | None = None, meta=None) -> None:
        self.entries: dict[tuple[str, str, int], StoredOracle] = dict(entries or {})
        self.meta: dict = dict(meta or {})

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, case: str, seed: int = 0, onnx_version: str | None = None) -> StoredOracle | None:
        return self.entries.get((case, onnx_version or onnx.__version__, seed))

    def put(self, case: str, entry: StoredOracle, seed: int = 0, onnx_version: str | None = None) -> None:
        self.entries[(case, onnx_version or onnx.__version__, seed)] = entry

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        arrays = {k: [] for k in ("index", "flags", "value32", "value64", "lower", "upper")}
        sizes = dict.fromkeys(arrays, 0)

        def add(kind: str, values: np.ndarray) -> list[int]:
            arrays[kind].append(values)
            sizes[kind] += len(values)
            return [sizes[kind] - len(values), len(values)]

        entries = []
        for (case, version, seed), entry in sorted(self.entries.items()):
            item = {"case": case, "onnx": version, "seed": seed, "fingerprint": entry.fingerprint}
            if entry.error is not None:
                item["error"] = entry.error
            else:
                item.update(backend=entry.backend, weak=entry.weak, f0=entry.f0, inputs={})
                for x, detail in entry.details.items():
                    evaluated = np.flatnonzero(detail.evaluated.reshape(-1))
                    value = detail.value.reshape(-1)[evaluated]
                    flags = np.zeros(len(evaluated), np.uint8)
                    for bit, name in enumerate(_FLAGS):
                        flag = getattr(detail, name)
                        if flag is not None:
                            flags |= flag.reshape(-1)[evaluated].astype(np.uint8) << bit
                    kinks = evaluated[detail.kink.reshape(-1)[evaluated]]
                    finite = value[np.isfinite(value)]
                    single = entry.float32.get(x, False) and (finite.size == 0 or np.abs(finite).max() < 1e37)
                    stored = {"shape": list(detail.value.shape), "flags": add("flags", flags)}
                    if len(evaluated) != detail.value.size:
                        stored["index"] = add("index", np.diff(evaluated, prepend=0).astype(np.uint32))
                    kind = "value32" if single else "value64"
                    stored[kind] = add(kind, value.astype(np.float32 if single else np.float64))
                    stored["lower"] = add("lower", detail.lower.reshape(-1)[kinks])
                    add("upper", detail.upper.reshape(-1)[kinks])
                    item["inputs"][x] = stored
            entries.append(item)
        dtypes = {"index": np.uint32, "flags": np.uint8, "value32": np.float32, "value64": np.float64,
                  "lower": np.float64, "upper": np.float64}
        flat = {k: np.concatenate(v).astype(dtypes[k]) if v else np.zeros(0, dtypes[k]) for k, v in arrays.items()}
        index = {"format": _REFERENCE_FORMAT, **self.meta, "entries": entries}
        flat["index.json"] = np.frombuffer(json.dumps(index, separators=(",", ":")).encode(), np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **flat)
        write_atomically(path, buffer.getvalue())
        return path

    @classmethod
    def load(cls, path: str | Path) -> References:
        with np.load(path, allow_pickle=False) as data:
            flat = {k: data[k] for k in data.files}
        index = json.loads(flat.pop("index.json").tobytes().decode())
        if index.get("format") != _REFERENCE_FORMAT:
            raise ValueError(f"{path}: unknown references format {index.get('format')!r}")
        meta = {k: v for k, v in index.items() if k not in ("format", "entries")}
        take = lambda kind, span: flat[kind][span[0]: span[0] + span[1]]  # noqa: E731
        entries = {}
        for item in index["entries"]:
            key = (item["case"], item["onnx"], item["seed"])
            if "error" in item:
                entries[key] = StoredOracle(item["fingerprint"], error=item["error"])
                continue
            details = {}
            for x, stored in item["inputs"].items():
                shape = tuple(stored["shape"])
                size = int(np.prod(shape, dtype=np.int64))
                flags = take("flags", stored["flags"])
                evaluated = (np.cumsum(take("index", stored["index"]), dtype=np.int64) if "index" in stored
                             else np.arange(size))
                kind = "value32" if "value32" in stored else "value64"
                value = np.full(size, np.nan)
                value[evaluated] = take(kind, stored[kind])
                masks = {}
                for bit, name in enumerate(_FLAGS):
                    mask = np.zeros(size, bool)
                    mask[evaluated] = (flags >> bit) & 1
                    masks[name] = mask.reshape(shape)
                lower, upper = value.copy(), value.copy()
                kinks = evaluated[masks["kink"].reshape(-1)[evaluated]]
                lower[kinks] = take("lower", stored["lower"])
                upper[kinks] = take("upper", stored["lower"])
                mask = np.zeros(size, bool)
                mask[evaluated] = True
                details[x] = FDGradient(value=value.reshape(shape), lower=lower.reshape(shape),
                                        upper=upper.reshape(shape), evaluated=mask.reshape(shape), **masks)
            entries[key] = StoredOracle(item["fingerprint"], item["backend"], item["weak"], item["f0"], None, details)
        return cls(entries, meta)


# --------------------------------------------------------------------------- many cases

_WORKER: dict = {}


def _work(index: int) -> tuple[list[Result], dict]:
    state = _WORKER
    case = state["cases"][index]
    record = {} if state.get("record") else None
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            check = run_case_order2 if state.get("order", 1) == 2 else run_case
            results = check(case, state["registry"], state["budget"], state.get("seed", 0),
                            references=state.get("references"), record=record)
            return results, record or {}
    except Exception as error:  # noqa: BLE001 - one broken case must not stop the sweep
        return [Result(case.name, case.op, case.kind, "*", "error", message=_one_line(error))], {}


def _quiet_onnxruntime() -> None:
    """Keep the progress line readable: no runtime or serializer chatter on stderr."""
    import logging

    logging.getLogger("onnx_ir").setLevel(logging.ERROR)
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)
    except Exception:  # noqa: BLE001
        pass


def run_cases(
    cases: Sequence[Case],
    registry=None,
    *,
    jobs: int = 1,
    budget: float = DEFAULT_BUDGET,
    progress: Callable[[int, int, list[Result]], None] | None = None,
    references: References | None = None,
    save: References | None = None,
    seed: int = 0,
    order: int = 1,
) -> list[Result]:
    """Run :func:`run_case` over ``cases`` (in ``jobs`` processes); results in case order.

    ``progress(done, total, results_of_that_case)`` is called after each case. ``references``:
    compare with stored oracle answers where they exist; ``save``: run the live oracle on every
    candidate input and put its answers into that :class:`References`.
    """
    from onnx_autodiff.rules import default_registry

    _quiet_onnxruntime()
    _WORKER.update(cases=list(cases), registry=registry if registry is not None else default_registry(), budget=budget,
                   references=references, record=save is not None, seed=seed, order=order)
    by_index: dict[int, list[Result]] = {}

    def done(i: int, outcome: tuple[list[Result], dict]) -> None:
        by_index[i], recorded = outcome
        if save is not None:
            for name, entry in recorded.items():
                save.put(name, entry, seed)
        if progress:
            progress(len(by_index), len(cases), by_index[i])

    try:
        if jobs <= 1 or len(cases) <= 1:
            for i in range(len(cases)):
                done(i, _work(i))
        else:
            import multiprocessing

            os.environ.setdefault("OMP_NUM_THREADS", "1")
            context = multiprocessing.get_context("fork")  # workers inherit cases and registry
            with context.Pool(jobs, initializer=_quiet_onnxruntime) as pool:
                order = sorted(range(len(cases)), key=lambda i: -len(cases[i].model))
                for i, outcome in zip(order, pool.imap(_work, order, chunksize=1)):
                    done(i, outcome)
    finally:
        _WORKER.clear()
    return [r for i in range(len(cases)) for r in by_index[i]]


def case_status(results: Sequence[Result]) -> str:
    """The status of a case from its inputs' statuses (see _CASE_PRECEDENCE)."""
    statuses = {r.status for r in results}
    return next(s for s in _CASE_PRECEDENCE if s in statuses)


def summarize(results: Sequence[Result]) -> list[dict]:
    """One row per op type: cases per status (each case counted once) and the worst error."""
    by_case: dict[str, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    rows: dict[str, dict] = {}
    for case_results in by_case.values():
        op = case_results[0].op
        row = rows.setdefault(op, {"op": op, "cases": 0, **{s: 0 for s in STATUSES}, "constants": 0,
                                   "worst_error": None})
        row["cases"] += 1
        row[case_status(case_results)] += 1
        row["constants"] += case_status(case_results) == "pass" and any(r.constants or r.defaults for r in case_results)
        for r in case_results:
            if r.error is not None and math.isfinite(r.error):
                row["worst_error"] = max(row["worst_error"] or 0.0, r.error)
            elif r.error is not None:
                row["worst_error"] = float("inf")
    return [rows[op] for op in sorted(rows)]


def totals(results: Sequence[Result]) -> dict:
    """Cases and checks per status; ``eligible`` cases (all but not-differentiable), the percent
    of them that pass, ``constants``: passing cases whose backward graph needed run-time inputs
    fed as constants, and ``defaults``: passing cases whose model needed its default attributes
    written out to pass onnx.checker."""
    by_case: dict[str, list[Result]] = {}
    for r in results:
        by_case.setdefault(r.case, []).append(r)
    cases = {s: 0 for s in STATUSES}
    checks = {s: 0 for s in STATUSES}
    constants = defaults = 0
    for case_results in by_case.values():
        status = case_status(case_results)
        cases[status] += 1
        constants += status == "pass" and any(r.constants for r in case_results)
        defaults += status == "pass" and any(r.defaults for r in case_results)
    for r in results:
        checks[r.status] += 1
    eligible = len(by_case) - cases["not-differentiable"]
    return {"cases": cases, "checks": checks, "case_count": len(by_case), "check_count": len(results),
            "eligible": eligible, "constants": constants, "defaults": defaults,
            "pass_percent": round(100 * cases["pass"] / eligible, 2) if eligible else 0.0}


def eligible_line(summary: Mapping) -> str:
    """One line: eligible cases (all but not-differentiable), how many pass (how many of those with
    run-time inputs fed as constants) and the percent."""
    parts = [f"{summary['constants']} with run-time inputs fed as constants" if summary["constants"] else "",
             f"{summary['defaults']} with default attributes written out" if summary.get("defaults") else ""]
    fed = f" ({', '.join(p for p in parts if p)})" if any(parts) else ""
    return (f"{summary['eligible']} eligible cases (all but not-differentiable): pass {summary['cases']['pass']}"
            f"{fed} = {summary['pass_percent']:.1f}%")


# --------------------------------------------------------------------------- reports

_COLUMNS = ("pass", "fail", "no-rule", "not-differentiable", "refused", "oracle-skip", "error")
_SHORT = {"not-differentiable": "not-diff", "oracle-skip": "skip"}
_PROBLEMS = ("fail", "error", "refused", "no-rule")


def _fmt_error(value) -> str:
    if value is None:
        return "-"
    return "inf" if not math.isfinite(value) else f"{value:.3g}"


def format_table(rows: Sequence[dict], markdown: bool = False) -> str:
    """The per-op summary as aligned text, or as a Markdown table. Column ``pass*``: passing
    cases checked exporter-style, run-time inputs fed as constants or default attributes written
    out (counted in ``pass`` too)."""
    header = ["op", "cases", *(_SHORT.get(c, c) for c in _COLUMNS), "pass*", "worst error"]
    body = [[r["op"], str(r["cases"]), *(str(r[c]) for c in _COLUMNS), str(r.get("constants", 0)),
             _fmt_error(r["worst_error"])] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in column) for column in zip(header, *body)]
    fmt = lambda row: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])


def _versions() -> dict:
    import onnx_ir
    import onnxruntime

    import onnx_autodiff

    return {
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx_ir": onnx_ir.__version__,
        "numpy": np.__version__,
        "onnx_autodiff": getattr(onnx_autodiff, "__version__", "?"),
    }


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return value


def write_reports(path: str | Path, results: Sequence[Result], meta: Mapping, verdicts=None) -> tuple[Path, Path]:
    """Write PATH.md and PATH.json (atomically); returns both paths. ``verdicts`` (from
    :func:`order2_verdicts`) adds the second-order section."""
    base = _report_base(path)
    rows = summarize(results)
    summary = totals(results)
    document = {
        **meta,
        "versions": _versions(),
        "statuses": list(STATUSES),
        "totals": summary,
        "ops": [{k: _jsonable(v) for k, v in row.items()} for row in rows],
        "results": [{k: _jsonable(v) for k, v in dataclasses.asdict(r).items()} for r in results],
    }
    if verdicts is not None:
        document["second_order"] = verdicts
    md = [
        "# onnx-autodiff conformance report",
        "",
        "Gradients of the backward graphs (onnxruntime) against float64 finite differences on the "
        "ONNX backend test data. Tolerance: |ad − fd| ≤ atol·max(1, ‖fd‖∞) + rtol·|fd| "
        "(float32: 1e-4, 1e-3; float64: 1e-6, 1e-5; float16: 1e-2, 1e-2; weak oracle: 3e-2); "
        "worst error is that ratio (≤ 1 passes). Cases are counted once, by their worst input.",
        "",
        ", ".join(f"{k} {v}" for k, v in document["versions"].items()),
        f"wall time {meta.get('wall_seconds', 0):.1f} s with {meta.get('jobs', 1)} job(s)",
        "",
        f"**{eligible_line(summary)}**",
        "",
        f"**{summary['case_count']} cases**: "
        + ", ".join(f"{s} {n}" for s, n in summary["cases"].items() if n),
        "",
        f"**{summary['check_count']} checks** (case × input): "
        + ", ".join(f"{s} {n}" for s, n in summary["checks"].items() if n),
        "",
        format_table(rows, markdown=True),
        "",
        "Column pass*: passing cases checked exporter-style (counted in pass, listed below and "
        "marked ⚑): first refused because an input the rule needs as a constant (Resize scales, "
        "Slice axes, ...) is fed at run time in the backend data, they ran with those inputs (every "
        "input not checked) as initializers; or onnx.checker rejected the model until the schema's "
        "default attributes were written out (onnx's shape inference reads other defaults).",
        "",
    ]
    if verdicts is not None:
        md[0] = "# onnx-autodiff second-order conformance report"
        md[2] = ("Per single-node case and input x: the first-order graph (VJP for x with seed dy = r) "
                 "differentiated again with respect to x, against finite differences of that graph. "
                 "Same tolerances as the first-order report. " + md[2].split(". ", 1)[1])
        tally: dict[str, list[str]] = {}
        for v in verdicts:
            tally.setdefault(v["verdict"], []).append(v["op"])
        md += ["## Twice differentiable?", "",
               "yes: every check passes (or has no trustworthy reference) and one at least passes; "
               "no: a check fails, errs, or a rule is missing or refuses inside the backward template; "
               "no first order: the first-order graph itself cannot be built.", "",
               ", ".join(f"**{k}** {len(ops)}" for k, ops in sorted(tally.items())), "",
               f"Twice differentiable ({len(tally.get('yes', []))}): " + ", ".join(tally.get("yes", [])), "",
               "| op | verdict | checks | pass | reasons |", "|---|---|---:|---:|---|"]
        md += [f"| {v['op']} | {v['verdict']} | {v['checks']} | {v['pass']} | {'; '.join(v['reasons'][:4]).replace('|', '/')} |"
               for v in verdicts if v["verdict"] != "yes"]
        md.append("")
    problems = [r for r in results if r.status in _PROBLEMS]
    if problems:
        md += ["## Failures, errors, refusals and missing rules", ""]
        for r in problems:
            error = f" (error {_fmt_error(r.error)})" if r.error is not None else ""
            fed = " ⚑" if r.constants or r.defaults else ""
            md.append(f"- **{r.status}**{fed} `{r.case}` input `{r.input}`{error}: {r.message}".rstrip(": "))
        md.append("")
    fed = [r for r in results if (r.constants or r.defaults) and r.status not in _PROBLEMS]
    if fed:
        md += ["## ⚑ Checked exporter-style", "",
               "Run-time inputs fed as constants (the first attempt, with the inputs as in the backend "
               "data, was refused) and default attributes written out.", ""]
        md += [f"- **{r.status}** ⚑ `{r.case}` input `{r.input}`: "
               + "; ".join(p for p in (", ".join(r.constants), ", ".join(f"@{d}" for d in r.defaults)) if p)
               + (f" ({r.message})" if r.message else "") for r in fed]
        md.append("")
    skips = [r for r in results if r.status == "oracle-skip"]
    if skips:
        md += ["## Oracle skips", ""] + [f"- `{r.case}` input `{r.input}`: {r.message}" for r in skips] + [""]
    md_path, json_path = base.with_name(base.name + ".md"), base.with_name(base.name + ".json")
    _atomic_write(md_path, "\n".join(md))
    _atomic_write(json_path, json.dumps(document, indent=1, default=str) + "\n")
    return md_path, json_path


def _report_base(path: str | Path) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".md", ".json") else path


def _atomic_write(path: Path, text: str) -> None:
    write_atomically(path, text.encode("utf-8"))


# --------------------------------------------------------------------------- command line


class UsageError(Exception):
    """Bad command-line input: reported on one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``onnx-autodiff conformance`` to ``parser``."""
    parser.add_argument("--op", nargs="+", action="extend", default=[], metavar="OP",
                        help="only cases of these op types (or model suites: pytorch-converted, pytorch-operator)")
    parser.add_argument("--case", nargs="+", action="extend", default=[], metavar="NAME",
                        help="only these cases (e.g. test_add_bcast, pytorch-converted/test_Linear)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument("--report", metavar="PATH", help="write PATH.md and PATH.json")
    parser.add_argument("--limit", type=int, metavar="N", help="at most N cases (after filtering)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, metavar="SECONDS",
                        help=f"finite-difference time budget per case (default {DEFAULT_BUDGET:g})")
    parser.add_argument("--no-models", action="store_true",
                        help="skip the pytorch-converted/pytorch-operator models")
    parser.add_argument("--refresh-cache", action="store_true", help="collect the backend test cases again")
    parser.add_argument("--order", type=int, choices=(1, 2), default=1,
                        help="2: differentiate each single-node case's first-order graph again and check it "
                             "against finite differences of that graph (per-op verdict: twice differentiable)")
    parser.add_argument("--references", nargs="?", const=str(DEFAULT_REFERENCES), metavar="FILE",
                        help="compare with the oracle answers stored in FILE (default: the packaged "
                             "conformance/references/oracle.npz) instead of running finite differences; "
                             "cases missing from FILE use the live oracle and are listed")
    parser.add_argument("--save-references", metavar="FILE",
                        help="run the live oracle on every candidate input and store its answers in FILE "
                             "(.npz; entries of other cases, onnx versions or seeds already in FILE are kept)")


def select_cases(cases: Sequence[Case], ops: Sequence[str] = (), names: Sequence[str] = (), limit: int | None = None) -> list[Case]:
    """Filter by op type and case name (UsageError on unknown ones), then keep the first ``limit``."""
    known_ops = sorted({c.op for c in cases})
    for op in ops:
        if op not in known_ops:
            close = difflib.get_close_matches(op, known_ops, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"unknown op '{op}': no backend test case exercises it{hint}")
    by_name = {c.name: c for c in cases}
    short = {c.name.split("/", 1)[1]: c.name for c in cases if c.kind == "model"}
    wanted = []
    for name in names:
        full = name if name in by_name else short.get(name)
        if full is None:
            close = difflib.get_close_matches(name, list(by_name), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"unknown case '{name}'{hint}")
        wanted.append(full)
    selected = [c for c in cases if (not ops or c.op in ops) and (not names or c.name in wanted)]
    return selected[:limit] if limit is not None else selected


def _check_report_path(path: str) -> None:
    base = _report_base(path)
    directory = base.parent if str(base.parent) else Path(".")
    if not directory.is_dir():
        raise UsageError(f"cannot write the report: directory '{directory}' does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"cannot write the report: directory '{directory}' is not writable")
    for suffix in (".md", ".json"):
        target = base.with_name(base.name + suffix)
        if target.is_dir() or (target.exists() and not os.access(target, os.W_OK)):
            raise UsageError(f"cannot write the report: '{target}' is not a writable file")


class _Progress:
    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self.counts = {s: 0 for s in STATUSES}
        self.last = 0.0

    def __call__(self, done: int, total: int, results: list[Result]) -> None:
        if results:
            self.counts[case_status(results)] += 1
        now = time.perf_counter()
        if not (self.tty and now - self.last > 0.2) and not (done == total or done % 50 == 0):
            return
        self.last = now
        counts = " ".join(f"{_SHORT.get(s, s)} {n}" for s, n in self.counts.items() if n)
        name = results[0].case if results else ""
        line = f"[{done}/{total}] {now - self.started:.0f}s {counts} {name}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:160])
            if done == total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _reference_options(args: argparse.Namespace) -> tuple[References | None, References | None]:
    """(references to compare with, references to fill) from --references / --save-references."""
    load, save = getattr(args, "references", None), getattr(args, "save_references", None)
    if load and save:
        raise UsageError("use either --references or --save-references, not both")
    references = None
    if load:
        if not Path(load).is_file():
            raise UsageError(f"cannot read the references: '{load}' does not exist")
        try:
            references = References.load(load)
        except Exception as error:  # noqa: BLE001 - a corrupt file is a usage problem
            raise UsageError(f"cannot read the references '{load}': {_one_line(error)}") from None
    target = None
    if save:
        directory = Path(save).parent
        if not directory.is_dir():
            raise UsageError(f"cannot write the references: directory '{directory}' does not exist")
        target = References()
        if Path(save).is_file():
            try:
                target = References.load(save)
            except Exception as error:  # noqa: BLE001
                raise UsageError(f"cannot update the references '{save}': {_one_line(error)}") from None
    return references, target


def run(args: argparse.Namespace, registry=None) -> int:
    """Run ``onnx-autodiff conformance``: 0 all registered rules pass, 1 a rule fails, 2 bad usage.

    ``args`` comes from a parser set up by :func:`add_arguments`; ``registry`` defaults to the
    shipped one.
    """
    prog = "onnx-autodiff conformance"
    try:
        if args.jobs < 1:
            raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"--limit must be at least 1, not {args.limit}")
        if getattr(args, "budget", DEFAULT_BUDGET) <= 0:
            raise UsageError(f"--budget must be positive, not {args.budget}")
        if args.report:
            _check_report_path(args.report)
        references, save = _reference_options(args)
        started = time.perf_counter()
        cases = load_node_cases(refresh=getattr(args, "refresh_cache", False))
        node_names = {c.name for c in cases}
        if (
            not getattr(args, "no_models", False)
            and (not args.op or any(op in MODEL_SUITES for op in args.op))
            and (not args.case or any(name not in node_names for name in args.case))
        ):
            cases += load_model_cases()
        order = getattr(args, "order", 1)
        if order == 2:  # the op's own rule twice: single-node cases (expanded bodies and models are order-1 matters)
            cases = [c for c in cases if c.kind == "node" or c.name in args.case]
        selected = select_cases(cases, args.op, args.case, args.limit)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    budget = getattr(args, "budget", DEFAULT_BUDGET)
    results = run_cases(selected, registry, jobs=args.jobs, budget=budget, progress=_Progress(),
                        references=references, save=save, order=order)
    wall = time.perf_counter() - started
    rows = summarize(results)
    summary = totals(results)
    print(format_table(rows))
    print()
    print(f"{summary['case_count']} cases: " + ", ".join(f"{s} {n}" for s, n in summary["cases"].items() if n))
    print(eligible_line(summary))
    print(f"{summary['check_count']} checks: " + ", ".join(f"{s} {n}" for s, n in summary["checks"].items() if n))
    for r in results:
        if r.status in ("fail", "error"):
            print(f"{r.status}: {r.case} [{r.input}] {_fmt_error(r.error) if r.error is not None else ''} {r.message}".rstrip())
    verdicts = order2_verdicts(results) if order == 2 else None
    if verdicts is not None:
        counts = {}
        for v in verdicts:
            counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
        print("second order, op types: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
        for v in verdicts:
            if v["verdict"] not in ("yes", "not differentiable"):
                print(f"  {v['op']}: {v['verdict']}: " + "; ".join(v["reasons"][:2]))
    print(f"wall time {wall:.1f} s ({args.jobs} job(s), {len(selected)} selected cases)")
    if references is not None:
        live = [r for r in results if r.source.startswith("live")]
        stored = sum(r.source == "stored" for r in results)
        print(f"references {args.references}: {stored} checks from stored values, {len(live)} with the live oracle")
        for r in live:
            print(f"  {r.source}: {r.case} [{r.input}]")
    if save is not None:
        save.meta.update(versions=_versions(), budget=budget, max_coords=MAX_COORDS, oracle_revision=ORACLE_REVISION)
        try:
            path = save.save(args.save_references)
        except OSError as error:
            print(f"{prog}: error: cannot write the references: {error}", file=sys.stderr)
            return 2
        print(f"references: {len(save)} entries in {path} ({path.stat().st_size / 1e6:.2f} MB)")
    if args.report:
        meta = {"wall_seconds": wall, "jobs": args.jobs, "budget": budget, "selected_cases": len(selected), "order": order,
                "filters": {"op": list(args.op), "case": list(args.case), "limit": args.limit}}
        try:
            md_path, json_path = write_reports(args.report, results, meta, verdicts)
        except OSError as error:
            print(f"{prog}: error: cannot write the report: {error}", file=sys.stderr)
            return 2
        print(f"report: {md_path}, {json_path}")
    return 1 if any(r.status in ("fail", "error") for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onnx-autodiff conformance", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
