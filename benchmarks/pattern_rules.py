"""Pattern gradient rules on an unoptimised export: backward nodes and step time with and without.

    python benchmarks/pattern_rules.py [--layers 4] [--hidden 256] [--runs 20]

Builds a Llama-shaped decoder (``--model gpt2``: GPT-2; ``gpt2-erf``: GPT-2 with the erf GELU,
exported at opset 18, where Gelu is no op yet) from a ``transformers`` config (random weights, no
download), exports its next-token loss with ``torch.onnx.export(dynamo=True, optimize=False)``
(RMSNorm and SiLU, or GPT-2's tanh or erf GELU, spelled out op by op), differentiates it with respect to every parameter with the default
registry and with the same registry less its pattern rules, and prints the node counts, the
build seconds, the forward+backward milliseconds on onnxruntime (2 threads, the two graphs taking
turns) and the largest relative difference between their gradients.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_lora

from onnx_autodiff import autodiff_pass, cleanup_passes, default_registry


def gpt2_module(size: dict, seq: int, activation: str = "gelu_new"):
    """transformers' GPT-2 (random weights) with its next-token loss; its MLP's GELU is ``activation``
    (gelu_new: the tanh form; gelu: torch's erf form)."""
    import torch
    import transformers

    config = transformers.GPT2Config(n_layer=size["layers"], n_embd=size["hidden"], n_head=size["heads"],
                                     vocab_size=size["vocab"], n_positions=seq, activation_function=activation,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    return llama_lora.next_token_loss(transformers.GPT2LMHeadModel(config)).eval()


def differentiate(model: onnx.ModelProto, registry):
    ir_model = ir.from_proto(model)
    grad = autodiff_pass(of=model.graph.output[0].name, registry=registry)
    start = time.perf_counter()
    ir.passes.PassManager([grad, *cleanup_passes()])(ir_model)
    return ir.to_proto(ir_model), grad.gradient_names, time.perf_counter() - start


def main(argv=None) -> int:
    import onnxruntime as ort
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--model", choices=["llama", "gpt2", "gpt2-erf"], default="llama",
                        help="llama: RMSNorm and SiLU spelled out; gpt2: its tanh GELU (gelu_new) spelled out; "
                             "gpt2-erf: GPT-2 with the erf GELU spelled out")
    args = parser.parse_args(argv)
    size = {"vocab": 2048, "hidden": args.hidden, "intermediate": args.hidden * 11 // 4, "layers": args.layers,
            "heads": 8, "kv_heads": 4}
    if args.model == "llama":
        module = llama_lora.build_module(size)
    else:
        module = gpt2_module(size, args.seq, "gelu" if args.model == "gpt2-erf" else "gelu_new")
    ids = torch.randint(0, size["vocab"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opset = 18 if args.model == "gpt2-erf" else None  # the default opset's Gelu op would not spell it out
        forward = torch.onnx.export(module, (ids, ids), dynamo=True, optimize=False, opset_version=opset,
                                    verbose=False).model_proto
    plain = default_registry().copy(patterns=False)  # the same rules, each op differentiated alone
    feeds = {i.name: ids.numpy() for i in forward.graph.input}
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    rows = {}
    for name, registry in (("op by op", plain), ("with pattern rules", default_registry())):
        proto, names, build = differentiate(forward, registry)
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        outputs = [o.name for o in session.get_outputs()]
        grads = dict(zip(outputs, session.run(None, feeds)))
        rows[name] = {"nodes": len(proto.graph.node), "build": build, "session": session, "names": names, "grads": grads}
    times = {name: [] for name in rows}
    for _ in range(args.runs):
        for name, row in rows.items():
            start = time.perf_counter()
            row["session"].run(None, feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
    a, b = rows["op by op"], rows["with pattern rules"]
    worst = max(float(np.abs(b["grads"][b["names"][k]] - a["grads"][a["names"][k]]).max()
                      / (np.abs(a["grads"][a["names"][k]]).max() + 1e-30)) for k in a["names"])
    print(f"{args.model} {size}, batch {args.batch}, sequence {args.seq}: torch.onnx.export(optimize=False) "
          f"{len(forward.graph.node)} forward nodes\n")
    print("| rules | fwd+bwd nodes | build s | ort fwd+bwd ms (median) |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['nodes']} | {row['build']:.2f} | {statistics.median(times[name]):.1f} |")
    print(f"\ngradients of {len(a['names'])} parameters: largest relative difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
