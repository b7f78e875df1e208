"""Writes what the LLM page (llm.html) fine-tunes: LoRA artifacts of a Llama-shaped decoder on an int4 base.

    python examples/web/prepare_llm.py [--size {full,small}] [--out examples/web/build]

Builds ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` with random weights (seed 0, nothing
downloaded) over a byte-level vocabulary (256 tokens: a text's UTF-8 bytes; byte 2 starts a
sequence, byte 0 ends and pads it). ``--size full``: hidden 768, MLP 3072, 12 heads, 4 KV heads,
12 layers, about 104 M parameters; ``--size small``: hidden 64, MLP 128, 2 layers (seconds). Its
loss is the next-token cross-entropy of ``(ids, labels)`` (as benchmarks/llama_lora.py) and its
second output the logits, which the page reads from the eval model to generate. The artifacts
train LoRA adapters (rank 8) on every projection and the head, the frozen base stored in int4
(blocks of 32, symmetric) at build time, so that the base is 8x smaller than in float32:

- OUT/llm-SIZE/artifacts/: for onnxruntime-web's WebAssembly provider;
- OUT/llm-SIZE/artifacts-webgpu/: the same lowered for its WebGPU provider (target "webgpu");
- OUT/llm-SIZE/llm.json: the sentence the page trains the model to reproduce, the tokens, the
  sequence length and the model's shape.

The exported model has fixed shapes [1, SEQ]: a causal model's logits at position t depend on the
ids up to t only, so greedy generation fills one padded sequence, one full forward per token. The
same size gives the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import numpy as np
import onnx

BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build")
SENTENCE = "onnx-autodiff fine-tunes a Llama in the browser."
BOS, EOS = 2, 0  # byte 0 also pads: the model learns to end the sentence there
SIZES = {
    "full": {"hidden": 768, "intermediate": 3072, "heads": 12, "kv_heads": 4, "layers": 12},
    "small": {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "layers": 2},
}
VOCAB = 256
RANK = 8
LEARNING_RATE = {"full": 2e-3, "small": 1e-2}
# every projection of attention and MLP, and the head: an adapter on q and v alone is too little
# for a random base to learn a sentence in a few steps
TARGETS = ("*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*", "*gate_proj*", "*up_proj*", "*down_proj*", "*lm_head*")
# onnxruntime-web 1.30 runs the MatMulNBits contrib kernel on WebAssembly and on WebGPU, so the
# forward never holds a float copy of a weight; the DequantizeLinear form (int4, opset 21) also
# steps on WebAssembly
QUANTIZE_FORMAT = "matmulnbits"


def tokens(text: str = SENTENCE) -> np.ndarray:
    """[BOS, UTF-8 bytes of text..., EOS, padding] as int64, of length ``sequence_length(text)``."""
    raw = list(text.encode("utf-8"))
    ids = np.full(sequence_length(text), EOS, np.int64)
    ids[0], ids[1:1 + len(raw)] = BOS, raw
    return ids


def sequence_length(text: str = SENTENCE) -> int:
    """BOS, the text and EOS, rounded up to a multiple of 8."""
    return -(-(len(text.encode("utf-8")) + 2) // 8) * 8


def build_module(size: dict):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="eager")
    lm = transformers.LlamaForCausalLM(config).eval()

    class LossAndLogits(torch.nn.Module):
        """The next-token cross-entropy of (ids, labels) and the logits."""

        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            logits = self.lm(input_ids=ids).logits
            shifted = logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1))
            return loss, logits

    return LossAndLogits(lm)


def export(size: dict, path: str) -> int:
    """Exports the model to ``path`` (external data); returns its parameter count."""
    import torch

    module = build_module(size)
    ids = torch.from_numpy(tokens()[None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # optimize=False keeps each parameter an initializer under its module name, which the
        # LoRA targets match
        program = torch.onnx.export(module, (ids, ids), dynamo=True, optimize=False, verbose=False,
                                    input_names=["ids", "labels"], output_names=["loss", "logits"])
    program.save(path, external_data=True)
    return sum(p.numel() for p in module.parameters())


def built(size: str, out: str = BUILD) -> bool:
    """Whether OUT/llm-SIZE holds what main writes for ``size`` with the default format (its llm.json
    last: written once the artifacts are)."""
    try:
        with open(os.path.join(out, f"llm-{size}", "llm.json")) as stream:
            info = json.load(stream)
    except (OSError, ValueError):
        return False
    return info.get("size") == size and info.get("quantize") == f"int4 {QUANTIZE_FORMAT}" and info.get("sentence") == SENTENCE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="small", help="default: %(default)s")
    parser.add_argument("--out", default=BUILD, help="the directory to write into (default: %(default)s)")
    parser.add_argument("--quantize-format", choices=["matmulnbits", "dequantizelinear"], default=QUANTIZE_FORMAT,
                        help="how the int4 base is read (default %(default)s)")
    args = parser.parse_args(argv)
    from onnx_autodiff.files import write_atomically
    from onnx_autodiff.training.lora import LoraConfig
    from onnx_autodiff.training import generate_artifacts

    size = SIZES[args.size]
    folder = os.path.join(args.out, f"llm-{args.size}")
    os.makedirs(folder, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onnx-autodiff-llm-") as scratch:
        model = os.path.join(scratch, "model.onnx")
        params = export(size, model)
        exported = time.perf_counter() - start
        # read in whole (under 0.5 GB at the full size), so that the artifacts hold their tensors
        # rather than reading them from this temporary model's data file
        model = onnx.load(model)
        lora = LoraConfig(rank=RANK, targets=TARGETS, quantize_base="int4", quantize_format=args.quantize_format)
        for directory, target in (("artifacts", "onnxruntime"), ("artifacts-webgpu", "webgpu")):
            artifacts = generate_artifacts(model, loss=None, output="loss", optimizer="adamw", lora=lora,
                                           optimizer_options={"lr": LEARNING_RATE[args.size], "weight_decay": 0.0},
                                           target=target)
            artifacts.save(os.path.join(folder, directory), checkpoint_format="safetensors")
    ids = tokens()
    info = {"sentence": SENTENCE, "ids": ids.tolist(), "bos": BOS, "eos": EOS, "seq": len(ids), "vocab": VOCAB,
            "size": args.size, **size, "parameters": params, "rank": RANK, "quantize": f"int4 {args.quantize_format}",
            "lr": LEARNING_RATE[args.size]}
    write_atomically(os.path.join(folder, "llm.json"), json.dumps(info, indent=1).encode())
    train_bytes = sum(os.path.getsize(os.path.join(folder, "artifacts", f)) for f in os.listdir(os.path.join(folder, "artifacts")))
    print(f"wrote {folder}: Llama {params / 1e6:.1f} M parameters, int4 {args.quantize_format} base, "
          f"artifacts {train_bytes / 1e6:.1f} MB; export {exported:.1f} s, total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
