"""The IR toolkit the engine, the rules and the cleanup share: op builder, shape helpers, graph walks, shape inference.

Every layer reads a constant, a single number or a node's axes, and makes zeros, with the one
helper each here: :func:`constant`, :func:`number`, :func:`axes`, :func:`zeros`.
"""

from __future__ import annotations

from onnx_autodiff.toolkit import shapes
from onnx_autodiff.toolkit.builder import FLOAT_TYPES, Namer, OpBuilder, may_be_float
from onnx_autodiff.toolkit.graphs import (
    all_graphs, captured_values, detach, detach_whole, graph_and_subgraphs, initializers_to_constants, proto_graphs, subgraphs,
)
from onnx_autodiff.toolkit.inference import infer_node_shapes, infer_shapes
from onnx_autodiff.toolkit.shapes import axes, constant, number, unbroadcast, zeros

__all__ = [
    "FLOAT_TYPES",
    "Namer",
    "OpBuilder",
    "all_graphs",
    "axes",
    "captured_values",
    "constant",
    "detach",
    "detach_whole",
    "graph_and_subgraphs",
    "initializers_to_constants",
    "infer_node_shapes",
    "infer_shapes",
    "may_be_float",
    "number",
    "proto_graphs",
    "shapes",
    "subgraphs",
    "unbroadcast",
    "zeros",
]
