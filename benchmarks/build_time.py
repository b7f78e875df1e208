"""Build time of the autodiff pass against forward node count, on stacked transformer-style blocks.

Run: python benchmarks/build_time.py [--blocks 4 16 64 256 1024 1600] [--repeat 3]
Prints one row per model: forward nodes, backward nodes, seconds for the pass alone, for the
pass plus cleanup, and microseconds per forward node (flat when growth is linear).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff

D, HEADS, SEQ = 32, 4, 8


def transformer_stack(blocks: int, seed: int = 0):
    """blocks × (LayerNorm → QKV MatMul → Split → attention → projection → residual → MLP)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name))
        return name

    def node(op, inputs, outputs, **attrs):
        nodes.append(helper.make_node(op, inputs, outputs, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    weight("ones", D)
    weight("zeros", D)
    inits.append(numpy_helper.from_array(np.array([0, SEQ, HEADS, D // HEADS], np.int64), "heads"))
    inits.append(numpy_helper.from_array(np.array([0, SEQ, D], np.int64), "merged"))
    inits.append(numpy_helper.from_array(np.array([D, D, D], np.int64), "qkv_split"))
    inits.append(numpy_helper.from_array(np.array(1 / np.sqrt(D // HEADS), np.float32), "scale"))
    x = "x"
    for b in range(blocks):
        p = f"b{b}_"
        h = node("LayerNormalization", [x, "ones", "zeros"], [p + "ln1"], axis=-1)
        qkv = node("MatMul", [h, weight(p + "Wqkv", D, 3 * D)], [p + "qkv"])
        q, k, v = node("Split", [qkv, "qkv_split"], [p + "q", p + "k", p + "v"], axis=-1)
        heads = []
        for name in (q, k, v):
            r = node("Reshape", [name, "heads"], [name + "_r"])
            heads.append(node("Transpose", [r], [name + "_t"], perm=[0, 2, 1, 3]))
        kt = node("Transpose", [heads[1]], [p + "kT"], perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [heads[0], kt], [p + "qk"]), "scale"], [p + "scores"])
        attn = node("Softmax", [scores], [p + "attn"], axis=-1)
        ctx = node("Transpose", [node("MatMul", [attn, heads[2]], [p + "ctx"])], [p + "ctx_t"], perm=[0, 2, 1, 3])
        merged = node("Reshape", [ctx, "merged"], [p + "merged"])
        x = node("Add", [x, node("MatMul", [merged, weight(p + "Wo", D, D)], [p + "proj"])], [p + "res1"])
        h = node("LayerNormalization", [x, "ones", "zeros"], [p + "ln2"], axis=-1)
        up = node("Relu", [node("MatMul", [h, weight(p + "W1", D, 4 * D)], [p + "up"])], [p + "act"])
        x = node("Add", [x, node("MatMul", [up, weight(p + "W2", 4 * D, D)], [p + "down"])], [p + "res2"])
    loss = node("ReduceMean", [node("Mul", [x, x], ["sq"])], ["loss"], keepdims=0)
    graph = helper.make_graph(
        nodes, "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SEQ, D])],
        [helper.make_tensor_value_info(loss, TensorProto.FLOAT, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def measure(blocks: int, repeat: int) -> tuple[int, int, float, float]:
    proto = transformer_stack(blocks)
    forward = len(proto.graph.node)
    best_pass = best_total = float("inf")
    for _ in range(repeat):
        model = ir.from_proto(proto)
        start = time.perf_counter()
        onnx_autodiff.autodiff_pass(of="loss")(model)
        middle = time.perf_counter()
        for cleanup in onnx_autodiff.cleanup_passes():
            cleanup(model)
        end = time.perf_counter()
        best_pass = min(best_pass, middle - start)
        best_total = min(best_total, end - start)
    return forward, len(model.graph) - forward, best_pass, best_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 1600])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'blocks':>6} {'fwd nodes':>9} {'bwd nodes':>9} {'pass s':>8} {'+cleanup s':>10} {'us/fwd node':>11}")
    for blocks in args.blocks:
        forward, backward, seconds, total = measure(blocks, args.repeat if blocks < 1000 else 1)
        print(f"{blocks:>6} {forward:>9} {backward:>9} {seconds:>8.3f} {total:>10.3f} {1e6 * seconds / forward:>11.1f}")


if __name__ == "__main__":
    main()
