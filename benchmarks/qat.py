"""Quantization-aware training against post-training quantization: held-out accuracy, size, latency, step time.

    python benchmarks/qat.py [--epochs 15] [--qat-epochs 2] [--qat-lr 3e-4] [--calibration-steps 40]
        [--batch 32] [--latency-batch 256] [--latency-runs 200] [--timing-steps 300] [--seed 0]
        [--seeds 10] [--models cnn dwcnn] [--quick] [--llama] [--llama-steps 100] [--llama-qat-steps 30] [--dir DIR] [--keep]

Two models of ``examples/train_digits.py`` (``--models``): its CNN (conv 16 → pool → conv 32 → pool →
Gemm 128-64 → Gemm 64-10, seeded) and its depthwise-separable CNN ``dwcnn`` (MobileNet-style: a
convolution, then depthwise 3×3 and pointwise blocks with BatchNorm after each convolution: the layers
where post-training quantization loses most, BatchNorm folded into the convolutions by the QAT build),
each on scikit-learn's bundled digits split as that example splits them (75% train,
25% held out, stratified, ``random_state=0``), once per seed (``--seeds``: the initial weights and
the batches' order), the accuracies averaged over the seeds (450 held-out rows: one row is 0.22
points, so a single run resolves little):

- float: trained as the example trains it (AdamW, lr 3e-3, weight decay 1e-4, a cosine step of the
  learning rate per epoch, batches of 32), exported (its nodes unnamed, as ``cnn()`` writes them: the
  benchmark checks that the int4 export of such a model loads);
- post-training quantization of that float model:
  - int8: onnxruntime's ``quantize_static`` (QDQ, int8 weights per channel, uint8 activations per
    tensor, MinMax calibration over every training batch);
  - int4 weights (round to nearest): onnxruntime's quantizers do not quantize a Conv to int4, so
    this is onnx-autodiff's ``qat="int4-weights"`` build of the float model exported before any
    step: symmetric int4 weights, convolutions per output channel, the Gemms in blocks of 32 along
    the reduction axis, activations float. The benchmark checks it against the same rounding done
    in numpy on the float weights;
  - int4 weights, onnxruntime's ``MatMulNBitsQuantizer`` (blocks of 32, symmetric): it quantizes
    MatMul alone, so the two Gemms are first written as ``MatMul(x, Wᵀ) + b`` (the same float
    function); the convolutions stay float;
- quantization-aware training: ``generate_artifacts(float model, qat=QatConfig(scheme,
  calibration_steps))`` fine-tuned ``--qat-epochs`` (AdamW from ``--qat-lr``, the same per-epoch
  cosine), for "int8" and "int4-weights", then ``Trainer.export`` (the QDQ model);
- "float, fine-tuned the same": the float model fine-tuned exactly as the QAT rows are, without
  quantization (what the extra steps alone give).

Every model is run by onnxruntime (default session options) on the held-out rows. Columns:
``acc %`` held-out accuracy; ``held-out loss`` its mean cross-entropy; ``size KB`` the exported
file; ``ms/batch`` the median of ``--latency-runs`` runs on a batch of ``--latency-batch`` held-out
rows; ``quantized kernels`` the weighted ops of onnxruntime's optimized graph that run a quantized
kernel (QLinearConv, QGemm, MatMulNBits, ...); ``step ms`` the train step (median of single steps);
``recovered %`` = (QAT − PTQ) / (float − PTQ) of the accuracy or the loss, against the PTQ of the same
scheme (n/a where the PTQ loses nothing). The step times are measured apart, on one fixed training
batch, the float step and each QAT step taking turns by blocks of 10 steps after a warmup.

Checks: each exported QAT model against its Trainer's eval model, with onnxruntime's default options
(its fused kernels round differently: QLinearConv, QGemm, and the MatMulNBits it makes of
DequantizeLinear → MatMul, whose default accuracy level 4 quantizes the activations to int8) and
with its graph optimisations off (the arithmetic the QDQ nodes define); the int4 export at step 0
against numpy's round to nearest of the float weights.

``--llama`` adds the Llama-shaped decoder of ``benchmarks/llama_lora.py`` at its smallest size
("tiny": vocabulary 512, hidden 64, 2 layers; needs torch, transformers, onnxscript), exported as
there and trained on its data (random token ids, the labels the ids: one fixed batch, on which the
loss falls), every parameter, for ``--llama-steps`` AdamW steps (float); from that model, int4 PTQ
(``MatMulNBitsQuantizer``; ours, round to nearest), "int4-weights" QAT fine-tuning for
``--llama-qat-steps`` (AdamW, a tenth of the learning rate) and the same fine-tuning in float. Its
linear layers are ``MatMul(x, Transpose(W))`` in that export, which the QAT build quantizes as they
are; for ``MatMulNBitsQuantizer`` alone (it reads MatMul initializers) they are folded into
``MatMul(x, Wᵀ)`` first, as llama_lora.py's ``--shipped-int4`` does. Losses by onnxruntime on the exported models,
on the training batch and on a held-out batch of other random ids (no more than chance can be
learnt there: it shows how far quantization moves the model, not generalisation).

Prints the tables and the acceptance lines ("must: ... : measured X (PASS/FAIL)"); exits 0 whether
they pass or not (1 only where a check of the benchmark itself fails).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCHEMES = ("int8", "int4-weights")


# ---------------------------------------------------------------------------------------------
# helpers


def session(path: str, exact: bool = False):
    """An onnxruntime session of ``path``, default options; ``exact``: graph optimisations off, so
    that QuantizeLinear and DequantizeLinear run as the float arithmetic they define (no fused
    quantized kernel, whose own rounding differs: see :func:`kernels`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if exact:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def size_kb(path: str) -> float:
    """The model's bytes on disk (its external data file too, where it has one)."""
    total = os.path.getsize(path)
    data = path + ".data"
    return (total + (os.path.getsize(data) if os.path.exists(data) else 0)) / 1024


def latency_ms(path: str, feeds: dict, runs: int) -> float:
    """Median ms of ``runs`` runs of ``feeds`` (after 5 warm-up runs), default session options."""
    s = session(path)
    for _ in range(5):
        s.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        s.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_times(trainers: dict, batch: dict, steps: int, warmup: int, block: int = 10) -> dict[str, tuple[float, float]]:
    """Median and minimum ms of ``steps`` single train steps of each trainer on ``batch``: after ``warmup`` steps
    each, the trainers take turns by blocks of ``block`` timed steps, each block after one untimed
    step (the other sessions' onnxruntime threads still spin for a while after their run, taking the
    cores from the first step after a switch)."""
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step(batch)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    while any(len(t) < steps for t in times.values()):
        for name, trainer in trainers.items():
            trainer.step(batch)
            for _ in range(min(block, steps - len(times[name]))):
                start = time.perf_counter()
                trainer.step(batch)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def worst(values: list[float], lowest: bool) -> float:
    return min(values) if lowest else max(values)


def table(headers: list[str], rows: list[list[str]]) -> str:
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"
    lines = ["| " + " | ".join(headers) + " |", rule]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def must(text: str, measured: str, ok: bool | None) -> str:
    verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    return f"must: {text} : measured {measured} ({verdict})"


@contextlib.contextmanager
def quiet_quantizers():
    """onnxruntime's quantizers' log lines and warnings silenced while the block runs (the
    process's logging as it was after: tests run this benchmark in their own process)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # (warnings of the graph optimisations it cannot apply)
    loggers = [logging.getLogger(name) for name in ("onnxruntime.quantization", "root")] + [logging.getLogger()]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        ort.set_default_logger_severity(2)


def gemms_as_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``Gemm(x, W, b)`` (alpha = beta = 1, no transA) of an initializer W written
    ``Add(MatMul(x, W'), b)``, W' = W or Wᵀ as [K, N] under a new name: the same function, in the
    form MatMulNBitsQuantizer reads (it quantizes MatMul alone)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    weights = {t.name: t for t in graph.initializer}
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in weights or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weights[node.input[1]])
        w = w.T if attrs.get("transB", 0) else w
        name = node.input[1] + "_kn"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), name))
        product = node.output[0] + "_matmul"
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product if len(node.input) > 2 else node.output[0]],
                                      name=(node.name or node.output[0]) + "_matmul"))
        if len(node.input) > 2 and node.input[2]:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]]))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return out


def matmul_nbits(model: onnx.ModelProto, path: str) -> int:
    """onnxruntime's MatMulNBitsQuantizer (int4, blocks of 32, symmetric, its default MatMulNBits
    form) on ``model``, saved at ``path``; returns the MatMulNBits count."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True)
    quantizer.process()
    quantized = quantizer.model.model
    onnx.save(quantized, path)
    return sum(n.op_type == "MatMulNBits" for n in quantized.graph.node)


def rtn_int4(w: np.ndarray, layout: str, block: int = 32) -> np.ndarray:
    """``w`` rounded to nearest symmetric int4 and back, as the QAT build's weights at step 0 (and
    onnxruntime's quantizer) take them: the restricted range, scale = max|w| / 7, integers in
    [−7, 7]; ``layout`` "channel" (a convolution: per output channel, axis 0) or "gemm_transb" (a
    [N, K] Gemm weight read transposed: blocks of ``block`` along K, axis 1)."""
    eps = np.float32(np.finfo(np.float32).eps)
    if layout == "channel":
        magnitude = np.abs(w).reshape(w.shape[0], -1).max(1).reshape(-1, *[1] * (w.ndim - 1))
        scale = np.maximum(magnitude / np.float32(7), eps)
        return (np.clip(np.rint(w / scale), -7, 7) * scale).astype(np.float32)
    n, k = w.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.float32)
    padded[:, :k] = w
    split = padded.reshape(n, blocks, block)
    scale = np.maximum(np.abs(split).max(2, keepdims=True) / np.float32(7), eps)
    return (np.clip(np.rint(split / scale), -7, 7) * scale).reshape(n, -1)[:, :k].astype(np.float32)


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    X = (data.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return train_test_split(X, data.target.astype(np.int64), test_size=0.25, random_state=0, stratify=data.target)


def fit(trainer, X, y, epochs: int, batch: int, lr: float, seed: int) -> int:
    """``epochs`` of whole shuffled batches, the learning rate a cosine step per epoch (as
    examples/train_digits.py); returns the steps taken."""
    rng = np.random.default_rng(seed)
    steps = 0
    for epoch in range(epochs):
        trainer.lr = lr * 0.5 * (1 + np.cos(np.pi * epoch / epochs))
        order = rng.permutation(len(X))
        for first in range(0, len(order) - batch + 1, batch):
            rows = order[first:first + batch]
            trainer.step({"X": X[rows], "labels": y[rows]})
            steps += 1
    return steps


def predictions(path: str, X, y) -> tuple[float, float]:
    """Held-out accuracy (percent) and mean cross-entropy of the model at ``path`` on onnxruntime."""
    logits = session(path).run(None, {"X": X})[0].astype(np.float64)
    shifted = logits - logits.max(1, keepdims=True)
    nll = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(len(y)), y]
    return float(np.mean(logits.argmax(1) == y)) * 100, float(nll.mean())


QUANTIZED_KERNELS = ("QLinearConv", "QGemm", "QLinearMatMul", "MatMulNBits", "MatMulInteger", "ConvInteger",
                     "DynamicQuantizeMatMul", "MatMulIntegerToFloat")
WEIGHTED_KERNELS = QUANTIZED_KERNELS + ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul")


def kernels(path: str, folder: str) -> str:
    """The weighted ops of onnxruntime's optimized graph of ``path`` (default options): how many run
    quantized kernels (QLinearConv, QGemm, MatMulNBits, ...), of all."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
    options.log_severity_level = 3  # (its warning that NCHWc layouts are machine-specific)
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    quantized = [op for op in ops if op in QUANTIZED_KERNELS]
    named = ", ".join(f"{op} {quantized.count(op)}" for op in dict.fromkeys(quantized))
    return f"{len(quantized)} of {sum(op in WEIGHTED_KERNELS for op in ops)}" + (f" ({named})" if named else "")


# the rows of the CNN's table, in order
CNN_ROWS = ("float", "ptq-int8", "qat-int8", "ptq-int4-rtn", "ptq-int4-matmulnbits", "qat-int4-weights", "float-finetuned")


def cnn_seed(args, seed: int, folder: str, data, model: str) -> dict:
    """One seed (the CNN's initial weights, the batches' order) of every row: the models' paths, the
    held-out accuracy and loss of each, and the checks."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    import train_digits

    from onnx_autodiff.errors import TrainingError
    from onnx_autodiff.training import Trainer, generate_artifacts
    from onnx_autodiff.training.qat import QatConfig

    X_train, X_test, y_train, y_test = data
    options = {"loss": "cross_entropy", "optimizer": "adamw", "optimizer_options": {"lr": args.lr, "weight_decay": 1e-4}}
    qat_options = dict(options, optimizer_options={"lr": args.qat_lr, "weight_decay": 1e-4})
    calibration = args.calibration_steps
    os.makedirs(folder, exist_ok=True)
    paths, steps, seconds = {}, {}, {}

    def path(name: str) -> str:
        paths[name] = os.path.join(folder, f"{name}.onnx")
        return paths[name]

    def qat(scheme: str, model: str):
        return generate_artifacts(model, qat=QatConfig(scheme, calibration_steps=calibration), **qat_options)

    # float, as examples/train_digits.py trains it
    start = time.perf_counter()
    trainer = Trainer(generate_artifacts(getattr(train_digits, model)(seed=seed), **options))
    steps["float"] = fit(trainer, X_train, y_train, args.epochs, args.batch, args.lr, seed)
    trainer.export(path("float"))
    seconds["float"] = time.perf_counter() - start
    # cnn()'s nodes have no names: check that its int4 export loads
    unnamed = os.path.join(folder, "unnamed-int4.onnx")
    try:
        Trainer(qat("int4-weights", paths["float"])).export(unnamed)
        session(unnamed)
        unnamed_loads = "yes"
    except Exception as error:  # noqa: BLE001 - reported, whatever onnxruntime raises
        unnamed_loads = "NO: " + str(error).strip().splitlines()[-1]
    float_model = onnx.load(paths["float"])

    # post-training quantization, int8: onnxruntime's quantize_static over every training batch
    class Batches(CalibrationDataReader):
        def __init__(self):
            self.rows = iter(range(0, len(X_train) - args.batch + 1, args.batch))

        def get_next(self):
            first = next(self.rows, None)
            return None if first is None else {"X": X_train[first:first + args.batch]}

    quantize_static(paths["float"], path("ptq-int8"), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)

    # post-training quantization, int4 weights, round to nearest: the int4-weights QAT build before any step,
    # and the same rounding in numpy on the float weights, through the float graph
    Trainer(qat("int4-weights", paths["float"])).export(path("ptq-int4-rtn"))
    rtn_error = None  # (where BatchNorm is folded first, numpy's rounding of the stored weights is not the reference)
    if not any(node.op_type == "BatchNormalization" for node in float_model.graph.node):
        reference = onnx.ModelProto()
        reference.CopyFrom(float_model)
        readers = {node.input[1]: node for node in reference.graph.node if node.op_type in ("Conv", "Gemm")}
        for tensor in reference.graph.initializer:
            if tensor.name in readers:
                layout = "channel" if readers[tensor.name].op_type == "Conv" else "gemm_transb"
                tensor.CopyFrom(numpy_helper.from_array(rtn_int4(numpy_helper.to_array(tensor), layout), tensor.name))
        onnx.save(reference, path("rtn-reference"))
        ours, theirs = (session(paths[n], exact=True).run(None, {"X": X_test})[0] for n in ("ptq-int4-rtn", "rtn-reference"))
        rtn_error = float(np.abs(ours - theirs).max())
    # the same export before any step for the scheme with activations: its observers have seen nothing
    try:
        Trainer(qat("int4-weights-int8-activations", paths["float"])).export(os.path.join(folder, "w4a8-step0.onnx"))
        w4a8 = predictions(os.path.join(folder, "w4a8-step0.onnx"), X_test, y_test)[0]
    except TrainingError as error:
        w4a8 = f"refused ({error})"

    # post-training quantization, int4: onnxruntime's MatMulNBitsQuantizer (the Gemms alone)
    nbits = matmul_nbits(gemms_as_matmul(float_model), path("ptq-int4-matmulnbits"))

    # quantization-aware training from the float model, and the float model fine-tuned the same
    consistency = {}
    for scheme in (None, *SCHEMES):
        name = f"qat-{scheme}" if scheme else "float-finetuned"
        start = time.perf_counter()
        t = Trainer(qat(scheme, paths["float"]) if scheme else generate_artifacts(paths["float"], **qat_options))
        steps[name] = fit(t, X_train, y_train, args.qat_epochs, args.batch, args.qat_lr, seed + 1000)
        t.export(path(name))
        seconds[name] = time.perf_counter() - start
        # the exported QDQ model against the Trainer's own (fake-quantized) eval model
        evaluated = t.evaluate({"X": X_test, "labels": y_test})["logits"]
        exported, exact = (session(paths[name], e).run(None, {"X": X_test})[0] for e in (False, True))
        consistency[name] = (float(np.mean(evaluated.argmax(1) == exported.argmax(1))) * 100,
                             float(np.abs(evaluated - exported).max()),
                             float(np.mean(evaluated.argmax(1) == exact.argmax(1))) * 100,
                             float(np.abs(evaluated - exact).max()))
    scores = {name: predictions(p, X_test, y_test) for name, p in paths.items()}
    return {"paths": paths, "steps": steps, "seconds": seconds, "nbits": nbits, "rtn_error": rtn_error,
            "consistency": consistency, "w4a8": w4a8, "unnamed_loads": unnamed_loads,
            "acc": {n: s[0] for n, s in scores.items()}, "loss": {n: s[1] for n, s in scores.items()}}


MODEL_TITLES = {"cnn": "digits CNN (train_digits.py's cnn: conv-relu-pool x2, two Gemms)",
                "dwcnn": "depthwise-separable digits CNN (train_digits.py's dwcnn: MobileNet-style, BatchNorm after each conv)"}


def run_cnn(args, folder: str, model: str = "cnn") -> int:
    import onnxruntime as ort

    from onnx_autodiff.training import Trainer, generate_artifacts
    from onnx_autodiff.training.qat import QatConfig

    code = 0
    data = X_train, X_test, y_train, y_test = digits()
    seeds = list(range(args.seed, args.seed + args.seeds))
    start = time.perf_counter()
    runs = {seed: cnn_seed(args, seed, os.path.join(folder, model, f"seed{seed}"), data, model) for seed in seeds}
    first = runs[seeds[0]]
    print(f"\n{MODEL_TITLES[model]}: {len(X_train)} train / {len(X_test)} held-out rows (one row is {100 / len(X_test):.2f} points); "
          f"seeds {seeds[0]}..{seeds[-1]} (initial weights, batch order); float: {args.epochs} epochs, "
          f"{first['steps']['float']} AdamW steps (lr {args.lr}, batch {args.batch}); QAT: {args.qat_epochs} epochs "
          f"from the float model, AdamW lr {args.qat_lr}, calibration_steps {args.calibration_steps}; all seeds' runs "
          f"{time.perf_counter() - start:.1f} s; onnxruntime {ort.__version__}")

    # step times on the first seed's float model: fresh trainers of the float and QAT builds
    qat_options = {"loss": "cross_entropy", "optimizer": "adamw",
                   "optimizer_options": {"lr": args.qat_lr, "weight_decay": 1e-4}}
    timing = {"float": Trainer(generate_artifacts(first["paths"]["float"], **qat_options))}
    for scheme in SCHEMES:
        timing[scheme] = Trainer(generate_artifacts(first["paths"]["float"], **qat_options,
                                                    qat=QatConfig(scheme, calibration_steps=args.calibration_steps)))
    rows = np.random.default_rng(args.seed).choice(len(X_train), args.batch, replace=False)
    measured = step_times(timing, {"X": X_train[rows], "labels": y_train[rows]}, args.timing_steps, warmup=20)
    step_ms, low = ({k: v[i] for k, v in measured.items()} for i in (0, 1))

    # latency, size and kernels of the first seed's models (the same graphs for every seed)
    latency_x = np.resize(X_test, (args.latency_batch, *X_test.shape[1:]))  # (the held-out rows, repeated past 450)
    lat = {n: latency_ms(first["paths"][n], {"X": latency_x}, args.latency_runs) for n in CNN_ROWS}
    kernel = {n: kernels(first["paths"][n], folder) for n in CNN_ROWS}
    acc = {n: statistics.mean(r["acc"][n] for r in runs.values()) for n in first["acc"]}
    loss = {n: statistics.mean(r["loss"][n] for r in runs.values()) for n in first["loss"]}
    spread = {n: (min(r["acc"][n] for r in runs.values()), max(r["acc"][n] for r in runs.values())) for n in CNN_ROWS}

    def recovered(measure: dict, qat: str, ptq: str, higher_is_better: bool) -> str:
        lost = (measure["float"] - measure[ptq]) * (1 if higher_is_better else -1)
        if lost <= 0:
            return "n/a (PTQ loses nothing)"
        return f"{(measure[qat] - measure[ptq]) * (1 if higher_is_better else -1) / lost * 100:.0f}"

    steps = first["steps"]
    labels = {
        "float": f"float (AdamW, as train_digits.py --model {model})",
        "ptq-int8": "int8 PTQ: onnxruntime quantize_static (QDQ, per channel)",
        "qat-int8": f"int8 QAT, {steps['qat-int8']} steps",
        "ptq-int4-rtn": "int4-weights PTQ: round to nearest (the QAT build exported at step 0)",
        "ptq-int4-matmulnbits": f"int4 PTQ: MatMulNBitsQuantizer (the {first['nbits']} Gemms only, convs float)",
        "qat-int4-weights": f"int4-weights QAT, {steps['qat-int4-weights']} steps",
        "float-finetuned": f"float, fine-tuned the same {steps['float-finetuned']} steps",
    }
    steps_col = {"float": step_ms["float"], "qat-int8": step_ms["int8"], "qat-int4-weights": step_ms["int4-weights"],
                 "float-finetuned": step_ms["float"]}
    ptq_of = {"qat-int8": "ptq-int8", "qat-int4-weights": "ptq-int4-rtn"}
    print(f"\nMean over {len(seeds)} seeds of the held-out accuracy (min–max) and cross-entropy on onnxruntime; the "
          f"first seed's exported file, its onnxruntime latency (batch {args.latency_batch}, median of "
          f"{args.latency_runs}) and the weighted ops onnxruntime runs with quantized kernels; the train step (batch "
          f"{args.batch}, median of {args.timing_steps}); recovered: (QAT − PTQ) / (float − PTQ), against the PTQ "
          f"of the same scheme:\n")
    print(table(["method", "acc %", "acc min–max", "held-out loss", "size KB", f"ms/batch {args.latency_batch}",
                 "quantized kernels", "step ms", "recovered % (acc)", "recovered % (loss)"], [
        [labels[n], f"{acc[n]:.2f}", f"{spread[n][0]:.2f}–{spread[n][1]:.2f}", f"{loss[n]:.4f}",
         f"{size_kb(first['paths'][n]):.1f}", f"{lat[n]:.3f}", kernel[n], f"{steps_col[n]:.3f}" if n in steps_col else "",
         recovered(acc, n, ptq_of[n], True) if n in ptq_of else "",
         recovered(loss, n, ptq_of[n], False) if n in ptq_of else ""]
        for n in CNN_ROWS]))
    if len(seeds) > 1:
        print("\nPer seed, held-out accuracy %:\n")
        columns = ["float", "ptq-int8", "qat-int8", "ptq-int4-rtn", "qat-int4-weights", "float-finetuned"]
        print(table(["seed", *columns], [[str(s), *(f"{runs[s]['acc'][n]:.2f}" for n in columns)] for s in seeds]))

    print(f"\nQAT wall time per seed (build, steps, export), first seed: "
          + ", ".join(f"{n} {s:.1f} s" for n, s in first["seconds"].items()))
    for name in first["consistency"]:
        agree, error, agree_exact, error_exact = (worst([r["consistency"][name][i] for r in runs.values()], i % 2 == 0)
                                                  for i in range(4))
        print(f"check: {name}, the exported model against the Trainer's eval model (worst seed): argmax agreement "
              f"{agree:.2f}%, max |logit difference| {error:.2e} (onnxruntime's default options); {agree_exact:.2f}%, "
              f"{error_exact:.2e} (its optimisations off)")
        code |= agree_exact < 99.0
    errors = [r["rtn_error"] for r in runs.values() if r["rtn_error"] is not None]
    if errors:
        rtn_error = max(errors)
        print(f"check: int4-weights QAT export at step 0 against numpy round-to-nearest int4 of the float weights "
              f"(per channel / blocks of 32; onnxruntime's optimisations off), worst seed: max |logit difference| "
              f"{rtn_error:.2e}" + (" (the same)" if rtn_error < 1e-4 else " (DIFFERENT)"))
        code |= rtn_error >= 1e-4
    loads = first["unnamed_loads"]
    print(f"check: the int4-weights QAT export of the model as train_digits.{model}() builds it (its nodes unnamed) loads "
          f"in onnxruntime: {loads}" + ("" if loads == "yes" else "; the benchmark names the float model's nodes (Gemm_7, ...) before "
                        "its builds, so that its exports load"))
    w4a8 = first["w4a8"]
    print(f"note: int4-weights-int8-activations exported before any step (its observers have seen no batch: not a PTQ): "
          + (f"held-out accuracy {w4a8:.2f}%" if isinstance(w4a8, float) else w4a8))
    ratio = {scheme: step_ms[scheme] / step_ms["float"] for scheme in SCHEMES}
    print(f"step time, ms, median (min) of {args.timing_steps} single steps, taking turns by blocks of 10, batch "
          f"{args.batch}: float {step_ms['float']:.3f} ({low['float']:.3f}), "
          + ", ".join(f"{s} QAT {step_ms[s]:.3f} ({low[s]:.3f})" for s in SCHEMES)
          + "; qat/float " + ", ".join(f"{s} {ratio[s]:.2f} ({low[s] / low['float']:.2f})" for s in SCHEMES))

    print()
    lost4 = acc["float"] - acc["ptq-int4-rtn"]
    row = 100 / len(X_test)  # one held-out row, in points
    figures = (f"float {acc['float']:.2f}, PTQ {acc['ptq-int4-rtn']:.2f}, QAT {acc['qat-int4-weights']:.2f}, mean of "
               f"{len(seeds)} seeds; held-out loss recovered: {recovered(loss, 'qat-int4-weights', 'ptq-int4-rtn', False)}%")
    text = f"int4-weight QAT recovers >= 80% of the held-out accuracy int4 PTQ loses against float ({model})"
    if lost4 <= 0:
        print(must(text, f"n/a, int4 PTQ loses nothing ({figures})", None))
    elif lost4 < row:  # fewer rows than seeds: the share is the noise of a row or two
        share = (acc["qat-int4-weights"] - acc["ptq-int4-rtn"]) / lost4 * 100
        print(must(text, f"{share:.0f}%, but int4 PTQ loses {lost4:.2f} points, less than one held-out row per seed "
                         f"({row:.2f} points): below what this held-out set resolves ({figures})", None))
    else:
        share = (acc["qat-int4-weights"] - acc["ptq-int4-rtn"]) / lost4 * 100
        print(must(text, f"{share:.0f}% ({figures})", share >= 80))
    gap = acc["float"] - acc["qat-int8"]
    print(must(f"int8 QAT within 0.5 points of float (held-out accuracy, {model})",
               f"float − QAT = {gap:+.2f} points ({acc['qat-int8']:.2f} against {acc['float']:.2f}, mean of "
               f"{len(seeds)} seeds)", gap <= 0.5))
    for scheme in SCHEMES:
        print(must(f"a QAT step costs <= 1.5x a float step ({scheme}, {model}, batch {args.batch})",
                   f"{ratio[scheme]:.2f}x ({step_ms[scheme]:.3f} / {step_ms['float']:.3f} ms)", ratio[scheme] <= 1.5))
    return code


# ---------------------------------------------------------------------------------------------
# the Llama of llama_lora.py


def fold_transposed_weights(model: onnx.ModelProto) -> int:
    """Each ``MatMul(x, Transpose(W))`` of a 2-D initializer W read by that Transpose alone becomes
    ``MatMul(x, Wᵀ)`` of a stored [K, N] initializer under W's name (as llama_lora.py's phase_ship);
    returns the count."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, position))
    folded = set()
    for node in list(graph.node):
        if (node.op_type != "Transpose" or node.input[0] not in weights or len(weights[node.input[0]].dims) != 2
                or len(readers[node.input[0]]) != 1
                or not all(r.op_type == "MatMul" and i == 1 for r, i in readers.get(node.output[0], []))):
            continue
        tensor = weights[node.input[0]]
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).T.copy(), tensor.name))
        for reader, position in readers[node.output[0]]:
            reader.input[position] = tensor.name
        graph.node.remove(node)
        folded.add(tensor.name)
    stale = [v for v in graph.value_info if v.name in folded]  # (the export records W's [N, K] there)
    for info in stale:
        graph.value_info.remove(info)
    return len(folded)


def run_llama(args, folder: str) -> int:
    import llama_lora

    from onnx_autodiff.training import Trainer, generate_artifacts
    from onnx_autodiff.training.qat import QatConfig

    size = llama_lora.SIZES["tiny"]
    spec = argparse.Namespace(size="tiny", layers=size["layers"], batch=2, seq=size["seq"], steps=args.llama_steps)
    start = time.perf_counter()
    exported = llama_lora.phase_export(folder, spec)
    model = onnx.load(os.path.join(folder, "model.onnx"))
    for tensor in model.graph.initializer:  # one file, no external data (the model is 1 MB)
        tensor.ClearField("data_location")
    for node in model.graph.node:  # the exporter's stack traces: half the file, kept by some exports, not others
        del node.metadata_props[:]
    source = os.path.join(folder, "exported.onnx")
    onnx.save(model, source)
    batches = llama_lora.batches(spec, size["vocab"])
    held = np.random.default_rng(2).integers(0, size["vocab"], (spec.batch, spec.seq)).astype(np.int64)
    held_out = {"ids": held, "labels": held}
    print(f"\nLlama (llama_lora.py --size tiny: vocabulary {size['vocab']}, hidden {size['hidden']}, {size['layers']} "
          f"layers, {exported['params']:,} parameters, its linear layers MatMul(x, Transpose(W)) as exported), batch "
          f"{spec.batch} x {spec.seq} tokens; export {time.perf_counter() - start:.1f} s")
    options = {"loss": None, "optimizer": "adamw", "optimizer_options": {"lr": args.llama_lr, "weight_decay": 0.01}}
    tune = dict(options, optimizer_options={"lr": args.llama_lr / 10, "weight_decay": 0.01})
    calibration = args.calibration_steps
    paths, losses = {}, {}

    def trained(name: str, model: str, steps: int, **build) -> None:
        trainer = Trainer(generate_artifacts(model, **build))
        losses[name] = [trainer.step(batches[i % len(batches)]) for i in range(steps)]
        paths[name] = os.path.join(folder, f"{name}.onnx")
        trainer.export(paths[name])

    # float, then from it: int4 QAT fine-tuning, the same fine-tuning in float, and the PTQs
    trained("float", source, args.llama_steps, **options)
    tuning = args.llama_qat_steps
    trained("qat-int4-weights", paths["float"], tuning, qat=QatConfig("int4-weights", calibration_steps=calibration), **tune)
    trained("float-finetuned", paths["float"], tuning, **tune)
    paths["ptq-matmulnbits"] = os.path.join(folder, "ptq-matmulnbits.onnx")
    transposes_folded = onnx.load(paths["float"])  # (MatMulNBitsQuantizer reads MatMul initializers alone)
    folded = fold_transposed_weights(transposes_folded)
    nbits = matmul_nbits(transposes_folded, paths["ptq-matmulnbits"])
    paths["ptq-rtn"] = os.path.join(folder, "ptq-rtn.onnx")
    Trainer(generate_artifacts(paths["float"], qat=QatConfig("int4-weights", calibration_steps=calibration),
                               **options)).export(paths["ptq-rtn"])
    # step times, fresh trainers of the exported float model (int8: for information, no must)
    timing = {"float": Trainer(generate_artifacts(source, **options))}
    for scheme in SCHEMES[::-1]:
        timing[scheme] = Trainer(generate_artifacts(source, qat=QatConfig(scheme, calibration_steps=calibration), **options))
    measured = step_times(timing, batches[0], args.llama_timing_steps, warmup=10)
    step_ms, low = ({k: v[i] for k, v in measured.items()} for i in (0, 1))

    def loss(p: str, batch) -> float:
        return float(session(p).run(None, batch)[0])

    rows = ("float", "ptq-matmulnbits", "ptq-rtn", "qat-int4-weights", "float-finetuned")
    train_loss = {n: loss(paths[n], batches[0]) for n in rows}
    labels = {"float": f"float, {args.llama_steps} steps",
              "ptq-matmulnbits": f"int4 PTQ of that: MatMulNBitsQuantizer ({nbits} MatMul; embedding float)",
              "ptq-rtn": "int4-weights PTQ of that: round to nearest (the QAT build at step 0)",
              "qat-int4-weights": f"int4-weights QAT from the float model, {tuning} steps",
              "float-finetuned": f"float, fine-tuned the same {tuning} steps"}
    steps_col = {"float": step_ms["float"], "qat-int4-weights": step_ms["int4-weights"]}
    lost = train_loss["ptq-rtn"] - train_loss["float"]
    recovered = (f"{(train_loss['ptq-rtn'] - train_loss['qat-int4-weights']) / lost * 100:.0f}" if lost > 0
                 else "n/a (PTQ loses nothing)")
    print(f"\nLosses of the exported models on onnxruntime: the training batch, and a held-out batch of other random ids "
          f"(chance: ln {size['vocab']} = {np.log(size['vocab']):.3f}); latency: the loss model on the training batch, "
          f"median of {args.latency_runs}; the MatMuls onnxruntime runs with quantized kernels; step: median of "
          f"{args.llama_timing_steps} single steps, taking turns by blocks of 10; recovered: (PTQ − QAT) / (PTQ − float), "
          f"training-batch loss, against the round-to-nearest PTQ; QAT and the float fine-tuning: AdamW lr "
          f"{args.llama_lr / 10:g} from the float model ({folded} MatMul(x, Transpose(W)) folded for MatMulNBitsQuantizer "
          f"alone):\n")
    print(table(["method", "train-batch loss", "held-out loss", "size KB", "ms/batch", "quantized kernels", "step ms",
                 "recovered % (loss)"], [
        [labels[n], f"{train_loss[n]:.4f}", f"{loss(paths[n], held_out):.4f}", f"{size_kb(paths[n]):.1f}",
         f"{latency_ms(paths[n], batches[0], args.latency_runs):.3f}", kernels(paths[n], folder),
         f"{steps_col[n]:.2f}" if n in steps_col else "", recovered if n == "qat-int4-weights" else ""]
        for n in rows]))
    gap, ptq_gap = train_loss["qat-int4-weights"] - train_loss["float-finetuned"], lost
    print(f"\nQAT against the same fine-tuning in float: its training-batch loss is {gap:+.4f} from the float "
          f"fine-tuning's, where int4 PTQ's is {ptq_gap:+.4f} from the float model's (the fine-tuning's own gain "
          f"counted out, QAT's gap is {gap / ptq_gap * 100:.0f}% of PTQ's: under 100% is better than PTQ)" if ptq_gap > 0 else
          f"\nQAT against the same fine-tuning in float: {gap:+.4f} (PTQ loses nothing here)")
    every = max(1, len(batches) // 10)
    for name, label in (("float", "float"), ("qat-int4-weights", "int4-weights QAT"), ("float-finetuned", "float fine-tuning")):
        print(f"\n  training losses, {label}, every {every} steps: " if name == "float" else
              f"  training losses, {label}, every {every} steps: ", end="")
        print(" ".join(f"{x:.3f}" for x in losses[name][::every]) + f" (last {losses[name][-1]:.3f})")
    ratio = {scheme: step_ms[scheme] / step_ms["float"] for scheme in SCHEMES}
    print(f"step time, ms, median (min): float {step_ms['float']:.2f} ({low['float']:.2f}), int4-weights QAT "
          f"{step_ms['int4-weights']:.2f} ({low['int4-weights']:.2f}), int8 QAT {step_ms['int8']:.2f} ({low['int8']:.2f}) "
          f"(information); qat/float int4-weights {ratio['int4-weights']:.2f} ({low['int4-weights'] / low['float']:.2f}), "
          f"int8 {ratio['int8']:.2f} ({low['int8'] / low['float']:.2f})")
    print()
    print(must("a QAT step costs <= 1.5x a float step (int4-weights, Llama tiny, batch 2 x 32 tokens)",
               f"{ratio['int4-weights']:.2f}x ({step_ms['int4-weights']:.2f} / {step_ms['float']:.2f} ms)",
               ratio["int4-weights"] <= 1.5))
    return 0


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="float training epochs (default 15, as train_digits.py)")
    parser.add_argument("--lr", type=float, default=3e-3, help="float training's AdamW learning rate (default 3e-3)")
    parser.add_argument("--qat-epochs", type=int, default=2, help="QAT fine-tuning epochs (default 2)")
    parser.add_argument("--qat-lr", type=float, default=3e-4, help="QAT's AdamW learning rate (default 3e-4)")
    parser.add_argument("--calibration-steps", type=int, default=40,
                        help="QatConfig.calibration_steps: the steps the activations' observers run (default 40)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--latency-batch", type=int, default=256)
    parser.add_argument("--latency-runs", type=int, default=200)
    parser.add_argument("--timing-steps", type=int, default=300, help="train steps timed per model (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=10,
                        help="CNN runs, seeds --seed, --seed + 1, ...: the means are reported (default 10)")
    parser.add_argument("--models", nargs="+", choices=list(MODEL_TITLES), default=list(MODEL_TITLES),
                        help="the digits models (default both)")
    parser.add_argument("--quick", action="store_true", help="a small run (seconds): the tests' configuration")
    parser.add_argument("--llama", action="store_true", help="also the Llama of llama_lora.py at its tiny size")
    parser.add_argument("--llama-steps", type=int, default=100, help="Llama training steps (default 100)")
    parser.add_argument("--llama-lr", type=float, default=1e-3, help="the float run's AdamW lr (QAT and the fine-tuning: a tenth)")
    parser.add_argument("--llama-qat-steps", type=int, default=30, help="QAT (and float) fine-tuning steps from the float model")
    parser.add_argument("--llama-timing-steps", type=int, default=200)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the models")
    parser.add_argument("--keep", action="store_true", help="keep the models")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.qat_epochs, args.calibration_steps, args.seeds = 4, 1, 20, 2
        args.latency_runs, args.timing_steps = 5, 20
        args.llama_steps, args.llama_timing_steps = 4, 5
    np.random.seed(args.seed)
    folder = tempfile.mkdtemp(prefix="onnx-autodiff-qat-", dir=args.dir)
    try:
        with quiet_quantizers():
            code = 0
            for model in args.models:
                code |= run_cnn(args, folder, model)
            if args.llama:
                code |= run_llama(args, folder)
        return code
    finally:
        if args.keep:
            print(f"models kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
