"""modelfile.to_proto: the ModelProto of an onnx-ir model, the one ``ir.to_proto`` makes (written in
protobuf's wire format where it can, by onnx-ir otherwise)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.demo import classifier_model
from onnx_autodiff.modelfile import _GraphWriter, _Unwritten, to_proto
from onnx_autodiff.training import generate_artifacts


def same_as_onnx_ir(model: ir.Model) -> None:
    assert to_proto(model).SerializeToString(deterministic=True) == ir.to_proto(model).SerializeToString(deterministic=True)


def varied_model() -> onnx.ModelProto:
    """Typed, untyped and symbolic values, an If with subgraphs, attributes of every kind,
    metadata, doc strings, omitted inputs and outputs, names outside ASCII."""
    then_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["then_out"])], "then", [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, ["N", 3])])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["else_out"])], "else", [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, ["N", 3])])
    clip = helper.make_node("Clip", ["x", "", "high"], ["clipped"], name="clip", doc_string="the upper bound only")
    clip.metadata_props.add(key="origin", value="ünïcode")
    clip.metadata_props.add(key="a", value="")
    nodes = [
        clip,
        helper.make_node("If", ["cond"], ["chosen"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Gemm", ["chosen", "W"], ["y"], alpha=0.5, transB=1, name="gemm"),
        helper.make_node("Dropout", ["y", "ratio"], ["dropped", ""]),  # an unnamed trailing output
        helper.make_node("Transpose", ["dropped"], ["t"], perm=[1, 0]),
        helper.make_node("Constant", [], ["table"], value=numpy_helper.from_array(np.arange(6, dtype=np.int64), "table")),
        helper.make_node("Constant", [], ["scales"], value_floats=[1.0, -0.0, 2.5]),
        helper.make_node("Constant", [], ["label"], value_strings=["a", "β"]),
        helper.make_node("Constant", [], ["one"], value_string="one"),
        helper.make_node("Split", ["t"], ["s0", "s1"], axis=0, num_outputs=2),
        helper.make_node("Concat", ["s1", "s0"], ["z"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "varied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("ratio", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, "N"]),
         helper.make_tensor_value_info("table", TensorProto.INT64, [6]),
         helper.make_tensor_value_info("scales", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.ones((3, 3), np.float32), "W"),
         numpy_helper.from_array(np.array(1.0, np.float32), "high")],
        doc_string="a graph of many kinds of things",
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
                    helper.make_tensor_value_info("chosen", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)],
                              producer_name="tests", doc_string="varied")
    model.model_version = 3
    model.metadata_props.add(key="k", value="v")
    return model


def test_written_as_onnx_ir_writes_it():
    model = ir.from_proto(varied_model())
    _GraphWriter().graph(model.graph)  # (written here, not left to onnx-ir)
    same_as_onnx_ir(model)


def test_left_to_onnx_ir_where_it_holds_more():
    model = varied_model()
    function = helper.make_function("com.example", "Double", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                                    [helper.make_opsetid("", 18)])
    model.functions.append(function)
    same_as_onnx_ir(ir.from_proto(model))
    annotated = varied_model()
    entry = annotated.graph.quantization_annotation.add(tensor_name="y")
    entry.quant_parameter_tensor_names.add(key="SCALE_TENSOR", value="high")
    with pytest.raises(_Unwritten):
        _GraphWriter().graph(ir.from_proto(annotated).graph)
    same_as_onnx_ir(ir.from_proto(annotated))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_artifacts_models_written_as_onnx_ir_writes_them(optimizer):
    artifacts = generate_artifacts(classifier_model(loss=False), loss="cross_entropy", optimizer=optimizer,
                                   max_grad_norm=1.0, gradient_accumulation=True)
    for proto in (artifacts.train_model, artifacts.eval_model, artifacts.accumulate_model, artifacts.apply_model):
        same_as_onnx_ir(ir.from_proto(proto))


def _value(model: ir.Model, where: str) -> ir.Value:
    graph = model.graph
    return {"node output": graph.node(0).outputs[0], "input": graph.inputs[2], "initializer": graph.initializers["W"],
            "output": graph.outputs[0]}[where]


@pytest.mark.parametrize("where", ["node output", "input", "initializer", "output"])
@pytest.mark.parametrize("extra", ["doc_string", "metadata_props"])
def test_values_doc_string_and_metadata_written_as_onnx_ir_writes_them(where, extra):
    """(ir.to_proto writes a value_info of a node's output that has either, typed or not)"""
    model = ir.from_proto(varied_model())
    value = _value(model, where)
    if where == "node output":
        value.type, value.shape = None, None
    if extra == "doc_string":
        value.doc_string = "described"
    else:
        value.metadata_props["origin"] = "here"
    same_as_onnx_ir(model)


@pytest.mark.parametrize("where", ["node output", "input", "initializer", "output", "unnamed trailing output"])
def test_quantization_annotations_left_to_onnx_ir_on_every_kind_of_value(where):
    model = ir.from_proto(varied_model())
    if where == "unnamed trailing output":
        value = next(n for n in model.graph if n.op_type == "Dropout").outputs[1]
    else:
        value = _value(model, where)
        value.type, value.shape = (None, None) if where == "node output" else (value.type, value.shape)
    value.meta["quant_parameter_tensor_names"] = {"SCALE_TENSOR": "high"}
    with pytest.raises(_Unwritten):
        _GraphWriter().graph(model.graph)
    same_as_onnx_ir(model)
