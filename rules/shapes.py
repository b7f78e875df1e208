"""The rule helpers' module under its earlier name: :mod:`onnx_autodiff.toolkit.shapes` (and its node-level shape inference)."""

from onnx_autodiff.toolkit.inference import infer_node_shapes
from onnx_autodiff.toolkit.shapes import (
    Dim,
    accumulate,
    alias,
    attr,
    cast_like,
    constant_input,
    dims,
    extent,
    fill_like,
    inverse_perm,
    known_rank,
    literal,
    normalize_axis,
    ones_like,
    rank,
    require_opset,
    shape_from,
    static_shape,
    swap_last2,
    typed_like,
    unbroadcast,
    zeros_like,
)

__all__ = [
    "Dim", "accumulate", "alias", "attr", "cast_like", "constant_input", "dims", "extent", "fill_like",
    "infer_node_shapes", "inverse_perm", "known_rank", "literal", "normalize_axis", "ones_like", "rank", "require_opset",
    "shape_from", "static_shape", "swap_last2", "typed_like", "unbroadcast", "zeros_like",
]
