"""Judging one case: prepare it (differentiable inputs, a model onnx.checker accepts, a deterministic
forward run, the cotangents), build and run each input's backward graph (retried exporter-style
when a rule refuses a run-time input), ask the oracle (stored or live), and give each input its
verdict. See :mod:`onnx_autodiff.conformance.runner` for the statuses and the retry."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_autodiff.conformance.cases import CHECKED_ELEM_TYPES, Case, elem_type
from onnx_autodiff.conformance.check import (LOSS, WEAK_TOLERANCE, backward_model, compare_elements, cotangent_feeds,
                                             scalarize, symbolic_inputs)
from onnx_autodiff.conformance.oracle import BACKENDS, Evaluator, OracleResult, cotangents_for, fd_vjp, usable
from onnx_autodiff.modelfile import from_proto
from onnx_autodiff.conformance.references import References, StoredOracle, case_fingerprint, is_stale
from onnx_autodiff.conformance.symbolic import recheck

STATUSES = ("pass", "fail", "no-rule", "not-differentiable", "refused", "oracle-skip", "error")
"""Every status a check can get, in report-column order."""

TOLERANCES = {
    np.dtype(np.float64): (1e-6, 1e-5),
    np.dtype(np.float32): (1e-4, 1e-3),
    np.dtype(np.float16): (1e-2, 1e-2),
}
"""(atol, rtol) per dtype of the backward computation: |ad − fd| ≤ atol·max(1, ‖fd‖∞) + rtol·|fd|."""

DEFAULT_BUDGET = 3.0
MAX_COORDS = 2000
FORWARD_AGREEMENT = 1e-3  # relative: the oracle's float64 forward vs onnxruntime's float32 one


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
    symbolic: str = ""  # the re-check on symbolic dimensions (SYMBOLIC_OUTCOMES; "": not run)
    symbolic_message: str = ""


def run_case(
    case: Case,
    registry=None,
    budget: float = DEFAULT_BUDGET,
    seed: int = 0,
    *,
    references: References | None = None,
    record: dict | None = None,
    symbolic: bool = True,
) -> list[Result]:
    """Check every float differentiable input of one case; one Result per input (or one per case
    when the case is not checked at all). Cases without a float input and a float output give [].

    With ``references``, the oracle's stored answers replace the finite differences when they
    exist for this case, seed and onnx version and their fingerprint (model, inputs, cotangents)
    matches; otherwise the live oracle runs (``Result.source`` says which). With ``record`` (a
    dict), the live oracle runs on every candidate input and ``record[case.name]`` receives its
    :class:`StoredOracle`. With ``symbolic``, every input that passed or failed is also checked on
    symbolic dimensions (``Result.symbolic``, see :func:`_symbolic`)."""
    from onnx_autodiff.rules import default_registry

    registry = registry if registry is not None else default_registry()
    forward = _prepare(case, registry, seed, started=time.perf_counter())
    if not isinstance(forward, _Forward):
        return forward
    gradients, results = {}, {}
    for x in forward.wrt:
        outcome = _backward(forward, x, registry)
        if isinstance(outcome, Result):
            results[x] = outcome
        else:
            gradients[x] = outcome
    if gradients or record is not None:
        answer = _ask_oracle(forward, gradients, budget, seed, references, record)
        results.update({x: _verdict(forward, x, gradient, answer) for x, gradient in gradients.items()})
    if symbolic:
        _symbolic(forward, {x: g for x, g in gradients.items() if results[x].status in ("pass", "fail")},
                  results, registry)
    return [results[x] for x in forward.wrt]


# --------------------------------------------------------------------------- prepare and run forward


def _result(case: Case, started: float, x: str, status: str, **fields) -> Result:
    return Result(case.name, case.op, case.kind, x, status, seconds=time.perf_counter() - started, **fields)


@dataclasses.dataclass
class _Forward:
    """A case ready for its checks: the model as checked (``defaults``: the default attributes
    written out for onnx.checker), the inputs to check, and the forward run on ``backend``."""

    case: Case
    model: onnx.ModelProto
    feeds: dict
    wrt: list
    defaults: list
    backend: str
    outputs: list
    cotangents: list
    started: float
    objective: float = dataclasses.field(init=False)  # f = Σ⟨out, r⟩ of the forward run
    nonfinite: bool = dataclasses.field(init=False)  # a float output has non-finite elements
    seeded: bool = dataclasses.field(init=False)  # a seeded training Dropout
    constants: list = dataclasses.field(init=False)  # what the exporter-style retry feeds as constants
    backward_backends: tuple = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.objective = _objective(self.outputs, self.cotangents)
        # r is 0 on non-finite outputs, but 0·NaN is NaN: there AD cannot be finite, nor wrong
        self.nonfinite = any(r is not None and not np.all(np.isfinite(out))
                             for out, r in zip(self.outputs, self.cotangents))
        self.seeded = _seeded_dropout(self.model, self.feeds)
        self.constants = _constant_candidates(self.case, self.model, self.wrt, self.feeds)
        # a backward graph must run on onnxruntime unless the forward model itself does not
        self.backward_backends = ("onnxruntime",) if self.backend == "onnxruntime" else ("onnxruntime", "reference")

    def result(self, x: str, status: str, **fields) -> Result:
        return _result(self.case, self.started, x, status, **fields)


def _prepare(case: Case, registry, seed: int, started: float) -> _Forward | list[Result]:
    """The case ready for its checks, or its results when it is not checked: [] when there is
    nothing to check, one result for input "*" when the op has no usable rule or the forward model
    gives the oracle nothing to trust."""
    model = case.proto()
    if any(not isinstance(v, np.ndarray) for v in case.inputs.values()):
        return []  # sequences, optionals: not tensors
    feeds = dict(case.inputs)
    float_outputs = [o for o in model.graph.output if elem_type(o) in CHECKED_ELEM_TYPES]
    float_inputs = [i for i in model.graph.input if elem_type(i) in CHECKED_ELEM_TYPES]
    if not float_outputs or not (float_inputs or case.kind == "model"):
        return []

    def settled(status: str, message: str) -> list[Result]:
        return [_result(case, started, "*", status, message=message)]

    try:
        status, wrt, message = differentiable_inputs(case, model, registry)
    except Exception as error:  # noqa: BLE001 - a broken rule lookup is reported, not raised
        return settled("error", one_line(error))
    if status:
        return settled(status, message)
    if not wrt:
        return []
    model, defaults, trouble = _checked(model)
    if model is None:
        return settled("oracle-skip", trouble)
    if training_dropout(model, feeds):
        return settled("oracle-skip", "training-mode Dropout without a seed attribute is random")
    backend, outputs, trouble = _run_forward(model, feeds)
    if trouble:
        return settled("oracle-skip", trouble)
    cotangents = cotangents_for(model, outputs, seed)
    if all(r is None for r in cotangents):
        return []
    return _Forward(case, model, feeds, wrt, defaults, backend, outputs, cotangents, started)


def differentiable_inputs(case: Case, model: onnx.ModelProto, registry) -> tuple[str, list[str], str]:
    """(status or "", candidate graph inputs, message) for the op under test."""
    floats = [i.name for i in model.graph.input if elem_type(i) in CHECKED_ELEM_TYPES]
    if case.wrt is not None:
        return "", [x for x in case.wrt if x in floats], ""
    if case.kind == "model":
        return "", [t.name for t in model.graph.initializer if t.data_type in CHECKED_ELEM_TYPES], ""
    base = onnx.load_from_string(case.base) if case.base is not None else model
    based = from_proto(base)
    graph = based.graph
    opsets = {("" if k == "ai.onnx" else k): v for k, v in based.opset_imports.items()}
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


def _checked(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, list[str], str]:
    """(the model, default attributes written out, "") in a form onnx.checker accepts, the schema's
    default attributes written out if that is what it takes; (None, [], why) when nothing does."""
    try:
        onnx.checker.check_model(model, full_check=True)
        return model, [], ""
    except Exception as error:  # noqa: BLE001 - the pass's output could not pass the checker either
        explicit, written = explicit_defaults(model)
        if explicit is None:
            return None, [], f"the forward model fails onnx.checker: {one_line(error)}"
        return explicit, written, ""  # as exporters write them; the function is the same


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


def training_dropout(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> bool:
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


def _run_forward(model: onnx.ModelProto, feeds) -> tuple[str, list[np.ndarray], str]:
    """(runtime, outputs, "") of the forward model on onnxruntime or else the reference evaluator,
    run twice; ("", [], why) when it runs on neither or is not deterministic."""
    failures = []
    for backend in ("onnxruntime", "reference"):
        try:
            forward = Evaluator(model, backends=(backend,))
            first, second = forward(feeds), forward(feeds)
        except Exception as error:  # noqa: BLE001 - try the next runtime
            failures.append(f"{backend}: {one_line(error)}")
            continue
        if not all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f") for a, b in zip(first, second)):
            return "", [], "the model is not deterministic (random op)"
        return backend, first, ""
    return "", [], "the forward model does not run: " + "; ".join(failures)


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


# --------------------------------------------------------------------------- backward


@dataclasses.dataclass
class _Gradient:
    """One input's VJP from its backward graph, the runtime that ran it and every output of that
    graph by name; ``constants`` and ``defaults`` say what the exporter-style retry changed."""

    ad: np.ndarray
    backend: str
    named: dict
    model: onnx.ModelProto  # the model whose backward graph gave it, and its feeds
    feeds: dict
    constants: list = dataclasses.field(default_factory=list)
    defaults: list = dataclasses.field(default_factory=list)


def _backward(forward: _Forward, x: str, registry) -> _Gradient | Result:
    """The VJP for ``x``, or the result saying why there is none to judge."""
    gradient, status, message = _attempt(forward, forward.model, forward.feeds, x, registry)
    if gradient is None and status == "refused" and forward.constants:
        gradient, status, message = _retry_with_constants(forward, x, registry, status, message)
    if gradient is None:
        if status == "error" and forward.backend != "onnxruntime":
            # onnxruntime rejects the forward model itself (an unsupported layout, a converted
            # model that breaks the broadcasting rules, ...): no runtime to judge the rule with.
            status = "oracle-skip"
        return forward.result(x, status, message=message)
    if forward.seeded and not _same_forward(gradient.named, forward.model, forward.outputs, forward.objective):
        return forward.result(x, "oracle-skip", message="the backward graph's seeded training Dropout drew "
                              "another mask than the forward run")
    return gradient


def _attempt(forward: _Forward, model: onnx.ModelProto, feeds, x: str, registry) -> tuple[_Gradient | None, str, str]:
    """(gradient, "", "") from the backward graph of ``model``, or (None, status, message)."""
    try:
        ad, backend, named = _ad(model, feeds, x, forward.cotangents, registry, forward.backward_backends)
    except Exception as error:  # noqa: BLE001 - every failure of the pass is a reported status
        return None, classify(error), one_line(error)
    return _Gradient(ad, backend, named, model, feeds), "", ""


def _retry_with_constants(forward: _Forward, x: str, registry, status: str, message: str):
    """The exporter-style retry of a refused input: exporters write the inputs the rule needs as
    constants as initializers or Constant nodes, so feed every input not checked that way (the
    function is the same). (gradient, status, message) with the first attempt's status and
    message, or (None, status, message) saying what the retry met."""
    names = ", ".join(forward.constants)
    model, feeds = with_constants(forward.model, forward.feeds, forward.constants)
    model, written, trouble = _checked(model)
    if model is not None:
        trouble = _forward_trouble((model, feeds), forward.backend, forward.cotangents, forward.objective)
    if trouble:
        return None, status, f"{message}; with {names} as constants {trouble}"
    gradient, again_status, again = _attempt(forward, model, feeds, x, registry)
    if gradient is not None:
        gradient.constants, gradient.defaults = list(forward.constants), written
        return gradient, status, message
    note = (f"the same with {names} fed as constants" if again == message
            else f"with {names} fed as constants: {again}")
    return (None, "error", note) if again_status == "error" else (None, status, f"{message}; {note}")


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


def _forward_trouble(exported, backend: str, cotangents, f32: float) -> str:
    """Why the exporter-style forward model cannot stand in for the case's (it does not run on the
    runtime that ran the case, or computes another function there), or ""."""
    try:
        outputs = Evaluator(exported[0], backends=(backend,))(exported[1])
    except Exception as error:  # noqa: BLE001
        return f"the forward model does not run on {backend}: {one_line(error)}"
    if _disagree(_objective(outputs, cotangents), f32):
        return f"the forward model computes other values on {backend}"
    return ""


def backward_graph(model: onnx.ModelProto, x: str, cotangents, registry) -> tuple[onnx.ModelProto, str, dict]:
    """(the model with the gradient for ``x``, that output's name, the seed's feeds): the seed
    ``dy`` is an input fed with r when one output is float, else Σ⟨out_k, r_k⟩ is differentiated."""
    proto, names, seed = backward_graphs(model, [x], cotangents, registry)
    return proto, names[x], seed


def backward_graphs(model: onnx.ModelProto, wrt: Sequence[str], cotangents,
                    registry) -> tuple[onnx.ModelProto, dict, dict]:
    """:func:`backward_graph` for several inputs at once: the gradients' names by input."""
    floats = [i for i, r in enumerate(cotangents) if r is not None]
    if len(floats) == 1:
        of = model.graph.output[floats[0]].name
        proto, autodiff = backward_model(model, of, list(wrt), registry, seed="input")
        seed = {autodiff.seed_name: cotangents[floats[0]]}
    else:
        fed = symbolic_inputs(model)
        proto, autodiff = backward_model(scalarize(model, cotangents, fed), LOSS, list(wrt), registry)
        seed = cotangent_feeds(cotangents) if fed else {}
    return proto, {x: autodiff.gradient_names[x] for x in wrt}, seed


def _ad(model, feeds, x, cotangents, registry, backends) -> tuple[np.ndarray, str, dict]:
    """The backward graph's VJP for ``x``, the backend that ran it (the first of ``backends``
    that loads and runs it) and every output of that graph by name."""
    proto, gradient_name, seed = backward_graph(model, x, cotangents, registry)
    outputs, backend = _run_backward(proto, {**feeds, **seed}, backends)
    named = dict(zip((o.name for o in proto.graph.output), outputs))
    return named[gradient_name], backend, named


def _run_backward(proto: onnx.ModelProto, feeds, backends) -> tuple[list[np.ndarray], str]:
    """(outputs, runtime) of a backward graph on the first of ``backends`` that loads and runs it."""
    failures = []
    for backend in backends:
        try:
            evaluate = Evaluator(proto, backends=(backend,))
        except RuntimeError as error:
            failures.append(f"the backward graph does not run on {backend}: {error}")
            continue
        try:
            return evaluate(feeds), backend
        except Exception as error:  # noqa: BLE001 - say which runtime failed
            failures.append(f"running the backward graph on {backend}: {one_line(error)}")
    raise RuntimeError("; ".join(failures))


def _symbolic(forward: _Forward, gradients: Mapping[str, _Gradient], results: dict, registry) -> None:
    """Set ``Result.symbolic`` of the judged inputs: :func:`~onnx_autodiff.conformance.symbolic.recheck`
    of the model each backward graph came from (the case's, or its exporter-style form), against
    that model's forward outputs on the case's runtime."""
    groups: dict[int, list[str]] = {}
    for x, gradient in gradients.items():
        groups.setdefault(id(gradient.model), []).append(x)
    for xs in groups.values():
        first = gradients[xs[0]]
        outputs = forward.outputs
        if first.model is not forward.model:
            try:
                outputs = Evaluator(first.model, backends=(forward.backend,))(first.feeds)
            except Exception as error:  # noqa: BLE001 - it ran in the retry; say so if not now
                for x in xs:
                    results[x].symbolic, results[x].symbolic_message = "fail", one_line(error)
                continue
        checks = recheck(
            first.model, first.feeds, {x: gradients[x].ad for x in xs}, forward_backend=forward.backend,
            outputs=outputs,
            build=lambda model, wrt: backward_graphs(model, wrt, forward.cotangents, registry),
            run=lambda proto, feeds: _run_backward(proto, feeds, forward.backward_backends),
            tolerance=lambda value: TOLERANCES.get(value.dtype, TOLERANCES[np.dtype(np.float32)]),
            describe=one_line)
        for x, check in checks.items():
            results[x].symbolic, results[x].symbolic_message = check.outcome, check.message


def _same_forward(named: Mapping[str, np.ndarray], model, first, f32: float) -> bool:
    """Whether the backward graph recomputed the forward outputs it exposes as the forward run did."""
    if LOSS in named:
        return not _disagree(float(named[LOSS]), f32)
    return all(np.allclose(named[o.name], out, equal_nan=True)
               for o, out in zip(model.graph.output, first) if o.name in named)


def classify(error: BaseException) -> str:
    """The status of an exception the pass raised."""
    from onnx_autodiff.errors import AutodiffError, MissingRuleError, NotDifferentiableError, RuleError

    if isinstance(error, MissingRuleError):
        return "no-rule"
    if isinstance(error, NotDifferentiableError):
        return "not-differentiable"
    if isinstance(error, RuleError) and (error.__cause__ is None or isinstance(error.__cause__, AutodiffError)):
        return "refused"  # raised on purpose (a rule's or the engine's); a crashing rule has another cause
    return "error"


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and message, whitespace collapsed, at most 500 characters."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:500]}"


# --------------------------------------------------------------------------- oracle


@dataclasses.dataclass
class _Answer:
    """The oracle's answer for a case (None: no trustworthy one, ``reason`` says why), where it
    came from ("stored", "live", "live (stale reference)"; "" without references) and, when
    onnxruntime's own function stood in for the float64 one, why (``fallback``)."""

    oracle: OracleResult | None
    reason: str = ""
    source: str = ""
    fallback: str = ""


def _ask_oracle(forward: _Forward, gradients: Mapping[str, _Gradient], budget: float, seed: int,
                references: References | None, record: dict | None) -> _Answer:
    """The stored answer when it fits, else the live oracle's; with ``record``, the live oracle on
    every candidate input (so a rule fixed later needs no new references), stored in ``record``."""
    need = list(forward.wrt) if record is not None else list(gradients)
    fingerprint = case_fingerprint(forward.case.model, forward.feeds, forward.cotangents)
    answer = _stored_or_live(forward, references if record is None else None, fingerprint, gradients,
                             need, budget, seed)
    if answer.oracle is not None and _disagree(answer.oracle.f0, forward.objective):
        answer = _float32_fallback(forward, answer, need, budget, seed)
    if record is not None:
        dtypes = {x: np.asarray(gradient.ad).dtype for x, gradient in gradients.items()}
        record[forward.case.name] = StoredOracle.from_oracle(fingerprint, answer.oracle, answer.reason, dtypes)
    return answer


def _stored_or_live(forward: _Forward, references: References | None, fingerprint: str, gradients,
                    need: list[str], budget: float, seed: int) -> _Answer:
    """The stored answer when it exists for this fingerprint, covers the inputs and is not stale;
    else the live oracle's (``source`` says why when references were given)."""
    stored = references.get(forward.case.name, seed) if references is not None else None
    if (stored is not None and stored.fingerprint == fingerprint and stored.covers(gradients)
            and not is_stale(stored, references, forward.feeds)):
        return _Answer(stored.oracle(), stored.error or "", "stored")
    source = ""
    if references is not None:
        source = "live (stale reference)" if stored is not None and stored.fingerprint != fingerprint else "live"
    oracle, reason = _live(forward, need, budget, seed)
    return _Answer(oracle, reason, source)


def _float32_fallback(forward: _Forward, answer: _Answer, need: list[str], budget: float, seed: int) -> _Answer:
    """The oracle's runtime and the forward run disagree on f: no float64 answer. Where onnxruntime
    ran the case its semantics may differ from the float64 runtime's (MaxUnpool with an
    output_shape); the rules follow onnxruntime, so judge them by its own function in float32."""
    reason = (f"the oracle's runtime ({answer.oracle.backend}) and {forward.backend} disagree on the "
              f"forward outputs: <out, r> = {answer.oracle.f0:.6g} vs {forward.objective:.6g}")
    if forward.backend != "onnxruntime":
        return _Answer(None, reason, answer.source)
    oracle, _ = _live(forward, need, budget, seed, backends=("float32",))
    if oracle is None or _disagree(oracle.f0, forward.objective):
        return _Answer(None, reason, answer.source)
    return _Answer(oracle, reason, answer.source and "live", fallback=reason)


def _live(forward: _Forward, need: list[str], budget: float, seed: int,
          backends: Sequence[str] = BACKENDS) -> tuple[OracleResult | None, str]:
    """(the live oracle's answer, "") or (None, why it failed)."""
    try:
        return fd_vjp(forward.model, forward.feeds, need, forward.cotangents, max_coords=MAX_COORDS,
                      time_budget=budget, seed=seed, backends=backends), ""
    except Exception as error:  # noqa: BLE001
        return None, one_line(error)


# --------------------------------------------------------------------------- verdict


def _verdict(forward: _Forward, x: str, gradient: _Gradient, answer: _Answer) -> Result:
    """pass or fail for one input against the oracle's answer (oracle-skip when there is nothing
    to compare with, error when the shapes do not match)."""
    common = {"source": answer.source, "constants": gradient.constants,
              "defaults": forward.defaults + gradient.defaults}
    oracle = answer.oracle
    if oracle is None:
        return forward.result(x, "oracle-skip", message=answer.reason, **common)
    detail = oracle.details[x]
    counts = detail.counts()
    atol, rtol = TOLERANCES.get(np.asarray(gradient.ad).dtype, TOLERANCES[np.dtype(np.float32)])
    if oracle.weak:
        atol, rtol = max(atol, WEAK_TOLERANCE), max(rtol, WEAK_TOLERANCE)
    common.update(oracle=oracle.backend, weak=oracle.weak, counts=counts)
    if gradient.backend != "onnxruntime":
        common["oracle"] += f"; AD on {gradient.backend}"
    try:
        errors = compare_elements(gradient.ad, detail, atol, rtol)
    except ValueError as error:
        return forward.result(x, "error", message=str(error), **common)
    if forward.nonfinite:
        masked = ~np.isfinite(np.asarray(gradient.ad, np.float64)) & ~np.isnan(errors)
        errors = np.where(masked, np.nan, errors)
        counts["checked"] -= int(masked.sum())
        counts["nonfinite_ad"] = int(masked.sum())
    if counts["checked"] == 0 and counts["size"] > 0:
        skipped = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k not in ("size", "evaluated"))
        return forward.result(x, "oracle-skip", message=f"no element could be checked ({skipped})", **common)
    worst = float(np.nanmax(errors)) if counts["checked"] else 0.0
    status = "pass" if worst <= 1.0 else "fail"
    notes = [_describe_worst(errors, gradient.ad, detail)] if status == "fail" else []
    if answer.fallback:
        notes.append(f"{answer.fallback}: checked against onnxruntime's own function in float32 (weak)")
    if counts.get("one_sided"):
        notes.append(f"{counts['one_sided']} element(s) by one-sided differences (the output length "
                     "changes on the other side)")
    if forward.seeded:
        notes.append("training Dropout with a seed: the same mask in every run, checked as fixed")
    return forward.result(x, status, error=worst, message="; ".join(n for n in notes if n), **common)


def _describe_worst(errors: np.ndarray, ad: np.ndarray, detail) -> str:
    if np.all(np.isnan(errors)):
        return ""
    index = np.unravel_index(int(np.nanargmax(errors)), errors.shape)
    where = list(int(i) for i in index)
    fd = f"{detail.value[index]:.6g}"
    if detail.kink[index]:
        fd = f"[{detail.lower[index]:.6g}, {detail.upper[index]:.6g}] (kink)"
    return f"worst element {where}: AD {float(ad[index]):.6g}, FD {fd}"
