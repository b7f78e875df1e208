"""LoRA fine-tuning of a Llama-shaped decoder over 2 GB on plain onnxruntime, against PyTorch + peft.

    python benchmarks/llama_lora.py [--layers 2] [--steps 4] [--dir /tmp] [--keep] [--no-torch]

Builds ``transformers.LlamaForCausalLM`` from a config with random weights (seed 0, no download):
vocabulary 128,256, hidden 2048, MLP 5632, 16 heads, 4 KV heads, untied embeddings, float32;
two layers are 2.46 GB, most of it the two 128,256 x 2048 matrices. Then, each phase in its own
process so that its peak RSS is its own (``--tiny``: a toy size, seconds):

- export: the next-token cross-entropy (in float32, as the model) of ``(ids, labels)``, by
  ``torch.onnx.export(dynamo=True, optimize=False)``, saved with external data. optimize=False
  keeps every parameter an initializer of its own under its module name (the optimiser may fold
  or fuse them into new constants), so LoRA targets are matched by name and each adapted weight
  maps one to one onto peft's;
- ``onnx-autodiff artifacts --loss none --optimizer adamw --lora 8 --lora-targets '*q_proj*'
  '*v_proj*'``;
- Trainer: ``--steps`` AdamW steps on fixed batches, then ``export()`` merged, with external data;
- the merged model once on onnxruntime: its loss against the Trainer's eval loss;
- PyTorch + peft eager (unless ``--no-torch``): the same weights (same seed), the same LoRA config
  and initial A, the same batches and AdamW steps; its losses against ours.

Prints one table: wall time, peak RSS and disk per phase, and the step times. Files are removed
afterwards unless ``--keep``. At two layers it needs 12.3 GB of disk (the artifacts write three
2.46 GB data files) and 12 GB of memory in its largest phase (artifacts; see the table).
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

FULL = {"vocab": 128256, "hidden": 2048, "intermediate": 5632, "heads": 16, "kv_heads": 4}
TINY = {"vocab": 512, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2}
TARGETS = ("q_proj", "v_proj")
RANK, LR = 8, 1e-3


def sizes(args) -> dict:
    return dict(TINY if args.tiny else FULL, layers=args.layers)


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


def phase_train(folder: str, args) -> dict:
    from onnx_autodiff.training import Trainer

    data = batches(args, sizes(args)["vocab"])
    start = time.perf_counter()
    trainer = Trainer(os.path.join(folder, "artifacts"), lr=LR, providers=["CPUExecutionProvider"])
    session = time.perf_counter() - start
    losses, times = [], []
    for batch in data:
        start = time.perf_counter()
        losses.append(trainer.step(batch))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    evaluated = float(trainer.evaluate(data[0])["loss"])
    evaluating = time.perf_counter() - start
    start = time.perf_counter()
    trainer.export(os.path.join(folder, "merged.onnx"), external_data=True)
    exporting = time.perf_counter() - start
    return {"session_s": session, "losses": losses, "step_s": times, "eval_loss": evaluated, "eval_s": evaluating,
            "export_s": exporting}


def phase_merged(folder: str, args) -> dict:
    import onnxruntime as ort

    batch = batches(args, sizes(args)["vocab"])[0]
    start = time.perf_counter()
    session = ort.InferenceSession(os.path.join(folder, "merged.onnx"), providers=["CPUExecutionProvider"])
    (loss,) = session.run(None, batch)
    return {"loss": float(loss), "run_s": time.perf_counter() - start}


def phase_torch(folder: str, args) -> dict:
    import peft
    import torch

    from onnx_autodiff.training import TrainingArtifacts

    data = batches(args, sizes(args)["vocab"])
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
    losses, times = [], []
    for batch in data:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(torch.from_numpy(batch["ids"]), torch.from_numpy(batch["labels"]))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"build_s": built, "adapters": copied, "losses": losses, "step_s": times}


PHASES = {"export": phase_export, "train": phase_train, "merged": phase_merged, "torch": phase_torch}


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
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2: 2.46 GB in float32)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="a toy model (vocabulary 512, hidden 64): seconds")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch + peft")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the files")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        result = PHASES[args.phase](args.folder, args)
        with open(os.path.join(args.folder, f"{args.phase}.json"), "w") as stream:
            json.dump(dict(result, vmhwm_mb=peak_mb()), stream)
        return 0
    folder = tempfile.mkdtemp(prefix="onnx-autodiff-llama-", dir=args.dir)
    common = [f"--layers={args.layers}", f"--steps={args.steps}", f"--batch={args.batch}", f"--seq={args.seq}",
              *(["--tiny"] if args.tiny else []), f"--folder={folder}"]
    rows, results = [], {}

    def phase(label: str, argv: list[str], name: str | None = None, disk: str | None = None) -> bool:
        code, seconds, peak, text = run_measured(argv)
        if name and not code:
            with open(os.path.join(folder, f"{name}.json")) as stream:
                results[name] = json.load(stream)
        rows.append((label, f"{seconds:.1f}", f"{peak:.0f}", "" if disk is None else f"{disk_mb(folder, disk):.0f}"))
        if code or not name:  # the phases' own output is warnings (torch's registry, onnxruntime's folding)
            print(f"{label}: exit {code}\n  " + text.replace("\n", "\n  "))
        return not code

    me = [sys.executable, os.path.abspath(__file__)]
    cli = [sys.executable, "-m", "onnx_autodiff", "artifacts", os.path.join(folder, "model.onnx"), "-o",
           os.path.join(folder, "artifacts"), "--loss", "none", "--optimizer", "adamw", "--lr", str(LR),
           "--weight-decay", "0.01", "--lora", str(RANK), "--lora-targets", *(f"*{t}*" for t in TARGETS)]
    try:
        ok = (phase("build + torch.onnx.export + save", [*me, *common, "--phase=export"], "export", "model.onnx")
              and phase("onnx-autodiff artifacts --lora", cli, None, "artifacts")
              and phase(f"Trainer: {args.steps} steps, evaluate, export merged", [*me, *common, "--phase=train"],
                        "train", "merged.onnx")
              and phase("merged model on onnxruntime", [*me, *common, "--phase=merged"], "merged")
              and (args.no_torch or phase(f"PyTorch + peft: {args.steps} steps", [*me, *common, "--phase=torch"], "torch")))
        size = sizes(args)
        if "export" in results:
            e = results["export"]
            print(f"\nmodel: LlamaForCausalLM {size}, {e['params'] / 1e6:.0f} M parameters, {e['bytes'] / 1e9:.2f} GB "
                  f"float32; build {e['build_s']:.1f} s, export {e['export_s']:.1f} s, save {e['save_s']:.1f} s")
            for f in sorted(os.listdir(folder)):
                if f.startswith("model.onnx"):
                    print(f"  {f}: {os.path.getsize(os.path.join(folder, f)) / 1e6:.1f} MB")
        print("\n| phase | wall s | peak RSS MB | disk MB |\n|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
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
