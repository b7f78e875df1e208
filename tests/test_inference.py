"""Shape inference helpers (toolkit/inference.py): the inferred types taken onto a model converted
from the proto as given, against the conversion of the inferred proto."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.modelfile import from_proto
from onnx_autodiff.toolkit import graph_and_subgraphs
from onnx_autodiff.toolkit.inference import onnx_inferred, take_inferred_types


def branching_model():
    """X[N, 4] · W → If(sum > 0: Relu, else Neg) → SplitToSequence into 3 and 1 columns → the
    first element; a Cast inside the then branch, value_info of its own in the else branch."""
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    sizes = numpy_helper.from_array(np.array([3, 1], np.int64), "sizes")
    then_branch = helper.make_graph(
        [helper.make_node("Relu", ["Y"], ["r"]), helper.make_node("Cast", ["r"], ["t"], to=TensorProto.FLOAT)],
        "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["Y"], ["n"]), helper.make_node("Identity", ["n"], ["e"])],
        "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
        value_info=[helper.make_tensor_value_info("n", TensorProto.FLOAT, ["N", 4])])
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["Y"]),
        helper.make_node("ReduceSum", ["Y"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["Z"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("SplitToSequence", ["Z", "sizes"], ["parts"], axis=1),
        helper.make_node("SequenceAt", ["parts", "first"], ["out"]),
    ]
    inits = [weight, sizes, numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array(0, np.int64), "first")]
    graph = helper.make_graph(nodes, "branching", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def types_by_name(model):
    found = {}
    for graph in graph_and_subgraphs(model.graph):
        for value in (*graph.inputs, *graph.initializers.values(), *(out for node in graph for out in node.outputs),
                      *graph.outputs):
            found.setdefault(value.name, (value.type, value.shape))
    return found


def test_inferred_types_taken_as_converting_the_inferred_proto_gives_them():
    proto = branching_model()
    inferred = onnx_inferred(proto)
    assert inferred is not None and inferred.graph.value_info
    model = from_proto(proto)
    take_inferred_types(model, inferred)
    expected = types_by_name(from_proto(inferred))
    assert types_by_name(model) == expected
    assert expected["Y"][1] == ["N", 4] and expected["parts"][0] is not None  # inferred, not declared
    assert types_by_name(from_proto(proto))["Y"] == (None, None)


def test_inference_of_a_few_nodes_names_no_dimension():
    """The dimensions onnx's inference of nodes apart from their model makes up ("unk__0") stay
    unnamed: that inference knows no other name of the model, its "unk__0" may be another extent
    than the model's own, and onnxruntime takes equal names for equal sizes (an LSTM's backward
    failed with "Shape mismatch attempting to re-use buffer")."""
    import onnx_ir as ir

    from onnx_autodiff.toolkit.inference import infer_node_shapes

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 6]))
    sizes = ir.Value(name="sizes", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([2]))
    node = ir.Node("", "Reshape", [x, sizes], num_outputs=1)
    node.outputs[0].name = "y"
    infer_node_shapes([node], [x, sizes], 18)
    assert node.outputs[0].shape is not None and len(node.outputs[0].shape) == 2
    assert all(d.value is None for d in node.outputs[0].shape.dims)
