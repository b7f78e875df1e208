"""The ai.onnx.ml domain: the classical-ML operators that are differentiable in their input X.

Tree ensembles and Binarizer are piecewise constant in X: their gradient is zero (zeros, not a
stop, so a model mixing them with smooth parts still differentiates).
"""

from __future__ import annotations

import numpy as np

from onnx_autodiff.rules.registry import rule
from onnx_autodiff.toolkit import shapes

ML = "ai.onnx.ml"


@rule("ArrayFeatureExtractor", ML, differentiable=("X",))
def array_feature_extractor(op, node, dY):
    """Z = X[..., Y]: the selected features along the last axis; dX scatter-adds dZ back."""
    X, indices = node.inputs
    zeros = shapes.zeros(op, X)
    index = op.Expand(op.Reshape(indices, [-1]), op.Shape(dY))
    return {"X": op.ScatterElements(zeros, index, dY, axis=-1, reduction="add")}


@rule("Scaler", ML, differentiable=("X",))
def scaler(op, node, dY):
    """Y = (X - offset) * scale, per feature (last axis) or one value for all."""
    scale = np.asarray(shapes.attr(node, "scale", [1.0]), np.float32)
    return {"X": op.Mul(dY, op.const(scale, like=dY))}


@rule("LinearRegressor", ML, differentiable=("X",), when=lambda n: shapes.attr(n, "post_transform", "NONE") == "NONE")
def linear_regressor(op, node, dY):
    """Y = X @ Cᵀ + intercepts, C of shape (targets, features); dX = dY @ C."""
    targets = shapes.attr(node, "targets", 1)
    coefficients = np.asarray(shapes.attr(node, "coefficients"), np.float32).reshape(targets, -1)
    return {"X": op.MatMul(dY, op.const(coefficients, like=dY))}


def _zero(op, node, *dYs):
    return {"X": shapes.zeros(op, node.inputs[0])}


for _op_type in ("Binarizer", "TreeEnsemble", "TreeEnsembleRegressor", "TreeEnsembleClassifier"):
    rule(_op_type, ML, differentiable=("X",))(_zero)
