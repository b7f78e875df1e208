import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from helpers import assert_gradients, make_model, op_model, rng
from onnx_autodiff import cleanup_passes
from onnx_autodiff.rules import nn as nn_rules
from onnx_autodiff.conformance import check_vjp
from onnx_autodiff.conformance.check import backward_model
from onnx_autodiff.conformance.differences import random_cotangents
from onnx_autodiff.errors import RuleError

R = rng()


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def check(op_type, inputs, wrt=None, backends=None, **kw):
    """Finite-difference check, plus: the backward graph loads and runs on onnxruntime itself.

    When the oracle falls back to float32 (no float64 kernel, or ``backends``), the bound is 10x
    tighter than its default weak tolerance: these ops are linear in each input, so float32
    differences stay accurate.
    """
    model = op_model(op_type, inputs, **kw)
    feeds = {k: v for k, v in inputs.items() if k}
    wrt = list(wrt or feeds)
    options = {"backends": backends} if backends else {}
    result = check_vjp(model, feeds, wrt, **options)
    assert result.ok, f"gradient mismatch\n{result}\nAD: {result.ad}\nFD: {result.fd}"
    if result.weak:
        assert max(result.errors.values()) < 0.1, str(result)
    for name in wrt:
        assert np.any(result.fd[name] != 0)
    y = _ort(model).run(None, feeds)[0]
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    _ort(proto).run(None, {**feeds, autodiff.seed_name: np.ones_like(y)})


def _ort(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


# Gemm

@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_transpose(trans_a, trans_b):
    a = f32(*((4, 3) if trans_a else (3, 4)))
    b = f32(*((5, 4) if trans_b else (4, 5)))
    c = f32(3, 5)
    check("Gemm", {"A": a, "B": b, "C": c}, transA=trans_a, transB=trans_b, alpha=0.7, beta=1.3)


@pytest.mark.parametrize("c_shape", [(), (5,), (1, 5), (3, 1), (3, 5), (1, 1)])
def test_gemm_c_broadcast(c_shape):
    a, b, c = f32(3, 4), f32(4, 5), f32(*c_shape)
    check("Gemm", {"A": a, "B": b, "C": c}, beta=-0.5)


def test_gemm_without_c():
    check("Gemm", {"A": f32(3, 4), "B": f32(5, 4)}, transB=1, alpha=2.0)


@pytest.mark.parametrize("opset", [7, 9, 11, 13])
def test_gemm_opsets(opset):
    a, b, c = f32(4, 3), f32(4, 5), f32(5)
    check("Gemm", {"A": a, "B": b, "C": c}, transA=1, alpha=0.5, opset=opset)


def test_gemm_symbolic_rows():
    a, b, c = f32(3, 4), f32(4, 5), f32(3, 1)
    check("Gemm", {"A": a, "B": b, "C": c}, shapes={"A": ["M", 4], "C": ["M", 1]})


# MatMul

MATMUL_SHAPES = [
    ((4,), (4,)),
    ((4,), (4, 3)),
    ((3, 4), (4,)),
    ((4,), (2, 4, 3)),
    ((2, 3, 4), (4,)),
    ((3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((3, 4), (2, 4, 5)),
    ((2, 3, 4), (4, 5)),
    ((2, 1, 2, 3), (1, 3, 3, 2)),
    ((2, 3, 2, 4), (4, 5)),
    ((4, 5), (2, 3, 5, 2)),
    ((2, 3, 2, 4), (4,)),
    ((4,), (2, 3, 4, 2)),
    ((1, 3, 2, 4), (2, 3, 4, 5)),
    ((2, 3, 2, 4), (2, 3, 4, 5)),
    ((2, 3, 2, 4), (3, 4, 5)),
    ((3, 2, 4), (2, 3, 4, 5)),
]


@pytest.mark.parametrize("shape_a,shape_b", MATMUL_SHAPES)
def test_matmul(shape_a, shape_b):
    check("MatMul", {"A": f32(*shape_a), "B": f32(*shape_b)})


@pytest.mark.parametrize("opset", [9, 11])
def test_matmul_old_opsets(opset):
    check("MatMul", {"A": f32(2, 3), "B": f32(2, 3, 2)}, opset=opset)
    check("MatMul", {"A": f32(3), "B": f32(2, 3, 2)}, opset=opset)
    check("MatMul", {"A": f32(2, 2, 3), "B": f32(3)}, opset=opset)
    check("MatMul", {"A": f32(2, 3), "B": f32(3, 4)}, opset=opset)
    check("MatMul", {"A": f32(2, 2, 3), "B": f32(3, 4)}, opset=opset)


def backward_op_types(inputs, opset=18, lowered=False, **kw):
    """Op types of the nodes the MatMul rule emits: canonical (no cleanup), or after the default
    cleanup, which lowers them for onnxruntime (its Constant nodes become initializers)."""
    model = op_model("MatMul", inputs, opset=opset, **kw)
    proto, _ = backward_model(model, "out0", ["A", "B"], seed="input")
    if lowered:
        cleaned = ir.from_proto(proto)
        ir.passes.PassManager(cleanup_passes())(cleaned)
        proto = ir.to_proto(cleaned)
    forward = {n.name for n in model.graph.node}
    return sorted(n.op_type for n in proto.graph.node if n.name not in forward)


@pytest.mark.parametrize(
    "shape_a,shape_b,opset,canonical,lowered",
    [
        # A linear layer: dW is one Gemm over the flattened batch, dA a MatMul by Wᵀ.
        ((2, 3, 4), (4, 5), 18, ["Constant", "Constant", "Gemm", "MatMul", "Reshape", "Reshape", "Transpose"],
         ["Gemm", "MatMul", "Reshape", "Reshape", "Transpose"]),
        ((4, 5), (2, 3, 5, 2), 18, ["Einsum", "MatMul", "Transpose"], ["Einsum", "MatMul", "Transpose"]),
        ((3, 4), (4, 5), 18, ["Gemm", "Gemm"], ["Gemm", "Gemm"]),
        ((3, 4), (4, 5), 11, ["Gemm", "Gemm"], ["Gemm", "Gemm"]),
        ((4,), (2, 4, 3), 18, ["Einsum", "Einsum"], ["Einsum", "Einsum"]),
        ((2, 3, 4), (4,), 18, ["Einsum", "Einsum"], ["Einsum", "Einsum"]),
        # Batch axes on both sides, equal extents and ranks: MatMul by the other's swap (which
        # onnxruntime fuses); with unequal ranks one Einsum each, summing the extra batch axes.
        ((2, 3, 4), (2, 4, 5), 18, ["MatMul", "MatMul", "Transpose", "Transpose"],
         ["MatMul", "MatMul", "Transpose", "Transpose"]),
        ((2, 3, 2, 4), (3, 4, 5), 18, ["Einsum", "Einsum"], ["Einsum", "Einsum"]),
        # A size-1 batch axis broadcasts (explicit Einsum letters cannot): MatMul with a Transpose
        # each, and ReduceSum over the broadcast axes.
        ((2, 1, 3, 4), (5, 4, 2), 18,
         ["Constant", "Constant", "MatMul", "MatMul", "ReduceSum", "ReduceSum", "Transpose", "Transpose"],
         ["MatMul", "MatMul", "ReduceSum", "ReduceSum", "Transpose", "Transpose"]),
        ((2, 3, 4), (2, 4, 5), 11, ["MatMul", "MatMul", "Transpose", "Transpose"],
         ["MatMul", "MatMul", "Transpose", "Transpose"]),
        # No Einsum before opset 12: the MatMul form, with ReduceSum over the batch axes.
        ((2, 3, 4), (4, 5), 11, ["MatMul", "MatMul", "ReduceSum", "Transpose", "Transpose"],
         ["MatMul", "MatMul", "ReduceSum", "Transpose", "Transpose"]),
    ],
)
def test_matmul_formulation(shape_a, shape_b, opset, canonical, lowered):
    inputs = {"A": f32(*shape_a), "B": f32(*shape_b)}
    assert backward_op_types(inputs, opset) == canonical
    assert backward_op_types(inputs, opset, lowered=True) == lowered


def test_matmul_bfloat16_keeps_the_matmul_form():
    """Einsum takes no bfloat16: the weight gradient falls back to MatMul and ReduceSum."""
    a, b = f32(2, 3, 4), f32(4, 5)
    model = op_model("MatMul", {"A": a, "B": b})
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = onnx.TensorProto.BFLOAT16
    proto, _ = backward_model(model, "out0", ["A", "B"], seed="input")
    types = [n.op_type for n in proto.graph.node]
    assert "Einsum" not in types and "ReduceSum" in types


@pytest.mark.parametrize("shape_a,shape_b", [((2, 3, 4), (4, 5)), ((3, 4), (4,)), ((3, 4), (4, 5))])
def test_matmul_float64(shape_a, shape_b):
    inputs = {"A": f32(*shape_a).astype(np.float64), "B": f32(*shape_b).astype(np.float64)}
    check("MatMul", inputs)


@pytest.mark.parametrize(
    "shape_a,shape_b",
    [((2, 3, 4), (4, 5)), ((4, 5), (2, 5, 3)), ((3, 4), (4, 5)), ((4,), (2, 4, 3)),
     ((2, 3, 4), (4,)), ((2, 3, 4), (2, 4, 5)), ((2, 2, 3, 4), (2, 4, 3)), ((2, 1, 3, 4), (3, 4, 2))],
)
def test_matmul_second_order(shape_a, shape_b):
    """The backward graph (Einsum, Gemm, MatMul forms) differentiated again, seed included."""
    a, b = f32(*shape_a), f32(*shape_b)
    model = op_model("MatMul", {"A": a, "B": b})
    y = _ort(model).run(None, {"A": a, "B": b})[0]
    first, autodiff = backward_model(model, "out0", ["A", "B"], seed="input")
    feeds = {"A": a, "B": b, autodiff.seed_name: f32(*y.shape)}
    result = check_vjp(first, feeds, list(feeds))
    assert result.ok, f"gradient mismatch\n{result}"


@pytest.mark.parametrize(
    "shape_a,shape_b,sym",
    [
        ((3, 2, 4), (4, 5), {"A": ["N", 2, 4]}),
        ((4, 5), (3, 5, 2), {"B": ["N", 5, 2]}),
        ((3, 2, 4), (1, 4, 5), {"A": ["N", 2, 4]}),
        ((3, 2, 4), (4,), {"A": ["N", 2, 4]}),
        ((4,), (3, 4, 2), {"B": ["N", 4, 2]}),
        ((3, 2, 4), (3, 4, 2), {"A": ["N", 2, 4], "B": ["N", 4, 2]}),
        ((3, 2, 2, 4), (4, 5), {"A": ["N", "T", 2, 4]}),
        ((2, 3), (3, 4), {"A": ["N", 3]}),
        ((2, 4), (3, 4, 2), {"B": ["N", 4, 2]}),
        ((3, 2, 2, 4), (3, 2, 4, 3), {"A": ["N", 2, 2, 4], "B": ["N", 2, 4, 3]}),  # one Einsum form
        ((3, 2, 2, 4), (3, 2, 4, 3), {"A": ["N", 2, 2, 4], "B": ["M", 2, 4, 3]}),  # N, M may differ
        ((3, 2, 4), (3, 4, 2), {"A": ["N", 2, 4]}),
    ],
)
def test_matmul_symbolic_batch(shape_a, shape_b, sym):
    check("MatMul", {"A": f32(*shape_a), "B": f32(*shape_b)}, shapes=sym)


# Conv

CONV_CASES = {
    # name: (X shape, W shape, attributes)
    "1d": ((2, 2, 6), (3, 2, 3), {}),
    "1d_group2": ((1, 4, 6), (4, 2, 3), {"group": 2}),
    "1d_stride2_pads": ((1, 2, 8), (2, 2, 3), {"strides": [2], "pads": [1, 2]}),
    "1d_depthwise_dil2": ((2, 3, 7), (3, 1, 3), {"group": 3, "dilations": [2]}),
    "1d_same_upper_s3": ((1, 2, 8), (2, 2, 4), {"auto_pad": "SAME_UPPER", "strides": [3]}),
    "2d": ((1, 2, 4, 4), (3, 2, 3, 3), {}),
    "2d_group2": ((1, 4, 4, 3), (4, 2, 3, 2), {"group": 2}),
    "2d_depthwise": ((2, 3, 4, 4), (3, 1, 3, 3), {"group": 3}),
    "2d_depthwise_multiplier": ((1, 2, 4, 4), (4, 1, 2, 3), {"group": 2, "strides": [2, 1]}),
    "2d_strides2": ((1, 2, 6, 5), (2, 2, 3, 3), {"strides": [2, 2]}),
    "2d_dilations2": ((1, 2, 6, 5), (2, 2, 3, 2), {"dilations": [2, 2]}),
    "2d_asym_pads": ((1, 2, 4, 4), (2, 2, 3, 3), {"pads": [1, 0, 2, 1]}),
    "2d_all": ((1, 4, 5, 6), (4, 2, 3, 2), {"group": 2, "strides": [2, 3], "dilations": [1, 2],
                                              "pads": [0, 2, 1, 1]}),
    "2d_valid": ((1, 2, 6, 5), (2, 2, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
    "2d_same_upper": ((1, 2, 5, 6), (2, 2, 3, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "2d_same_lower": ((1, 2, 5, 6), (2, 2, 3, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    "2d_same_upper_s1": ((1, 1, 4, 5), (2, 1, 2, 3), {"auto_pad": "SAME_UPPER"}),
    "2d_same_lower_s1": ((1, 1, 5, 4), (2, 1, 2, 3), {"auto_pad": "SAME_LOWER"}),
    "2d_kernel_shape": ((1, 2, 4, 4), (2, 2, 2, 3), {"kernel_shape": [2, 3], "pads": [1, 1, 1, 1]}),
    "3d": ((1, 2, 3, 3, 4), (2, 2, 2, 2, 3), {"strides": [1, 2, 1], "pads": [1, 0, 0, 0, 1, 1]}),
    "3d_group": ((1, 2, 3, 4, 3), (2, 1, 2, 2, 2), {"group": 2, "dilations": [1, 2, 1]}),
}
NO_BIAS = ["1d", "1d_group2", "2d_strides2", "2d_depthwise", "2d_same_lower", "3d"]


def conv_inputs(case, bias=True):
    x_shape, w_shape, attrs = CONV_CASES[case]
    inputs = {"X": f32(*x_shape), "W": f32(*w_shape)}
    if bias:
        inputs["B"] = f32(w_shape[0])
    return inputs, x_shape, attrs


@pytest.mark.parametrize(
    "case,bias", [(c, True) for c in CONV_CASES] + [(c, False) for c in NO_BIAS]
)
def test_conv(case, bias):
    inputs, _, attrs = conv_inputs(case, bias)
    check("Conv", inputs, **attrs)


@pytest.mark.parametrize("case,slices", [("2d", 0), ("2d_asym_pads", 0), ("2d_strides2", 1)])
def test_conv_kernel_grad_slice_only_when_taps_overhang(case, slices, monkeypatch):
    """dW's Conv gives exactly the kernel's taps unless the strides leave windows short of X's end."""
    monkeypatch.setattr(nn_rules, "COLUMNS_LIMIT", 0)  # the Conv form, as for large inputs
    inputs, _, attrs = conv_inputs(case, bias=False)
    # dY computed by another node, as in a network: it carries no shape of its own.
    nodes = [onnx.helper.make_node("Conv", ["X", "W"], ["y"], **attrs),
             onnx.helper.make_node("Mul", ["y", "y"], ["out0"])]
    model = make_model(nodes, inputs, ["out0"])
    proto, _ = backward_model(model, "out0", ["W"], seed="input")
    assert [n.op_type for n in proto.graph.node].count("Slice") == slices
    result = check_vjp(model, inputs, ["W"])
    assert result.ok, str(result)


@pytest.mark.parametrize("case", ["1d_stride2_pads", "2d_asym_pads", "2d_dilations2", "2d_same_lower", "3d"])
@pytest.mark.parametrize("limit", ["columns", "conv"])
def test_conv_kernel_grad_by_columns_and_by_conv(case, limit, monkeypatch):
    """Both dW formulations agree with finite differences; the columns form is the one used for
    small static inputs, the Conv form past COLUMNS_LIMIT."""
    if limit == "conv":
        monkeypatch.setattr(nn_rules, "COLUMNS_LIMIT", 0)
    inputs, _, attrs = conv_inputs(case, bias=False)
    proto, _ = backward_model(op_model("Conv", inputs, **attrs), "out0", ["W"], seed="input")
    types = [n.op_type for n in proto.graph.node]
    assert (types.count("Conv") == 2 and "ReduceSum" in types) == (limit == "columns")
    check("Conv", inputs, wrt=["W"], **attrs)


@pytest.mark.parametrize("case", ["2d_all", "1d_depthwise_dil2", "1d_same_upper_s3"])
def test_conv_symbolic_batch(case):
    inputs, x_shape, attrs = conv_inputs(case)
    check("Conv", inputs, shapes={"X": ["N", *x_shape[1:]]}, **attrs)


@pytest.mark.parametrize("case", ["2d_all", "1d_stride2_pads"])
def test_conv_symbolic_spatial(case):
    inputs, x_shape, attrs = conv_inputs(case, bias=False)
    sym = ["N", x_shape[1], *(f"S{i}" for i in range(len(x_shape) - 2))]
    check("Conv", inputs, shapes={"X": sym}, **attrs)


@pytest.mark.parametrize("opset", [1, 11])
def test_conv_old_opsets(opset):
    inputs, _, attrs = conv_inputs("1d_depthwise_dil2")
    check("Conv", inputs, opset=opset, **attrs)


# ConvTranspose

CONV_T_CASES = {
    # name: (X shape, W shape, attributes)
    "1d": ((2, 2, 4), (2, 3, 3), {}),
    "1d_stride2_pads": ((1, 2, 4), (2, 2, 3), {"strides": [2], "pads": [1, 2]}),
    "1d_output_padding": ((1, 2, 4), (2, 2, 3),
                          {"strides": [3], "pads": [1, 1], "output_padding": [2]}),
    "1d_group2_dil2": ((2, 4, 4), (4, 1, 3), {"group": 2, "dilations": [2]}),
    "2d": ((1, 2, 3, 3), (2, 3, 2, 2), {}),
    "2d_all": ((1, 4, 3, 3), (4, 2, 3, 2), {"group": 2, "strides": [2, 3], "dilations": [1, 2],
                                              "pads": [0, 2, 1, 1], "output_padding": [1, 0]}),
    "2d_depthwise": ((1, 3, 3, 3), (3, 1, 2, 2), {"group": 3, "strides": [2, 2]}),
    "2d_output_shape": ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [6, 7]}),
    "2d_same_upper": ((1, 2, 3, 3), (2, 1, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    "2d_same_lower": ((1, 2, 3, 3), (2, 1, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    "2d_valid": ((1, 2, 3, 3), (2, 1, 2, 2), {"strides": [2, 1], "auto_pad": "VALID"}),
    "3d": ((1, 2, 2, 3, 2), (2, 1, 2, 2, 2), {"strides": [1, 2, 1], "pads": [1, 0, 0, 0, 1, 0]}),
}


@pytest.mark.parametrize("case", list(CONV_T_CASES))
def test_conv_transpose(case):
    x_shape, w_shape, attrs = CONV_T_CASES[case]
    inputs = {"X": f32(*x_shape), "W": f32(*w_shape), "B": f32(w_shape[1] * attrs.get("group", 1))}
    # onnx.reference's grouped ConvTranspose is wrong (W slices, bias): float32 onnxruntime oracle.
    backends = ("float32",) if attrs.get("group", 1) > 1 else None
    check("ConvTranspose", inputs, backends=backends, **attrs)


@pytest.mark.parametrize("case", ["2d_all", "1d_output_padding"])
def test_conv_transpose_symbolic(case):
    x_shape, w_shape, attrs = CONV_T_CASES[case]
    inputs = {"X": f32(*x_shape), "W": f32(*w_shape)}
    sym = ["N", x_shape[1], *(f"S{i}" for i in range(len(x_shape) - 2))]
    check("ConvTranspose", inputs, shapes={"X": sym}, backends=("float32",), **attrs)


# Pooling

def distinct(*shape):
    """Values 0.1 apart in random order: no ties within a window."""
    n = int(np.prod(shape))
    return (R.permutation(n).reshape(shape) * 0.1 - n * 0.05).astype(np.float32)


POOL_CASES = {
    # name: (X shape, attributes, opset)
    "1d": ((2, 2, 7), {"kernel_shape": [3], "strides": [2]}, 18),
    "2d_k2s2": ((1, 2, 4, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}, 18),
    "2d_overlap_pads": ((1, 2, 5, 4), {"kernel_shape": [3, 2], "pads": [1, 0, 2, 1]}, 18),
    "2d_ceil": ((1, 1, 6, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, 18),
    # (Not a case whose last ceil_mode window would start in the padding: onnx shape inference
    # keeps that window, runtimes drop it, so the model's declared output shape is wrong.)
    "2d_ceil_pads": ((1, 1, 5, 6), {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 1, 0, 1],
                                   "ceil_mode": 1}, 18),
    "2d_same_upper": ((1, 2, 5, 5), {"kernel_shape": [2, 3], "strides": [2, 2],
                                     "auto_pad": "SAME_UPPER"}, 18),
    "2d_same_lower": ((1, 2, 5, 5), {"kernel_shape": [2, 3], "strides": [2, 2],
                                     "auto_pad": "SAME_LOWER"}, 18),
    "2d_valid": ((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 1], "auto_pad": "VALID"},
                 18),
    "2d_dilations": ((1, 1, 6, 6), {"kernel_shape": [2, 2], "dilations": [2, 1],
                                    "pads": [1, 0, 0, 1]}, 19),
    "3d": ((1, 1, 3, 4, 4), {"kernel_shape": [2, 2, 2], "strides": [1, 2, 2]}, 18),
    "2d_opset11": ((1, 2, 4, 5), {"kernel_shape": [2, 2], "strides": [2, 2],
                                  "pads": [0, 1, 0, 0]}, 11),
}


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_average_pool(case, count_include_pad):
    x_shape, attrs, opset = POOL_CASES[case]
    check("AveragePool", {"X": f32(*x_shape)}, opset=opset, count_include_pad=count_include_pad,
          **attrs)


@pytest.mark.parametrize("case", ["2d_overlap_pads", "2d_ceil"])
def test_average_pool_symbolic_batch(case):
    x_shape, attrs, opset = POOL_CASES[case]
    check("AveragePool", {"X": f32(*x_shape)}, shapes={"X": ["N", "C", *x_shape[2:]]}, opset=opset,
          count_include_pad=1, **attrs)


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_max_pool(case):
    x_shape, attrs, opset = POOL_CASES[case]
    check("MaxPool", {"X": distinct(*x_shape)}, opset=opset, **attrs)


@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_with_indices(storage_order):
    x = distinct(1, 2, 4, 5)
    check("MaxPool", {"X": x}, n_outputs=2, kernel_shape=[2, 3], strides=[1, 2],
          storage_order=storage_order)


def test_max_pool_ties_go_to_first():
    x = np.ones((1, 1, 2, 2), np.float32)
    model = op_model("MaxPool", {"X": x}, kernel_shape=[2, 2])
    proto, autodiff = backward_model(model, "out0", ["X"], seed="input")
    dy = np.full((1, 1, 1, 1), 3.0, np.float32)
    grad = _ort(proto).run(None, {"X": x, autodiff.seed_name: dy})[-1]
    np.testing.assert_array_equal(grad, [[[[3, 0], [0, 0]]]])


def test_max_pool_symbolic_batch():
    x_shape, attrs, opset = POOL_CASES["2d_overlap_pads"]
    check("MaxPool", {"X": distinct(*x_shape)}, shapes={"X": ["N", "C", "H", "W"]}, **attrs)


@pytest.mark.parametrize("overlap", [False, True])
def test_max_pool_before_opset8_converts(overlap):
    """MaxPool-1 has no Indices output: the model is converted to the opset the gradient needs."""
    kw = {"kernel_shape": [2, 2], "strides": [1, 1] if overlap else [2, 2]}
    check("MaxPool", {"X": distinct(1, 1, 4, 4)}, opset=7, **kw)


def test_max_pool_overlap_before_opset16_refused():
    model = op_model("MaxPool", {"X": distinct(1, 1, 4, 4)}, kernel_shape=[2, 2], opset=13)
    with pytest.raises(RuleError, match="needs opset 16"):
        backward_model(model, "out0", ["X"], seed="input", upgrade_opset=False)


# Windows apart along every axis: the gradient is one MaxUnpool.
UNPOOL_CASES = {
    "2d_k2s2": ((2, 3, 4, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}, 18),
    "2d_ceil_odd": ((1, 2, 5, 7), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, 18),
    "2d_stride_gt_kernel": ((1, 1, 7, 8), {"kernel_shape": [2, 2], "strides": [3, 3]}, 18),
    "2d_pads": ((1, 2, 5, 5), {"kernel_shape": [2, 3], "strides": [2, 3], "pads": [1, 0, 0, 1]}, 18),
    "2d_same_upper": ((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2],
                                     "auto_pad": "SAME_UPPER"}, 18),
    "2d_dilations": ((1, 1, 7, 7), {"kernel_shape": [2, 2], "strides": [3, 3],
                                    "dilations": [2, 2]}, 18),
    "1d": ((2, 2, 9), {"kernel_shape": [3], "strides": [3]}, 18),
    "3d": ((1, 2, 4, 4, 4), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, 18),
    "opset9": ((1, 2, 4, 4), {"kernel_shape": [2, 2], "strides": [2, 2]}, 9),
    "opset10_ceil": ((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, 10),
}


def backward_types(op_type, inputs, wrt, **kw):
    model = op_model(op_type, inputs, **kw)
    proto, _ = backward_model(model, "out0", wrt, seed="input")
    forward = {n.name for n in model.graph.node}
    return [n.op_type for n in proto.graph.node if n.name not in forward]


@pytest.mark.parametrize("case", list(UNPOOL_CASES))
def test_max_pool_apart_windows_unpool(case):
    x_shape, attrs, opset = UNPOOL_CASES[case]
    x = distinct(*x_shape)
    check("MaxPool", {"X": x}, opset=opset, **attrs)
    types = backward_types("MaxPool", {"X": x}, ["X"], opset=opset, **attrs)
    assert "MaxUnpool" in types and "ScatterElements" not in types


def test_max_pool_unpool_symbolic_batch_and_indices_output():
    x = distinct(3, 2, 4, 6)
    check("MaxPool", {"X": x}, shapes={"X": ["N", "C", 4, 6]}, kernel_shape=[2, 2], strides=[2, 2])
    check("MaxPool", {"X": x}, n_outputs=2, kernel_shape=[2, 2], strides=[2, 2])


def test_max_pool_unpool_ties_go_to_first():
    x = np.ones((1, 1, 4, 4), np.float32)
    model = op_model("MaxPool", {"X": x}, kernel_shape=[2, 2], strides=[2, 2])
    proto, autodiff = backward_model(model, "out0", ["X"], seed="input")
    dy = np.arange(1, 5, dtype=np.float32).reshape(1, 1, 2, 2)
    grad = _ort(proto).run(None, {"X": x, autodiff.seed_name: dy})[-1]
    expected = np.zeros((1, 1, 4, 4), np.float32)
    expected[0, 0, ::2, ::2] = dy[0, 0]
    np.testing.assert_array_equal(grad, expected)


@pytest.mark.parametrize("case", ["symbolic_spatial", "float64", "overhang_a_kernel"])
def test_max_pool_apart_windows_scatter_fallback(case):
    """No static spatial sizes, no onnxruntime MaxUnpool kernel for the type, or pads MaxUnpool
    cannot take: the ScatterElements form."""
    x, kw = distinct(1, 2, 4, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}
    if case == "symbolic_spatial":
        kw["shapes"] = {"X": [1, 2, "H", "W"]}
    elif case == "float64":
        x = x.astype(np.float64)
    else:  # the windows reach a whole kernel into the end padding
        x, kw = distinct(1, 1, 4, 4), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1] * 4}
    check("MaxPool", {"X": x}, **kw)
    types = backward_types("MaxPool", {"X": x}, ["X"], **kw)
    assert "ScatterElements" in types and "MaxUnpool" not in types


def test_max_pool_overlap_along_one_axis():
    """Windows overlapping along one axis only share elements: a maximum in two windows gets
    both gradients (ScatterElements with reduction='add', opset 16)."""
    x = np.array([[[[0.0, 1.0], [5.0, 2.0], [3.0, 4.0]]]], np.float32)
    kw = {"kernel_shape": [2, 2], "strides": [1, 2]}
    check("MaxPool", {"X": x}, **kw)
    model = op_model("MaxPool", {"X": x}, opset=13, **kw)
    with pytest.raises(RuleError, match="needs opset 16"):
        backward_model(model, "out0", ["X"], seed="input", upgrade_opset=False)


@pytest.mark.parametrize(
    "shape,sym", [((2, 3, 4), None), ((1, 2, 3, 4), None), ((2, 2, 2, 2, 3), None),
                  ((2, 3, 4, 3), ["N", 3, "H", "W"])]
)
@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool(op_type, shape, sym):
    x = distinct(*shape) if op_type == "GlobalMaxPool" else f32(*shape)
    check(op_type, {"X": x}, shapes={"X": sym} if sym else None)


# Spatial sizes known only at run time (detection and OCR exports keep H and W dynamic): one
# backward graph serves every image size.

SYMBOLIC = {"X": ["N", "C", "H", "W"]}


def check_two_sizes(model, feeds, wrt, weak_bound=None):
    """``model`` (symbolic spatial sizes) against float64 finite differences at each of the two
    ``feeds`` (assert_gradients at the first); then one backward graph, built once, run at both:
    the same gradients. ``weak_bound``: where the oracle falls back to float32 (ConvTranspose with
    output_shape: onnx.reference cannot run it), the scaled error must stay below it."""
    proto, autodiff = backward_model(model, "out0", wrt, seed="input")
    session = _ort(proto)
    names = [o.name for o in proto.graph.output]
    for i, given in enumerate(feeds):
        result = assert_gradients(model, given, wrt) if i == 0 else check_vjp(model, given, wrt)
        assert result.ok, f"{result}\nAD: {result.ad}\nFD: {result.fd}"
        if result.weak:
            assert weak_bound is not None and max(result.errors.values()) < weak_bound, str(result)
        r = random_cotangents(model, given)[0]
        got = dict(zip(names, session.run(None, {**given, autodiff.seed_name: r})))
        for x in wrt:
            np.testing.assert_allclose(got[autodiff.gradient_names[x]], result.ad[x], rtol=1e-5, atol=1e-6)


RUN_TIME_POOL_CASES = {
    # name: (op type, attributes, opset, X shapes); the first cases as torch and paddle export them
    "avg_ceil_pads": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 0, 0, 1],
                                          ceil_mode=1, count_include_pad=0), 11,
                      [(1, 1, 4, 5), (2, 1, 3, 2)]),
    "avg_same_upper": ("AveragePool", dict(kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER",
                                           count_include_pad=1), 18, [(1, 1, 4, 3), (1, 1, 5, 4)]),
    "avg_same_lower": ("AveragePool", dict(kernel_shape=[2, 3], strides=[1, 2], auto_pad="SAME_LOWER"),
                       11, [(1, 1, 3, 5), (1, 2, 2, 4)]),
    "avg_dilations_ceil": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 1], dilations=[2, 1],
                                               pads=[0, 1, 1, 0], ceil_mode=1, count_include_pad=1),
                           19, [(1, 1, 6, 3), (1, 1, 5, 4)]),
    "avg_valid": ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], auto_pad="VALID"), 11,
                  [(1, 1, 3, 4), (1, 1, 2, 3)]),
    "max_ceil_pads_indices": ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 1, 1, 0],
                                              ceil_mode=1), 11, [(1, 1, 5, 4), (2, 1, 3, 3)]),
    "max_same_overlap": ("MaxPool", dict(kernel_shape=[3, 2], strides=[2, 1], dilations=[1, 2],
                                         auto_pad="SAME_UPPER"), 18, [(1, 1, 5, 4), (1, 2, 3, 5)]),
}


@pytest.mark.parametrize("case", list(RUN_TIME_POOL_CASES))
def test_pool_run_time_sizes(case):
    op_type, attrs, opset, sizes = RUN_TIME_POOL_CASES[case]
    make = distinct if op_type == "MaxPool" else f32
    feeds = [{"X": make(*size)} for size in sizes]
    n_outputs = 2 if case.endswith("indices") else 1
    model = op_model(op_type, feeds[0], n_outputs, opset=opset, shapes=SYMBOLIC, **attrs)
    check_two_sizes(model, feeds, ["X"])


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool_run_time_sizes(op_type):
    make = distinct if op_type == "GlobalMaxPool" else f32
    feeds = [{"X": make(1, 2, 3, 2)}, {"X": make(2, 1, 2, 5)}]
    check_two_sizes(op_model(op_type, feeds[0], opset=11, shapes=SYMBOLIC), feeds, ["X"])


RUN_TIME_CONV_CASES = {
    # name: (op type, W shape, attributes, opset, X shapes); W an initializer, as exports have it
    "conv_same_upper_group": ("Conv", (2, 1, 3, 2), dict(group=2, strides=[2, 2], auto_pad="SAME_UPPER"),
                              11, [(1, 2, 3, 4), (1, 2, 2, 5)]),
    "conv_same_lower": ("Conv", (2, 1, 2, 3), dict(strides=[2, 3], auto_pad="SAME_LOWER"), 18,
                        [(1, 1, 5, 4), (1, 1, 3, 5)]),
    # a stride past the window (tf2onnx's 1x1 shortcut): the total padding is clamped at 0
    "conv_same_long_stride": ("Conv", (2, 1, 1, 1), dict(strides=[2, 3], auto_pad="SAME_UPPER"), 11,
                              [(1, 1, 4, 5), (1, 1, 3, 3)]),
    "conv_same_long_stride_opset13": ("Conv", (2, 1, 1, 1), dict(strides=[2, 3], auto_pad="SAME_LOWER"),
                                      13, [(1, 1, 4, 5), (1, 1, 3, 3)]),
    # windows that stop short of X's end, by up to a stride less one
    "conv_pads_tail": ("Conv", (2, 1, 2, 2), dict(strides=[3, 2], dilations=[1, 2], pads=[1, 0, 0, 0]), 11,
                       [(1, 1, 5, 4), (1, 1, 4, 4)]),
    "conv_t_same_upper_output_padding": ("ConvTranspose", (2, 1, 3, 2),
                                         dict(strides=[2, 2], output_padding=[1, 0],
                                              auto_pad="SAME_UPPER"), 11, [(1, 2, 2, 3), (1, 2, 3, 2)]),
    "conv_t_output_shape": ("ConvTranspose", (1, 2, 3, 3), dict(strides=[2, 2], output_shape=[6, 7]),
                            11, [(1, 1, 3, 3), (1, 1, 4, 4)]),
    "conv_t_output_shape_same_upper": ("ConvTranspose", (1, 1, 2, 3),
                                       dict(strides=[2, 1], dilations=[2, 1], output_shape=[6, 5],
                                            output_padding=[1, 0], auto_pad="SAME_UPPER"), 18,
                                       [(1, 1, 3, 3), (2, 1, 2, 4)]),
}


@pytest.mark.parametrize("case", list(RUN_TIME_CONV_CASES))
def test_conv_run_time_sizes(case):
    op_type, w_shape, attrs, opset, sizes = RUN_TIME_CONV_CASES[case]
    w = f32(*w_shape)
    b = f32(w_shape[0] if op_type == "Conv" else w_shape[1] * attrs.get("group", 1))
    feeds = [{"X": f32(*size)} for size in sizes]
    model = op_model(op_type, {"X": feeds[0]["X"], "W": w, "B": b}, opset=opset, shapes=SYMBOLIC,
                     initializers={"W": w, "B": b}, **attrs)
    check_two_sizes(model, feeds, ["X", "W"], weak_bound=0.1)


RUN_TIME_KERNEL_CASES = {
    # name: (op type, attributes, opset, (X shape, W shape) pairs); no kernel_shape, as in
    # CausalConvWithState's function body, so only W's shape at run time tells the kernel's size
    "conv_causal_depthwise_1d": ("Conv", dict(group=3), 18, [((1, 3, 6), (3, 1, 3)), ((2, 3, 4), (3, 1, 1))]),
    "conv_pads_dilations_group": ("Conv", dict(group=2, strides=[1, 2], dilations=[2, 1], pads=[1, 0, 0, 2]),
                                  11, [((1, 4, 6, 5), (2, 2, 2, 3)), ((2, 4, 7, 4), (2, 2, 3, 1))]),
    "conv_same_upper": ("Conv", dict(strides=[2, 1], auto_pad="SAME_UPPER"), 18,
                        [((1, 2, 5, 4), (3, 2, 3, 2)), ((1, 2, 4, 5), (3, 2, 2, 3))]),
    # the second kernel 1x1, under the strides: the total padding is clamped at 0
    "conv_same_lower_long_stride": ("Conv", dict(strides=[3, 2], auto_pad="SAME_LOWER"), 11,
                                    [((1, 1, 5, 4), (2, 1, 2, 2)), ((1, 1, 4, 5), (2, 1, 1, 1))]),
    # opset 9: converted to 10 for Slice with run-time ends
    "conv_t_pads_output_padding": ("ConvTranspose", dict(strides=[3, 2], pads=[1, 0, 2, 1],
                                                         output_padding=[1, 1]), 9,
                                   [((1, 2, 3, 3), (2, 1, 3, 2)), ((1, 2, 2, 4), (2, 1, 2, 3))]),
    # the second kernel is narrower than the stride along the last axis: the total padding is 0
    "conv_t_same_upper_group": ("ConvTranspose", dict(group=2, strides=[2, 2], auto_pad="SAME_UPPER"), 18,
                                [((1, 2, 3, 3), (2, 1, 3, 2)), ((1, 2, 2, 3), (2, 1, 2, 1))]),
    # the second kernel is too small for output_shape along the last axis: Y ends in zeros
    "conv_t_output_shape": ("ConvTranspose", dict(strides=[2, 2], output_shape=[6, 7]), 11,
                            [((1, 1, 3, 3), (1, 2, 3, 3)), ((1, 1, 3, 3), (1, 2, 2, 2))]),
}


@pytest.mark.parametrize("case", list(RUN_TIME_KERNEL_CASES))
def test_conv_run_time_kernel_sizes(case):
    """X's and W's every extent known only at run time: one backward graph at two kernel sizes."""
    op_type, attrs, opset, sizes = RUN_TIME_KERNEL_CASES[case]
    feeds = [{"X": f32(*x_shape), "W": f32(*w_shape)} for x_shape, w_shape in sizes]
    symbolic = {name: [f"{name}{i}" for i in range(len(sizes[0][0]))] for name in ("X", "W", "out0")}
    node = onnx.helper.make_node(op_type, ["X", "W"], ["out0"], **attrs)
    # (onnx's inference leaves Y without a rank when it does not know the kernel's size)
    model = make_model([node], feeds[0], ["out0"], shapes=symbolic, opset=opset,
                       output_shapes={"out0": symbolic["out0"]})
    check_two_sizes(model, feeds, ["X", "W"], weak_bound=0.1)


@pytest.mark.parametrize("opset", [11, 17])
def test_torch_export_with_dynamic_image_size(opset, tmp_path):
    """A TorchScript export with dynamic N, H, W (Conv, BatchNormalization, ceil_mode average and
    max pools, GlobalAveragePool) differentiated by the command line: torch autograd's gradients
    at two image sizes."""
    torch = pytest.importorskip("torch")
    from onnx_autodiff.cli import main

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3)

        def forward(self, x):
            h = torch.nn.functional.avg_pool2d(self.bn(self.conv(x)), 2, ceil_mode=True)
            h = torch.nn.functional.max_pool2d(h, 2, ceil_mode=True)
            return torch.nn.functional.adaptive_avg_pool2d(h, 1)

    torch.manual_seed(0)
    net = Net().eval()
    forward, backward = tmp_path / "model.onnx", tmp_path / "grad.onnx"
    torch.onnx.export(net, (torch.randn(1, 2, 7, 9),), str(forward), dynamo=False, opset_version=opset,
                      do_constant_folding=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}, "y": {0: "n"}})
    assert main(["grad", str(forward), "-o", str(backward), "--wrt", "x", "conv.weight"]) == 0
    session = ort.InferenceSession(str(backward), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for shape in [(2, 2, 7, 9), (1, 2, 12, 5)]:
        x = torch.randn(*shape, requires_grad=True)
        net.zero_grad()
        y = net(x)
        dy = torch.randn(y.shape)
        (y * dy).sum().backward()
        got = dict(zip(names, session.run(None, {"x": x.detach().numpy(), "dy": dy.numpy()})))
        for name, want in (("grad_x", x.grad), ("grad_conv.weight", net.conv.weight.grad)):
            want = want.numpy()
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=name)
