"""Write a backward rule for a custom operator and check it against finite differences.

The model calls `acme::ScaledTanh(X, s) = s * tanh(X)`, defined as a model-local function so any
runtime can execute it. No shipped rule knows it; we register one and verify it numerically.
Run: python examples/custom_rule.py
"""

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from onnx_autodiff import MissingRuleError, autodiff_pass, default_registry
from onnx_autodiff.conformance import check_vjp


def scaled_tanh_model() -> onnx.ModelProto:
    body = helper.make_function(
        "acme", "ScaledTanh", ["X", "s"], ["Y"],
        [helper.make_node("Tanh", ["X"], ["t"]), helper.make_node("Mul", ["s", "t"], ["Y"])],
        [helper.make_opsetid("", 18)],
    )
    graph = helper.make_graph(
        [helper.make_node("ScaledTanh", ["x", "s"], ["y"], domain="acme")],
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    return helper.make_model(
        graph, functions=[body],
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("acme", 1)], ir_version=8,
    )


def main() -> None:
    model = scaled_tanh_model()
    try:
        autodiff_pass(of="y", wrt=["x", "s"])(ir.from_proto(model))
    except MissingRuleError as error:
        print("without a rule:", str(error)[:110], "...")

    registry = default_registry().copy()  # keep the shipped registry untouched

    @registry.register("ScaledTanh", "acme", differentiable=("X", "s"), broadcast=True, inputs=("X", "s"))
    def scaled_tanh(op, node, dY):
        """Y = s * tanh(X); dX = dY * s * (1 - tanh²X), ds = dY * tanh(X) (reduced by the engine)."""
        X, s = node.inputs
        t = op.Tanh(X)
        return {"X": op.Mul(dY, op.Mul(s, op.Sub(1.0, op.Mul(t, t)))), "s": op.Mul(dY, t)}

    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32), "s": np.array(1.7, np.float32)}
    result = check_vjp(model, feeds, ["x", "s"], registry=registry)
    print("with the rule:", result)


if __name__ == "__main__":
    main()
