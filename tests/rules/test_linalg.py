import numpy as np
import onnxruntime as ort
import pytest

from helpers import assert_gradients, op_model, rng
from onnx_autodiff.conformance import check_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import RuleError

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


def test_det_unknown_size_is_refused():
    x = well_conditioned(3, 3)
    model = op_model("Det", {"X": x}, shapes={"X": ["M", "M"]})
    with pytest.raises(RuleError, match="static"):
        backward_model(model, "out0", ["X"], seed="input")


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
