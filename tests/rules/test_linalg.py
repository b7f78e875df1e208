import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from helpers import assert_gradients, assert_valid_model, make_model, op_model, rng
from onnx_autodiff import cleanup_passes
from onnx_autodiff.conformance import check_vjp, fd_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import RuleError
from onnx_autodiff.passes.transforms import hvp, vjp

R = rng(7)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def _ort_backward(model, feeds, wrt):
    """The backward graph loads and runs on onnxruntime itself; returns its gradients."""
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    seed = R.standard_normal(y.shape).astype(np.float32)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in proto.graph.output], session.run(None, {**feeds, autodiff.seed_name: seed})))
    return seed, {x: outs[autodiff.gradient_names[x]] for x in wrt}


def einsum_check(equation, *arrays, shapes=None):
    names = [f"X{i}" for i in range(len(arrays))]
    feeds = dict(zip(names, arrays))
    model = op_model("Einsum", feeds, equation=equation, shapes=shapes)
    assert_gradients(model, feeds, names)
    seed, grads = _ort_backward(model, feeds, names)
    torch = pytest.importorskip("torch")
    if torch is not None:
        ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
        y = torch.einsum(equation, *ts)
        y.backward(torch.tensor(seed, dtype=torch.float64))
        for name, t in zip(names, ts):
            np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 2)]),  # matmul
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),  # batched
        ("i,i->", [(5,), (5,)]),  # dot, scalar output
        ("i,j->ij", [(3,), (4,)]),  # outer
        ("ij->ji", [(3, 4)]),  # transpose
        ("ij->i", [(3, 4)]),  # a letter only this operand has: sum
        ("ij,j->", [(3, 4), (4,)]),  # i summed away, only in operand 0
        ("ii->i", [(4, 4)]),  # diagonal
        ("ii", [(4, 4)]),  # trace, implicit
        ("iij->j", [(3, 3, 2)]),
        ("bii,bi->b", [(2, 3, 3), (2, 3)]),  # a diagonal beside another operand
        ("iii->", [(3, 3, 3)]),  # triple repeat
        ("ij,jk", [(3, 4), (4, 2)]),  # implicit: -> ik
        ("ba,b", [(3, 4), (3,)]),  # implicit: -> a
        ("Ab,bA", [(2, 3), (3, 2)]),  # upper-case letters, implicit -> scalar
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),  # three operands
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 2)]),  # ellipsis
        ("...ij,jk", [(2, 3, 4), (4, 2)]),  # ellipsis beside none, implicit
        ("...i,i->...", [(2, 3, 4), (4,)]),
        ("...ii->...i", [(2, 3, 3)]),  # batched diagonal
        ("i...,i...->...", [(3, 2), (3, 2)]),  # leading letters, trailing ellipsis
        ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 2)]),  # size-1 ellipsis dims broadcast
        ("i i , i j -> j", [(3, 3), (3, 2)]),  # spaces
    ],
)
def test_einsum(equation, shapes):
    einsum_check(equation, *(f32(*s) for s in shapes))


def test_einsum_ellipsis_summed_away_reference_only():
    """onnxruntime refuses an ellipsis missing from the output ("Inputs have ellipses in them but
    the provided output subscript does not contain an ellipsis"), so this runs on onnx.reference."""
    x = f32(2, 3, 4)
    model = op_model("Einsum", {"X0": x}, equation="...ij->ij")
    from onnx.reference import ReferenceEvaluator

    proto, autodiff = backward_model(model, "out0", ["X0"], seed="input")
    seed = f32(3, 4)
    grad = ReferenceEvaluator(proto).run([autodiff.gradient_names["X0"]], {"X0": x, autodiff.seed_name: seed})[0]
    np.testing.assert_allclose(grad, np.broadcast_to(seed, x.shape), rtol=1e-6)


def test_einsum_same_input_twice():
    x = f32(3, 3)
    names = {"X": x}
    from onnx import helper
    from helpers import make_model

    model = make_model([helper.make_node("Einsum", ["X", "X"], ["out0"], equation="ij,jk->ik")], names, ["out0"])
    assert_gradients(model, names, ["X"])


def test_einsum_symbolic_batch():
    a, b = f32(3, 2, 4), f32(3, 4, 2)
    einsum_check("bij,bjk->bik", a, b, shapes={"X0": ["N", 2, 4], "X1": ["N", 4, 2]})
    # Diagonal and summed letters with a symbolic extent: identity and ones built at run time.
    einsum_check("bii->b", f32(2, 3, 3), shapes={"X0": ["N", "M", "M"]})
    einsum_check("...ij->...j", f32(2, 3, 4), shapes={"X0": ["N", 3, 4]})


def test_einsum_unknown_broadcast_at_run_time():
    # Symbolic extents that may or may not be 1: the sum over broadcast axes is found at run time.
    a, b = f32(2, 1, 3), f32(1, 4, 3)
    einsum_check("...ij,...ij->...ij", a, b, shapes={"X0": ["A", "B", 3], "X1": ["C", "D", 3]})


def test_einsum_malformed_is_refused():
    # (An equation with a lone "." is avoided here: onnx's Einsum shape inference loops forever on it.)
    model = op_model("Einsum", {"X0": f32(3, 3)}, equation="ii->i")
    model.graph.node[0].attribute[0].s = b"ij,jk->ik"
    with pytest.raises(RuleError, match="2 terms for 1 inputs"):
        backward_model(model, "out0", ["X0"], seed="input")


# Det

def well_conditioned(*shape):
    x = R.standard_normal(shape)
    return (x + 2 * np.eye(shape[-1])).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 3, 3), (2, 2, 2, 2), (3, 1, 1)])
def test_det(shape):
    x = well_conditioned(*shape)
    model = op_model("Det", {"X": x})
    assert_gradients(model, {"X": x}, ["X"])
    seed, grads = _ort_backward(model, {"X": x}, ["X"])
    torch = pytest.importorskip("torch")
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    torch.linalg.det(t).backward(torch.tensor(seed, dtype=torch.float64))
    np.testing.assert_allclose(grads["X"], t.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_det_singular_matrix():
    """At a singular matrix the gradient is the (nonzero) adjugate transpose, not NaN."""
    x = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]], np.float32)
    model = op_model("Det", {"X": x})
    seed, grads = _ort_backward(model, {"X": x}, ["X"])
    cof = np.array([[np.linalg.det(np.delete(np.delete(x.astype(np.float64), i, 0), j, 1)) * (-1) ** (i + j)
                     for j in range(3)] for i in range(3)])
    assert np.abs(cof).max() > 1
    np.testing.assert_allclose(grads["X"], seed * cof, rtol=1e-4, atol=1e-4)
    assert_gradients(model, {"X": x}, ["X"])


def test_det_symbolic_batch():
    x = well_conditioned(3, 2, 2)
    model = op_model("Det", {"X": x}, shapes={"X": ["N", 2, 2]})
    assert_gradients(model, {"X": x}, ["X"])
    _ort_backward(model, {"X": x}, ["X"])


def test_det_of_a_matrix_size_known_at_run_time():
    """The minors' index table and the signs are computed from n; a 1×1 matrix's minor is 0×0."""
    model = op_model("Det", {"X": well_conditioned(2, 3, 3)}, shapes={"X": ["B", "M", "M"]})
    for shape in ((2, 3, 3), (1, 4, 4), (3, 1, 1), (2, 2, 2)):
        x = well_conditioned(*shape)
        assert_gradients(model, {"X": x}, ["X"], symbolic=False)  # (this model is the symbolic one)


def test_det_second_order():
    """The Det template is made of ops with rules (Gather, Transpose, Det, Mul): it differentiates again."""
    x = well_conditioned(3, 3)
    model = op_model("Det", {"X": x})
    proto, autodiff = backward_model(model, "out0", ["X"])
    from onnx import helper

    # Scalar of the gradient: sum(grad_X * W); its gradient with respect to X is a Hessian-vector product.
    w = f32(3, 3)
    grad_name = autodiff.gradient_names["X"]
    graph = proto.graph
    graph.node.extend([
        helper.make_node("Constant", [], ["hv_w"], value=helper.make_tensor("w", 1, w.shape, w.ravel())),
        helper.make_node("Mul", [grad_name, "hv_w"], ["hv_m"]),
        helper.make_node("ReduceSum", ["hv_m"], ["hv_s"], keepdims=0),
    ])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("hv_s", 1, []))
    result = check_vjp(proto, {"X": x}, ["X"])
    assert result.ok, str(result)


# Products of a vector and a matrix. onnxruntime 1.32's MatmulTransposeFusion miscomputes a
# Transpose of a 2-D matrix feeding MatMul as its first operand with a 1-D second one (float and
# double, right with optimisations off): the rules never emit a Transpose next to a vector in a
# MatMul, and the cleanup rewrites one it finds into the product without the Transpose.

def _transposed_times_vector(dtype):
    """y = MatMul(Transpose(M), v), M [3, 4], v [3]."""
    M, v = R.standard_normal((3, 4)).astype(dtype), R.standard_normal(3).astype(dtype)
    nodes = [helper.make_node("Transpose", ["M"], ["Mt"], perm=[1, 0]), helper.make_node("MatMul", ["Mt", "v"], ["y"])]
    return make_model(nodes, {"M": M, "v": v}, ["y"]), {"M": M, "v": v}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_onnxruntime_miscomputes_a_transposed_matrix_times_a_vector(dtype):
    """Documents the fault (the reason for the rewrite): when this fails, onnxruntime has fixed it."""
    model, feeds = _transposed_times_vector(dtype)
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    results = [ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)[0] for options in (plain, ort.SessionOptions())]
    expected = feeds["M"].T @ feeds["v"]
    np.testing.assert_allclose(results[0], expected, rtol=1e-5)
    assert not np.allclose(results[1], expected, rtol=1e-3), "onnxruntime computes MatMul(Transpose(M), v) right now"


def _vector_matrix_model(form, M, v):
    """loss = Σ sin(p), p a product of v and M in the given ``form`` (t: M transposed; R: then
    reshaped to the shape it has, a Reshape that runtimes and the cleanup remove)."""
    operands = {"vM": ["v", "M"], "Mv": ["M", "v"], "vMt": ["v", "Mt"], "Mtv": ["Mt", "v"], "MtRv": ["R", "v"]}[form]
    nodes = [helper.make_node("Transpose", ["M"], ["Mt"], perm=[1, 0]),
             helper.make_node("Reshape", ["Mt", "shape"], ["R"]),
             helper.make_node("MatMul", operands, ["p"]),
             helper.make_node("Sin", ["p"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    if "R" not in form:
        nodes = nodes[:1] + nodes[2:] if "t" in form else nodes[2:]
    shape = {"shape": np.array(M.shape[::-1], np.int64)} if "R" in form else None
    return make_model(nodes, {"M": M, "v": v}, ["loss"], initializers=shape)


def _cleaned(proto):
    model = ir.from_proto(proto)
    for step in cleanup_passes():
        model = step(model).model
    return ir.to_proto(model)


def _run_default(proto, feeds):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in proto.graph.output], session.run(None, feeds)))


# Each form, and the same function without the Transpose (the oracle's reference).
VECTOR_FORMS = {"vM": "vM", "Mv": "Mv", "vMt": "Mv", "Mtv": "vM", "MtRv": "vM"}
MISCOMPUTED_FORWARD = {"Mtv", "MtRv"}  # onnxruntime miscomputes the forward graph itself


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("form", list(VECTOR_FORMS))
def test_vector_matrix_products_on_default_session(form, dtype):
    """Gradients and Hessian-vector products wrt both operands, run with onnxruntime's default
    session options, against finite differences (of the same function written without the
    Transpose: the oracle runs onnxruntime too); with the cleanup, and without it where
    onnxruntime computes the forward graph itself right."""
    M = R.standard_normal((3, 4)).astype(dtype)
    v = R.standard_normal(4 if form in ("Mv", "vMt") else 3).astype(dtype)
    feeds = {"M": M, "v": v}
    model, plain = _vector_matrix_model(form, M, v), _vector_matrix_model(VECTOR_FORMS[form], M, v)
    directions = {f"v_{k}": R.standard_normal(x.shape).astype(dtype) for k, x in feeds.items()}
    fd = fd_vjp(plain, feeds, ["M", "v"], [np.array(1.0)])
    fd2 = fd_vjp(vjp(plain, "loss", ["M", "v"]), feeds, ["M", "v"], [None, directions["v_M"], directions["v_v"]])
    tolerance = {"rtol": 1e-3, "atol": 1e-4} if dtype == np.float32 else {"rtol": 1e-6, "atol": 1e-7}
    for clean in (True,) if form in MISCOMPUTED_FORWARD else (True, False):
        for transform, expected, prefix, extra in ((vjp(model, "loss", ["M", "v"]), fd, "grad", {}),
                                                    (hvp(model, "loss", ["M", "v"]), fd2, "hvp", directions)):
            proto = _cleaned(transform) if clean else transform
            assert_valid_model(proto)  # no transposed matrix times a vector
            outs = _run_default(proto, {**feeds, **extra})
            for x in ("M", "v"):
                np.testing.assert_allclose(outs[f"{prefix}_{x}"], expected[x], **tolerance,
                                           err_msg=f"{prefix}_{x}, cleanup {clean}")
