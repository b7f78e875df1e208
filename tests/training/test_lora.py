"""LoraPass: which weights get adapters, the model unchanged at B = 0, merging, adapter gradients."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_gradients, assert_valid_model
from onnx_autodiff import UnknownValueError, UnsupportedModelError
from onnx_autodiff.training.lora import LoraConfig, LoraPass, merged_weights

N = 3


def model(opset: int = 18) -> onnx.ModelProto:
    """Gemm(transB) -> Tanh -> MatMul(Transpose(W2)) -> W3 read twice (tied) -> + Gather(E, ids);
    ``p1`` (an adapted product) is also a graph output."""
    rng = np.random.default_rng(0)
    inits = {
        "W1": rng.standard_normal((6, 4)), "b1": rng.standard_normal(6), "W2": rng.standard_normal((6, 6)),
        "W3": rng.standard_normal((6, 5)), "E": rng.standard_normal((7, 5)),
    }
    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("Transpose", ["W2"], ["W2t"], perm=[1, 0]),
        helper.make_node("MatMul", ["a", "W2t"], ["m"]),
        helper.make_node("MatMul", ["m", "W3"], ["p1"]),
        helper.make_node("MatMul", ["a", "W3"], ["p2"]),
        helper.make_node("Add", ["p1", "p2"], ["s"]),
        helper.make_node("Gather", ["E", "ids"], ["emb"]),
        helper.make_node("Add", ["s", "emb"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "lora",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4]), helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]), helper.make_tensor_value_info("p1", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def gemm_model() -> onnx.ModelProto:
    """Gemm with transA, transB, alpha and beta: Y = 0.5 · Xtᵀ Wᵀ + 2 C."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["Xt", "W", "C"], ["Y"], transA=1, transB=1, alpha=0.5, beta=2.0)], "gemm",
        [helper.make_tensor_value_info("Xt", TensorProto.FLOAT, [4, N])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [N, 3])],
        [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "C")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def feeds(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    if proto.graph.input[0].name == "Xt":
        return {"Xt": rng.standard_normal((4, N)).astype(np.float32)}
    return {"X": rng.standard_normal((N, 4)).astype(np.float32), "ids": np.array([0, 6, 2], np.int64)}


def run(proto: onnx.ModelProto, inputs) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


def adapt(proto: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, LoraPass]:
    adapted = ir.from_proto(proto)
    lora = LoraPass(LoraConfig(**{"rank": 2, **options}))
    lora(adapted)
    return ir.to_proto(adapted), lora


def with_values(proto: onnx.ModelProto, values) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for tensor in out.graph.initializer:
        if tensor.name in values:
            tensor.CopyFrom(numpy_helper.from_array(values[tensor.name], tensor.name))
    return out


def random_adapters(proto: onnx.ModelProto, lora: LoraPass, seed: int = 3) -> dict[str, np.ndarray]:
    """Every adapter's A and B replaced by random values (B = 0 would hide every error)."""
    rng = np.random.default_rng(seed)
    shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    names = [n for a in lora.adapters for n in (a.A, a.B)]
    return {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in names}


def test_adapters_on_exactly_the_matmul_and_gemm_weights_and_nothing_changes_at_init():
    forward = model()
    adapted, lora = adapt(forward, alpha=6, dropout=0.1)
    assert_valid_model(adapted)
    assert [(a.weight, a.A, a.B, a.transposed) for a in lora.adapters] == [
        ("W1", "W1.lora_A", "W1.lora_B", True),  # Gemm(transB=1): X @ W1ᵀ
        ("W2", "W2.lora_A", "W2.lora_B", True),  # MatMul(X, Transpose(W2)), as torch.onnx.export writes Linear
        ("W3", "W3.lora_A", "W3.lora_B", False),  # read by two MatMuls: one adapter
    ]  # E is read by a Gather: merging would change the embedding too
    inits = {t.name: numpy_helper.to_array(t) for t in adapted.graph.initializer}
    assert inits["W1.lora_A"].shape == (4, 2) and inits["W1.lora_B"].shape == (2, 6)
    assert inits["W3.lora_A"].shape == (6, 2) and inits["W3.lora_B"].shape == (2, 5)
    assert np.abs(inits["W1.lora_A"]).max() <= 1 / np.sqrt(4) and np.abs(inits["W1.lora_A"]).std() > 0.1
    assert not any(inits[a.B].any() for a in lora.adapters)
    for name in ("W1", "W2", "W3", "E", "b1"):
        assert np.array_equal(inits[name], numpy_helper.to_array(next(t for t in forward.graph.initializer if t.name == name)))
    ops = [n.op_type for n in adapted.graph.node]
    assert ops.count("MatMul") == 3 + 2 * 4 and ops.count("Dropout") == 4 and ops.count("Mul") == 4  # scale 3
    assert [o.name for o in adapted.graph.output] == ["y", "p1"]
    for got, want in zip(run(adapted, feeds(forward)), run(forward, feeds(forward))):
        assert np.array_equal(got, want)


def test_no_dropout_and_unit_scale_add_only_the_products():
    adapted, _ = adapt(model(), alpha=2)
    assert [n.op_type for n in adapted.graph.node if n.op_type in ("Dropout", "Mul")] == []


@pytest.mark.parametrize("build", [model, gemm_model], ids=["matmul-gemm-transpose", "gemm-transA-alpha"])
def test_adapted_model_equals_the_merged_weights(build):
    forward = build()
    adapted, lora = adapt(forward, rank=3, alpha=1.5)
    values = random_adapters(adapted, lora)
    base = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    merged = merged_weights(lora.adapters, lora.config.scale, base, values)
    a = lora.adapters[0]
    delta = 0.5 * values[a.A] @ values[a.B]
    assert np.allclose(merged[a.weight], base[a.weight] + (delta.T if a.transposed else delta), atol=1e-6)
    for got, want in zip(run(with_values(adapted, values), feeds(forward)), run(with_values(forward, merged), feeds(forward))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_adapter_gradients_match_finite_differences():
    forward = model()
    adapted, lora = adapt(forward, alpha=3)
    adapted = with_values(adapted, random_adapters(adapted, lora))
    assert_gradients(adapted, feeds(forward), [n for a in lora.adapters for n in (a.A, a.B)])


def test_gemm_transA_adapter_gradients_match_finite_differences():
    forward = gemm_model()
    adapted, lora = adapt(forward, rank=2, alpha=4)
    adapted = with_values(adapted, random_adapters(adapted, lora))
    assert_gradients(adapted, feeds(forward), ["W.lora_A", "W.lora_B"])


def test_patterns_select_by_initializer_name():
    _, lora = adapt(model(), targets=["W3", "W1*"])
    assert [a.weight for a in lora.adapters] == ["W1", "W3"]  # the model's order
    with pytest.raises(UnknownValueError, match=r"'q_proj\*' matches no weight.*the weights are W1, W2, W3"):
        adapt(model(), targets=["q_proj*"])
    with pytest.raises(UnknownValueError, match=r"'E' is read by Gather \(input 0\)"):
        adapt(model(), targets=["E"])


def test_biases_and_norms_on_request():
    forward = model()
    forward.graph.node.append(helper.make_node("LayerNormalization", ["y", "g", "beta"], ["z"]))
    forward.graph.initializer.extend([numpy_helper.from_array(np.ones(5, np.float32), "g"),
                                      numpy_helper.from_array(np.zeros(5, np.float32), "beta")])
    assert adapt(forward)[1].extra == []
    assert adapt(forward, train_biases=True)[1].extra == ["b1"]
    assert adapt(forward, train_biases=True, train_norms=True)[1].extra == ["b1", "g", "beta"]


def test_dropout_needs_opset_12():
    with pytest.raises(UnsupportedModelError, match="opset >= 12"):
        adapt(model(opset=11), dropout=0.1)
    adapt(model(opset=11))  # without dropout any opset serves


def test_config_is_checked():
    from onnx_autodiff.training import TrainingError

    for bad in ({"rank": 0}, {"rank": 2, "alpha": 0}, {"rank": 2, "dropout": 1.0}):
        with pytest.raises(TrainingError):
            LoraConfig(**bad)
    assert LoraConfig(rank=8).scale == 1.0 and LoraConfig(rank=4, alpha=16).scale == 4.0
