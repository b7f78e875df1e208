"""Ops whose outputs carry no gradient to any input: gradients stop cleanly at them."""

from __future__ import annotations

from onnx_autodiff.rules.registry import not_differentiable

not_differentiable(
    # shapes, sizes, index producers
    "Shape", "Size", "NonZero", "ArgMax", "ArgMin", "ConstantOfShape", "Constant", "EyeLike",
    "NonMaxSuppression",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitCast",
    # random numbers
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli",
    # quantisation: integer outputs or inputs
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "ConvInteger", "MatMulInteger",
    "QLinearConv", "QLinearMatMul",
    # windows, strings, images
    "HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix", "StringNormalizer",
    "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer", "ImageDecoder",
    # optionals
    "OptionalHasElement",
)

not_differentiable(
    "CastMap", "CategoryMapper", "DictVectorizer", "LabelEncoder", "OneHotEncoder", "ZipMap",
    domain="ai.onnx.ml",
)

not_differentiable("Adagrad", "Adam", "Momentum", domain="ai.onnx.preview.training")
