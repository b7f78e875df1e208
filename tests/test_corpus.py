"""The producers' corpus (tests/corpus/, see its README.md): tiny random-weight models written by
paddle2onnx, tf2onnx, the TorchScript and dynamo exporters, optimum and onnx.helper, and three
checks on each, run as a user runs them (the CLI's ``grad``, ``params`` and ``train``):

(a) ``grad`` wrt the float inputs and the corpus's weights (tests/corpus/catalog.py computes them
    from the graph alone) against float64 central finite differences: one random directional
    derivative per variable (the oracle of onnx_autodiff.conformance on a copy of the model whose
    variable is x0 + t·v), at the first input size and, for a model with dynamic axes, at the
    second size with the same generated backward model;
(b) ``params`` lists every weight as a module parameter: by the initializer's name, or for a
    weight held by a Constant node, by the name of that node's output;
(c) ``train`` lowers the loss on one batch (one step per epoch on the whole batch) and the model it
    exports passes the checker, runs on onnxruntime at every tested size and keeps the producer's
    structure (the multiset of op types, Constant nodes left out, subgraphs included).

A (model, check) known to fail today is in XFAIL with its error's first line; the marks are strict,
so a fix that makes one pass shows up as XPASS(strict) until its line here is removed. To measure
afresh, ``CORPUS_NO_XFAIL=1 python -m pytest tests/test_corpus.py -rf`` runs every one unmarked.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnx.version_converter
import pytest
from onnx import helper, numpy_helper

from onnx_autodiff.cli import main
from onnx_autodiff.conformance import fd_vjp

sys.path.insert(0, str(Path(__file__).parent / "corpus"))
from catalog import HERE as CORPUS, load_manifest, op_types, weight_value, weights  # noqa: E402

MANIFEST = load_manifest()

# (model, check) -> the first line of today's error; check is "grad", "params" or "train".
XFAIL: dict[tuple[str, str], str] = {}

STEPS = 6  # train: epochs of one step each on the one batch
TOLERANCE = 1e-3  # directional derivative: |ad - fd| <= TOLERANCE * (|fd| + ||g*v||_2) + 1e-7
DIRECTION = 1e-2  # scale of the random directions: an oracle step then crosses few ReLU/MaxPool kinks
WEAK_TOLERANCE = 3e-2  # where the oracle falls back to float32


def cases(check: str):
    if os.environ.get("CORPUS_NO_XFAIL"):  # to measure afresh: every (model, check) runs unmarked
        return list(MANIFEST)
    marks = {key: pytest.mark.xfail(strict=True, reason=XFAIL[(key, check)])
             for key in MANIFEST if (key, check) in XFAIL}
    return [pytest.param(key, id=key, marks=marks.get(key, ())) for key in MANIFEST]


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def cli_ok(*argv: str) -> str:
    code, out, err = cli(*argv)
    if code != 0:
        lines = err.strip().splitlines() or [f"exit {code}"]
        pytest.fail(f"{argv[0]}: {lines[0]}", pytrace=False)
    return out


def feeds_for(spec: dict, size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, size])
    feeds = {}
    for item in spec["inputs"]:
        shape, dtype, fill = item["shapes"][size], np.dtype(item["dtype"]), item["fill"]
        if fill == "normal":
            value = rng.standard_normal(shape)
        elif fill.startswith("ints:"):
            low, high = map(int, fill.split(":")[1:])
            value = rng.integers(low, high, shape)
        elif fill.startswith("value:"):
            value = np.full(shape, float(fill.split(":")[1]))
        else:
            value = {"ones": np.ones, "zeros": np.zeros}[fill](shape)
        feeds[item["name"]] = value.astype(dtype)
    return feeds


def sizes(spec: dict) -> list[int]:
    """Both sizes for a model whose inputs vary between them (dynamic axes), else the first."""
    return [0, 1] if any(item["shapes"][0] != item["shapes"][1] for item in spec["inputs"]) else [0]


def session(model) -> ort.InferenceSession:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def output_of(spec: dict, feeds) -> np.ndarray:
    model = onnx.load(str(CORPUS / spec["file"]))
    return session(model).run([spec["output"]], feeds)[0]


# ------------------------------------------------------------------ (a) gradients

def _subgraphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                yield from _subgraphs(sub)


def directional_model(model: onnx.ModelProto, output: str, values: dict[str, np.ndarray],
                      directions: dict[str, np.ndarray], groups: list[list[str]]) -> onnx.ModelProto:
    """A copy of ``model`` with only ``output``, where each variable x (graph input, initializer or
    Constant output anywhere) of ``groups[k]`` becomes x0 + t_k·v_x of a new scalar input t_k: the
    oracle's derivative wrt t_k at 0 is the directional derivative along the group's v."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    names = set(values)
    kept_outputs = [o for o in graph.output if o.name == output]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    kept_inputs = [i for i in graph.input if i.name not in names]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    for sub in _subgraphs(graph):
        kept = [t for t in sub.initializer if t.name not in names]
        del sub.initializer[:]
        sub.initializer.extend(kept)
        nodes = [n for n in sub.node if not (n.op_type == "Constant" and n.output[0] in names)]
        del sub.node[:]
        sub.node.extend(nodes)
    front = []
    for k, group in enumerate(groups):
        t = f"corpus_t{k}"
        for j, name in enumerate(group):
            x0, v, tv = f"corpus_x0_{k}_{j}", f"corpus_v{k}_{j}", f"corpus_tv{k}_{j}"
            front += [
                helper.make_node("Constant", [], [x0], value=numpy_helper.from_array(values[name], x0)),
                helper.make_node("Constant", [], [v], value=numpy_helper.from_array(directions[name], v)),
                helper.make_node("Mul", [t, v], [tv]),
                helper.make_node("Add", [x0, tv], [name]),
            ]
        graph.input.append(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, []))
    nodes = front + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    if copy.ir_version < 4:
        copy.ir_version = 4
    return copy


def _wrt(spec: dict, model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    floats = [i["name"] for i in spec["inputs"] if np.dtype(i["dtype"]).kind == "f"]
    return floats, [w["name"] for w in weights(model)]


@pytest.mark.parametrize("key", cases("grad"))
def test_gradients_match_finite_differences(key, tmp_path):
    spec = MANIFEST[key]
    path = CORPUS / spec["file"]
    model = onnx.load(str(path))
    inputs, params = _wrt(spec, model)
    out = tmp_path / "grad.onnx"
    cli_ok("grad", str(path), "-o", str(out), "--of", spec["output"], "--wrt", *inputs, *params)
    backward = onnx.load(str(out))
    onnx.checker.check_model(backward, full_check=True)
    seeds = [i.name for i in backward.graph.input if i.name not in {j.name for j in model.graph.input}]
    assert len(seeds) <= 1, seeds
    grad_names = [o.name for o in backward.graph.output][len(model.graph.output):]
    assert len(grad_names) == len(inputs) + len(params), grad_names
    runner = session(backward)
    failures = []
    for size in sizes(spec):
        feeds = feeds_for(spec, size)
        values = {name: feeds[name] for name in inputs} | {name: weight_value(model, name) for name in params}
        rng = np.random.default_rng([7, size])
        r = rng.standard_normal(output_of(spec, feeds).shape).astype(np.float32)
        results = runner.run(None, {**feeds, **({seeds[0]: r} if seeds else {})})
        if not seeds:
            r = np.ones_like(r)
        ad_grads = dict(zip(inputs + params, results[len(model.graph.output):]))
        failures += directional_failures(model, spec, size, feeds, values, ad_grads, r)
    assert not failures, "; ".join(failures[:4]) + (f" (+{len(failures) - 4} more)" if len(failures) > 4 else "")


def directional_failures(model, spec, size, feeds, values, ad_grads, r) -> list[str]:
    """Where the AD gradients ``ad_grads`` disagree with the oracle's directional derivatives of
    Σ⟨out, r⟩ at ``feeds`` (``values``: the variables' values); fails when too few are checkable."""
    failures = []
    for scale in (DIRECTION, 1.0):
        oracle, groups, directions = _oracle(model, spec, feeds, values, r, size, scale)
        if not oracle.weak:
            break
    # the oracle fell back to float32 (a forward op without float64 kernels): its steps are
    # larger and its estimates coarser, so it gets CONFORMANCE.md's weak tolerance
    tolerance = WEAK_TOLERANCE if oracle.weak else TOLERANCE
    checked = 0
    for k, group in enumerate(groups):
        terms = []
        for name in group:
            g = np.asarray(ad_grads[name], np.float64)
            if g.shape != np.shape(values[name]):
                failures.append(f"size {size}: grad of {name} has shape {g.shape}, the value {np.shape(values[name])}")
                g = np.zeros(np.shape(values[name]))
            terms.append((g * directions[name]).reshape(-1))
        terms = np.concatenate(terms)
        ad = float(terms.sum())
        detail = oracle.details[f"corpus_t{k}"]
        if not detail.checkable.all():
            continue
        checked += 1
        lower, upper = float(detail.lower.reshape(-1)[0]), float(detail.upper.reshape(-1)[0])
        distance = max(lower - ad, ad - upper, 0.0)
        bound = tolerance * (max(abs(lower), abs(upper)) + float(np.sqrt((terms ** 2).sum()))) + 1e-7
        if not distance <= bound:
            what = group[0] if len(group) == 1 else "all variables"
            failures.append(f"size {size}: d/d({what})·v: AD {ad:.6g}, finite differences {lower:.6g}..{upper:.6g}"
                            f" ({oracle.backend})")
    assert checked >= max(1, len(groups) // 2), f"size {size}: the oracle checked {checked} of {len(groups)} directions"
    return failures


def _oracle(model, spec, feeds, values, r, size, scale):
    """The oracle's directional derivatives: one direction per variable at the first size; at the
    second, which checks that the backward model holds over the dynamic axes, one over them all."""
    rng = np.random.default_rng([11, size])
    directions = {name: (scale * rng.standard_normal(np.shape(v))).astype(v.dtype) for name, v in values.items()}
    groups = [[name] for name in values] if size == 0 else [list(values)]
    probe = directional_model(model, spec["output"], values, directions, groups)
    ts = [f"corpus_t{k}" for k in range(len(groups))]
    others = {n: v for n, v in feeds.items() if n not in values}
    at = {**others, **{t: np.zeros((), np.float32) for t in ts}}
    oracle = fd_vjp(probe, at, ts, [r], max_coords=None)
    if oracle.weak and probe.opset_import[0].version < 13:
        # onnx's reference evaluator has no working Resize-10 and onnxruntime no float64 Resize:
        # the same function at opset 13 (onnx's converter) gets a float64 oracle
        converted = onnx.version_converter.convert_version(probe, 13)
        upgraded = fd_vjp(converted, at, ts, [r], max_coords=None)
        oracle = oracle if upgraded.weak else upgraded
    return oracle, groups, directions


# ------------------------------------------------------------------ (b) parameters

@pytest.mark.parametrize("key", cases("params"))
def test_params_lists_every_weight(key):
    spec = MANIFEST[key]
    path = CORPUS / spec["file"]
    rows = json.loads(cli_ok("params", str(path), "--json"))
    found = {row["initializer"] for row in rows if row["name"] is not None} | {
        row["name"] for row in rows if row["name"] is not None}
    expected = [w["name"] for w in weights(onnx.load(str(path)))]
    missing = [name for name in expected if name not in found]
    assert not missing, f"params misses {len(missing)} of {len(expected)} weights: {missing[:5]}"


# ------------------------------------------------------------------ (c) training

def batch_for(spec: dict) -> dict[str, np.ndarray]:
    feeds = feeds_for(spec, 0, seed=1)
    logits = output_of(spec, feeds)
    rng = np.random.default_rng(2)
    if spec["loss"] == "cross_entropy":
        labels = rng.integers(0, logits.shape[1], logits.shape[:1] + logits.shape[2:]).astype(np.int64)
    else:
        labels = rng.standard_normal(logits.shape).astype(np.float32)
    return {**feeds, "labels": labels}


@pytest.mark.parametrize("key", cases("train"))
def test_train_lowers_the_loss_and_keeps_the_structure(key, tmp_path):
    spec = MANIFEST[key]
    path = CORPUS / spec["file"]
    batch = batch_for(spec)
    np.savez(tmp_path / "batch.npz", **batch)
    rows = len(batch["labels"])
    out = tmp_path / "run"
    cli_ok("train", str(path), "--data", str(tmp_path / "batch.npz"), "-o", str(out), "--loss", spec["loss"],
           "--output-name", spec["output"], "--optimizer", spec["optimizer"], "--lr", str(spec["lr"]),
           "--epochs", str(STEPS), "--batch-size", str(rows))
    with open(out / "metrics.csv", newline="") as stream:
        losses = [float(row["loss"]) for row in csv.DictReader(stream)]
    assert len(losses) == STEPS and np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    trained = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(trained, full_check=True)
    runner = session(trained)
    for size in sizes(spec):
        feeds = feeds_for(spec, size)
        assert runner.run([spec["output"]], feeds)[0].shape == output_of(spec, feeds).shape
    original, exported = op_types(onnx.load(str(path))), op_types(trained)
    differ = {op: f"{exported.get(op, 0)} (producer {original.get(op, 0)})"
              for op in sorted(set(original) | set(exported)) if exported.get(op, 0) != original.get(op, 0)}
    assert not differ, f"the exported model's op counts differ from the producer's: {differ}"


# Models whose weighted layers are all inside subgraphs (If branches) or recurrent: QAT quantizes
# the main graph's Conv, ConvTranspose, Gemm and MatMul, and says so where it finds none.
NOTHING_TO_QUANTIZE = {"onnx_silero_like"}


@pytest.mark.parametrize("scheme", ["int8", "int4-weights"])
@pytest.mark.parametrize("key", list(MANIFEST))
def test_qat_trains_and_exports_what_onnxruntime_runs_quantized(key, scheme, tmp_path):
    """``train --qat``: the steps run, the exported QDQ model runs at every size its forward takes
    with the producer's output shapes, and onnxruntime replaces some layer with a quantized kernel
    (int8: QLinear*/QGemm; int4: MatMulNBits, where a MatMul or Gemm is quantized)."""
    spec = MANIFEST[key]
    batch = batch_for(spec)
    np.savez(tmp_path / "batch.npz", **batch)
    argv = ["train", str(CORPUS / spec["file"]), "--data", str(tmp_path / "batch.npz"), "-o", str(tmp_path / "run"),
            "--loss", spec["loss"], "--output-name", spec["output"], "--optimizer", spec["optimizer"],
            "--lr", str(spec["lr"]), "--epochs", "2", "--batch-size", str(len(batch["labels"])), "--qat", scheme,
            "--qat-calibration-steps", "1"]
    code, _, err = cli(*argv)
    if key in NOTHING_TO_QUANTIZE:
        assert code != 0 and "found no Conv, ConvTranspose, Gemm or MatMul" in err, err
        return
    assert code == 0, err
    path = tmp_path / "run" / "model.onnx"
    exported = onnx.load(str(path))
    onnx.checker.check_model(exported, full_check=True)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    runner = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for size in sizes(spec):
        feeds = feeds_for(spec, size)
        got = runner.run([spec["output"]], feeds)[0]
        assert got.shape == output_of(spec, feeds).shape and np.isfinite(got).all()
    kernels = {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}
    weighted = {n.op_type for n in onnx.load(str(CORPUS / spec["file"])).graph.node}
    if scheme == "int8":
        assert any(k.startswith("QLinear") or k == "QGemm" for k in kernels), kernels
    elif weighted & {"MatMul", "Gemm"}:
        assert "MatMulNBits" in kernels, kernels


def test_the_gradient_check_fails_on_a_wrong_gradient(tmp_path):
    """The directional comparison passes the package's gradients of a model that passes and
    catches one of them 1% off, or zero."""
    spec = MANIFEST["onnx_cnn_opset12"]
    model = onnx.load(str(CORPUS / spec["file"]))
    feeds = feeds_for(spec, 0)
    values = {"x": feeds["x"], "fc_w": weight_value(model, "fc_w"), "conv1_w": weight_value(model, "conv1_w")}
    r = np.random.default_rng(0).standard_normal(output_of(spec, feeds).shape).astype(np.float32)
    out = tmp_path / "grad.onnx"
    cli_ok("grad", str(CORPUS / spec["file"]), "-o", str(out), "--of", "logits", "--wrt", *values)
    right = dict(zip(values, session(onnx.load(str(out))).run(None, {**feeds, "dy": r})[1:]))
    assert directional_failures(model, spec, 0, feeds, values, right, r) == []
    for name, wrong in (("fc_w", right["fc_w"] * 1.01), ("conv1_w", np.zeros_like(right["conv1_w"]))):
        failures = directional_failures(model, spec, 0, feeds, values, {**right, name: wrong}, r)
        assert len(failures) == 1 and f"d/d({name})" in failures[0], failures


def test_manifest_matches_the_files():
    """The manifest's weight lists and op multisets are those of the committed files."""
    for key, spec in MANIFEST.items():
        model = onnx.load(str(CORPUS / spec["file"]))
        assert spec["weights"] == weights(model), key
        assert spec["ops"] == op_types(model), key
        assert (CORPUS / spec["file"]).stat().st_size < 300_000, key
