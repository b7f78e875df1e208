"""RematerializePass: cheap elementwise values read late are recomputed there; results unchanged."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper

from helpers import make_model, rng
from onnx_autodiff import autodiff_pass
from onnx_autodiff.passes.remat import rematerialize_pass

R = rng(11)


def run(proto, feeds):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def mlp_with_gradients():
    """x -> Gemm -> Relu -> Gemm -> sum, differentiated for both weights (the second Gemm's
    backward reads the Relu output long after the forward used it)."""
    x = R.standard_normal((4, 6)).astype(np.float32)
    w1 = R.standard_normal((6, 5)).astype(np.float32)
    w2 = R.standard_normal((5, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2"], ["o"]),
        helper.make_node("ReduceSum", ["o"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": x}, ["loss"], initializers={"w1": w1, "w2": w2})
    ir_model = ir.from_proto(model)
    autodiff_pass(of="loss", wrt=["w1", "w2"])(ir_model)
    return ir_model, {"x": x}


def test_relu_output_recomputed_before_its_late_reads():
    model, feeds = mlp_with_gradients()
    before = ir.to_proto(model)
    result = rematerialize_pass(min_gap=1)(model)
    after = ir.to_proto(result.model)
    onnx.checker.check_model(after, full_check=True)
    assert result.modified
    copies = [n for n in after.graph.node if n.name.startswith("remat")]
    assert [n.op_type for n in copies] == ["Relu"] and list(copies[0].input) == ["h"]
    order = [n.name for n in after.graph.node]
    late_readers = [n for n in after.graph.node if copies[0].output[0] in n.input]
    assert late_readers and all(order.index(n.name) > order.index(copies[0].name) for n in late_readers)
    # the original Relu output keeps only its forward reader
    assert [n.op_type for n in after.graph.node if "r" in n.input] == ["Gemm"]
    for got, want in zip(run(after, feeds), run(before, feeds)):
        np.testing.assert_array_equal(got, want)


def test_nothing_to_do_without_a_gap():
    model, _ = mlp_with_gradients()
    nodes = len(model.graph)
    result = rematerialize_pass(min_gap=10_000)(model)
    assert not result.modified and len(result.model.graph) == nodes
