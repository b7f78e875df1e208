"""BatchNormalization folded into the convolution before it: the same outputs, the weight's name kept."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.modelfile import from_proto, to_proto
from onnx_autodiff.training.generation.fold_batchnorm import FoldBatchNormPass


def conv_norm(op_type: str, bias: bool, reused_output: bool = False):
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.5, (4, 3, 3, 3) if op_type == "Conv" else (3, 4, 3, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w")] + ([numpy_helper.from_array(rng.normal(0, 1, 4).astype(np.float32), "b")] if bias else [])
    inits += [numpy_helper.from_array(a.astype(np.float32), n) for n, a in [
        ("scale", rng.uniform(0.5, 2, 4)), ("shift", rng.normal(0, 1, 4)), ("mean", rng.normal(0, 1, 4)),
        ("var", rng.uniform(0.2, 2, 4))]]
    nodes = [helper.make_node(op_type, ["x", "w", *(["b"] if bias else [])], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["y"], epsilon=1e-3, name="bn")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if reused_output:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 5, 5])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(proto, x):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("op_type, bias", [("Conv", True), ("Conv", False), ("ConvTranspose", True)])
def test_folded_model_computes_the_same(op_type, bias):
    proto = conv_norm(op_type, bias)
    model = from_proto(proto)
    folding = FoldBatchNormPass()
    assert folding(model).modified and folding.folded == ["bn"]
    folded = to_proto(model)
    assert [n.op_type for n in folded.graph.node] == [op_type]
    assert folded.graph.node[0].input[1] == "w" and folded.graph.output[0].name == "y"
    assert {t.name for t in folded.graph.initializer} == {"w", "b" if bias else "conv.bias"}
    x = np.random.default_rng(1).normal(size=(2, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(run(folded, x)[0], run(proto, x)[0], rtol=1e-5, atol=1e-5)


def test_a_conv_output_read_elsewhere_is_not_folded():
    model = from_proto(conv_norm("Conv", True, reused_output=True))
    assert not FoldBatchNormPass()(model).modified
