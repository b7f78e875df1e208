"""The op builder's module under its earlier name: :mod:`onnx_autodiff.toolkit.builder`."""

from onnx_autodiff.toolkit.builder import CONSTANT_TYPES_BEFORE_9, FLOAT_TYPES, Differentiate, Namer, OpBuilder, may_be_float

__all__ = ["CONSTANT_TYPES_BEFORE_9", "FLOAT_TYPES", "Differentiate", "Namer", "OpBuilder", "may_be_float"]
