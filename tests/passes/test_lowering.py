"""The runtime lowering of the cleanup: each onnxruntime rule rewrites its canonical form and
nothing else; canonical (``target=None``) and lowered graphs give the gradients of finite
differences, pass the full checker and run on onnxruntime."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import make_model, rng
from onnx import helper, numpy_helper

from onnx_autodiff import autodiff_pass, cleanup_passes
from onnx_autodiff.conformance import fd_vjp
from onnx_autodiff.passes.cleanup import CleanupPass
from onnx_autodiff.passes.metadata import GRAD_OF, GRAD_OF_DOMAIN, GRAD_OF_OP, Provenance, mark, provenance
from onnx_autodiff.passes.rewrite_rules import lowering, lowering_rules

R = rng(11)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def cleaned(model: onnx.ModelProto, target="onnxruntime") -> onnx.ModelProto:
    ir_model = ir.from_proto(model)
    CleanupPass(target=target)(ir_model)
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def run(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {k: v for k, v in feeds.items() if k in names})))


def assert_same_function(model, lowered, feeds):
    want, got = run(model, feeds), run(lowered, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_unknown_target_is_refused_naming_the_known_ones():
    for make in (lowering_rules, lambda t: CleanupPass(target=t), lambda t: cleanup_passes(target=t)):
        with pytest.raises(ValueError, match=r"unknown lowering target 'tensorrt'.*'onnxruntime'"):
            make("tensorrt")


# MatMul of a Transpose of a matrix: Gemm reads it transposed.

def _transposed_product(shape_x, shape_w, transpose_w=False, dtype=np.float32, opset=18):
    x, w = f32(*shape_x).astype(dtype), f32(*shape_w).astype(dtype)
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=list(range(len(shape_x)))[:-2] + [len(shape_x) - 1, len(shape_x) - 2])]
    if transpose_w:
        nodes.append(helper.make_node("Transpose", ["w"], ["wt"]))  # no perm: reverses the axes
    nodes.append(helper.make_node("MatMul", ["xt", "wt" if transpose_w else "w"], ["y"]))
    return make_model(nodes, {"x": x, "w": w}, ["y"], opset=opset), {"x": x, "w": w}


@pytest.mark.parametrize("transpose_w", [False, True])
def test_matmul_of_a_transposed_matrix_becomes_gemm(transpose_w):
    model, feeds = _transposed_product((4, 3), (5, 4) if transpose_w else (4, 5), transpose_w)
    lowered = cleaned(model)
    assert ops(lowered) == ["Gemm"]
    flags = {a.name: a.i for a in lowered.graph.node[0].attribute}
    assert flags == ({"transA": 1, "transB": 1} if transpose_w else {"transA": 1})
    assert ops(cleaned(model, target=None)).count("Transpose") == 1 + transpose_w
    assert_same_function(model, lowered, feeds)


@pytest.mark.parametrize("shape_x,shape_w,dtype,opset", [
    ((2, 4, 3), (4, 5), np.float32, 18),  # a batched Transpose: no Gemm
    ((4, 3), (4, 5), np.int32, 18),  # no integer Gemm
    ((4, 3), (4, 5), np.float32, 10),  # Gemm needs C before opset 11
])
def test_matmul_stays_where_gemm_does_not_fit(shape_x, shape_w, dtype, opset):
    model, feeds = _transposed_product(shape_x, shape_w, dtype=dtype, opset=opset)
    assert "Gemm" not in ops(cleaned(model))


@pytest.mark.parametrize("opset,fires", [(18, True), (10, False)])
def test_gemm_of_a_transpose_flips_its_flag(opset, fires):
    a, b, c = f32(4, 3), f32(3, 5), f32(5)
    nodes = [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
             helper.make_node("Gemm", ["at", "b", "c"], ["y"], transA=1, alpha=0.5)]  # a·b: reads a itself
    model = make_model(nodes, {"a": a, "b": b, "c": c}, ["y"], opset=opset)
    lowered = cleaned(model)
    assert ops(lowered) == (["Gemm"] if fires else ["Transpose", "Gemm"])
    if fires:
        gemm = lowered.graph.node[0]
        assert list(gemm.input) == ["a", "b", "c"]
        assert {x.name: helper.get_attribute_value(x) for x in gemm.attribute} == {"transA": 0, "alpha": 0.5}
    assert_same_function(model, lowered, {"a": a, "b": b, "c": c})


@pytest.mark.parametrize("vector_first", [False, True])
def test_transposed_matrix_and_vector_multiply_without_the_transpose(vector_first):
    """MatMul(Mᵀ, v) is MatMul(v, M): onnxruntime 1.32 miscomputes the first form (the forward
    graph itself, so the reference is the model run with its optimisations off)."""
    m, v = f32(3, 4), f32(4 if vector_first else 3)
    operands = ["v", "mt"] if vector_first else ["mt", "v"]
    nodes = [helper.make_node("Transpose", ["m"], ["mt"], perm=[1, 0]), helper.make_node("MatMul", operands, ["y"])]
    model = make_model(nodes, {"m": m, "v": v}, ["y"])
    lowered = cleaned(model)
    assert ops(lowered) == ["MatMul"]
    assert list(lowered.graph.node[0].input) == (["m", "v"] if vector_first else ["v", "m"])
    expected = m @ v if vector_first else v @ m
    np.testing.assert_allclose(run(lowered, {"m": m, "v": v})["y"], expected, rtol=1e-5)


# Bias sums: ReduceSum over every axis but the last is a product with ones.

def _reduce_sum(shape, axes, keepdims=0, dtype=np.float32, opset=18, symbolic=None):
    x = f32(*shape).astype(dtype)
    if opset >= 13:
        node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=keepdims)
        initializers = {"axes": np.array(axes, np.int64)}
    else:
        node = helper.make_node("ReduceSum", ["x"], ["y"], axes=axes, keepdims=keepdims)
        initializers = None
    shapes = {"x": symbolic} if symbolic else None
    return make_model([node], {"x": x}, ["y"], initializers=initializers, opset=opset, shapes=shapes), {"x": x}


def _ones_rows(model: onnx.ModelProto) -> list[int]:
    """The lengths of the all-ones vectors that a MatMul reads."""
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [stored[n.input[0]].size for n in model.graph.node
            if n.op_type == "MatMul" and n.input[0] in stored and np.all(stored[n.input[0]] == 1)]


@pytest.mark.parametrize("shape,axes,opset,expected", [
    ((3, 4, 5), [0, 1], 18, ["Reshape", "MatMul"]),
    ((3, 4, 5), [1, -3], 18, ["Reshape", "MatMul"]),
    ((6, 5), [0], 18, ["MatMul"]),
    ((3, 4, 5), [0, 1], 11, ["Reshape", "MatMul"]),  # axes as an attribute
])
def test_bias_sum_becomes_a_product_with_ones(shape, axes, opset, expected):
    model, feeds = _reduce_sum(shape, axes, opset=opset)
    lowered = cleaned(model)
    assert ops(lowered) == expected and _ones_rows(lowered) == [int(np.prod(shape[:-1]))]
    assert ops(cleaned(model, target=None)) == ["ReduceSum"]
    assert_same_function(model, lowered, feeds)


@pytest.mark.parametrize("kw", [
    dict(shape=(3, 4, 5), axes=[0, 1], keepdims=1),
    dict(shape=(3, 4, 5), axes=[0]),  # not every leading axis
    dict(shape=(3, 4, 5), axes=[1, 2]),
    dict(shape=(3, 4, 5), axes=[0, 1], dtype=np.float16),
    dict(shape=(3, 4, 5), axes=[0, 1], symbolic=["N", 4, 5]),
])
def test_other_sums_stay_reduce_sum(kw):
    model, _ = _reduce_sum(**kw)
    assert ops(cleaned(model)) == ["ReduceSum"]


def test_bias_sum_of_more_rows_than_the_limit_stays_reduce_sum(monkeypatch):
    monkeypatch.setattr(lowering, "COLUMN_SUM_ROWS", 11)
    model, _ = _reduce_sum((3, 4, 5), [0, 1])  # 12 rows
    assert ops(cleaned(model)) == ["ReduceSum"]
    model, _ = _reduce_sum((2, 5, 5), [0, 1])  # 10 rows
    assert ops(cleaned(model)) == ["Reshape", "MatMul"]


# Slopes, and Relu's gate.

def _where(a, b, branch_is_input=False):
    x = f32(2, 3)
    nodes = [helper.make_node("Greater", ["x", "zero"], ["cond"]), helper.make_node("Where", ["cond", "a", "b"], ["y"])]
    initializers = {"zero": np.zeros((), np.float32), "b": np.array(b, np.float32)}
    feeds = {"x": x}
    if branch_is_input:
        feeds["a"] = a
    else:
        initializers["a"] = np.array(a, np.float32)
    return make_model(nodes, feeds, ["y"], initializers=initializers), feeds


@pytest.mark.parametrize("b", [0.0, 0.01, 1.0])
def test_slope_becomes_max_of_the_mask(b):
    model, feeds = _where(1.0, b)
    lowered = cleaned(model)
    assert ops(lowered) == ["Greater", "Cast", "Max"]
    assert_same_function(model, lowered, feeds)


@pytest.mark.parametrize("a,b", [(1.0, 1.5), (1.0, -0.5), (2.0, 0.5), (1.0, [0.5, 0.2, 0.5])])
def test_other_wheres_stay(a, b):
    model, _ = _where(a, b)
    assert ops(cleaned(model)) == ["Greater", "Where"]


def test_a_forward_where_guarding_a_nan_stays():
    """Where(x > 0, log(x), 0) outside Relu's gradient: a product with the mask would let log's
    NaN through."""
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    nodes = [helper.make_node("Log", ["x"], ["l"]), helper.make_node("Greater", ["x", "zero"], ["cond"]),
             helper.make_node("Where", ["cond", "l", "zero"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], initializers={"zero": np.zeros((), np.float32)})
    lowered = cleaned(model)
    assert "Where" in ops(lowered)
    np.testing.assert_array_equal(run(lowered, {"x": x})["y"], np.array([0.0, 0.0, np.log(2.0)], np.float32))


def _gradient(model: onnx.ModelProto, wrt, target="onnxruntime", of="loss"):
    ir_model = ir.from_proto(model)
    grad = autodiff_pass(of=of, wrt=wrt)
    ir.passes.PassManager([grad, *cleanup_passes(target=target)])(ir_model)
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, grad


def test_relu_gate_becomes_a_product_with_the_mask():
    """Canonical: dY where X > 0, 0 elsewhere (also for a NaN or infinite dY); lowered for
    onnxruntime: dY·Cast(X > 0), NaN there (the documented difference)."""
    x = np.array([-1.0, 0.0, 2.0, -3.0, 4.0], np.float32)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": x}, ["y"])
    dy = np.array([np.nan, np.inf, np.nan, 5.0, 3.0], np.float32)
    expected = {"onnxruntime": [np.nan, np.nan, np.nan, 0.0, 3.0], None: [0.0, 0.0, np.nan, 0.0, 3.0]}
    for target, (kept, gone) in {"onnxruntime": ("Cast", "Where"), None: ("Where", "Cast")}.items():
        proto, grad = _gradient(model, ["x"], target, of="y")
        assert kept in ops(proto) and gone not in ops(proto)
        got = run(proto, {"x": x, grad.seed_name: dy})[grad.gradient_names["x"]]
        np.testing.assert_array_equal(got, expected[target], err_msg=f"target {target}")


# Whole models: canonical and lowered gradients against finite differences.

def _linear(x_shape, w_shape, activation=None, alpha=None):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["q"])]
    last = "q"
    if activation:
        nodes.append(helper.make_node(activation, ["q"], ["h"], **({"alpha": alpha} if alpha else {})))
        nodes.append(helper.make_node("MatMul", ["h", "w2"], ["r"]))
        last = "r"
    nodes += [helper.make_node("Tanh", [last], ["t"]), helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)]
    return nodes


def linear_layer():
    feeds = {"x": f32(2, 3, 4), "w": f32(4, 5), "b": f32(5)}
    return make_model(_linear((2, 3, 4), (4, 5)), feeds, ["loss"]), feeds, ["x", "w", "b"]


def mlp(activation, alpha=None):
    feeds = {"x": f32(6, 4), "w": f32(4, 5), "b": f32(5), "w2": f32(5, 3)}
    return make_model(_linear((6, 4), (4, 5), activation, alpha), feeds, ["loss"]), feeds, ["x", "w", "b", "w2"]


def batched_matmul():
    feeds = {"a": f32(2, 3, 4), "c": f32(2, 4, 5)}
    nodes = [helper.make_node("MatMul", ["a", "c"], ["p"]), helper.make_node("Sin", ["p"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    return make_model(nodes, feeds, ["loss"]), feeds, ["a", "c"]


MODELS = {
    "linear layer": (linear_layer, set()),  # its lowered form: the bias sum by ones (below)
    "mlp relu": (lambda: mlp("Relu"), {"Cast"}),
    "mlp leaky relu": (lambda: mlp("LeakyRelu", 0.1), {"Max"}),
    "batched matmul": (batched_matmul, set()),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_canonical_and_lowered_gradients_match_finite_differences(name):
    make, lowered_ops = MODELS[name]
    model, feeds, wrt = make()
    expected = fd_vjp(model, feeds, wrt, [np.ones((), np.float32)])
    for target in ("onnxruntime", None):
        proto, grad = _gradient(model, wrt, target)
        backward = set(ops(proto)) - set(ops(model))
        assert lowered_ops <= backward if target else not lowered_ops & backward, (target, backward)
        got = run(proto, feeds)
        for x in wrt:
            np.testing.assert_allclose(got[grad.gradient_names[x]], expected[x], rtol=1e-3, atol=1e-4,
                                       err_msg=f"{name}: grad of {x}, target {target}")


def test_canonical_backward_of_matmul_and_add_has_no_product_with_ones():
    model, feeds, wrt = linear_layer()
    canonical, _ = _gradient(model, ["w", "b"], target=None)
    assert not _ones_rows(canonical)
    assert ops(canonical).count("ReduceSum") == 2  # the bias sum, and the loss's
    lowered, _ = _gradient(model, ["w", "b"])
    assert _ones_rows(lowered) == [6]
    assert len(lowered.graph.node) <= len(canonical.graph.node)


# Relu's gate is found by the structured provenance, not by the text of GRAD_OF.

def _tagged_gate(**metadata):
    """The gate Where(x > 0, dy, 0) of one node, with ``metadata`` on the Where."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["cond"]), helper.make_node("Where", ["cond", "dy", "zero"], ["g"])]
    for key, value in metadata.items():
        nodes[1].metadata_props.add(key=key, value=value)
    feeds = {"x": f32(2, 3), "dy": f32(2, 3)}
    return make_model(nodes, feeds, ["g"], initializers={"zero": np.zeros((), np.float32)}), feeds


@pytest.mark.parametrize("metadata,lowered", [
    ({GRAD_OF: "Activation:n", GRAD_OF_OP: "Relu"}, True),  # the label's text is not read
    ({GRAD_OF: "Relu:n", GRAD_OF_OP: "Clip"}, False),
    ({GRAD_OF: "Relu:n", GRAD_OF_OP: "Relu", GRAD_OF_DOMAIN: "custom"}, False),  # another domain's Relu
    ({GRAD_OF: "Relu:n"}, True),  # a model tagged before GRAD_OF_OP: its label still tells
    ({}, False),
])
def test_relu_gate_is_found_by_its_provenance(metadata, lowered):
    model, feeds = _tagged_gate(**metadata)
    got = cleaned(model)
    assert ("Where" not in ops(got)) == lowered and ("Cast" in ops(got)) == lowered
    assert_same_function(model, got, feeds)


def test_backward_nodes_carry_their_forward_op_through_the_cleanup():
    """Every backward node, also those the rewrites and the lowering made, records the forward op
    type in its own entry, agreeing with GRAD_OF's label."""
    model, _, wrt = mlp("Relu")
    proto, _ = _gradient(model, wrt)
    assert "Cast" in ops(proto) and "Where" not in ops(proto)  # the gate was lowered
    backward = list(ir.from_proto(proto).graph)[len(model.graph.node):]
    tagged = [o for o in map(provenance, backward) if o is not None]
    assert len(tagged) >= len(backward) - 1  # the engine's own bias sum (a product with ones) has no rule
    assert {o.op_type for o in tagged} == {"Relu", "MatMul", "Tanh"}
    gate = [n.op_type for n in backward if provenance(n) is not None and provenance(n).is_op("Relu")]
    assert gate == ["Greater", "Cast", "Mul"]  # the lowering's nodes keep the gate's provenance
    for node in proto.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        if GRAD_OF in props:
            assert props[GRAD_OF_OP] == props[GRAD_OF].split(":", 1)[0] and GRAD_OF_DOMAIN not in props


def test_provenance_records_a_custom_domain():
    node = ir.node("Relu", [], domain="custom", name="r")
    origin = Provenance.of(node)
    assert origin == Provenance("Relu", "custom", "Relu:r") and not origin.is_op("Relu")
    assert origin.metadata() == {GRAD_OF: "Relu:r", GRAD_OF_OP: "Relu", GRAD_OF_DOMAIN: "custom"}
    assert Provenance.of(ir.node("Relu", [], domain="ai.onnx", name="r")).metadata() == {GRAD_OF: "Relu:r", GRAD_OF_OP: "Relu"}
    tagged = ir.node("Where", [])
    mark(tagged, origin)
    assert provenance(tagged) == origin
    mark(tagged, Provenance("Neg", "", "Neg:m"))  # kept: a node keeps the provenance it has
    assert provenance(tagged) == origin
    mark(tagged, Provenance("Neg", "", "Neg:m"), overwrite=True)  # replaced whole: no stale domain
    assert dict(tagged.metadata_props) == {GRAD_OF: "Neg:m", GRAD_OF_OP: "Neg"}


# SoftmaxCrossEntropyLoss: NegativeLogLikelihoodLoss of a LogSoftmax, its gradient's Softmax the
# Exp of that LogSoftmax, and no one-hot of the scores' size.

def _cross_entropy(reduction, ignore_index, extra_dims=(), classes=5, n=6, log_prob=False):
    scores = f32(n, classes, *extra_dims) * 3
    labels = R.integers(0, classes, size=(n, *extra_dims)).astype(np.int64)
    if ignore_index is not None:
        labels.flat[::3] = ignore_index
    attributes = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    outputs = ["loss", "log_prob"] if log_prob else ["loss"]
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], outputs, **attributes)
    feeds = {"scores": scores, "labels": labels}
    if reduction == "none":  # a scalar to differentiate
        return make_model([node, helper.make_node("ReduceSum", ["loss"], ["total"], keepdims=0)], feeds, ["total"]), feeds
    return make_model([node], feeds, ["loss"]), feeds


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, -3, 2, -100, 9])
@pytest.mark.parametrize("extra_dims", [(), (3,)])
def test_cross_entropy_is_lowered_to_nll_of_log_softmax_with_a_lean_gradient(reduction, ignore_index, extra_dims):
    """The gradient takes its weight off at each label with a ScatterElements (no one-hot of the
    scores' size) where every label, ignore_index included, indexes the 5 classes."""
    model, feeds = _cross_entropy(reduction, ignore_index, extra_dims)
    of = model.graph.output[0].name
    expected = fd_vjp(model, feeds, ["scores"], [np.ones((), np.float32)])
    for target in ("onnxruntime", None):
        ir_model = ir.from_proto(model)
        grad = autodiff_pass(of=of, wrt=["scores"])
        grad(ir_model)
        CleanupPass(target=target)(ir_model)
        proto = ir.to_proto(ir_model)
        onnx.checker.check_model(proto, full_check=True)
        got = run(proto, feeds)
        np.testing.assert_allclose(got[grad.gradient_names["scores"]], expected["scores"], rtol=1e-3, atol=1e-4,
                                   err_msg=f"target {target}")
        np.testing.assert_allclose(got[of], run(model, feeds)[of], rtol=1e-6, atol=1e-7)
        assert ("ScatterElements" in ops(proto)) == (ignore_index in (None, -3, 2)), ops(proto)
        if target == "onnxruntime":
            assert "SoftmaxCrossEntropyLoss" not in ops(proto) and "Softmax" not in ops(proto), ops(proto)
            assert {"NegativeLogLikelihoodLoss", "LogSoftmax", "Exp"} <= set(ops(proto))
        else:
            assert "SoftmaxCrossEntropyLoss" in ops(proto)


def test_cross_entropy_with_log_prob_stays_and_softmax_alone_stays():
    model, feeds = _cross_entropy("mean", None, log_prob=True)
    lowered = cleaned(model)
    assert ops(lowered) == ["SoftmaxCrossEntropyLoss"]
    softmax = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], {"x": f32(3, 4)}, ["y"])
    assert ops(cleaned(softmax)) == ["Softmax"]
    both = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1),
                       helper.make_node("LogSoftmax", ["x"], ["z"], axis=0)], {"x": f32(3, 4)}, ["y", "z"])
    assert sorted(ops(cleaned(both))) == ["LogSoftmax", "Softmax"]  # another axis
    same = make_model([helper.make_node("Softmax", ["x"], ["y"], axis=1),
                       helper.make_node("LogSoftmax", ["x"], ["z"], axis=1)], {"x": f32(3, 4)}, ["y", "z"])
    lowered = cleaned(same)
    assert sorted(ops(lowered)) == ["Exp", "LogSoftmax"]
    assert_same_function(same, lowered, {"x": f32(3, 4)})
