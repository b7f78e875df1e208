"""The finite-difference oracle against PyTorch float64 autograd (skipped without torch)."""

import numpy as np
import pytest
from onnx import helper

from helpers import make_model
from onnx_autodiff.conformance import fd_vjp

torch = pytest.importorskip("torch")
F = torch.nn.functional
R = np.random.default_rng(21)


def case_tanh():
    x = R.standard_normal((3, 4))
    return [helper.make_node("Tanh", ["x"], ["y"])], {"x": x}, lambda t: torch.tanh(t["x"])


def case_softplus():  # onnxruntime has no float64 Softplus: the reference evaluator runs it
    x = R.standard_normal((3, 4))
    return [helper.make_node("Softplus", ["x"], ["y"])], {"x": x}, lambda t: F.softplus(t["x"])


def case_matmul():
    a, b = R.standard_normal((2, 3, 4)), R.standard_normal((4, 5))
    return [helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": a, "b": b}, lambda t: t["a"] @ t["b"]


def case_softmax():
    x = R.standard_normal((3, 5)) * 3
    return [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, lambda t: torch.softmax(t["x"], -1)


def case_layer_norm():
    x, s, b = R.standard_normal((4, 6)), R.standard_normal(6), R.standard_normal(6)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)
    return [node], {"x": x, "s": s, "b": b}, lambda t: F.layer_norm(t["x"], (6,), t["s"], t["b"], 1e-5)


def case_conv():  # no float64 Conv in onnxruntime either
    x, w = R.standard_normal((1, 2, 5, 5)), R.standard_normal((3, 2, 3, 3))
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    return [node], {"x": x, "w": w}, lambda t: F.conv2d(t["x"], t["w"], padding=1)


def case_gelu():
    x = R.standard_normal((3, 4))
    return [helper.make_node("Gelu", ["x"], ["y"])], {"x": x}, lambda t: F.gelu(t["x"])


CASES = [case_tanh, case_softplus, case_matmul, case_softmax, case_layer_norm, case_conv, case_gelu]


def test_oracle_matches_torch_float64_autograd():
    errors = []
    for make in CASES:
        nodes, inputs, forward = make()
        opset = 20 if make is case_gelu else 18
        feeds32 = {k: v.astype(np.float32) for k, v in inputs.items()}
        model = make_model(nodes, feeds32, ["y"], opset=opset)
        tensors = {k: torch.tensor(v.astype(np.float32), dtype=torch.float64, requires_grad=True) for k, v in feeds32.items()}
        y = forward(tensors)
        r = np.random.default_rng(0).standard_normal(tuple(y.shape))
        (y * torch.tensor(r)).sum().backward()
        fd = fd_vjp(model, feeds32, list(inputs), [r])
        assert not fd.weak, f"{make.__name__}: the oracle fell back to float32"
        for name, tensor in tensors.items():
            expected = tensor.grad.numpy()
            scale = max(1.0, float(np.abs(expected).max()))
            errors.extend((np.abs(fd[name] - expected) / scale).ravel())
    errors = np.asarray(errors)
    assert np.median(errors) < 1e-8, np.median(errors)
    assert errors.max() < 1e-6, errors.max()
