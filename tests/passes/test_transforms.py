"""jvp, hvp, jacobian: consistency with each other and with the VJP, against torch autograd, and
the strict checks on every transform's output."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_valid_model
from onnx_autodiff import cleanup_passes
from onnx_autodiff.conformance import Evaluator, to_float64
from onnx_autodiff.conformance.gradcheck import random_feeds
from onnx_autodiff.passes.transforms import hvp, jacobian, jvp, vjp
from onnx_autodiff.training import generate_artifacts


def run(model, feeds):
    assert_valid_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


UNARY = ["Tanh", "Sigmoid", "Sin", "Softplus", "Exp"]


def random_model(seed: int, unary: list[str], rows: int, cols: int):
    """y = f_k(...f_1(X @ W + b)) * X[:, :1]: a symbolic batch, broadcasting, a fan-out of X."""
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((3, cols)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(cols) * 0.5).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["a0"])]
    last = "a0"
    for i, op in enumerate(unary):
        nodes.append(helper.make_node(op, [last], [f"u{i}"]))
        last = f"u{i}"
    nodes += [
        helper.make_node("Slice", ["X", "zero", "one", "one"], ["x0"]),
        helper.make_node("Mul", [last, "x0"], ["y"]),
    ]
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"), numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(nodes, "random", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", cols])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    X = (rng.standard_normal((rows, 3)) * 0.5).astype(np.float32)
    return model, X, W, rng


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), unary=st.lists(st.sampled_from(UNARY), min_size=1, max_size=3),
       rows=st.integers(1, 4), cols=st.integers(1, 3), chunk=st.integers(1, 3))
def test_jvp_is_jacobian_times_tangent_and_jacobian_rows_are_vjps(seed, unary, rows, cols, chunk):
    model, X, W, rng = random_model(seed, unary, rows, cols)
    J = run(jacobian(model, "y", ["X", "W"], chunk=chunk), {"X": X})
    assert J["jac_X"].shape == (rows, cols, rows, 3) and J["jac_W"].shape == (rows, cols, 3, cols)
    tX = rng.standard_normal(X.shape).astype(np.float32)
    tW = rng.standard_normal(W.shape).astype(np.float32)
    out = run(jvp(model, "y", ["X", "W"]), {"X": X, "t_X": tX, "t_W": tW})
    expected = np.tensordot(J["jac_X"], tX, axes=2) + np.tensordot(J["jac_W"], tW, axes=2)
    np.testing.assert_allclose(out["jvp_y"], expected, rtol=1e-4, atol=1e-5)
    u = rng.standard_normal((rows, cols)).astype(np.float32)
    grads = run(vjp(model, "y", ["X", "W"]), {"X": X, "dy": u})
    np.testing.assert_allclose(grads["grad_X"], np.tensordot(u, J["jac_X"], axes=2), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["grad_W"], np.tensordot(u, J["jac_W"], axes=2), rtol=1e-4, atol=1e-5)


def test_inference_gradients_wrt_inputs_for_several_batch_sizes():
    model, _, _, rng = random_model(3, ["Tanh"], 1, 2)
    J_model = jacobian(model, "y", ["X"])
    grad_model = vjp(model, "y", ["X"])
    for rows in (1, 3, 7):
        X = rng.standard_normal((rows, 3)).astype(np.float32)
        J = run(J_model, {"X": X})["jac_X"]
        u = rng.standard_normal((rows, 2)).astype(np.float32)
        np.testing.assert_allclose(run(grad_model, {"X": X, "dy": u})["grad_X"], np.tensordot(u, J, axes=2), rtol=1e-4, atol=1e-6)


def test_transforms_leave_the_input_model_unchanged():
    model, X, _, _ = random_model(5, ["Sin"], 2, 2)
    before = model.SerializeToString(deterministic=True)
    for transform in (lambda m: jvp(m, "y", ["W"]), lambda m: jacobian(m, "y", ["W"]), lambda m: vjp(m, "y", ["W"])):
        transform(model)
    assert model.SerializeToString(deterministic=True) == before


def test_hvp_needs_a_scalar():
    model, _, _, _ = random_model(1, ["Tanh"], 2, 2)
    from onnx_autodiff import NotDifferentiableError

    with pytest.raises(NotDifferentiableError, match="one-element"):
        hvp(model, "y", ["W"])


# Against torch.autograd Hessian-vector products (float64 on both sides, and float32 on onnxruntime).

def _hvp_float64(model, feeds, vs):
    hv = hvp(model, "loss", list(vs))
    float32 = run(hv, {**feeds, **{f"v_{k}": v.astype(np.float32) for k, v in vs.items()}})
    wide = to_float64(hv, keep=[k for k, v in feeds.items() if v.dtype.kind != "f"])
    evaluate = Evaluator(wide)
    names = [o.name for o in wide.graph.output]
    fed = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
    outs = dict(zip(names, evaluate({**fed, **{f"v_{k}": v for k, v in vs.items()}})))
    return {k: outs[f"hvp_{k}"] for k in vs}, {k: float32[f"hvp_{k}"] for k in vs}


def _torch_hvp(torch, f, params: dict, vs: dict):
    names = list(params)
    primals = tuple(torch.tensor(params[n], dtype=torch.float64) for n in names)
    tangents = tuple(torch.tensor(vs[n], dtype=torch.float64) for n in names)
    _, result = torch.autograd.functional.hvp(lambda *p: f(dict(zip(names, p))), primals, tangents)
    return {n: r.numpy() for n, r in zip(names, result)}


def _compare(ours64, ours32, theirs):
    for name, expected in theirs.items():
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(ours64[name], expected, rtol=1e-5, atol=1e-7 * scale, err_msg=name)
        np.testing.assert_allclose(ours32[name], expected, rtol=1e-3, atol=1e-4 * scale, err_msg=name)


def test_hvp_mlp_cross_entropy_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = {"W1": rng.standard_normal((6, 4)) * 0.5, "b1": rng.standard_normal(6) * 0.1,
              "W2": rng.standard_normal((3, 6)) * 0.5, "b2": rng.standard_normal(3) * 0.1}
    X, labels = rng.standard_normal((5, 4)), rng.integers(0, 3, 5)
    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["z"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["z", "labels"], ["loss"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [5, 4]), helper.make_tensor_value_info("labels", TensorProto.INT64, [5])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    vs = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    exact = {k: v.astype(np.float32).astype(np.float64) for k, v in params.items()}
    ours64, ours32 = _hvp_float64(model, {"X": X.astype(np.float32), "labels": labels}, vs)
    x = torch.tensor(X.astype(np.float32), dtype=torch.float64)
    t = torch.tensor(labels)

    def loss(p):
        h = torch.tanh(x @ p["W1"].T + p["b1"])
        return torch.nn.functional.cross_entropy(h @ p["W2"].T + p["b2"], t)

    _compare(ours64, ours32, _torch_hvp(torch, loss, exact, vs))


def test_hvp_conv_layernorm_gelu_softmax_matches_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    params = {"K": rng.standard_normal((3, 1, 3, 3)) * 0.4, "scale": 1 + rng.standard_normal(27) * 0.1,
              "W": rng.standard_normal((27, 4)) * 0.3}
    X, C = rng.standard_normal((2, 1, 5, 5)), rng.standard_normal((2, 4))
    nodes = [
        helper.make_node("Conv", ["X", "K"], ["c"]),
        helper.make_node("Reshape", ["c", "flat"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Gelu", ["n"], ["g"]),
        helper.make_node("MatMul", ["g", "W"], ["z"]),
        helper.make_node("Softmax", ["z"], ["p"], axis=-1),
        helper.make_node("Mul", ["p", "C"], ["pc"]),
        helper.make_node("ReduceSum", ["pc"], ["loss"], keepdims=0),
    ]
    inits = {k: v.astype(np.float32) for k, v in params.items()}
    inits.update(flat=np.array([2, 27], np.int64), bias=np.zeros(27, np.float32), C=C.astype(np.float32))
    graph = helper.make_graph(
        nodes, "conv_ln_gelu_softmax",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 1, 5, 5])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    vs = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    exact = {k: v.astype(np.float32).astype(np.float64) for k, v in params.items()}
    ours64, ours32 = _hvp_float64(model, {"X": X.astype(np.float32)}, vs)
    x = torch.tensor(X.astype(np.float32), dtype=torch.float64)
    c = torch.tensor(C.astype(np.float32), dtype=torch.float64)

    def loss(p):
        h = F.conv2d(x, p["K"]).reshape(2, 27)
        h = F.layer_norm(h, (27,), p["scale"], None, eps=1e-5)
        return (torch.softmax(F.gelu(h) @ p["W"], -1) * c).sum()

    _compare(ours64, ours32, _torch_hvp(torch, loss, exact, vs))


# Every transform's output, raw and after the cleanup, and the training artifacts pass the shared
# strict checks (full checker, strict type and shape inference with data propagation, no made-up
# sequence element names, no transposed matrix times a vector) and run on onnxruntime.

def _loss_of(model, output, name="loss"):
    """``model`` with the scalar output ``name`` = Σ output² in place of its outputs."""
    scalar = onnx.ModelProto()
    scalar.CopyFrom(model)
    scalar.graph.node.extend([helper.make_node("Mul", [output, output], [f"{name}_sq"]),
                              helper.make_node("ReduceSum", [f"{name}_sq"], [name], keepdims=0)])
    del scalar.graph.output[:]
    scalar.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
    return scalar


def _unequal_pieces(inferred=True):
    """X [N, 15] split into 7 and 8 columns, read by SequenceAt: y = Σ sin(S[0]) · S[1] · W
    (typed by onnx's inference when ``inferred``, which names the pieces' one unknown width)."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("SplitToSequence", ["X", "split"], ["S"], axis=1),
        helper.make_node("SequenceAt", ["S", "zero"], ["a"]),
        helper.make_node("SequenceAt", ["S", "one"], ["b"]),
        helper.make_node("Sin", ["a"], ["sa"]),
        helper.make_node("ReduceSum", ["sa", "axis"], ["ra"]),
        helper.make_node("Mul", ["ra", "b"], ["rb"]),
        helper.make_node("Mul", ["rb", "W"], ["y"]),
    ]
    weight = np.random.default_rng(3).standard_normal(8).astype(np.float32)
    arrays = {"W": weight, "split": np.array([7, 8], np.int64), "zero": np.array(0, np.int64),
              "one": np.array(1, np.int64), "axis": np.array([1], np.int64)}
    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    graph = helper.make_graph(nodes, "pieces", [helper.make_tensor_value_info("X", f, ["N", 15])],
                              [helper.make_tensor_value_info("y", f, ["N", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model) if inferred else model


def _empty_slice():
    """y = sin(X[:, 5:1]): an empty output."""
    nodes = [helper.make_node("Slice", ["X", "five", "one", "axis"], ["s"]), helper.make_node("Sin", ["s"], ["y"])]
    inits = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("five", 5), ("one", 1), ("axis", 1))]
    graph = helper.make_graph(nodes, "empty", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 0])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _old_opset():
    """y = tanh(X @ W) at opset 9, where a Loop must carry a value and OneHot is new."""
    W = numpy_helper.from_array(np.random.default_rng(5).standard_normal((3, 2)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])]
    graph = helper.make_graph(nodes, "opset9", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [W])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)


CHECKED_MODELS = {
    "random": lambda: random_model(4, ["Sigmoid", "Sin"], 2, 3)[0],
    "pieces": _unequal_pieces,
    "empty": _empty_slice,
    "opset9": _old_opset,
}


def _cleaned(proto):
    model = ir.from_proto(proto)
    for step in cleanup_passes():
        model = step(model).model
    return ir.to_proto(model)


@pytest.mark.parametrize("transform", ["grad", "jvp", "hvp", "jacobian"])
@pytest.mark.parametrize("name", list(CHECKED_MODELS))
def test_transform_outputs_pass_the_strict_checks(name, transform):
    model = CHECKED_MODELS[name]()
    of, wrt = "y", [model.graph.input[0].name]
    if transform == "hvp":
        model, of = _loss_of(model, "y"), "loss"
    build = {"grad": vjp, "jvp": jvp, "hvp": hvp, "jacobian": jacobian}[transform]
    raw = build(model, of, wrt)
    for proto in (raw, _cleaned(raw)):
        for batch in (3, 64) if name == "pieces" else (3,):  # the larger one failed on the pieces
            outputs = run(proto, random_feeds(proto, seed=1, batch=batch))
            assert all(np.all(np.isfinite(v)) for v in outputs.values())


def test_training_artifacts_pass_the_strict_checks():
    # The inference model is the input model as given: one typed by onnx's inference fails (the
    # input's own value_info names the pieces' width).
    for model in (random_model(6, ["Tanh"], 2, 3)[0], _unequal_pieces(inferred=False)):
        artifacts = generate_artifacts(model, loss="mse", gradient_accumulation=True)
        for proto in (artifacts.train_model, artifacts.eval_model, artifacts.inference_model,
                      artifacts.accumulate_model, artifacts.apply_model):
            assert_valid_model(proto)
