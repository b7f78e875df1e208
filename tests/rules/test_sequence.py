import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_gradients, assert_valid_model, make_model, rng
from onnx_autodiff import cleanup_passes
from onnx_autodiff.conformance import fd_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.errors import RuleError
from onnx_autodiff.passes.transforms import hvp, vjp

R = rng(7)


def const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64)))


def randn(*shape):
    return R.standard_normal(shape).astype(np.float32)


def check(model, feeds, wrt):
    """Gradients match finite differences, and the backward graph runs on onnxruntime itself."""
    result = assert_gradients(model, feeds, wrt)
    out = model.graph.output[0].name
    proto, autodiff = backward_model(model, out, wrt, seed="input")
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run([out], feeds)[0]
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    grads = session.run([autodiff.gradient_names[x] for x in wrt], {**feeds, autodiff.seed_name: np.ones_like(y)})
    for x, g in zip(wrt, grads):
        assert g.shape == feeds[x].shape
    return result


def test_sequence_at_accumulates_and_negative_positions():
    # Two reads of the same sequence add their sequence gradients elementwise.
    x = randn(3, 4)
    nodes = [
        helper.make_node("SplitToSequence", ["X"], ["S"], axis=0, keepdims=0),
        const("p0", 0), const("p1", -1),
        helper.make_node("SequenceAt", ["S", "p0"], ["a"]),
        helper.make_node("SequenceAt", ["S", "p1"], ["b"]),
        helper.make_node("SequenceAt", ["S", "q"], ["c"]),
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("Mul", ["ab", "c"], ["Y"]),
    ]
    for q in (np.array(-2, np.int64), np.array(0, np.int32), np.array(2, np.int64)):
        model = make_model(nodes, {"X": x, "q": q}, ["Y"])
        check(model, {"X": x, "q": q}, ["X"])


def test_sequence_at_symbolic_batch():
    x = randn(4, 3)
    nodes = [
        helper.make_node("SplitToSequence", ["X"], ["S"], axis=0, keepdims=0),
        const("p", -1),
        helper.make_node("SequenceAt", ["S", "p"], ["last"]),
        helper.make_node("Sin", ["last"], ["Y"]),
    ]
    model = make_model(nodes, {"X": x}, ["Y"], shapes={"X": ["N", 3]})
    for n in (2, 4):
        check(model, {"X": x[:n]}, ["X"])


SPLITS = [
    # (split, attributes, concat attributes)
    (None, {"axis": 0, "keepdims": 0}, {"axis": -1, "new_axis": 1}),   # rows stacked as columns
    (None, {"axis": 1, "keepdims": 0}, {"axis": 0, "new_axis": 1}),
    (None, {"axis": -1}, {"axis": 0}),                                  # keepdims=1: pieces [3, 1]
    (np.array(2, np.int64), {"axis": 1}, {"axis": 1}),                  # 2, 2, 1
    (np.array([2, 1, 2], np.int64), {"axis": -1}, {"axis": -1}),
    (np.array([1, 2], np.int64), {"axis": 0, "keepdims": 0}, {"axis": 0}),  # keepdims ignored
]


@pytest.mark.parametrize("split,split_attrs,concat_attrs", SPLITS)
def test_split_to_sequence_then_concat(split, split_attrs, concat_attrs):
    x = randn(3, 5)
    inputs = ["X"] + (["split"] if split is not None else [])
    nodes = [
        helper.make_node("SplitToSequence", inputs, ["S"], **split_attrs),
        helper.make_node("ConcatFromSequence", ["S"], ["C"], **concat_attrs),
        helper.make_node("Mul", ["C", "C"], ["Y"]),
    ]
    inits = {"split": split} if split is not None else None
    model = make_model(nodes, {"X": x}, ["Y"], initializers=inits)
    check(model, {"X": x}, ["X"])


def test_concat_extents_at_run_time_symbolic():
    # Uneven pieces of a dimension only known at run time.
    x = randn(2, 5)
    nodes = [
        const("two", 2),
        helper.make_node("SplitToSequence", ["X", "two"], ["S"], axis=1),
        helper.make_node("ConcatFromSequence", ["S"], ["C"], axis=-1),
        helper.make_node("Mul", ["C", "W"], ["Y"]),
    ]
    model = make_model(nodes, {"X": x, "W": x}, ["Y"], shapes={"X": [2, "L"], "W": [2, "L"]})
    for length in (5, 3):
        w = randn(2, length)
        check(model, {"X": x[:, :length], "W": w}, ["X", "W"])


def test_sequence_construct():
    a, b = randn(2, 3), randn(2, 3)
    nodes = [
        helper.make_node("Mul", ["A", "B"], ["ab"]),
        helper.make_node("Sin", ["A"], ["sa"]),
        helper.make_node("SequenceConstruct", ["ab", "sa", "B"], ["S"]),
        const("one", 1),
        helper.make_node("SequenceAt", ["S", "one"], ["s1"]),
        helper.make_node("ConcatFromSequence", ["S"], ["C"], axis=0),
        helper.make_node("Tile", ["s1", "reps"], ["t"]),
        helper.make_node("Mul", ["C", "t"], ["Y"]),
    ]
    model = make_model(nodes, {"A": a, "B": b}, ["Y"], initializers={"reps": np.array([3, 1], np.int64)})
    check(model, {"A": a, "B": b}, ["A", "B"])


INSERT_ERASE = [
    # (insert position, erase position); None: absent; a string: a run-time graph input
    (None, None), (1, 0), (-1, -2), (3, None), (None, 1), ("pi", "pe"),
]


@pytest.mark.parametrize("insert_at,erase_at", INSERT_ERASE)
def test_insert_erase(insert_at, erase_at):
    x, z = randn(3, 4), randn(4)
    feeds = {"X": x, "Z": z}
    nodes = [helper.make_node("SplitToSequence", ["X"], ["S"], axis=0, keepdims=0),
             helper.make_node("Tanh", ["Z"], ["t"])]
    positions = []
    for name, at in (("pi", insert_at), ("pe", erase_at)):
        if isinstance(at, str):
            feeds[name] = np.array(-1 if name == "pi" else -3, np.int64)
        elif at is not None:
            nodes.append(const(name, at))
        positions.append([name] if at is not None else [])
    nodes += [
        helper.make_node("SequenceInsert", ["S", "t", *positions[0]], ["T"]),
        helper.make_node("SequenceErase", ["T", *positions[1]], ["E"]),
        helper.make_node("ConcatFromSequence", ["E"], ["C"], axis=0, new_axis=1),
        helper.make_node("Mul", ["C", "W"], ["Y"]),
    ]
    model = make_model(nodes, feeds, ["Y"], initializers={"W": randn(3, 4)})
    check(model, feeds, ["X", "Z"])


def map_body():
    """y = x * w + sin(x) * c, with c captured from the outer graph."""
    f = TensorProto.FLOAT
    return helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node("Sin", ["x"], ["sx"]),
            helper.make_node("Mul", ["sx", "c"], ["sc"]),
            helper.make_node("Add", ["xw", "sc"], ["y"]),
        ],
        "body",
        [helper.make_tensor_value_info("x", f, None), helper.make_tensor_value_info("w", f, [4])],
        [helper.make_tensor_value_info("y", f, None)],
    )


def test_sequence_map():
    x, w, c = randn(3, 4), randn(4), randn(4)
    nodes = [
        helper.make_node("SplitToSequence", ["X", "split"], ["S"], axis=0),
        helper.make_node("SequenceMap", ["S", "W"], ["M"], body=map_body()),
        helper.make_node("ConcatFromSequence", ["M"], ["Y"], axis=0),
    ]
    model = make_model(nodes, {"X": x, "W": w, "c": c}, ["Y"], initializers={"split": np.array([1, 2], np.int64)},
                       output_shapes={"Y": [3, 4]})
    check(model, {"X": x, "W": w, "c": c}, ["X", "W", "c"])


def test_sequence_map_two_sequences_one_output_unused():
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["p"]), helper.make_node("Sub", ["a", "b"], ["d"])],
        "body",
        [helper.make_tensor_value_info("a", f, None), helper.make_tensor_value_info("b", f, None)],
        [helper.make_tensor_value_info("p", f, None), helper.make_tensor_value_info("d", f, None)],
    )
    x, z = randn(2, 3), randn(2, 3)
    nodes = [
        helper.make_node("SplitToSequence", ["X"], ["S"], axis=1),
        helper.make_node("SplitToSequence", ["Z"], ["T"], axis=1),
        helper.make_node("SequenceMap", ["S", "T"], ["P", "D"], body=body),
        helper.make_node("ConcatFromSequence", ["P"], ["C"], axis=0),
        helper.make_node("Sin", ["C"], ["Y"]),
    ]
    model = make_model(nodes, {"X": x, "Z": z}, ["Y"], output_shapes={"Y": [6, 1]})
    check(model, {"X": x, "Z": z}, ["X", "Z"])


def unequal_pieces_model(rows):
    """loss = Σ sin(S[0]) · Σ S[1]², S = X [rows, 15] split into 7 and 8 columns."""
    nodes = [
        helper.make_node("SplitToSequence", ["X", "split"], ["S"], axis=1),
        const("p0", 0), const("p1", 1),
        helper.make_node("SequenceAt", ["S", "p0"], ["a"]),
        helper.make_node("SequenceAt", ["S", "p1"], ["b"]),
        helper.make_node("Sin", ["a"], ["sa"]),
        helper.make_node("Mul", ["b", "b"], ["bb"]),
        helper.make_node("ReduceSum", ["sa"], ["ra"], keepdims=0),
        helper.make_node("ReduceSum", ["bb"], ["rb"], keepdims=0),
        helper.make_node("Mul", ["ra", "rb"], ["loss"]),
    ]
    return make_model(nodes, {"X": randn(rows, 15)}, ["loss"], initializers={"split": np.array([7, 8], np.int64)})


@pytest.mark.parametrize("rows", [4, 64])
def test_hvp_through_pieces_of_unequal_sizes(rows):
    """onnx's inference names the pieces' one unknown width ("unk__0"), which claimed the 7 and 8
    columns equal: onnxruntime reused one piece's buffer for the other (a warning, or failing)."""
    model = unequal_pieces_model(rows)
    x, v = randn(rows, 15), randn(rows, 15)
    check(model, {"X": x}, ["X"])
    # H·v is the VJP of the gradient with cotangent v (H is symmetric): finite differences of it.
    expected = fd_vjp(vjp(model, "loss", ["X"]), {"X": x}, ["X"], [None, v])["X"]
    hv = hvp(model, "loss", ["X"])
    cleaned = ir.from_proto(hv)
    for step in cleanup_passes():  # the cleanup types the values it adds by onnx's inference too
        cleaned = step(cleaned).model
    for proto in (hv, ir.to_proto(cleaned)):
        assert_valid_model(proto)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        (got,) = session.run(["hvp_X"], {"X": x, "v_X": v})
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


def test_older_opset_static_extents():
    # Before opset 17 (no SequenceMap) concatenations whose extents are static still work.
    x = randn(3, 4)
    nodes = [
        helper.make_node("SplitToSequence", ["X"], ["S"], axis=1, keepdims=0),
        helper.make_node("ConcatFromSequence", ["S"], ["C"], axis=1, new_axis=1),
        helper.make_node("SplitToSequence", ["C"], ["S2"], axis=0),
        helper.make_node("ConcatFromSequence", ["S2"], ["C2"], axis=-2),
        helper.make_node("Mul", ["C2", "C2"], ["Y"]),
    ]
    model = make_model(nodes, {"X": x}, ["Y"], opset=13)
    check(model, {"X": x}, ["X"])


def older_opset_model(opset, shared):
    """Y = S[-2] * Σ_axis1(concat(S') * W), S' = S when ``shared``, else a second split of X."""
    x = randn(3, 4)
    nodes = [
        helper.make_node("SplitToSequence", ["X", "split"], ["S"], axis=1),
        helper.make_node("SplitToSequence", ["X", "split"], ["S2"], axis=1),
        const("p", -2),
        helper.make_node("SequenceAt", ["S", "p"], ["a"]),
        helper.make_node("ConcatFromSequence", ["S" if shared else "S2"], ["C"], axis=1),
        helper.make_node("Mul", ["C", "W"], ["cw"]),
        helper.make_node("ReduceSum", ["cw", "axes"], ["r"], keepdims=1),
        helper.make_node("Mul", ["a", "r"], ["Y"]),
    ]
    inits = {"split": np.array([1, 2, 1], np.int64), "axes": np.array([1], np.int64)}
    return make_model(nodes, {"X": x, "W": x}, ["Y"], initializers=inits, opset=opset)


@pytest.mark.parametrize("opset", [13, 16])
def test_before_opset_17(opset):
    # Zeros like a sequence and run-time extents come from a Loop carrying a sequence.
    feeds = {"X": randn(3, 4), "W": randn(3, 4)}
    check(older_opset_model(opset, shared=False), feeds, ["X", "W"])


def test_before_opset_17_shared_sequence():
    """Two uses of a sequence add their gradients with SequenceMap (opset 17): the op builder asks for
    that opset, and the model is converted."""
    feeds = {"X": randn(3, 4), "W": randn(3, 4)}
    check(older_opset_model(16, shared=True), feeds, ["X", "W"])


def test_opset_12_refused():
    x = randn(3, 4)
    nodes = [
        helper.make_node("SplitToSequence", ["X"], ["S"], axis=0, keepdims=0),
        const("p", 1),
        helper.make_node("SequenceAt", ["S", "p"], ["Y"]),
    ]
    model = make_model(nodes, {"X": x}, ["Y"], opset=12)
    with pytest.raises(RuleError, match="opset 12: convert it"):
        backward_model(model, "Y", ["X"], seed="input")


def test_torch_scripted_split():
    torch = pytest.importorskip("torch")
    import io
    import warnings

    class Model(torch.nn.Module):
        def forward(self, x, w):
            pieces = torch.split(x, 2, dim=1)
            cat = torch.cat(pieces, dim=1)
            return (pieces[0] * pieces[-2]).sum() + (cat * cat * w).sum()

    x, w = randn(3, 5), randn(3, 5)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(Model()), (torch.from_numpy(x), torch.from_numpy(w)), buffer,
                          dynamo=False, opset_version=17, input_names=["x", "w"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "w": {0: "N"}})
    model = onnx.load_from_string(buffer.getvalue())
    assert {"SplitToSequence", "SequenceAt", "ConcatFromSequence"} <= {n.op_type for n in model.graph.node}
    # onnx-ir's shape inference would retype untyped sequences as tensors: type them with onnx's.
    model = onnx.shape_inference.infer_shapes(model)
    feeds = {"x": x, "w": w}
    check(model, feeds, ["x", "w"])

    proto, autodiff = backward_model(model, "y", ["x", "w"])
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    grads = session.run([autodiff.gradient_names[v] for v in ("x", "w")], feeds)
    tx, tw = (torch.from_numpy(v).requires_grad_() for v in (x, w))
    Model()(tx, tw).backward()
    np.testing.assert_allclose(grads[0], tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], tw.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_scalar_split_of_one_without_keepdims():
    # What TorchScript exports for unbind. onnxruntime removes the axis although the spec says
    # keepdims is ignored when split is given; the scalar output hides the difference.
    x = randn(3, 4)
    nodes = [
        const("one", 1),
        helper.make_node("SplitToSequence", ["X", "one"], ["S"], axis=-2, keepdims=0),
        const("p0", 0), const("p1", -1),
        helper.make_node("SequenceAt", ["S", "p0"], ["a"]),
        helper.make_node("SequenceAt", ["S", "p1"], ["b"]),
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("ReduceSum", ["ab"], ["Y"], keepdims=0),
    ]
    model = make_model(nodes, {"X": x}, ["Y"])
    check(model, {"X": x}, ["X"])


# Optionals: OptionalGetElement passes its element's gradient through (an optional holding it
# when the input is an optional), Optional takes the element back out.

def _optional_model(opset, wrap):
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"])]
    if wrap:
        nodes.append(helper.make_node("Optional", ["sq"], ["opt"]))
    nodes += [helper.make_node("OptionalGetElement", ["opt" if wrap else "sq"], ["got"]),
              helper.make_node("Sin", ["got"], ["y"])]
    return make_model(nodes, {"x": randn(2, 3)}, ["y"], opset=opset)


@pytest.mark.parametrize("opset", [18, 21])
def test_optional_get_element_of_a_tensor(opset):
    """From opset 18 a plain tensor passes through OptionalGetElement."""
    check(_optional_model(opset, wrap=False), {"x": randn(2, 3)}, ["x"])


def test_optional_get_element_of_a_tensor_opset28():
    """onnxruntime 1.32 has no OptionalGetElement-28 kernel: the check runs on the reference evaluator."""
    model = _optional_model(28, wrap=False)
    result = assert_gradients(model, {"x": randn(2, 3)}, ["x"], ad_backends=("onnxruntime", "reference"))
    assert np.any(result.ad["x"] != 0)


def test_optional_round_trip():
    """x -> Optional -> OptionalGetElement: the gradient goes in and out of an optional."""
    model = _optional_model(18, wrap=True)
    feeds = {"x": randn(2, 3)}
    result = assert_gradients(model, feeds, ["x"])
    assert np.any(result.ad["x"] != 0)
    proto, autodiff = backward_model(model, "y", ["x"], seed="input")
    assert [n.op_type for n in proto.graph.node].count("Optional") == 2  # the forward one and dY's
    ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {**feeds, autodiff.seed_name: np.ones((2, 3), np.float32)})
