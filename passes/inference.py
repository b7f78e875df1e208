"""The shape inference module under its earlier name: :mod:`onnx_autodiff.toolkit.inference`."""

from onnx_autodiff.toolkit.inference import (
    complete_shapes,
    forget_element_names,
    frozen_shape,
    infer_node_shapes,
    infer_node_types,
    infer_shapes,
    inferred_types,
    onnx_inferred,
    static_by_node,
)

__all__ = [
    "complete_shapes", "forget_element_names", "frozen_shape", "infer_node_shapes", "infer_node_types",
    "infer_shapes", "inferred_types", "onnx_inferred", "static_by_node",
]
