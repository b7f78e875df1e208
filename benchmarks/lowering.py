"""The onnxruntime lowering, rule by rule: one op's backward graph canonical and lowered.

    python benchmarks/lowering.py [--runs 50] [--threads 2]

For each case it differentiates one forward op, cleans the graph up with ``target=None``
(canonical) and with ``target="onnxruntime"`` (lowered), and prints both node counts and
onnxruntime milliseconds (median of ``--runs``, the two sessions taking turns) and their ratio. A
ratio at or above 1 says the rule no longer pays off on this onnxruntime (see benchmarks/README.md,
"Why the onnxruntime lowering").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from onnx_autodiff import autodiff_pass, cleanup_passes


def _model(nodes, inputs: dict[str, tuple[int, ...]], output: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "case", [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


IMAGE = (64, 16, 28, 28)  # the CNN benchmark's first activation
CASES = {
    "linear layer [8,64,256]·[256,1024] (Gemm)": (
        [helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": (8, 64, 256), "w": (256, 1024)}, ["x", "w"]),
    "matrices [512,256]·[256,1024] (Gemm)": (
        [helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": (512, 256), "w": (256, 1024)}, ["x", "w"]),
    "bias [8,64,1024] + [1024] (ones)": (
        [helper.make_node("Add", ["x", "b"], ["y"])], {"x": (8, 64, 1024), "b": (1024,)}, ["b"]),
    "LeakyRelu 64×16×28×28 (Max)": (
        [helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.01)], {"x": IMAGE}, ["x"]),
    "Relu 64×16×28×28 (mask)": ([helper.make_node("Relu", ["x"], ["y"])], {"x": IMAGE}, ["x"]),
}


def backward(model: onnx.ModelProto, wrt: list[str], target: str | None) -> tuple[onnx.ModelProto, str]:
    ir_model = ir.from_proto(model)
    grad = autodiff_pass(of="y", wrt=wrt)
    ir.passes.PassManager([grad, *cleanup_passes(target=target)])(ir_model)
    return ir.to_proto(ir_model), grad.seed_name


def timed(sessions: list, feeds: list[dict], runs: int) -> list[float]:
    """Median milliseconds per session, the sessions taking turns call by call."""
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(5):  # warm-up
        for session, feed in zip(sessions, feeds):
            session.run(None, feed)
    for _ in range(runs):
        for k, (session, feed) in enumerate(zip(sessions, feeds)):
            start = time.perf_counter()
            session.run(None, feed)
            times[k].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, median of {args.runs} runs\n")
    print("| backward of | canonical nodes | lowered nodes | canonical ms | lowered ms | lowered / canonical |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (nodes, inputs, wrt) in CASES.items():
        forward = _model(nodes, inputs, "y")
        data = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
        sessions, feeds, counts = [], [], []
        for target in (None, "onnxruntime"):
            proto, seed = backward(forward, wrt, target)
            session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
            shape = [d.dim_value for d in proto.graph.input[-1].type.tensor_type.shape.dim]
            sessions.append(session)
            feeds.append({**data, seed: rng.standard_normal(shape).astype(np.float32)})
            counts.append(len(proto.graph.node) - len(forward.graph.node))
        canonical, lowered = timed(sessions, feeds, args.runs)
        print(f"| {name} | {counts[0]} | {counts[1]} | {canonical:.2f} | {lowered:.2f} | {lowered / canonical:.2f} |")


if __name__ == "__main__":
    main()
