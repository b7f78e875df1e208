"""Backward-graph benchmark: size, build time, run time and memory of fwd+bwd graphs next to PyTorch.

    python benchmarks/backward_graph.py [--layers 1 8] [--models gpt cnn mlp] [--runs 20]
        [--warmup 5] [--threads 2] [--source auto|torch|helper] [--analyze] [--tiny] [--repeat N]

For each model (GPT-style decoder with L blocks, a small CNN, an MLP 784-256-10, each ending in
a mean cross-entropy) it differentiates the loss with respect to every weight (float initializers
of more than one element, BatchNormalization's running statistics excepted:
``autodiff_pass(of=loss, wrt=parameters(model))`` then ``cleanup_passes()``), checks once that
the gradients match PyTorch autograd, and prints one table: node counts, build seconds,
onnxruntime and PyTorch milliseconds (2 intra-op threads each, median of ``--runs`` after
warm-up, onnxruntime and PyTorch taking turns in blocks of five calls), the peak memory of
onnxruntime and the ratios; then the same runs in process CPU time, which other load on the
machine disturbs less. A second table times the same steps with the weights fed as graph
inputs, as a training loop runs them (onnxruntime then neither pre-packs the weights for its
matrix products nor folds them into fused convolutions). "outlined nodes" counts the same graph
after ``OutlinePass`` (each rule's backward nodes one call of a model-local function, which
onnxruntime inlines at load: the same kernels), "function nodes" the nodes in those functions'
bodies (each defined once). ``--analyze`` adds, per model, where the backward nodes and the
onnxruntime kernel time go (by op type and by the forward op whose rule emitted them). ``--tiny`` shrinks
every model to run in seconds (what the test uses). ``--repeat N`` measures in N fresh processes
and prints each ratio's median and range.

Models come from ``torch.onnx.export(dynamo=True)`` when torch is installed, else from the
equivalent onnx.helper builders in ``models.py`` (``--source`` forces one).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models
from onnx_autodiff.rules import GradRegistry, default_registry

from onnx_autodiff import OutlinePass, autodiff_pass, cleanup_passes
from onnx_autodiff.demo import feedable

THREADS = 2
RULE_TAG = "benchmark.rule"  # node metadata key: the forward op type whose rule emitted the node

# Figures measured on this machine with other tools (onnxruntime-training 1.19.2's gradient
# builder and PyTorch eager), quoted from the issue: (fwd nodes, ort-training nodes, torch
# fwd+bwd ms, torch fwd ms).
ANCHORS = {1: (35, 114, 21.5, 7.3), 8: (224, 709, 153.0, 53.0)}
TARGETS = ("L=8 fwd+bwd <= 800 nodes; fwd+bwd time <= 1.0x PyTorch; backward <= 2.5x forward; "
           "training step peak memory <= 1.0x PyTorch (aim 0.8x)")


@dataclasses.dataclass
class Case:
    name: str
    config: object
    forward: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    source: str
    module: object = None  # the PyTorch module when the model was exported


def tiny(config):
    """The smallest configuration of the same network (for the test)."""
    if isinstance(config, models.GPTConfig):
        return dataclasses.replace(config, d_model=32, heads=2, seq=8, vocab=32, batch=2)
    if isinstance(config, models.CNNConfig):
        return dataclasses.replace(config, batch=4, channels=2)
    return dataclasses.replace(config, batch=4, sizes=(784, 16, 10))


def make_case(name: str, config, source: str) -> Case:
    inputs = models.inputs_of(config)
    if source == "helper":
        return Case(name, config, models.helper_model(config), inputs, "onnx.helper")
    module = models.torch_module(config)
    # The exporter's optimiser folds eval-mode BatchNormalization into the Conv weights, which
    # would leave no BatchNormalization (and no trainable BN scale/bias): export the CNN as is.
    optimize = not isinstance(config, models.CNNConfig)
    forward = models.export(module, inputs, optimize=optimize)
    return Case(name, config, forward, inputs, f"torch.onnx.export(optimize={optimize})", module)


def parameters(forward: onnx.ModelProto) -> list[str]:
    """The trainable weights: float initializers of more than one element, without
    BatchNormalization's running statistics (state, not parameters: PyTorch computes no gradient
    for them either). The exporter's scalar constants (the attention scale, the mask's fill value)
    are not parameters of the network."""
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    running = {name for node in forward.graph.node if node.op_type == "BatchNormalization"
               for name in node.input[3:5]}
    return [t.name for t in forward.graph.initializer if t.data_type in floats
            and np.prod(t.dims, dtype=np.int64) > 1 and t.name not in running]


def differentiate(forward: onnx.ModelProto, registry: GradRegistry | None = None):
    """The fwd+bwd model, its gradient output names and the seconds of pass + cleanup."""
    model = ir.from_proto(forward)
    loss = forward.graph.output[0].name
    start = time.perf_counter()
    grad = autodiff_pass(of=loss, wrt=parameters(forward), registry=registry)
    grad(model)
    for cleanup in cleanup_passes():
        cleanup(model)
    seconds = time.perf_counter() - start
    return model, grad.gradient_names, seconds


def ort_session(proto: onnx.ModelProto, profile_prefix: str | None = None, threads: int = THREADS):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(steps: dict, warmup: int, runs: int, block: int = 5) -> dict[str, tuple[float, float]]:
    """Median wall-clock and process CPU milliseconds (all threads) per call of each step.

    The steps take turns in blocks of ``block`` timed calls, each block after one untimed call,
    so a change in the machine's load hits them alike. Not call by call: each runtime's worker
    threads keep spinning for a while after a call, and on two cores they then compete with the
    other runtime's next call (measured on the CNN: onnxruntime fwd+bwd 20 ms in blocks, 60 ms
    call by call; PyTorch 21 and 59 ms), which is no training loop's situation.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(max(1, -(-runs // block))):
        for name, step in steps.items():
            step()
            for _ in range(block):
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return {name: (1e3 * statistics.median(wall[name]), 1e3 * statistics.median(cpu[name]))
            for name in steps}


# Checking the gradients against PyTorch autograd ---------------------------------------------


def torch_gradients(case: Case) -> tuple[float, dict[str, np.ndarray]]:
    import torch

    args = [torch.from_numpy(v) for v in case.inputs.values()]
    case.module.zero_grad(set_to_none=True)
    loss = case.module(*args)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in case.module.named_parameters()}
    return loss.item(), grads


def expected_gradient(name: str, value: np.ndarray, params: dict, grads: dict, values_shared: bool):
    """The PyTorch gradient of the initializer ``name``, or None when it is no parameter.

    The exporter renames and transposes weights (``weight.T`` becomes a new initializer) and
    merges equal tensors into one initializer (all LayerNorm weights are ones at first); such a
    shared initializer receives the sum of its parameters' gradients.
    """
    if values_shared:  # the exporter kept equal tensors apart: match by name
        return grads.get(name)
    total = None
    for pname, p in params.items():
        if p.shape == value.shape and np.array_equal(p, value):
            g = grads[pname]
        elif p.ndim == 2 and p.T.shape == value.shape and np.array_equal(p.T, value):
            g = grads[pname].T
        else:
            continue
        total = g if total is None else total + g
    return total


def check_against_torch(case: Case, results: dict[str, np.ndarray], gradient_names: dict[str, str]):
    """(max relative error over the parameters, parameters checked, loss difference)."""
    loss, grads = torch_gradients(case)
    params = {n: p.detach().numpy() for n, p in case.module.named_parameters()}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in case.forward.graph.initializer}
    floats = {n: v for n, v in inits.items() if v.dtype.kind == "f"}
    worst, checked = 0.0, 0
    for name, value in floats.items():
        shared = sum(np.array_equal(value, v) for v in floats.values() if v.shape == value.shape) > 1
        expected = expected_gradient(name, value, params, grads, shared)
        if expected is None:
            continue  # a constant such as the attention scale, not a parameter
        got = results[gradient_names[name]]
        error = np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12)
        worst, checked = max(worst, float(error)), checked + 1
    loss_error = abs(float(results[case.forward.graph.output[0].name]) - loss)
    return worst, checked, loss_error


# Peak memory -----------------------------------------------------------------------------------

# Every measurement runs in a fresh process with the same imports (numpy, onnxruntime, onnx_autodiff's
# trainer, and torch when PyTorch is measured too) and reports the growth of its peak RSS from then on: the
# weights, the runtime's buffers and the activations, without the interpreter's or the libraries'.
_MEMORY_WORKER = """
import json, sys
import numpy as np, onnxruntime as ort
from onnx_autodiff.training import Trainer
torch = None
if sys.argv[7] == '1':  # compared with PyTorch: the same imports in every process
    import torch
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
kind, model, data, threads, config = sys.argv[1], sys.argv[2], np.load(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
feeds = {k: data[k] for k in data.files}
if torch is not None:
    torch.set_num_threads(threads)
if kind.startswith('torch'):
    sys.path.insert(0, sys.argv[6])
    import models
    spec = json.loads(config)
    config = getattr(models, spec.pop('class'))(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
start = status('VmRSS')
try:
    open('/proc/self/clear_refs', 'w').write('5')  # peak RSS := current RSS
except OSError:
    pass
options = ort.SessionOptions()
options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
if kind == 'ort':
    session = ort.InferenceSession(model, options, providers=['CPUExecutionProvider'])
    for _ in range(3):
        session.run(None, feeds)
elif kind == 'trainer':
    trainer = Trainer(model)  # its own session options, as a user gets them
    for _ in range(3):
        trainer.step(feeds)
else:
    module = models.torch_module(config)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3) if kind == 'torch-train' else None
    args = [torch.from_numpy(v) for v in feeds.values()]
    for _ in range(3):
        module.zero_grad(set_to_none=True)
        module(*args).backward()
        if optimizer is not None:
            optimizer.step()
print(status('VmHWM') - start)
"""


def peak_rss_mb(kind: str, model: str, inputs: dict[str, np.ndarray], threads: int, config=None,
                with_torch: bool = True) -> float:
    """Peak RSS growth (MB) of a fresh process doing 3 steps of ``kind``: "ort" (the fwd+bwd
    model file ``model``), "trainer" (Trainer steps of the artifacts directory ``model``), "torch"
    (forward+backward of ``config``'s PyTorch module) or "torch-train" (the same with AdamW)."""
    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "x.npz")
        np.savez(data, **inputs)
        spec = json.dumps({"class": type(config).__name__, **dataclasses.asdict(config)}) if config else "{}"
        command = [sys.executable, "-c", _MEMORY_WORKER, kind, model, data, str(threads), spec,
                   str(Path(__file__).resolve().parent), str(int(with_torch))]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def memory_row(case: Case, proto: onnx.ModelProto, args) -> dict:
    """Peak memory of one fwd+bwd step and of one AdamW training step, ours and PyTorch's."""
    from onnx_autodiff.training import generate_artifacts

    row = {}
    with tempfile.TemporaryDirectory() as folder:
        forward, grad = os.path.join(folder, "fwd.onnx"), os.path.join(folder, "grad.onnx")
        onnx.save(case.forward, forward)
        onnx.save(proto, grad)
        artifacts = os.path.join(folder, "artifacts")
        generate_artifacts(case.forward, requires_grad=parameters(case.forward), loss=None,
                           optimizer="adamw").save(artifacts)
        compared = case.module is not None
        row["ort fwd MB"] = peak_rss_mb("ort", forward, case.inputs, args.threads, with_torch=compared)
        row["ort fwd+bwd MB"] = peak_rss_mb("ort", grad, case.inputs, args.threads, with_torch=compared)
        row["train step MB"] = peak_rss_mb("trainer", artifacts, case.inputs, args.threads, with_torch=compared)
    if case.module is not None:
        row["torch fwd+bwd MB"] = peak_rss_mb("torch", "", case.inputs, args.threads, case.config)
        row["torch train MB"] = peak_rss_mb("torch-train", "", case.inputs, args.threads, case.config)
        row["f+b MB / torch"] = row["ort fwd+bwd MB"] / row["torch fwd+bwd MB"]
        row["train MB / torch"] = row["train step MB"] / row["torch train MB"]
    return row


# The table --------------------------------------------------------------------------------------


def measure(case: Case, args) -> dict:
    model, gradient_names, build = differentiate(case.forward)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    outlined = ir.from_proto(proto)
    OutlinePass()(outlined)
    row = {"model": case.name, "fwd nodes": len(case.forward.graph.node),
           "fwd+bwd nodes": len(proto.graph.node), "outlined nodes": len(outlined.graph),
           "function nodes": sum(len(f) for f in outlined.functions.values()), "build s": build}
    fwd_session = ort_session(case.forward, threads=args.threads)
    grad_session = ort_session(proto, threads=args.threads)
    names = [o.name for o in proto.graph.output]
    results = dict(zip(names, grad_session.run(None, case.inputs)))
    if case.module is not None:
        row["max rel err"], row["params checked"], row["loss err"] = check_against_torch(
            case, results, gradient_names)
    params = parameters(case.forward)
    fed_fwd, weights = weights_fed(case.forward, params)
    fed_grad, _ = weights_fed(proto, params)
    fed_inputs = {**case.inputs, **weights}
    fed_fwd_session = ort_session(fed_fwd, threads=args.threads)
    fed_grad_session = ort_session(fed_grad, threads=args.threads)
    steps = {"ort fwd": lambda: fwd_session.run(None, case.inputs),
             "ort fwd+bwd": lambda: grad_session.run(None, case.inputs),
             "ort fwd fed": lambda: fed_fwd_session.run(None, fed_inputs),
             "ort fwd+bwd fed": lambda: fed_grad_session.run(None, fed_inputs)}
    if case.module is not None:
        steps.update(torch_steps(case, args))
    for name, (wall, cpu) in median_ms(steps, args.warmup, args.runs).items():
        row[name + " ms"], row[name + " cpu"] = wall, cpu
    row.update(memory_row(case, proto, args))
    return row


def weights_fed(proto: onnx.ModelProto, params: list[str]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model with the parameters turned from initializers into graph inputs, and their values.

    What a training loop runs: it feeds new weights every step, so onnxruntime can neither
    pre-pack them for its matrix products nor fold them into its fused convolutions, in the
    forward-only model as in the fwd+bwd one.
    """
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in params}
    return feedable(proto, params), weights


def torch_steps(case: Case, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    targs = [torch.from_numpy(v) for v in case.inputs.values()]
    params = list(case.module.parameters())

    def step():
        for p in params:
            p.grad = None
        case.module(*targs).backward()

    def forward():
        with torch.no_grad():
            case.module(*targs)

    return {"torch fwd+bwd": step, "torch fwd": forward}


COLUMNS = [
    ("model", "{}"), ("fwd nodes", "{:d}"), ("fwd+bwd nodes", "{:d}"), ("outlined nodes", "{:d}"),
    ("function nodes", "{:d}"), ("build s", "{:.2f}"),
    ("ort fwd ms", "{:.2f}"), ("ort fwd+bwd ms", "{:.2f}"), ("torch fwd+bwd ms", "{:.2f}"),
    ("torch fwd ms", "{:.2f}"), ("ort f+b / torch f+b", "{:.2f}"), ("ort bwd / ort fwd", "{:.2f}"),
    ("max rel err", "{:.1e}"),
]

MEMORY_COLUMNS = [
    ("model", "{}"), ("ort fwd MB", "{:.0f}"), ("ort fwd+bwd MB", "{:.0f}"), ("torch fwd+bwd MB", "{:.0f}"),
    ("f+b MB / torch", "{:.2f}"), ("train step MB", "{:.0f}"), ("torch train MB", "{:.0f}"),
    ("train MB / torch", "{:.2f}"),
]


def print_table(rows: list[dict]) -> None:
    for row in rows:
        if "torch fwd+bwd ms" in row:
            row["ort f+b / torch f+b"] = row["ort fwd+bwd ms"] / row["torch fwd+bwd ms"]
        row["ort bwd / ort fwd"] = (row["ort fwd+bwd ms"] - row["ort fwd ms"]) / row["ort fwd ms"]
        if "ort fwd fed ms" in row:
            if "torch fwd+bwd ms" in row:
                row["fed f+b / torch f+b"] = row["ort fwd+bwd fed ms"] / row["torch fwd+bwd ms"]
            row["fed bwd / fed fwd"] = (row["ort fwd+bwd fed ms"] - row["ort fwd fed ms"]) / row["ort fwd fed ms"]
    print_markdown(rows, COLUMNS)
    print("\nThe same steps with the weights fed as graph inputs, as a training loop runs them "
          "(onnxruntime neither pre-packs nor folds them then):")
    print_markdown(rows, FED_COLUMNS)
    print("\nPeak memory (MB: growth of a fresh process's peak RSS over 3 steps, equal imports; "
          "train step: Trainer with AdamW against torch.optim.AdamW):")
    print_markdown(rows, MEMORY_COLUMNS)


def print_markdown(rows: list[dict], columns) -> None:
    cells = [[fmt.format(row[key]) if key in row else "n/a" for key, fmt in columns] for row in rows]
    print("| " + " | ".join(key for key, _ in columns) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|")
    for line in cells:
        print("| " + " | ".join(line) + " |")


FED_COLUMNS = [("model", "{}"), ("ort fwd fed ms", "{:.2f}"), ("ort fwd+bwd fed ms", "{:.2f}"),
               ("torch fwd+bwd ms", "{:.2f}"), ("fed f+b / torch f+b", "{:.2f}"),
               ("fed bwd / fed fwd", "{:.2f}")]

CPU_COLUMNS = [("model", "{}"), ("ort fwd cpu", "{:.1f}"), ("ort fwd+bwd cpu", "{:.1f}"),
               ("torch fwd+bwd cpu", "{:.1f}"), ("torch fwd cpu", "{:.1f}"),
               ("ort f+b / torch f+b cpu", "{:.2f}"), ("ort bwd / ort fwd cpu", "{:.2f}")]


def print_cpu_table(rows: list[dict]) -> None:
    """The same runs in process CPU time (all threads): less disturbed by other load, but
    inflated by threads that spin while waiting."""
    for row in rows:
        if "torch fwd+bwd cpu" in row:
            row["ort f+b / torch f+b cpu"] = row["ort fwd+bwd cpu"] / row["torch fwd+bwd cpu"]
        row["ort bwd / ort fwd cpu"] = (row["ort fwd+bwd cpu"] - row["ort fwd cpu"]) / row["ort fwd cpu"]
    print("\nThe same runs in process CPU ms per call (all threads):")
    print("| " + " | ".join(key for key, _ in CPU_COLUMNS) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(CPU_COLUMNS))) + "|")
    for row in rows:
        print("| " + " | ".join(fmt.format(row[k]) if k in row else "n/a" for k, fmt in CPU_COLUMNS) + " |")


def print_anchors(rows: list[dict], layers: list[int]) -> None:
    anchored = [n for n in layers if n in ANCHORS]
    if anchored:
        print("\nAnchors (measured on this machine with other tools; from the issue):")
        print("| model | fwd nodes | onnxruntime-training fwd+bwd nodes | PyTorch fwd+bwd ms | PyTorch fwd ms |")
        print("|---|---:|---:|---:|---:|")
        for n in anchored:
            print("| GPT L={} | {} | {} | {} | {} |".format(n, *ANCHORS[n]))
    print(f"\nTargets: {TARGETS}.")
    for row in rows:
        marks = []
        if row["model"] == "GPT L=8":
            total = row["outlined nodes"] + row["function nodes"]
            marks.append(f"fwd+bwd nodes {row['fwd+bwd nodes']} {'<=' if row['fwd+bwd nodes'] <= 800 else '>'} 800")
            marks.append(f"outlined {row['outlined nodes']} + {row['function nodes']} in functions = "
                         f"{total} {'<=' if total <= 800 else '>'} 800")
        if "ort f+b / torch f+b" in row:
            ratio = row["ort f+b / torch f+b"]
            marks.append(f"time {ratio:.2f}x PyTorch ({'met' if ratio <= 1.0 else 'missed'})")
        ratio = row["ort bwd / ort fwd"]
        marks.append(f"bwd {ratio:.2f}x fwd ({'met' if ratio <= 2.5 else 'missed'})")
        if "fed f+b / torch f+b" in row:
            ratio = row["fed f+b / torch f+b"]
            marks.append(f"weights fed: time {ratio:.2f}x PyTorch ({'met' if ratio <= 1.0 else 'missed'})")
        if "fed bwd / fed fwd" in row:
            ratio = row["fed bwd / fed fwd"]
            marks.append(f"bwd {ratio:.2f}x fwd ({'met' if ratio <= 2.5 else 'missed'})")
        if "train MB / torch" in row:
            ratio = row["train MB / torch"]
            verdict = "aim met" if ratio <= 0.8 else "met" if ratio <= 1.0 else "missed"
            marks.append(f"train step memory {ratio:.2f}x PyTorch ({verdict})")
        print(f"  {row['model']}: " + "; ".join(marks))


# Where the nodes and the time go ------------------------------------------------------------


def tagging_registry() -> GradRegistry:
    """The default rules, each wrapped to tag the nodes it emits with the forward op type."""

    def wrap(backward):
        def tagged(op, node, *dys):
            start = len(op.nodes)
            result = backward(op, node, *dys)
            for emitted in op.nodes[start:]:
                emitted.metadata_props[RULE_TAG] = node.op_type
            return result

        return tagged

    return GradRegistry(
        dataclasses.replace(r, backward=wrap(r.backward)) if r.backward is not None else r
        for r in default_registry().rules()
    )


def untagged(node: ir.Node) -> str:
    """Who made a backward node that no rule tagged: the engine names its nodes bwd_*."""
    if node.name.startswith("bwd"):
        return "(engine: seed, sums, reductions)"
    return "(made by the cleanup rewrites)"


def analyze(case: Case, args) -> None:
    model, _, _ = differentiate(case.forward, tagging_registry())
    forward_names = {n.name for n in case.forward.graph.node}
    tags = {n.name: n.metadata_props.get(RULE_TAG, untagged(n)) for n in model.graph
            if n.name not in forward_names}
    backward = [n for n in model.graph if n.name not in forward_names]
    forward_ops = collections.Counter(n.op_type for n in case.forward.graph.node)
    print(f"\n## {case.name}: {len(forward_names)} forward nodes, {len(backward)} backward nodes "
          "(after cleanup)")
    print("\nBackward nodes by op type: " + ", ".join(
        f"{op} {k}" for op, k in collections.Counter(n.op_type for n in backward).most_common()))
    print("\nBackward nodes by the forward op whose rule emitted them:")
    print("| forward op | forward nodes | backward nodes | per forward node | emitted op types |")
    print("|---|---:|---:|---:|---|")
    by_rule = collections.defaultdict(collections.Counter)
    for n in backward:
        by_rule[tags[n.name]][n.op_type] += 1
    for rule, ops in sorted(by_rule.items(), key=lambda kv: -sum(kv[1].values())):
        total, count = sum(ops.values()), forward_ops.get(rule, 0)
        per = f"{total / count:.1f}" if count else ""
        kinds = ", ".join(f"{op} {k}" for op, k in ops.most_common())
        print(f"| {rule} | {count or ''} | {total} | {per} | {kinds} |")
    profile_by_op_type(ir.to_proto(model), case.inputs, tags, forward_names, args)


def profile_by_op_type(proto: onnx.ModelProto, inputs, tags: dict[str, str], forward_names: set[str],
                       args) -> None:
    """Run the fwd+bwd graph with onnxruntime's profiler; kernel time by op type and by rule."""
    with tempfile.TemporaryDirectory() as folder:
        session = ort_session(proto, os.path.join(folder, "profile"), args.threads)
        for _ in range(args.warmup + args.runs):
            session.run(None, inputs)
        with open(session.end_profiling()) as f:
            events = json.load(f)
    runs = args.warmup + args.runs
    by_op = collections.defaultdict(lambda: [0.0, 0.0, 0.0])  # op type -> us [forward, backward, other]
    by_rule = collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        # onnxruntime names a fused node "<first node's name>/<fusion>/"
        node = e["name"][: -len("_kernel_time")].split("/")[0]
        op_type = e["args"].get("op_name", "?")
        us = e["dur"] / runs
        if node in tags or node.startswith("bwd"):
            part, rule = 1, tags.get(node, "(backward, fused by onnxruntime)")
        elif node in forward_names:
            part, rule = 0, "(forward graph)"
        else:  # reshapes around Gemm fusions, inlined functions: made by onnxruntime
            part, rule = 2, "(nodes made by onnxruntime)"
        by_op[op_type][part] += us
        by_rule[rule] += us
    total = sum(sum(parts) for parts in by_op.values())
    print(f"\nonnxruntime profile of the fwd+bwd graph ({args.threads} threads, kernel time per run "
          f"averaged over {runs} runs; total {total / 1e3:.2f} ms). By op type:")
    print("| op type | forward ms | backward ms | made by onnxruntime ms | share |")
    print("|---|---:|---:|---:|---:|")
    for op, parts in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
        cells = " | ".join(f"{us / 1e3:.3f}" for us in parts)
        print(f"| {op} | {cells} | {100 * sum(parts) / total:.1f}% |")
    print("\nKernel time by the forward op whose rule emitted the backward nodes:")
    print("| rule | ms | share |")
    print("|---|---:|---:|")
    for rule, us in by_rule.most_common():
        print(f"| {rule} | {us / 1e3:.3f} | {100 * us / total:.1f}% |")


# Main ----------------------------------------------------------------------------------------------


def torch_available() -> bool:
    try:
        import onnxscript  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8], help="GPT blocks")
    parser.add_argument("--models", nargs="+", default=["gpt", "cnn", "mlp"],
                        choices=["gpt", "cnn", "mlp"])
    parser.add_argument("--runs", type=int, default=20, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=THREADS, help="intra-op threads of both")
    parser.add_argument("--source", choices=["auto", "torch", "helper"], default="auto")
    parser.add_argument("--analyze", action="store_true", help="node and time breakdown per model")
    parser.add_argument("--tiny", action="store_true", help="smallest configurations (seconds)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure in N fresh processes; print each ratio's median and range")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # where a repeated run writes its rows
    args = parser.parse_args(argv)
    if args.repeat > 1:
        return repeat_in_processes(args)
    source = args.source
    if source == "auto":
        source = "torch" if torch_available() else "helper"
    started = time.perf_counter()

    configs = []
    if "gpt" in args.models:
        configs += [(f"GPT L={n}", models.GPTConfig(layers=n)) for n in args.layers]
    if "cnn" in args.models:
        configs.append(("CNN", models.CNNConfig()))
    if "mlp" in args.models:
        configs.append(("MLP 784-256-10", models.MLPConfig()))
    if args.tiny:
        configs = [(name + " (tiny)", tiny(config)) for name, config in configs]

    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, {args.threads} intra-op threads, "
          f"median of {args.runs} runs after {args.warmup} warm-up runs; models from {source}")
    cases, rows = [], []
    for name, config in configs:
        case = make_case(name, config, source)
        if source == "torch":
            built = len(models.helper_model(config).graph.node)
            print(f"{name}: {case.source} {len(case.forward.graph.node)} nodes, "
                  f"onnx.helper builder {built} nodes")
        cases.append(case)
        rows.append(measure(case, args))
    print()
    print_table(rows)
    for row in rows:
        if "max rel err" in row:
            print(f"  {row['model']}: gradients of {row['params checked']} parameters vs PyTorch "
                  f"autograd, max relative error {row['max rel err']:.1e}; loss differs by "
                  f"{row['loss err']:.1e}")
    print_cpu_table(rows)
    print_anchors(rows, args.layers if "gpt" in args.models and not args.tiny else [])
    print("\nmax rel err: max over parameters of max|ours - torch| / max|torch| (float32 both). "
          "Peak memory: growth of a fresh process's peak RSS from after the imports (numpy, "
          "onnxruntime, torch, onnx_autodiff's trainer, the same in every process) through 3 steps: "
          "session or module creation, weights, runtime buffers, activations. Torch forward runs under no_grad. "
          "Timings depend on the machine's other load at the time: compare within one run.")
    if args.analyze:
        for case in cases:
            analyze(case, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    print(f"\nTotal {time.perf_counter() - started:.0f} s")
    return 0


RATIOS = ["ort f+b / torch f+b", "ort bwd / ort fwd", "fed f+b / torch f+b", "fed bwd / fed fwd"]


def repeat_in_processes(args) -> int:
    """Run the measurement ``args.repeat`` times, each model in a fresh process, and print the
    median and range of every ratio: step times on this machine vary more from one process to the
    next (PyTorch's CNN step: 19 to 33 ms), and with what ran before in the process, than within
    one, so one run cannot say "reliably"."""
    common = ["--runs", str(args.runs), "--warmup", str(args.warmup), "--threads", str(args.threads),
              "--source", args.source] + (["--tiny"] if args.tiny else [])
    models_ = [["--models", "gpt", "--layers", str(n)] for n in args.layers if "gpt" in args.models]
    models_ += [["--models", name] for name in ("cnn", "mlp") if name in args.models]
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            rows = []
            for which in models_:
                path = os.path.join(folder, "rows.json")
                subprocess.run([sys.executable, __file__, *which, *common, "--json", path], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rows += json.loads(Path(path).read_text())
            runs.append(rows)
            print(f"run {i + 1}/{args.repeat} done", flush=True)
    print(f"\nMedian (min–max) over {args.repeat} runs, each model in a fresh process:")
    print("| model | fwd+bwd nodes | outlined nodes (+ function nodes) | " + " | ".join(RATIOS) + " |")
    print("|---|---:|---:|" + "---:|" * len(RATIOS))
    for k, row in enumerate(runs[0]):
        cells = []
        for key in RATIOS:
            values = [run[k][key] for run in runs if key in run[k]]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
                         if values else "n/a")
        outlined = f"{row['outlined nodes']} (+{row['function nodes']})"
        print(f"| {row['model']} | {row['fwd+bwd nodes']} | {outlined} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
