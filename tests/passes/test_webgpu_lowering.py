"""The WebGPU lowering (``cleanup_passes(target="webgpu")``): each rule rewrites what onnxruntime-web's
WebGPU provider lacks into ops it runs, computing the same function (checked on onnxruntime's CPU
provider against the original graph), and every rewritten graph passes the full checker.
tests/test_webgpu.py runs the lowered train models in Chromium's WebGPU."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import make_model, numpy_dropout_mask, rng
from onnx import helper
from test_lowering import cleaned, ops, run

from onnx_autodiff import autodiff_pass
from onnx_autodiff.passes.cleanup import CleanupPass
from onnx_autodiff.passes.lowering import LoweringPass
from onnx_autodiff.passes.rewrite_rules import lowering_rules
from onnx_autodiff.passes.rewrite_rules.webgpu import (
    IGNORED_ID, NEVER_ID, dropout_key, dropout_tables, hashed_dropout, label_ids, label_table,
)
from onnx_autodiff.toolkit import Namer, OpBuilder

R = rng(23)
# ops the WebGPU provider has no kernel for (it also has none for int64 compute, see int64_readers)
ABSENT = {"Sum", "LogSoftmax", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def all_nodes(model: onnx.ModelProto):
    def walk(graph):
        for node in graph.node:
            yield node
            for attribute in node.attribute:
                for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                    yield from walk(sub)
    yield from walk(model.graph)


def int64_readers(model: onnx.ModelProto, name: str) -> list[str]:
    """The op types of the nodes that read ``name`` or an int64 value computed from it, except as
    Gather indices (which the WebGPU provider reads on the GPU)."""
    found, tainted = [], {name}
    inferred = onnx.shape_inference.infer_shapes(model)
    int64 = {v.name for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
             if v.type.tensor_type.elem_type == onnx.TensorProto.INT64}
    for node in all_nodes(model):
        reads = [i for i, x in enumerate(node.input) if x in tainted]
        if not reads or node.op_type == "Gather" and reads == [1]:
            continue
        found.append(node.op_type)
        tainted.update(o for o in node.output if o in int64)
    return found


def assert_same_function(model, lowered, feeds, rtol=1e-5, atol=1e-6):
    want, got = run(model, feeds), run(lowered, feeds)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def test_webgpu_is_a_known_target_and_keeps_the_onnxruntime_rules():
    names = [rule.name for rule in lowering_rules("webgpu").rules]
    assert {"webgpu_sum_as_adds", "webgpu_log_softmax_decomposed", "webgpu_cross_entropy_decomposed",
            "webgpu_label_equal_by_lookup", "ort_matmul_to_gemm"} <= set(names)


@pytest.mark.parametrize("shapes", [[(3, 4)], [(3, 4), (3, 4)], [(3, 4), (4,), (1, 4), ()]])
def test_sum_becomes_a_chain_of_adds(shapes):
    feeds = {f"x{i}": f32(*shape) for i, shape in enumerate(shapes)}
    model = make_model([helper.make_node("Sum", list(feeds), ["y"])], feeds, ["y"])
    lowered = cleaned(model, target="webgpu")
    assert ops(lowered) == ["Add"] * (len(shapes) - 1) or len(shapes) == 1 and ops(lowered) == ["Identity"]
    assert_same_function(model, lowered, feeds)


@pytest.mark.parametrize("shape,axis,opset", [
    ((4, 5), 1, 18), ((4, 5), -1, 13), ((2, 3, 4), 1, 18), ((2, 3, 4), 0, 17),
    ((2, 3, 4), 1, 11),  # opset 11 normalises over every axis from 1 on
])
def test_log_softmax_is_decomposed_stably(shape, axis, opset):
    x = f32(*shape) * 40  # exp of these overflows float32 without the max subtracted
    x.flat[0] = -np.inf  # a masked logit
    model = make_model([helper.make_node("LogSoftmax", ["x"], ["y"], axis=axis)], {"x": x}, ["y"], opset=opset)
    lowered = cleaned(model, target="webgpu")
    assert not ABSENT & set(ops(lowered)) and {"ReduceMax", "Exp", "Log"} <= set(ops(lowered))
    assert_same_function(model, lowered, {"x": x})


def test_label_table_tells_every_valid_label_apart():
    for classes, ignore_index in [(5, None), (5, -100), (5, 2), (5, 5), (5, 9), (1, -1)]:
        table = label_table(classes, ignore_index)
        valid = [*range(classes), *([] if ignore_index is None else [ignore_index])]
        ids = table[np.array(valid)]  # as Gather indexes, negative from the end
        assert len(set(ids.tolist())) == len(set(valid)), (classes, ignore_index)
        for k in [*valid, -7, classes, 1000]:
            equal = np.array(valid) == k
            np.testing.assert_array_equal(ids == label_ids(np.array([k]), classes, ignore_index)[0], equal,
                                          err_msg=f"C={classes} ignore_index={ignore_index} k={k}")
    assert label_ids(np.array([-100, 3, 7]), 5, -100).tolist() == [IGNORED_ID, 3, NEVER_ID]


def _loss_model(op_type, reduction, weighted, ignore_index, extra_dims=(), opset=18, classes=4, n=6):
    scores = f32(n, classes, *extra_dims) * 3
    if op_type == "NegativeLogLikelihoodLoss":
        scores = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    labels = R.integers(0, classes, size=(n, *extra_dims)).astype(np.int64)
    if ignore_index is not None:
        labels.flat[::3] = ignore_index
    feeds = {"scores": scores, "labels": labels}
    inputs = ["scores", "labels"]
    if weighted:
        feeds["weights"] = R.uniform(0.5, 2.0, classes).astype(np.float32)
        inputs.append("weights")
    attributes = {"reduction": reduction}
    if ignore_index is not None:
        attributes["ignore_index"] = ignore_index
    model = make_model([helper.make_node(op_type, inputs, ["loss"], **attributes)], feeds, ["loss"], opset=opset)
    return model, feeds


@pytest.mark.parametrize("op_type", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, -100, 1, 7])
def test_losses_are_decomposed_without_int64_compute(op_type, reduction, weighted, ignore_index):
    model, feeds = _loss_model(op_type, reduction, weighted, ignore_index)
    lowered = cleaned(model, target="webgpu")
    assert not ABSENT & set(ops(lowered)), ops(lowered)
    assert int64_readers(lowered, "labels") == []
    assert_same_function(model, lowered, feeds)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_over_extra_axes(reduction):
    model, feeds = _loss_model("SoftmaxCrossEntropyLoss", reduction, True, -100, extra_dims=(3, 2))
    lowered = cleaned(model, target="webgpu")
    assert "SoftmaxCrossEntropyLoss" not in ops(lowered)
    assert_same_function(model, lowered, feeds)


def test_a_loss_stays_while_another_node_computes_on_its_labels():
    """Once decomposed, nothing would say what values the labels take, which the lookup of the
    other node's labels needs: the loss waits (here for ever: a Cast of the labels is no rule's)."""
    model, feeds = _loss_model("SoftmaxCrossEntropyLoss", "mean", False, -100)
    model.graph.node.append(helper.make_node("Cast", ["labels"], ["labels_f"], to=onnx.TensorProto.FLOAT))
    model.graph.output.append(helper.make_tensor_value_info("labels_f", onnx.TensorProto.FLOAT, [6]))
    assert "SoftmaxCrossEntropyLoss" in ops(cleaned(model, target="webgpu"))


def test_a_loss_of_a_symbolic_class_count_stays():
    model, _ = _loss_model("SoftmaxCrossEntropyLoss", "mean", False, -100)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "C"
    assert "SoftmaxCrossEntropyLoss" in ops(cleaned(model, target="webgpu"))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_cross_entropy_gradient_lowered_reads_labels_only_through_the_lookup(weighted, ignore_index):
    """The gradient's one-hot and ignore mask (Equal of the int64 labels and the class ids) compare
    looked-up int32 class ids; the loss and gradients are those of the canonical graph."""
    model, feeds = _loss_model("SoftmaxCrossEntropyLoss", "mean", weighted, ignore_index)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    model.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "N"
    graphs = {}
    for target in (None, "webgpu"):
        ir_model = ir.from_proto(model)
        autodiff_pass(of="loss", wrt=["scores", *(["weights"] if weighted else [])])(ir_model)
        CleanupPass(target=target)(ir_model)
        graphs[target] = ir.to_proto(ir_model)
        onnx.checker.check_model(graphs[target], full_check=True)
    lowered = graphs["webgpu"]
    assert not ABSENT & set(ops(lowered)), ops(lowered)
    assert int64_readers(lowered, "labels") == []
    assert_same_function(graphs[None], lowered, feeds)


def test_lowering_pass_lowers_subgraphs_and_is_idempotent():
    """LoweringPass (the lowering alone, for a train model's optimiser step): the Sum of an If
    branch becomes Adds; a second run changes nothing."""
    x = f32(3)
    branch = helper.make_graph([helper.make_node("Sum", ["x", "x", "x"], ["s"])], "then", [],
                               [helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["i"])], "else", [],
                              [helper.make_tensor_value_info("i", onnx.TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0),
             helper.make_node("Greater", ["t", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)]
    model = make_model(nodes, {"x": x}, ["y"], initializers={"zero": np.array(0, np.float32)},
                       output_shapes={"y": [3]})
    ir_model = ir.from_proto(model)
    assert LoweringPass("webgpu")(ir_model).modified
    assert not LoweringPass("webgpu")(ir_model).modified
    lowered = ir.to_proto(ir_model)
    onnx.checker.check_model(lowered, full_check=True)
    assert "Sum" not in [n.op_type for n in all_nodes(lowered)]
    for sign in (1, -1):
        feeds = {"x": sign * np.abs(x)}
        np.testing.assert_allclose(run(lowered, feeds)["y"], run(model, feeds)["y"], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sign_by_comparisons_keeps_nan_and_zero(dtype):
    x = np.array([np.nan, -0.0, 0.0, 2, -3, np.inf, -np.inf, 1e-30], dtype)
    model = make_model([helper.make_node("Sign", ["x"], ["y"])], {"x": x}, ["y"])
    lowered = cleaned(model, target="webgpu")
    assert "Sign" not in ops(lowered)
    # onnxruntime's float32 kernel (its float16 one gives 0 for NaN, the ONNX reference NaN)
    wide = make_model([helper.make_node("Sign", ["x"], ["y"])], {"x": x.astype(np.float32)}, ["y"])
    want, got = run(wide, {"x": x.astype(np.float32)})["y"].astype(dtype), run(lowered, {"x": x})["y"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # +0 for -0, as the kernel gives


@pytest.mark.parametrize("weighted", [False, True])
def test_a_mean_over_no_label_is_nan_as_the_kernel_gives(weighted):
    model, feeds = _loss_model("SoftmaxCrossEntropyLoss", "mean", weighted, -100)
    feeds["labels"][:] = -100
    lowered = cleaned(model, target="webgpu")
    assert np.isnan(run(model, feeds)["loss"]) and np.isnan(run(lowered, feeds)["loss"])


# Dropout in training mode, hashed (hashed_dropout, dropout_key)

WEBGPU_OPS = {"Add", "Sub", "Mul", "Div", "Cast", "Gather", "Size", "Shape", "Range", "Reshape", "GreaterOrEqual",
              "Where", "Constant"}  # what the hashed dropout may use: ops the provider runs (measured)


def splitmix64(k: int) -> int:
    """The k-th output of splitmix64 seeded with 0, in Python integers (an oracle for the tables)."""
    mask = (1 << 64) - 1
    z = (k * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def hashed_dropout_model(shape, ratio=None, salt=0, dtype=np.float32, opset=18) -> onnx.ModelProto:
    """x, step, micro_batch (and ratio, unless a constant is given) in; y and mask out."""
    op = OpBuilder(opset, Namer([], prefix="t"))
    elem = ir.DataType.from_numpy(np.dtype(dtype))
    x = ir.Value(name="x", type=ir.TensorType(elem), shape=ir.Shape(shape))
    seeds = [ir.Value(name=name, type=ir.TensorType(ir.DataType.UINT32), shape=ir.Shape([]))
             for name in ("step", "micro_batch")]
    inputs = [x, *seeds]
    if ratio is None:
        rate = ir.Value(name="ratio", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
        inputs.append(rate)
    else:
        rate = op.Constant(value=ir.tensor(np.array(ratio, np.float32)))
    tables = [op.Constant(value=ir.tensor(table)) for table in dropout_tables()]
    y, mask = hashed_dropout(op, x, rate, dropout_key(op, *seeds, tables), salt, tables)
    y.name, mask.name = "y", "mask"
    y.type, y.shape, mask.type, mask.shape = ir.TensorType(elem), ir.Shape(shape), ir.TensorType(ir.DataType.BOOL), ir.Shape(shape)
    graph = ir.Graph(inputs, [y, mask], nodes=op.nodes, opset_imports={"": opset}, name="dropout")
    model = ir.to_proto(ir.Model(graph, ir_version=9))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_dropout_tables_are_splitmix64():
    low, high = dropout_tables()
    assert low.dtype == high.dtype == np.uint32 and low.shape == high.shape == (1 << 16,)
    for k in (0, 1, 12345, (1 << 16) - 1):
        assert low[k] == splitmix64(k + 1) >> 32 and high[k] == splitmix64(k + (1 << 16) + 1) >> 32


@pytest.mark.parametrize("shape, ratio, salt, step, micro_batch", [
    ((6, 7), 0.5, 0, 1, 0), ((2, 3, 4), 0.1, 3, 2, 1), ((), 0.5, 0, 5, 2), ((5,), None, 1, 7, 0),
    ((3, 70000), 0.25, 2, 2**32 - 1, 9),  # past 2^16 elements (the index's high half), the largest step
])
def test_hashed_dropout_draws_the_numpy_masks(shape, ratio, salt, step, micro_batch):
    """y = x·mask/(1 − ratio) with the mask of the hash's definition, bit for bit, in ops the
    WebGPU provider runs (no bitwise op, which it lacks; no int64 compute)."""
    model = hashed_dropout_model(shape, ratio, salt)
    assert {n.op_type for n in model.graph.node} <= WEBGPU_OPS
    rate = 0.3 if ratio is None else ratio
    x = R.standard_normal(shape).astype(np.float32)
    feeds = {"x": x, "step": np.array(step, np.uint32), "micro_batch": np.array(micro_batch, np.uint32)}
    if ratio is None:
        feeds["ratio"] = np.array(rate, np.float32)
    got = run(model, feeds)
    want = numpy_dropout_mask(shape, rate, step, micro_batch, salt)
    np.testing.assert_array_equal(got["mask"], want)
    scale = np.float32(1) / (np.float32(1) - np.float32(rate))  # the kernel's, in float32
    np.testing.assert_array_equal(got["y"], x * np.where(want, scale, np.float32(0)))


def test_hashed_dropout_in_float16_scales_in_its_type():
    model = hashed_dropout_model((4, 5), 0.2, dtype=np.float16)
    x = R.standard_normal((4, 5)).astype(np.float16)
    got = run(model, {"x": x, "step": np.array(3, np.uint32), "micro_batch": np.array(0, np.uint32)})
    assert got["y"].dtype == np.float16
    want = numpy_dropout_mask((4, 5), 0.2, 3)
    np.testing.assert_array_equal(got["y"], x * np.where(want, np.float16(1.25), np.float16(0)))


def test_hashed_masks_keep_one_minus_ratio_independently():
    """On 2^18 elements: the share kept is 1 − ratio, and the masks of neighbouring elements, of
    the next step, of another micro-batch and of another Dropout (salt) agree as independent
    draws do (p² + (1 − p)²), each within 5 standard deviations."""
    shape, ratio = (256, 1024), 0.3
    n = 256 * 1024
    masks = {}
    for key, (step, micro_batch, salt) in {"base": (4, 0, 0), "step": (5, 0, 0), "micro": (4, 1, 0), "salt": (4, 0, 1)}.items():
        model = hashed_dropout_model(shape, ratio, salt)
        feeds = {"x": np.ones(shape, np.float32), "step": np.array(step, np.uint32), "micro_batch": np.array(micro_batch, np.uint32)}
        masks[key] = run(model, feeds)["mask"].ravel()
    kept = masks["base"].mean()
    assert abs(kept - (1 - ratio)) < 5 * np.sqrt(ratio * (1 - ratio) / n), kept
    agree = ratio**2 + (1 - ratio) ** 2
    bound = 5 * np.sqrt(agree * (1 - agree) / n)
    base = masks["base"]
    pairs = {"neighbours": (base[1:], base[:-1]), "next row": (base[1024:], base[:-1024]),
             "2^16 apart": (base[1 << 16:], base[:-(1 << 16)]),
             **{key: (base, masks[key]) for key in ("step", "micro", "salt")}}
    for what, (a, b) in pairs.items():
        assert abs((a == b).mean() - agree) < bound, (what, (a == b).mean(), agree)
