"""Ops whose outputs carry no gradient to any input: gradients stop cleanly at them."""

from __future__ import annotations

from onnx_autodiff.rules.registry import not_differentiable

not_differentiable(
    # shapes, sizes, index producers
    "Shape", "Size", "NonZero", "ArgMax", "ArgMin", "ConstantOfShape", "Constant", "EyeLike",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    # random numbers
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli",
    # windows and strings
    "HannWindow", "HammingWindow", "BlackmanWindow", "StringNormalizer", "StringConcat",
    "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
)
