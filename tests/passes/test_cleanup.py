"""Cleanup passes: each rewrite fires and keeps the numbers; differentiated values never fold;
idempotent, deterministic, valid on subgraphs; conformance cases give the same gradients."""

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import make_model, rng
from onnx import TensorProto, helper, numpy_helper
from onnx_autodiff.passes.metadata import DIFFERENTIATED_KEY

from onnx_autodiff import OutlinePass, autodiff_pass, cleanup_passes

R = rng(11)


def run(model: onnx.ModelProto, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3  # no warnings about the backend cases' unused initializers
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def clean(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    result = ir.passes.PassManager(cleanup_passes(**options))(ir.from_proto(model)).model
    proto = ir.to_proto(result)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def assert_same_results(before, after, feeds, rtol=1e-6, atol=1e-6):
    expected, got = run(before, feeds), run(after, feeds)
    assert list(got) == list(expected)  # same output names, same order
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


def cleaned_case(nodes, inputs, outputs, initializers=None, opset=18, **kw):
    """(model, cleaned model, feeds) for a graph of ``nodes``; results checked equal on onnxruntime."""
    model = make_model(nodes, inputs, outputs, initializers=initializers, opset=opset, **kw)
    after = clean(model)
    assert_same_results(model, after, inputs)
    return model, after


# ------------------------------------------------------------------------- each rewrite fires


def test_mul_by_a_full_tensor_of_ones_and_add_of_zeros_vanish():
    x = R.standard_normal((3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["x", "ones"], ["a"]),
        helper.make_node("Add", ["zeros", "a"], ["b"]),
        helper.make_node("Div", ["b", "ones"], ["c"]),
        helper.make_node("Sub", ["c", "zeros"], ["d"]),
        helper.make_node("Relu", ["d"], ["y"]),
    ]
    inits = {"ones": np.ones((3, 4), np.float32), "zeros": np.zeros((3, 4), np.float32)}
    _, after = cleaned_case(nodes, {"x": x}, ["y"], initializers=inits)
    assert ops(after) == ["Relu"]
    assert len(after.graph.initializer) == 0


def test_ones_that_broadcast_to_a_larger_shape_stay():
    x = R.standard_normal((4,)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "ones"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    _, after = cleaned_case(nodes, {"x": x}, ["y"], initializers={"ones": np.ones((3, 4), np.float32)})
    assert "Mul" in ops(after) or "Expand" in ops(after)
    assert run(after, {"x": x})["y"].shape == (3, 4)


def test_zero_gradients_propagate_and_disappear():
    x = R.standard_normal((3, 4)).astype(np.float32)
    z = R.standard_normal((3, 4)).astype(np.float32)
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [3, 4])
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=shape),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),  # float zeros by default
        helper.make_node("Mul", ["x", "zeros"], ["a"]),
        helper.make_node("Transpose", ["a"], ["t"], perm=[1, 0]),
        helper.make_node("Neg", ["t"], ["n"]),
        helper.make_node("MatMul", ["z", "n"], ["m"]),
        helper.make_node("Add", ["m", "z2"], ["b"]),
        helper.make_node("Sum", ["b", "m", "z3"], ["y"]),
    ]
    inputs = {"x": x, "z": z, "z2": R.standard_normal((3, 3)).astype(np.float32),
              "z3": R.standard_normal((3, 3)).astype(np.float32)}
    _, after = cleaned_case(nodes, inputs, ["y"])
    assert ops(after) == ["Add"]
    assert sorted(after.graph.node[0].input) == ["z2", "z3"]


def test_mul_by_zeros_gives_zeros_of_the_broadcast_shape():
    x = R.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["zeros", "x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    _, after = cleaned_case(nodes, {"x": x}, ["y"], initializers={"zeros": np.zeros((3, 1), np.float32)})
    assert "Mul" not in ops(after)
    assert "x" not in {i for n in after.graph.node for i in n.input}


def test_transpose_pairs_compose_or_cancel():
    x = R.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 2, 0]),
        helper.make_node("Transpose", ["t1"], ["t2"], perm=[2, 0, 1]),  # the inverse: cancels
        helper.make_node("Relu", ["t2"], ["y"]),
        helper.make_node("Transpose", ["x"], ["u1"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["u1"], ["u2"], perm=[0, 2, 1]),  # composes into one
        helper.make_node("Relu", ["u2"], ["w"]),
        helper.make_node("Transpose", ["x"], ["v"], perm=[0, 1, 2]),  # identity permutation
        helper.make_node("Relu", ["v"], ["v2"]),
    ]
    _, after = cleaned_case(nodes, {"x": x}, ["y", "w", "v2"])
    assert ops(after).count("Transpose") == 1
    transpose = next(n for n in after.graph.node if n.op_type == "Transpose")
    assert list(transpose.attribute[0].ints) == [1, 2, 0]


def test_a_transpose_read_elsewhere_is_not_composed_into_the_next():
    # Composing would save no node (the inner one stays for its Relu) and would turn a swap of the
    # last two axes, which runtimes fuse into the MatMul, into a copy.
    x = R.standard_normal((2, 3, 4)).astype(np.float32)
    w = R.standard_normal((2, 4, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),  # [2, 4, 3]
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Transpose", ["t"], ["s"], perm=[0, 2, 1]),  # back to x: cancels
        helper.make_node("Transpose", ["t"], ["u"], perm=[1, 0, 2]),  # [4, 2, 3]: stays as it is
        helper.make_node("MatMul", ["s", "w"], ["y"]),
    ]
    _, after = cleaned_case(nodes, {"x": x}, ["r", "u", "y"], initializers={"w": w})
    perms = {n.output[0]: list(n.attribute[0].ints) for n in after.graph.node if n.op_type == "Transpose"}
    assert sorted(perms.values()) == [[0, 2, 1], [1, 0, 2]]
    assert next(n for n in after.graph.node if n.op_type == "MatMul").input[0] == "x"


def test_transpose_into_matmul_becomes_gemm():
    a = R.standard_normal((4, 3)).astype(np.float32)
    b = R.standard_normal((5, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
        helper.make_node("Transpose", ["b"], ["bt"]),  # no perm: reverses the axes
        helper.make_node("MatMul", ["at", "bt"], ["y"]),
        helper.make_node("Gemm", ["bt", "a"], ["g"], transA=1, alpha=0.5),  # transposes back
    ]
    _, after = cleaned_case(nodes, {"a": a, "b": b}, ["y", "g"])
    assert ops(after) == ["Gemm", "Gemm"]
    attrs = [{k: helper.get_node_attr_value(n, k) if any(a.name == k for a in n.attribute) else 0
              for k in ("transA", "transB")} for n in after.graph.node]
    assert attrs == [{"transA": 1, "transB": 1}, {"transA": 0, "transB": 0}]


def _einsum_equations(model):
    return [helper.get_node_attr_value(n, "equation").decode() for n in model.graph.node if n.op_type == "Einsum"]


def test_transposes_fold_into_einsum_equations():
    x = R.standard_normal((2, 3, 4)).astype(np.float32)
    w = R.standard_normal((4, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),  # [4, 2, 3], read by Einsums only
        helper.make_node("Einsum", ["t", "w"], ["e"], equation="kab,kn->abn"),
        helper.make_node("Transpose", ["e"], ["y"], perm=[2, 0, 1]),  # [5, 2, 3]: the output letters move
        helper.make_node("Einsum", ["w", "t"], ["z"], equation="kn, kab -> nb"),  # the second reader
        helper.make_node("Transpose", ["x"], ["u"], perm=[1, 0, 2]),  # also read by a Relu: stays
        helper.make_node("Einsum", ["u"], ["s"], equation="bak->ak"),
        helper.make_node("Relu", ["u"], ["r"]),
    ]
    _, after = cleaned_case(nodes, {"x": x, "w": w}, ["y", "z", "s", "r"], initializers=None)
    assert ops(after).count("Transpose") == 1 and ops(after).count("Einsum") == 3
    assert sorted(_einsum_equations(after)) == sorted(["abk,kn->nab", "kn,abk->nb", "bak->ak"])
    assert clean(after).SerializeToString() == after.SerializeToString()


def test_transpose_of_an_einsum_read_elsewhere_stays():
    a = R.standard_normal((2, 3)).astype(np.float32)
    b = R.standard_normal((3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Einsum", ["a", "b"], ["e"], equation="mk,kn->mn"),
        helper.make_node("Transpose", ["e"], ["y"], perm=[1, 0]),
        helper.make_node("Relu", ["e"], ["r"]),
        helper.make_node("Einsum", ["a", "b"], ["f"], equation="...k,kn->...n"),  # ellipsis: left alone
        helper.make_node("Transpose", ["f"], ["z"], perm=[1, 0]),
    ]
    _, after = cleaned_case(nodes, {"a": a, "b": b}, ["y", "r", "z"])
    assert ops(after).count("Transpose") == 2


def test_concat_of_merging_reshapes_becomes_one_reshape():
    xs = {k: R.standard_normal((2, 3, 2, 4)).astype(np.float32) for k in ("p", "q", "r")}
    nodes = [
        *(helper.make_node("Reshape", [k, "shape"], [f"{k}2"]) for k in xs),
        helper.make_node("Concat", ["p2", "q2", "r2"], ["y"], axis=-1),  # [N, 3, 24]
        helper.make_node("Reshape", ["p", "shape"], ["s2"]),
        helper.make_node("Concat", ["s2", "s2"], ["z"], axis=2),
        helper.make_node("Relu", ["s2"], ["w"]),  # s2 has other readers: this Concat stays
    ]
    sym = {k: ["N", 3, 2, 4] for k in xs}
    model = make_model(nodes, xs, ["y", "z", "w"], initializers={"shape": np.array([0, 3, 8], np.int64)}, shapes=sym)
    after = clean(model)
    assert ops(after).count("Concat") == 2 and ops(after).count("Reshape") == 2
    assert_same_results(model, after, xs)
    assert_same_results(model, after, {k: v[:1] for k, v in xs.items()})  # another batch size
    assert clean(after).SerializeToString() == after.SerializeToString()


def test_concat_of_transposes_becomes_one_transpose():
    # Attention heads: q, v arrive as [N, H, T, D] and k as [N, H, D, T]; each went back by its own
    # Transpose to [N, T, H, D] before the Concat over heads.
    q, v = (R.standard_normal((2, 3, 4, 5)).astype(np.float32) for _ in range(2))
    k = R.standard_normal((2, 3, 5, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 3, 1, 2]),
        helper.make_node("Transpose", ["v"], ["vt"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["qt", "kt", "vt"], ["y"], axis=2),  # [N, T, 3H, D]
        helper.make_node("Transpose", ["s"], ["a"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["s"], ["b"], perm=[0, 1, 3, 2]),
        helper.make_node("Concat", ["a", "b"], ["z"], axis=0),  # two perms, two inputs: no gain, stays
    ]
    s = R.standard_normal((2, 2, 3, 3)).astype(np.float32)
    _, after = cleaned_case(nodes, {"q": q, "k": k, "v": v, "s": s}, ["y", "z"])
    # one Transpose after the new Concat, one for k's residue (swap of the last two), z's two
    assert ops(after).count("Transpose") == 4 and ops(after).count("Concat") == 2
    assert clean(after).SerializeToString() == after.SerializeToString()


def test_transpose_of_a_matmul_moves_onto_its_inputs():
    a = R.standard_normal((2, 3, 4, 5)).astype(np.float32)
    b = R.standard_normal((2, 3, 4, 6)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=[0, 1, 3, 2]),  # composes with the new one
        helper.make_node("MatMul", ["at", "b"], ["p"]),  # [2, 3, 5, 6]
        helper.make_node("Transpose", ["p"], ["y"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["b", "c"], ["q"]),  # inputs not transposed: no gain, stays
        helper.make_node("Transpose", ["q"], ["z"], perm=[0, 1, 3, 2]),
    ]
    c = R.standard_normal((2, 3, 6, 2)).astype(np.float32)
    _, after = cleaned_case(nodes, {"a": a, "b": b, "c": c}, ["y", "z"])
    # y = MatMul(bᵀ, a): one Transpose (of b) instead of two; z's product keeps its Transpose
    assert ops(after).count("Transpose") == 2 and ops(after).count("MatMul") == 2
    assert clean(after).SerializeToString() == after.SerializeToString()


def test_constant_nodes_become_initializers():
    x = R.standard_normal((2, 3)).astype(np.float32)
    c = helper.make_tensor("c", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    branch = helper.make_graph([helper.make_node("Constant", [], ["k"], value_float=2.0)], "b", [],
                               [helper.make_tensor_value_info("k", TensorProto.FLOAT, [])])
    nodes = [
        helper.make_node("Constant", [], ["cst"], value=c),
        helper.make_node("Constant", [], ["axes"], value_ints=[1]),
        helper.make_node("Add", ["x", "cst"], ["a"]),
        helper.make_node("ReduceSum", ["a", "axes"], ["y"]),
        helper.make_node("Constant", [], ["out"], value_int=7),  # a graph output: stays a node
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Greater", ["m", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["k"], then_branch=branch, else_branch=branch),
    ]
    zero = np.zeros((), np.float32)
    model = make_model(nodes, {"x": x}, ["y", "out", "k"], initializers={"zero": zero},
                       output_shapes={"k": []})
    model.graph.output[1].type.tensor_type.elem_type = TensorProto.INT64
    after = clean(model)
    assert_same_results(model, after, {"x": x})
    main = [(n.op_type, list(n.output)) for n in after.graph.node if n.op_type == "Constant"]
    assert main == [("Constant", ["out"])]
    assert {"cst", "axes"} <= {t.name for t in after.graph.initializer}
    assert clean(after).SerializeToString() == after.SerializeToString()


def test_shape_ops_that_do_nothing_vanish():
    x = R.standard_normal((2, 1, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Reshape", ["x", "same"], ["r"]),
        helper.make_node("Expand", ["r", "ones"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axis1"], ["s"], keepdims=1),  # over a length-1 axis
        helper.make_node("Tile", ["s", "reps"], ["t"]),
        helper.make_node("Relu", ["t"], ["y"]),
        helper.make_node("Reshape", ["x", "flat"], ["f1"]),
        helper.make_node("Reshape", ["f1", "other"], ["f2"]),  # Reshape∘Reshape: one Reshape
        helper.make_node("Relu", ["f2"], ["w"]),
    ]
    inits = {
        "same": np.array([2, 1, 4], np.int64), "ones": np.array([1, 1], np.int64),
        "axis1": np.array([1], np.int64), "reps": np.array([1, 1, 1], np.int64),
        "flat": np.array([-1], np.int64), "other": np.array([4, 2], np.int64),
    }
    _, after = cleaned_case(nodes, {"x": x}, ["y", "w"], initializers=inits)
    assert sorted(ops(after)) == ["Relu", "Relu", "Reshape"]


def test_noop_expand_with_a_symbolic_batch_vanishes():
    x = R.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Expand", ["x", "ones"], ["e"]), helper.make_node("Relu", ["e"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], initializers={"ones": np.array([1, 1], np.int64)},
                       shapes={"x": ["N", 4]})
    after = clean(model)
    assert ops(after) == ["Relu"]
    for n in (1, 5):
        feeds = {"x": R.standard_normal((n, 4)).astype(np.float32)}
        assert_same_results(model, after, feeds)


def test_squeeze_unsqueeze_pairs_cancel_in_both_opset_forms():
    x = R.standard_normal((3, 1, 4)).astype(np.float32)
    nodes13 = [
        helper.make_node("Unsqueeze", ["x", "ax"], ["u"]),
        helper.make_node("Squeeze", ["u", "neg"], ["s"]),  # the same axis, counted from the end
        helper.make_node("Squeeze", ["s", "one"], ["q"]),
        helper.make_node("Unsqueeze", ["q", "one"], ["p"]),
        helper.make_node("Relu", ["p"], ["y"]),
    ]
    inits = {"ax": np.array([0], np.int64), "neg": np.array([-4], np.int64), "one": np.array([1], np.int64)}
    _, after = cleaned_case(nodes13, {"x": x}, ["y"], initializers=inits)
    assert ops(after) == ["Relu"]
    nodes11 = [
        helper.make_node("Unsqueeze", ["x"], ["u"], axes=[3]),
        helper.make_node("Squeeze", ["u"], ["s"], axes=[-1]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    _, after = cleaned_case(nodes11, {"x": x}, ["y"], opset=11)
    assert ops(after) == ["Relu"]


def test_exact_cast_chains_vanish_and_lossy_ones_stay():
    x = R.standard_normal((3, 4)).astype(np.float32) * 1e3
    nodes = [
        helper.make_node("Cast", ["x"], ["same"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["same"], ["d"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["d"], ["back"], to=TensorProto.FLOAT),
        helper.make_node("CastLike", ["back", "x"], ["like"]),
        helper.make_node("Relu", ["like"], ["y"]),
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),  # lossy: must stay
        helper.make_node("Cast", ["h"], ["hb"], to=TensorProto.FLOAT),
        helper.make_node("Relu", ["hb"], ["w"]),
    ]
    _, after = cleaned_case(nodes, {"x": x}, ["y", "w"])
    assert ops(after).count("Cast") == 2
    assert not np.array_equal(run(after, {"x": x})["w"], np.maximum(x, 0))  # the rounding is kept


def test_identities_of_one_value_keep_both_output_names():
    x = R.standard_normal((3,)).astype(np.float32)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["r"], ["o1"]),
        helper.make_node("Identity", ["r"], ["o2"]),
        helper.make_node("Identity", ["x"], ["o3"]),  # a graph input: the Identity must stay
        helper.make_node("Identity", ["o1"], ["t"]),
        helper.make_node("Neg", ["t"], ["o4"]),
    ]
    _, after = cleaned_case(nodes, {"x": x}, ["o1", "o2", "o3", "o4"])
    assert [o.name for o in after.graph.output] == ["o1", "o2", "o3", "o4"]
    assert ops(after).count("Identity") == 2


def test_rewrites_reach_if_branches():
    x = R.standard_normal((3,)).astype(np.float32)

    def branch(name, op):
        return helper.make_graph(
            [helper.make_node(op, ["x", "ones"], [f"{name}_a"]), helper.make_node("Neg", [f"{name}_a"], [f"{name}_out"])],
            name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [3])],
        )

    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch("then", "Mul"), else_branch=branch("else", "Div"))]
    model = make_model(nodes, {"x": x, "c": np.array(True)}, ["y"], initializers={"ones": np.ones(3, np.float32)})
    after = clean(model)
    for c in (True, False):
        assert_same_results(model, after, {"x": x, "c": np.array(c)})
    branches = [a.g for a in after.graph.node[0].attribute]
    assert [[n.op_type for n in g.node] for g in branches] == [["Neg"], ["Neg"]]


def test_a_dead_if_takes_the_outer_values_it_read_along():
    x = R.standard_normal((3,)).astype(np.float32)

    def branch(name):
        return helper.make_graph([helper.make_node("Identity", ["a"], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [3])])

    nodes = [
        helper.make_node("Neg", ["x"], ["a"]),  # read only inside the branches of an unused If
        helper.make_node("If", ["c"], ["unused"], then_branch=branch("then"), else_branch=branch("else")),
        helper.make_node("Relu", ["x"], ["y"]),
    ]
    _, after = cleaned_case(nodes, {"x": x, "c": np.array(True)}, ["y"])
    assert ops(after) == ["Relu"]
    assert clean(after).SerializeToString() == after.SerializeToString()


def test_rewrites_reach_model_local_functions():
    x = R.standard_normal((3, 4)).astype(np.float32)
    function = helper.make_function(
        "local", "f", ["a"], ["b"],
        [
            helper.make_node("Transpose", ["a"], ["t"], perm=[1, 0]),
            helper.make_node("Transpose", ["t"], ["u"], perm=[1, 0]),
            helper.make_node("Relu", ["u"], ["b"]),
        ],
        [helper.make_opsetid("", 18)],
    )
    model = make_model([helper.make_node("f", ["x"], ["y"], domain="local")], {"x": x}, ["y"],
                       extra_opsets={"local": 1}, output_shapes={"y": [3, 4]})
    model.functions.append(function)
    after = clean(model)
    assert_same_results(model, after, {"x": x})
    assert [n.op_type for n in after.functions[0].node] == ["Relu"]


# ------------------------------------------------------------------------- what must not fold


def linear_model():
    """y = Σ x·Wᵀ with W an initializer (a training parameter)."""
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["h"]),
        helper.make_node("Tanh", ["h"], ["a"]),
        helper.make_node("ReduceSum", ["a"], ["y"], keepdims=0),
    ]
    x = R.standard_normal((2, 3)).astype(np.float32)
    W = R.standard_normal((4, 3)).astype(np.float32)
    return make_model(nodes, {"x": x}, ["y"], initializers={"W": W}), {"x": x}


def with_new_weights(model: onnx.ModelProto, W: np.ndarray) -> onnx.ModelProto:
    """The model with initializer W replaced, as a training step would feed it."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for i, t in enumerate(copy.graph.initializer):
        if t.name == "W":
            copy.graph.initializer[i].CopyFrom(numpy_helper.from_array(W, "W"))
    return copy


def grads_and_cleaned(forward, drop_record=False, **options):
    raw = ir.to_proto(autodiff_pass(of="y", wrt=["W"])(ir.from_proto(forward)).model)
    if drop_record:
        kept = [p for p in raw.metadata_props if p.key != DIFFERENTIATED_KEY]
        del raw.metadata_props[:]
        raw.metadata_props.extend(kept)
    return raw, clean(raw, **options)


@pytest.mark.parametrize("how", ["recorded", "keep"])
def test_differentiated_initializers_are_never_folded(how):
    forward, feeds = linear_model()
    if how == "keep":  # neither the record nor a grad_W output: only the explicit option
        raw = ir.to_proto(autodiff_pass(of="y", wrt=["W"])(ir.from_proto(forward)).model)
        del raw.metadata_props[:]
        raw.graph.output[-1].name = "dW"
        for node in raw.graph.node:
            node.output[:] = ["dW" if o == "grad_W" else o for o in node.output]
        cleaned = clean(raw, keep=["W"])
    else:
        raw, cleaned = grads_and_cleaned(forward)
    W2 = R.standard_normal((4, 3)).astype(np.float32)
    assert_same_results(with_new_weights(raw, W2), with_new_weights(cleaned, W2), feeds, rtol=1e-5)
    assert "Transpose" in ops(cleaned) or "Gemm" in ops(cleaned)


def test_what_is_protected_is_read_from_the_metadata_alone():
    """An output named grad_W protects nothing: without the record (or keep), W is a constant
    like any other, and Transpose(W) folds."""
    forward, feeds = linear_model()
    raw, cleaned = grads_and_cleaned(forward, drop_record=True)
    assert "grad_W" in [o.name for o in raw.graph.output]
    assert_same_results(raw, cleaned, feeds)
    assert any(n.op_type == "Transpose" and "W" in n.input for n in raw.graph.node)
    assert not any(n.op_type == "Transpose" and "W" in n.input for n in cleaned.graph.node)  # folded


def test_an_unprotected_initializer_does_fold():
    """The control for the test above: without any protection Transpose(W) becomes a constant."""
    forward, feeds = linear_model()
    raw = ir.to_proto(autodiff_pass(of="y", wrt=["x"])(ir.from_proto(forward)).model)
    cleaned = clean(raw)
    assert_same_results(raw, cleaned, feeds)
    assert "Transpose" not in ops(cleaned)
    W2 = R.standard_normal((4, 3)).astype(np.float32)
    stale = run(with_new_weights(cleaned, W2), feeds)["y"]
    assert not np.allclose(stale, run(with_new_weights(raw, W2), feeds)["y"])


def test_autodiff_records_the_differentiated_names():
    forward, _ = linear_model()
    model = autodiff_pass(of="y", wrt=["W", "x"])(ir.from_proto(forward)).model
    assert json.loads(model.metadata_props[DIFFERENTIATED_KEY]) == ["W", "x"]


def test_folding_does_not_materialise_large_fills():
    x = R.standard_normal((64, 64)).astype(np.float32)
    model = make_model([helper.make_node("Tanh", ["x"], ["y"])], {"x": x}, ["y"])
    raw = ir.to_proto(autodiff_pass(of="y", wrt=["x"], seed="ones")(ir.from_proto(model)).model)
    cleaned = clean(raw)
    assert_same_results(raw, cleaned, {"x": x})
    assert all(np.prod(t.dims) <= 1024 for t in cleaned.graph.initializer)
    for node in cleaned.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                assert np.prod(a.t.dims) <= 16, node.op_type


# ------------------------------------------------------------------------- whole backward graphs


def mlp_with_cross_entropy():
    W1 = R.standard_normal((8, 16)).astype(np.float32)
    b1 = np.zeros(16, np.float32)
    W2 = R.standard_normal((16, 4)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"]),
    ]
    x = R.standard_normal((5, 8)).astype(np.float32)
    t = R.integers(0, 4, 5).astype(np.int64)
    model = make_model(nodes, {"x": x, "t": t}, ["loss"], initializers={"W1": W1, "b1": b1, "W2": W2},
                       shapes={"x": ["N", 8], "t": ["N"]})
    return model, {"x": x, "t": t}


def test_backward_graph_shrinks_and_keeps_its_gradients():
    model, feeds = mlp_with_cross_entropy()
    raw = ir.to_proto(autodiff_pass(of="loss")(ir.from_proto(model)).model)
    cleaned = clean(raw)
    assert len(cleaned.graph.node) < len(raw.graph.node)
    assert_same_results(raw, cleaned, feeds, rtol=1e-5)
    feeds3 = {"x": feeds["x"][:3], "t": feeds["t"][:3]}  # the symbolic batch still works
    assert_same_results(raw, cleaned, feeds3, rtol=1e-5)


def test_cleanup_is_idempotent_and_deterministic():
    model, _ = mlp_with_cross_entropy()
    raw = ir.to_proto(autodiff_pass(of="loss")(ir.from_proto(model)).model)
    once = clean(raw)
    again = clean(raw)
    assert once.SerializeToString() == again.SerializeToString()
    assert clean(once).SerializeToString() == once.SerializeToString()


def test_the_default_passes_need_no_arguments():
    model, _ = mlp_with_cross_entropy()
    result = ir.passes.PassManager([autodiff_pass(of="loss"), *cleanup_passes()])(ir.from_proto(model))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    assert [o.name for o in proto.graph.output] == ["loss", "grad_W1", "grad_b1", "grad_W2"]
    assert {t.name for t in proto.graph.initializer} >= {"W1", "b1", "W2"}


# ------------------------------------------------------------------------- build cost


def residual_chain(layers: int) -> onnx.ModelProto:
    """x ← x + tanh(x·W_i), then the mean: each layer's backward repeats the same nodes."""
    nodes, weights, x = [], {}, "x"
    for i in range(layers):
        weights[f"w{i}"] = (R.standard_normal((4, 4)) / 2).astype(np.float32)
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"t{i}"]),
                  helper.make_node("Add", [x, f"t{i}"], [f"r{i}"])]
        x = f"r{i}"
    nodes.append(helper.make_node("ReduceMean", [x], ["loss"], keepdims=0))
    return make_model(nodes, {"x": R.standard_normal((2, 4)).astype(np.float32)}, ["loss"], initializers=weights)


def _cleanup_calls(model: onnx.ModelProto, monkeypatch) -> dict[str, int]:
    """How often the cleanup of the model's backward graph removes nodes from a graph and runs
    onnx's inference of the whole model (each costs time proportional to the model)."""
    calls = {"remove": 0, "infer": 0}
    remove, infer = ir.Graph.remove, onnx.shape_inference.infer_shapes

    def counted_remove(self, *args, **kwargs):
        calls["remove"] += 1
        return remove(self, *args, **kwargs)

    def counted_infer(*args, **kwargs):
        calls["infer"] += 1
        return infer(*args, **kwargs)

    raw = autodiff_pass(of="loss")(ir.from_proto(model)).model
    with monkeypatch.context() as patch:
        patch.setattr(ir.Graph, "remove", counted_remove)
        patch.setattr(onnx.shape_inference, "infer_shapes", counted_infer)
        cleanup_passes()[0](raw)
    return calls


def test_the_cleanup_does_not_repeat_work_per_node(monkeypatch):
    """Duplicates, dead nodes and replaced nodes leave the graph in one removal per step (each
    removal copies the list of graph outputs, one per gradient), and the values that lack a shape
    get it from their nodes' own inference (one per distinct node): nothing grows with the number
    of layers, where before there was one removal per node and a whole-model inference per round."""
    small, large = (_cleanup_calls(residual_chain(n), monkeypatch) for n in (5, 50))
    assert small == large
    assert large["infer"] <= 1


def test_the_rounds_end_without_a_last_removal_and_a_second_run_changes_nothing(monkeypatch):
    """A round after the first that folds and rewrites nothing ends before the dead-node removal
    and the common-subexpression elimination (they would find nothing): one removal fewer than
    rounds. Run again, the cleanup takes one round and changes nothing."""
    from onnx_autodiff.passes.unused import RemoveUnusedPass

    calls = []
    call = RemoveUnusedPass.call
    monkeypatch.setattr(RemoveUnusedPass, "call", lambda self, model: calls.append(model) or call(self, model))
    raw = autodiff_pass(of="loss")(ir.from_proto(residual_chain(5))).model
    cleanup = cleanup_passes()[0]
    first = cleanup(raw)
    assert first.modified and 1 < first.rounds < cleanup.max_rounds and len(calls) == first.rounds - 1
    once = ir.to_proto(raw).SerializeToString()
    second = cleanup(raw)
    assert not second.modified and second.rounds == 1
    assert ir.to_proto(raw).SerializeToString() == once


def test_equal_gradients_reach_a_fixed_point():
    """Two parameters with the same gradient: merging their graph outputs would only swap one
    node for an Identity, which the folder turns back; the rounds end at once."""
    nodes = [helper.make_node("Sum", ["a", "b", "c"], ["s"])]
    feeds = {k: R.standard_normal((3,)).astype(np.float32) for k in "abc"}
    raw = autodiff_pass(of="s", wrt=["a", "b", "c"], seed="ones")(ir.from_proto(make_model(nodes, feeds, ["s"]))).model
    cleanup = cleanup_passes()[0]
    cleanup(raw)
    assert cleanup.rounds < cleanup.max_rounds
    once = ir.to_proto(raw)
    assert not cleanup(raw).modified
    assert ir.to_proto(raw).SerializeToString() == once.SerializeToString()
    outputs = run(once, feeds)
    for name in ("grad_a", "grad_b", "grad_c"):
        np.testing.assert_array_equal(outputs[name], np.ones(3, np.float32))


# ------------------------------------------------------------------------- conformance cases


def _conformance_cases(step: int):
    from onnx_autodiff.conformance.runner import load_node_cases

    cases = [c for c in load_node_cases() if c.kind in ("node", "expanded")]
    return cases[::step]


def _backward_pair(case):
    """A thunk giving (raw, cleaned, feeds) for the case's first float input, the later ones frozen into initializers
    (so folding has constants to work on); None where the case has nothing to differentiate."""
    from onnx_autodiff.conformance.check import LOSS, backward_model, scalarize
    from onnx_autodiff.conformance.oracle import random_cotangents

    model = case.proto()
    feeds = {k: v for k, v in case.inputs.items() if isinstance(v, np.ndarray)}
    if len(feeds) != len(case.inputs) or any(o.type.WhichOneof("value") != "tensor_type" for o in model.graph.output):
        return None
    floats = [i.name for i in model.graph.input if i.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE)]
    if not floats:
        return None
    try:
        run(model, feeds)
    except Exception:  # noqa: BLE001 - onnxruntime lacks the forward op: nothing to compare on
        return None
    cotangents = random_cotangents(model, feeds, seed=0)
    if all(r is None for r in cotangents):
        return None
    scalar = scalarize(model, cotangents)
    frozen = onnx.ModelProto()
    frozen.CopyFrom(scalar)
    for name in floats[1:]:
        frozen.graph.initializer.append(numpy_helper.from_array(feeds[name], name))
        kept = [i for i in frozen.graph.input if i.name != name]
        del frozen.graph.input[:]
        frozen.graph.input.extend(kept)
    feeds = {k: v for k, v in feeds.items() if k == floats[0] or k not in floats}
    try:
        raw, _ = backward_model(frozen, LOSS, floats[:1])
        run(raw, feeds)
    except Exception:  # noqa: BLE001 - no backward graph that onnxruntime runs: nothing to compare
        return None
    return lambda: (raw, clean(raw), feeds)


def _check_cases(step: int, minimum: int):
    compared, failures = 0, []
    for case in _conformance_cases(step):
        pair = _backward_pair(case)
        if pair is None:
            continue
        try:
            raw, cleaned, feeds = pair()
            assert clean(raw).SerializeToString() == cleaned.SerializeToString(), "not deterministic"
            assert clean(cleaned).SerializeToString() == cleaned.SerializeToString(), "not idempotent"
            outlined = ir.from_proto(cleaned)
            OutlinePass()(outlined)
            outlined = ir.to_proto(outlined)
            onnx.checker.check_model(outlined, full_check=True)
            expected = run(raw, feeds)
            for after in (cleaned, outlined):
                got = run(after, feeds)
                assert list(got) == list(expected), "output names differ"
                for name, value in expected.items():
                    finite = value[np.isfinite(value)] if value.dtype.kind == "f" else value
                    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
                    np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5 * scale, equal_nan=True,
                                               err_msg=name)
        except Exception as error:  # noqa: BLE001 - collect every failing case, then report
            failures.append(f"{case.name}: {type(error).__name__}: {str(error).strip()[:300]}")
        compared += 1
    assert not failures, "\n".join(failures)
    assert compared >= minimum
    return compared


def test_conformance_sample_gives_the_same_gradients_with_and_without_cleanup():
    """Also checks, on each case, that cleanup is deterministic and idempotent, and that the
    outlined graph (OutlinePass after cleanup) is valid and gives the same gradients."""
    _check_cases(step=12, minimum=40)


@pytest.mark.slow
def test_conformance_sweep_gives_the_same_gradients_with_and_without_cleanup():
    _check_cases(step=1, minimum=600)


def test_transpose_of_a_large_frozen_weight_is_not_folded():
    """onnxscript's folder folds any Transpose; a frozen weight's would be a second copy of it."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from onnx_autodiff import autodiff_pass, cleanup_passes

    big = numpy_helper.from_array(np.ones((64, 32), np.float32), "W")  # 2,048 elements > FOLD_LIMIT
    small = numpy_helper.from_array(np.ones((4, 8), np.float32), "S")
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["X", "Wt"], ["h"]),
         helper.make_node("Transpose", ["S"], ["St"], perm=[1, 0]), helper.make_node("MatMul", ["X4", "St"], ["k"]),
         helper.make_node("ReduceSum", ["h"], ["a"], keepdims=0), helper.make_node("ReduceSum", ["k"], ["b"], keepdims=0),
         helper.make_node("Add", ["a", "b"], ["loss"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 32]), helper.make_tensor_value_info("X4", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [big, small])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    result = ir.passes.PassManager([autodiff_pass(of="loss", wrt=["X", "X4"]), *cleanup_passes()])(model).model
    initializers = {name: tuple(v.shape) for name, v in result.graph.initializers.items()}
    assert initializers.get("W") == (64, 32) and (32, 64) not in initializers.values()  # kept as a node
    assert (8, 4) in initializers.values() and "S" not in initializers  # a small one still folds
