"""Pattern gradient rules: a subgraph an onnxscript pattern matches is differentiated as one unit,
to the gradients of finite differences; where its interior values are read elsewhere, it is not."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import make_model, rng
from onnx import helper

from onnx_autodiff import autodiff_pass, cleanup_passes, default_registry, register_gradient
from onnx_autodiff.conformance import fd_vjp

R = rng(3)


def silu(op, x):
    return op.Mul(x, op.Sigmoid(x, _outputs=["s"]))


def silu_registry(calls: list):
    registry = default_registry().copy(patterns=False)  # this SiLU rule alone

    @register_gradient(pattern=silu, differentiable=("x",), registry=registry)
    def silu_grad(op, match, dY):
        calls.append(match.name)
        s, y = match["s"], match.outputs[0]  # dy/dx = s + x·s·(1 − s) = s + y·(1 − s)
        return {"x": op.Mul(dY, op.Add(s, op.Mul(y, op.Sub(op.const(1.0, like=s), s))))}

    return registry


def silu_model(extra_output: bool = False):
    x = R.standard_normal((4, 5)).astype(np.float32)
    w = R.standard_normal((5, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("Mul", ["h", "s"], ["a"]), helper.make_node("ReduceSum", ["a"], ["loss"], keepdims=0)]
    outputs = ["loss", "s"] if extra_output else ["loss"]
    return make_model(nodes, {"x": x}, outputs, initializers={"w": w}), {"x": x}


def gradients(model, feeds, registry):
    ir_model = ir.from_proto(model)
    grad = autodiff_pass(of="loss", wrt=["x", "w"], registry=registry)
    ir.passes.PassManager([grad, *cleanup_passes()])(ir_model)
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    return proto, {name: out[grad.gradient_names[name]] for name in ("x", "w")}


def test_a_pattern_rule_differentiates_its_match_as_one_unit():
    model, feeds = silu_model()
    calls = []
    proto, grads = gradients(model, feeds, silu_registry(calls))
    assert len(calls) == 1  # one match, one call
    expected = fd_vjp(model, {**feeds, "w": onnx.numpy_helper.to_array(model.graph.initializer[0])},
                      ["x", "w"], [np.ones((), np.float32)])
    for name in ("x", "w"):
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-4, atol=1e-4)
    plain, _ = gradients(model, feeds, default_registry().copy(patterns=False))
    assert len(proto.graph.node) < len(plain.graph.node)  # the unit's backward is shorter than the chain's


def test_a_match_whose_interior_is_read_elsewhere_does_not_apply():
    model, feeds = silu_model(extra_output=True)  # the Sigmoid's output is a graph output too
    calls = []
    _, grads = gradients(model, feeds, silu_registry(calls))
    assert calls == []
    _, plain = gradients(model, feeds, default_registry().copy(patterns=False))
    for name in ("x", "w"):
        np.testing.assert_allclose(grads[name], plain[name], rtol=1e-6)


def test_pattern_rules_take_only_their_own_options():
    with pytest.raises(TypeError, match="a pattern rule takes"):
        register_gradient("Relu", pattern=silu, registry=default_registry().copy())
    with pytest.raises(TypeError, match="for an op_type, or for a pattern"):
        register_gradient(registry=default_registry().copy())
