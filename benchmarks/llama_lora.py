"""LoRA fine-tuning of a Llama-shaped decoder over 2 GB on plain onnxruntime, against PyTorch + peft.

    python benchmarks/llama_lora.py [--size {2.5g,155m,tiny}] [--layers N] [--steps 4] [--batch 2]
        [--seq N] [--dir /tmp] [--keep] [--no-torch] [--quantize-base ...] [--shipped-int4]

Builds ``transformers.LlamaForCausalLM`` from a config with random weights (seed 0, no download),
untied embeddings, float32. ``--size 2.5g`` (the default): vocabulary 128,256, hidden 2048, MLP
5632, 16 heads, 4 KV heads, two layers, 2.46 GB, most of it the two 128,256 x 2048 matrices,
sequences of 32 tokens; ``--size 155m``: vocabulary 32,000, hidden 768, MLP 3072, 12 heads, 4 KV
heads, 12 layers, 153 M parameters (0.61 GB), sequences of 128 tokens, a minute or two;
``--size tiny`` (also ``--tiny``): vocabulary 512, hidden 64, seconds. Then, each phase in its own
process so that its peak RSS is its own:

- export: the next-token cross-entropy (in float32, as the model) of ``(ids, labels)``, by
  ``torch.onnx.export(dynamo=True, optimize=False)``, saved with external data. optimize=False
  keeps every parameter an initializer of its own under its module name (the optimiser may fold
  or fuse them into new constants), so LoRA targets are matched by name and each adapted weight
  maps one to one onto peft's;
- ``onnx-autodiff artifacts --loss none --optimizer adamw --lora 8 --lora-targets '*q_proj*'
  '*v_proj*'`` (its options are built in :func:`artifacts_argv` alone);
- Trainer: ``--steps`` AdamW steps on fixed batches, then ``export()`` merged, with external data;
- the merged model once on onnxruntime: its loss against the Trainer's eval loss;
- with ``--quantize-base`` (QLoRA): the artifacts, the Trainer and the merged model again, on
  the base quantized at build time, read as ``artifacts --quantize-base`` reads it by default
  (``--quantize-format dequantizelinear``); for ``--quantize-format matmulnbits``, also the
  merged export in that form (a ``model_q4.onnx`` as shipped) trained with its weights read
  through DequantizeLinear (``--quantize-format dequantizelinear``): onnxruntime's kernel holds
  a pre-packed copy of the weights beside those the backward reads;
- with ``--shipped-int4``: a file as shipped, the float export quantized by onnxruntime's own
  ``MatMulNBitsQuantizer`` (int4, blocks of 32, symmetric; its linear weights first stored as
  MatMul's B [K, N], as the TorchScript exporter and optimum write them: the quantizer skips the
  ``MatMul(x, Transpose(W))`` of an optimize=False export), saved with external data as
  ``model_q4.onnx``; then the artifacts (the options above), the Trainer and the merged model of
  that file twice: as the command line reads it by default (its weights read through
  DequantizeLinear in the train models, as ``--quantize-base int4`` stores a float base), and with
  ``--quantize-format matmulnbits`` (its MatMulNBits kernels, which keep a pre-packed copy);
- PyTorch + peft eager (unless ``--no-torch``): the same weights (same seed), the same LoRA config
  and initial A, the same batches and AdamW steps; its losses against ours.

Prints one table: wall time, peak RSS and disk per phase and, for the two phases that train (the
Trainer, PyTorch + peft), the RSS after the imports, after loading the model (Trainer constructed;
peft model, A and optimiser made) and what loading took over the weight file
(``model.onnx.data``); then the step times. Files are removed afterwards unless ``--keep``. At
two layers it needs 5 GB of disk (the model's data file, which the artifacts read where it is,
and the merged export) and 3 GB of memory in its largest phases (export, PyTorch + peft).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from large_model import run_measured

# the presets of --size: the model's shape, with the layers and the sequence length --layers and
# --seq default to
SIZES = {
    "2.5g": {"vocab": 128256, "hidden": 2048, "intermediate": 5632, "heads": 16, "kv_heads": 4, "layers": 2, "seq": 32},
    "155m": {"vocab": 32000, "hidden": 768, "intermediate": 3072, "heads": 12, "kv_heads": 4, "layers": 12, "seq": 128},
    "tiny": {"vocab": 512, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "layers": 2, "seq": 32},
}
FULL, TINY = SIZES["2.5g"], SIZES["tiny"]
TARGETS = ("q_proj", "v_proj")
RANK, LR = 8, 1e-3


def sizes(args) -> dict:
    size = {k: v for k, v in SIZES[args.size].items() if k != "seq"}
    return dict(size, layers=args.layers)


def rss_mb() -> float:
    """This process's resident set now (MB)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def artifacts_argv(args, folder: str, base: str = "float") -> list[str]:
    """The ``onnx-autodiff artifacts`` command of the artifacts phase of ``base`` (see
    :data:`BASES`): its options are built here alone."""
    sources = {"reread": "merged-quantized.onnx", "shipped": "model_q4.onnx", "shipped-kernels": "model_q4.onnx"}
    source = os.path.join(folder, sources.get(base, "model.onnx"))
    argv = [sys.executable, "-m", "onnx_autodiff", "artifacts", source, "-o",
            os.path.join(folder, base_files(base)[0]), "--loss", "none", "--optimizer", "adamw", "--lr", str(LR),
            "--weight-decay", "0.01", "--lora", str(RANK), "--lora-targets", *(f"*{t}*" for t in TARGETS)]
    if base == "quantized":
        argv += ["--quantize-base", args.quantize_base, "--quantize-format", args.quantize_format]
    elif base == "reread":
        argv += ["--quantize-format", "dequantizelinear"]
    elif base == "shipped-kernels":
        argv += ["--quantize-format", "matmulnbits"]
    return argv


# the bases trained: the float export; its base quantized at build time (--quantize-base); and, for
# a MatMulNBits base, the merged export in that form (a model_q4.onnx as shipped) trained with its
# weights read through DequantizeLinear (--quantize-format dequantizelinear); and the float export
# quantized by onnxruntime's MatMulNBitsQuantizer, a file as shipped (--shipped-int4), read as the
# command line reads it by default (through DequantizeLinear) and by its kernels
BASES = ("float", "quantized", "reread", "shipped", "shipped-kernels")


def base_files(base: str) -> tuple[str, str, str]:
    """The artifacts directory, the merged export and the phases' result suffix of ``base``."""
    return {"float": ("artifacts", "merged.onnx", ""), "quantized": ("artifacts-quantized", "merged-quantized.onnx", "-quantized"),
            "reread": ("artifacts-reread", "merged-reread.onnx", "-reread"),
            "shipped": ("artifacts-shipped", "merged-shipped.onnx", "-shipped"),
            "shipped-kernels": ("artifacts-shipped-kernels", "merged-shipped-kernels.onnx", "-shipped-kernels")}[base]


def batches(args, vocab: int) -> list[dict[str, np.ndarray]]:
    """``args.steps`` times one batch of random token ids, the labels the ids themselves (shifted in
    the loss): on one batch the loss falls, which random batches on a random model would not show."""
    ids = np.random.default_rng(1).integers(0, vocab, (args.batch, args.seq)).astype(np.int64)
    return [{"ids": ids, "labels": ids}] * args.steps


def next_token_loss(lm):
    """The causal LM ``lm`` as a module whose output is its next-token loss of ``(ids, labels)`` in
    the model's dtype (transformers' own loss casts the logits to float32, and takes ignore_index
    labels we do not need)."""
    import torch

    class LossOf(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            logits = self.lm(input_ids=ids).logits[:, :-1]
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    return LossOf(lm)


def build_module(size: dict):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="eager")
    return next_token_loss(transformers.LlamaForCausalLM(config)).eval()


def peak_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def phase_export(folder: str, args) -> dict:
    import torch

    start = time.perf_counter()
    module = build_module(sizes(args))
    built = time.perf_counter() - start
    params = sum(p.numel() for p in module.parameters())
    ids = torch.from_numpy(batches(args, sizes(args)["vocab"])[0]["ids"])
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (ids, ids), dynamo=True, optimize=False, verbose=False)
    exported = time.perf_counter() - start
    start = time.perf_counter()
    program.save(os.path.join(folder, "model.onnx"), external_data=True)
    saved = time.perf_counter() - start
    return {"params": params, "bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "build_s": built, "export_s": exported, "save_s": saved}


def phase_ship(folder: str, args) -> dict:
    """``model_q4.onnx``: the float export as onnxruntime's MatMulNBitsQuantizer writes it (int4,
    blocks of 32, symmetric), with external data, after its ``MatMul(x, Transpose(W))`` became
    ``MatMul(x, Wᵀ)`` of a stored [K, N] initializer under W's name (the quantizer reads MatMul
    initializers only)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # (a line per node otherwise)
    start = time.perf_counter()
    model = onnx.load(os.path.join(folder, "model.onnx"))
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    readers = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, position))
    folded = []
    for node in list(graph.node):
        if (node.op_type != "Transpose" or node.input[0] not in weights or len(weights[node.input[0]].dims) != 2
                or len(readers[node.input[0]]) != 1
                or not all(r.op_type == "MatMul" and i == 1 for r, i in readers.get(node.output[0], []))):
            continue
        tensor = weights[node.input[0]]
        tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor).T.copy(), tensor.name))
        for reader, position in readers[node.output[0]]:
            reader.input[position] = tensor.name
        graph.node.remove(node)
        folded.append(tensor.name)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True)
    quantizer.process()
    shipped = quantizer.model.model
    del model, weights, readers
    path = os.path.join(folder, "model_q4.onnx")
    onnx.save(shipped, path, save_as_external_data=True, location="model_q4.onnx.data", size_threshold=1024)
    nbits = sum(n.op_type == "MatMulNBits" for n in shipped.graph.node)
    return {"folded": len(folded), "nbits": nbits, "ship_s": time.perf_counter() - start}


def phase_train(folder: str, args) -> dict:
    import onnxruntime  # noqa: F401 - imported before "after imports", as the Trainer would

    from onnx_autodiff.training import Trainer

    data = batches(args, sizes(args)["vocab"])
    imported = rss_mb()
    start = time.perf_counter()
    directory, merged, _ = base_files(args.base)
    trainer = Trainer(os.path.join(folder, directory), lr=LR, providers=["CPUExecutionProvider"])
    session = time.perf_counter() - start
    loaded = rss_mb()
    losses, times = [], []
    for batch in data:
        start = time.perf_counter()
        losses.append(trainer.step(batch))
        times.append(time.perf_counter() - start)
    stepped = peak_mb()
    start = time.perf_counter()
    evaluated = float(trainer.evaluate(data[0])["loss"])
    evaluating = time.perf_counter() - start
    evaluated_peak = peak_mb()
    start = time.perf_counter()
    trainer.export(os.path.join(folder, merged), external_data=True)
    exporting = time.perf_counter() - start
    cost = trainer.merge_cost(data[0]) if args.base != "float" else None  # after the peaks: its own sessions
    return {"merge_cost": cost, "session_s": session, "losses": losses, "step_s": times, "eval_loss": evaluated, "eval_s": evaluating,
            "export_s": exporting, "imports_mb": imported, "loaded_mb": loaded, "steps_peak_mb": stepped,
            "eval_peak_mb": evaluated_peak}


def phase_merged(folder: str, args) -> dict:
    import onnxruntime as ort

    batch = batches(args, sizes(args)["vocab"])[0]
    start = time.perf_counter()
    session = ort.InferenceSession(os.path.join(folder, base_files(args.base)[1]), providers=["CPUExecutionProvider"])
    (loss,) = session.run(None, batch)
    return {"loss": float(loss), "run_s": time.perf_counter() - start}


def phase_torch(folder: str, args) -> dict:
    import peft
    import torch
    import transformers  # noqa: F401 - imported before "after imports"

    from onnx_autodiff.training import TrainingArtifacts

    data = batches(args, sizes(args)["vocab"])
    imported = rss_mb()
    start = time.perf_counter()
    model = peft.get_peft_model(build_module(sizes(args)),
                                peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=list(TARGETS), lora_dropout=0.0))
    checkpoint = TrainingArtifacts.load(os.path.join(folder, "artifacts")).checkpoint
    copied = 0
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.Linear):  # the same initial A: ours [in, r], peft's [r, in]
            weight = name.split("base_model.model.", 1)[1] + ".weight"
            module.lora_A["default"].weight.data = torch.from_numpy(checkpoint[f"{weight}.lora_A"].T.copy())
            copied += 1
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=1e-2)
    built = time.perf_counter() - start
    loaded = rss_mb()
    losses, times = [], []
    for batch in data:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(torch.from_numpy(batch["ids"]), torch.from_numpy(batch["labels"]))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"build_s": built, "adapters": copied, "losses": losses, "step_s": times, "imports_mb": imported,
            "loaded_mb": loaded, "steps_peak_mb": peak_mb()}


PHASES = {"export": phase_export, "ship": phase_ship, "train": phase_train, "merged": phase_merged, "torch": phase_torch}


def disk_mb(folder: str, prefix: str = "") -> float:
    total = 0
    for root, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if os.path.relpath(os.path.join(root, f), folder).startswith(prefix))
    return total / 1e6


def _steps(times: list[float]) -> str:
    """First step (sessions warm up) and the median of the rest."""
    rest = f", then {statistics.median(times[1:]) * 1e3:.0f} ms" if len(times) > 1 else ""
    return f"first {times[0] * 1e3:.0f} ms{rest}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="2.5g",
                        help="2.5g (default): vocabulary 128,256, hidden 2048, 2 layers, 2.46 GB in float32; "
                             "155m: vocabulary 32,000, hidden 768, 12 layers, 0.62 GB (a minute or two); "
                             "tiny: vocabulary 512, hidden 64 (seconds)")
    parser.add_argument("--tiny", action="store_const", dest="size", const="tiny", help="--size tiny")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the size's, 2 or 12)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: 128 for 155m, 32 otherwise)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch + peft")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the files")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--quantize-base", choices=["int4", "int8", "float16"],
                        help="also train LoRA on the base quantized at build time (QLoRA), side by side")
    parser.add_argument("--quantize-format", choices=["dequantizelinear", "matmulnbits"], default="dequantizelinear",
                        help="how the quantized base is read (default, as the command line's: DequantizeLinear; "
                             "matmulnbits: onnxruntime's MatMulNBits kernel, and its merged export trained again)")
    parser.add_argument("--shipped-int4", action="store_true",
                        help="also train LoRA on the float export quantized by onnxruntime's MatMulNBitsQuantizer "
                             "(int4, blocks of 32, symmetric), a model_q4.onnx as shipped, side by side")
    parser.add_argument("--base", choices=BASES, default="float", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.layers = SIZES[args.size]["layers"] if args.layers is None else args.layers
    args.seq = SIZES[args.size]["seq"] if args.seq is None else args.seq
    if args.phase:
        result = PHASES[args.phase](args.folder, args)
        with open(os.path.join(args.folder, f"{args.phase}{base_files(args.base)[2]}.json"), "w") as stream:
            json.dump(dict(result, vmhwm_mb=peak_mb()), stream)
        return 0
    folder = tempfile.mkdtemp(prefix="onnx-autodiff-llama-", dir=args.dir)
    common = [f"--layers={args.layers}", f"--steps={args.steps}", f"--batch={args.batch}", f"--seq={args.seq}",
              f"--size={args.size}", f"--folder={folder}"]
    rows, results = [], {}

    def phase(label: str, argv: list[str], name: str | None = None, disk: str | None = None) -> bool:
        code, seconds, peak, text = run_measured(argv)
        if name and not code:
            with open(os.path.join(folder, f"{name}.json")) as stream:
                results[name] = json.load(stream)
        rows.append([label, f"{seconds:.1f}", f"{peak:.0f}", "" if disk is None else f"{disk_mb(folder, disk):.0f}",
                     name if name in ("train", "torch", "train-quantized", "train-reread", "train-shipped",
                                                 "train-shipped-kernels") and not code else None])
        if code or not name:  # the phases' own output is warnings (torch's registry, onnxruntime's folding)
            print(f"{label}: exit {code}\n  " + text.replace("\n", "\n  "))
        return not code

    me = [sys.executable, os.path.abspath(__file__)]
    cli = artifacts_argv(args, folder)
    try:
        ok = (phase("build + torch.onnx.export + save", [*me, *common, "--phase=export"], "export", "model.onnx")
              and phase("onnx-autodiff artifacts --lora", cli, None, "artifacts")
              and phase(f"Trainer: {args.steps} steps, evaluate, export merged", [*me, *common, "--phase=train"],
                        "train", "merged.onnx")
              and phase("merged model on onnxruntime", [*me, *common, "--phase=merged"], "merged")
              and (args.no_torch or phase(f"PyTorch + peft: {args.steps} steps", [*me, *common, "--phase=torch"], "torch")))
        if ok and args.quantize_base:
            base = f"{args.quantize_base} {args.quantize_format}"
            quantized = [*common, "--base=quantized"]
            ok = (phase(f"onnx-autodiff artifacts --lora --quantize-base {base}", artifacts_argv(args, folder, "quantized"),
                        None, "artifacts-quantized")
                  and phase(f"Trainer, {base} base: {args.steps} steps, evaluate, export merged",
                            [*me, *quantized, "--phase=train"], "train-quantized", "merged-quantized")
                  and phase(f"merged {base} model on onnxruntime", [*me, *quantized, "--phase=merged"], "merged-quantized"))
        if ok and args.quantize_base in ("int4", "int8") and args.quantize_format == "matmulnbits":
            ok = (phase(f"onnx-autodiff artifacts --lora --quantize-format dequantizelinear on the merged {base} model",
                        artifacts_argv(args, folder, "reread"), None, "artifacts-reread")
                  and phase(f"Trainer, that model's MatMulNBits read through DequantizeLinear: {args.steps} steps",
                            [*me, *common, "--base=reread", "--phase=train"], "train-reread", "merged-reread"))
        if ok and args.shipped_int4:
            ok = phase("onnxruntime MatMulNBitsQuantizer: model_q4.onnx (int4, blocks of 32)",
                       [*me, *common, "--phase=ship"], "ship", "model_q4.onnx")
            for base, how in (("shipped", "read through DequantizeLinear, the default"),
                              ("shipped-kernels", "--quantize-format matmulnbits: its kernels")):
                directory, merged, suffix = base_files(base)
                ok = ok and (phase(f"onnx-autodiff artifacts --lora on model_q4.onnx ({how})",
                                   artifacts_argv(args, folder, base), None, directory)
                             and phase(f"Trainer, model_q4.onnx ({how}): {args.steps} steps, evaluate, export merged",
                                       [*me, *common, f"--base={base}", "--phase=train"], f"train{suffix}",
                                       merged.removesuffix(".onnx"))
                             and phase(f"merged model_q4.onnx ({how}) on onnxruntime",
                                       [*me, *common, f"--base={base}", "--phase=merged"], f"merged{suffix}"))
        size = sizes(args)
        if "export" in results:
            e = results["export"]
            print(f"\nmodel: LlamaForCausalLM {size}, {e['params'] / 1e6:.0f} M parameters, {e['bytes'] / 1e9:.2f} GB "
                  f"float32; build {e['build_s']:.1f} s, export {e['export_s']:.1f} s, save {e['save_s']:.1f} s")
            for f in sorted(os.listdir(folder)):
                if f.startswith("model.onnx"):
                    print(f"  {f}: {os.path.getsize(os.path.join(folder, f)) / 1e6:.1f} MB")
        data = os.path.join(folder, "model.onnx.data")
        weights = os.path.getsize(data) / 2**20 if os.path.isfile(data) else None
        print("\n| phase | wall s | peak RSS MB | disk MB | RSS after imports MB | RSS after load MB | "
              "(load - imports) / weights | peak RSS of the steps MB |\n|---|---|---|---|---|---|---|---|")
        for *cells, name in rows:
            memory = ["", "", "", ""]
            if name:  # the phases that load the model: what loading it took, against its weight file
                r = results[name]
                ratio = f"{(r['loaded_mb'] - r['imports_mb']) / weights:.2f}" if weights else ""
                memory = [f"{r['imports_mb']:.0f}", f"{r['loaded_mb']:.0f}", ratio, f"{r['steps_peak_mb']:.0f}"]
            print("| " + " | ".join([*cells, *memory]) + " |")
        if weights:
            print(f"weights: model.onnx.data {weights:.0f} MB")
        code = 0 if ok else 1
        if "train" in results:
            t = results["train"]
            print(f"\nours (onnxruntime): sessions {t['session_s']:.1f} s; step {_steps(t['step_s'])}; "
                  f"evaluate {t['eval_s']:.2f} s; export merged {t['export_s']:.1f} s")
            print("  losses " + " ".join(f"{x:.5f}" for x in t["losses"]))
        if "merged" in results:
            error = abs(results["merged"]["loss"] - results["train"]["eval_loss"]) / abs(results["train"]["eval_loss"])
            print(f"merged model: loss {results['merged']['loss']:.5f}, Trainer.evaluate {results['train']['eval_loss']:.5f} "
                  f"(relative difference {error:.1e}); session + run {results['merged']['run_s']:.1f} s")
            code |= error > 1e-4
        if "train-quantized" in results:
            q = results["train-quantized"]
            print(f"\nours, {args.quantize_base} {args.quantize_format} base: sessions {q['session_s']:.1f} s; step "
                  f"{_steps(q['step_s'])}; export merged {q['export_s']:.1f} s")
            print("  losses " + " ".join(f"{x:.5f}" for x in q["losses"]) + "  (float base: "
                  + " ".join(f"{x:.5f}" for x in results["train"]["losses"]) + ")")
            cost = q["merge_cost"]
            print(f"  merging into the {args.quantize_base} base (quantized again): loss {cost['adapted']:.5f} -> "
                  f"{cost['merged']:.5f}")
            if "merged-quantized" in results:
                error = abs(results["merged-quantized"]["loss"] - cost["merged"]) / abs(cost["merged"])
                print(f"  merged model: loss {results['merged-quantized']['loss']:.5f} (against merge_cost: {error:.1e})")
                code |= error > 1e-4
            if "train" in results:
                steps = q["steps_peak_mb"] / results["train"]["steps_peak_mb"]
                print(f"  peak RSS of the steps: {steps:.2f}x the float base's")
        if "train-reread" in results:
            r = results["train-reread"]
            print(f"\nours, the merged {args.quantize_base} MatMulNBits model read through DequantizeLinear: sessions "
                  f"{r['session_s']:.1f} s; step {_steps(r['step_s'])}")
            print("  losses " + " ".join(f"{x:.5f}" for x in r["losses"]))
            if "merged-quantized" in results:  # its first step's loss is the merged model's, on the same batch
                error = abs(r["losses"][0] - results["merged-quantized"]["loss"]) / abs(results["merged-quantized"]["loss"])
                print(f"  first loss against the merged model's on onnxruntime: {error:.1e}")
                code |= error > 1e-4
            if "train" in results:
                steps = r["steps_peak_mb"] / results["train"]["steps_peak_mb"]
                print(f"  peak RSS of the steps: {steps:.2f}x the float base's")
        for suffix, how in (("-shipped", "read through DequantizeLinear (the default)"),
                            ("-shipped-kernels", "its MatMulNBits kernels (--quantize-format matmulnbits)")):
            if f"train{suffix}" not in results:
                continue
            r, ship = results[f"train{suffix}"], results["ship"]
            print(f"\nours, model_q4.onnx (MatMulNBitsQuantizer: {ship['nbits']} MatMulNBits, {ship['folded']} "
                  f"transposes folded first, {ship['ship_s']:.1f} s), {how}: sessions {r['session_s']:.1f} s; step "
                  f"{_steps(r['step_s'])}")
            print("  losses " + " ".join(f"{x:.5f}" for x in r["losses"]))
            merged = results.get(f"merged{suffix}")
            if merged and r["merge_cost"]:
                error = abs(merged["loss"] - r["merge_cost"]["merged"]) / abs(r["merge_cost"]["merged"])
                print(f"  merged model: loss {merged['loss']:.5f} (against merge_cost: {error:.1e})")
                code |= error > 1e-4
            if "train" in results:
                steps = r["steps_peak_mb"] / results["train"]["steps_peak_mb"]
                print(f"  peak RSS of the steps: {steps:.2f}x the float base's")
        if "train-shipped" in results and "train-shipped-kernels" in results:  # the same file, the same adapters
            error = max(abs(a - b) / abs(b) for a, b in zip(results["train-shipped"]["losses"],
                                                            results["train-shipped-kernels"]["losses"]))
            print(f"  the losses read through DequantizeLinear against the kernels': {error:.1e}")
            code |= error > 1e-4
        if "torch" in results:
            p = results["torch"]
            print(f"PyTorch + peft eager: {p['adapters']} adapters, build {p['build_s']:.1f} s; step {_steps(p['step_s'])}")
            print("  losses " + " ".join(f"{x:.5f}" for x in p["losses"]))
            ours, theirs = np.array(results["train"]["losses"]), np.array(p["losses"])
            error = np.abs(ours - theirs) / np.abs(theirs)
            print("  loss relative difference per step: " + " ".join(f"{x:.1e}" for x in error))
            code |= p["adapters"] != 2 * size["layers"] or error.max() > 1e-3
        return int(code)
    finally:
        if args.keep:
            print(f"files kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
