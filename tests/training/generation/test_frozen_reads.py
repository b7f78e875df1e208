"""FrozenReadsPass: a large frozen weight multiplied transposed read in place by a Gemm; frozen
bases of another type read at each use where the target reads them so."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from training.generation.build_models import typed
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training.generation.frozen_reads import FROZEN_IN_PLACE, FrozenReadsPass
from onnx_autodiff.training.targets import CANONICAL, ONNXRUNTIME

K = 256  # a K x K float32 weight is FROZEN_IN_PLACE bytes


def linear(dtype=np.float32, read=None) -> ir.Model:
    """y = x @ Wᵀ (and y2 = x @ W), W frozen, stored as ``dtype`` and read through ``read``."""
    W = np.random.default_rng(0).standard_normal((K, K)).astype(dtype)
    nodes = [helper.make_node(read, ["W"], ["Wf"], to=TensorProto.FLOAT)] if read else []
    weight = "Wf" if read else "W"
    nodes += [helper.make_node("Transpose", [weight], ["Wt"], perm=[1, 0]),
              helper.make_node("MatMul", ["x", "Wt"], ["p"]), helper.make_node("MatMul", ["x", weight], ["p2"]),
              helper.make_node("Relu", ["p"], ["y"]), helper.make_node("Relu", ["p2"], ["y2"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", K])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", K]) for n in ("y", "y2")],
                              [numpy_helper.from_array(W, "W")])
    return typed(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8))[1]


def test_a_large_frozen_weight_is_read_transposed_in_place():
    assert K * K * 4 == FROZEN_IN_PLACE
    model = linear()
    FrozenReadsPass(ONNXRUNTIME)(model)
    ops = [n.op_type for n in model.graph]
    assert "Transpose" not in ops and "Gemm" in ops
    gemm = next(n for n in model.graph if n.op_type == "Gemm")
    assert gemm.inputs[1].name == "W" and gemm.attributes["transB"].value == 1


def test_half_precision_bases_become_floats_at_each_use_where_the_target_reads_them_so():
    runtime, canonical = linear(np.float16, "Cast"), linear(np.float16, "Cast")
    FrozenReadsPass(ONNXRUNTIME)(runtime)
    FrozenReadsPass(CANONICAL)(canonical)
    casts = [n for n in runtime.graph if n.op_type == "Cast"]
    assert len(casts) == 2 and "W" in [v.name for v in runtime.graph.inputs]  # one per reader, W overridable
    assert [n.op_type for n in canonical.graph].count("Cast") == 1 and "W" not in [v.name for v in canonical.graph.inputs]
