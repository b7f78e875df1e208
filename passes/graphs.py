"""The graph walks' module under its earlier name: :mod:`onnx_autodiff.toolkit.graphs`."""

from onnx_autodiff.toolkit.graphs import all_graphs, captured_values, detach, graph_and_subgraphs, proto_graphs, subgraphs

__all__ = ["all_graphs", "captured_values", "detach", "graph_and_subgraphs", "proto_graphs", "subgraphs"]
