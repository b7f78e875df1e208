"""Widening a model's floating-point computation: float16/bfloat16/float32 to float64 for the oracle,
or float16/bfloat16 to float32 for its fallback. Graphs, subgraphs and functions alike."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT_ELEM_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE})
"""Every floating-point element type."""

_HALF_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype", "output_datatype")

def _widen_tensor(tensor: TensorProto, to: int) -> TensorProto:
    if tensor.data_type not in _widened(to):
        return tensor
    array = numpy_helper.to_array(tensor).astype(helper.tensor_dtype_to_np_dtype(to))
    return numpy_helper.from_array(array, tensor.name)


def _widened(to: int) -> frozenset[int]:
    """The element types that widening to ``to`` (DOUBLE or FLOAT) replaces."""
    return FLOAT_ELEM_TYPES - {TensorProto.DOUBLE} if to == TensorProto.DOUBLE else _HALF_TYPES


def _widen_type(type_proto: onnx.TypeProto, to: int) -> None:
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        if type_proto.tensor_type.elem_type in _widened(to):
            type_proto.tensor_type.elem_type = to
    elif which == "sequence_type":
        _widen_type(type_proto.sequence_type.elem_type, to)
    elif which == "optional_type":
        _widen_type(type_proto.optional_type.elem_type, to)


def _widen_nodes(nodes, keep: frozenset[str], to: int) -> None:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                attribute.t.CopyFrom(_widen_tensor(attribute.t, to))
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _widen_graph(attribute.g, keep, to)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _widen_graph(sub, keep, to)
            elif attribute.name in _DTYPE_ATTRIBUTES and attribute.i in _widened(to):
                attribute.i = to
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and to == TensorProto.DOUBLE:
            for attribute in node.attribute:
                if attribute.name in ("value_float", "value_floats"):
                    values = attribute.f if attribute.name == "value_float" else list(attribute.floats)
                    widened = helper.make_attribute(
                        "value", numpy_helper.from_array(np.asarray(values, np.float64))
                    )
                    attribute.CopyFrom(widened)


def _widen_graph(graph: onnx.GraphProto, keep: frozenset[str], to: int) -> None:
    for index, tensor in enumerate(graph.initializer):
        if tensor.name not in keep:
            graph.initializer[index].CopyFrom(_widen_tensor(tensor, to))
    for value in (*graph.input, *graph.output):
        if value.name not in keep:
            _widen_type(value.type, to)
    del graph.value_info[:]
    _widen_nodes(graph.node, keep, to)


def to_float64(model: onnx.ModelProto, keep: Sequence[str] = (), to: int = TensorProto.DOUBLE) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 (inputs named in ``keep`` stay as they are).

    Widens float16/bfloat16/float32 graph inputs, outputs, initializers, tensor attributes
    (``Constant``, ``ConstantOfShape``), ``value_float(s)``, dtype attributes (``Cast.to``,
    ``dtype``, ...), subgraphs and model-local functions; drops ``value_info`` so that runtimes
    re-derive intermediate types. ``to=TensorProto.FLOAT`` widens float16/bfloat16 to float32 only.
    """
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    _widen_graph(widened.graph, frozenset(keep), to)
    for function in widened.functions:
        _widen_nodes(function.node, frozenset(), to)
    return widened

