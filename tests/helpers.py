"""Building small models for rule tests and checking their gradients against the float64 oracle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_autodiff.conformance import check_vjp
from onnx_autodiff.conformance.check import ad_vjp, backward_model
from onnx_autodiff.conformance.oracle import Evaluator, random_cotangents
from onnx_autodiff.conformance.symbolic import symbolic_model
from onnx_autodiff.passes.rewrite_rules.webgpu import dropout_tables
from onnx_autodiff.toolkit import proto_graphs

RNG_SEED = 0
_FLOAT_ELEM = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def rng(seed: int = RNG_SEED) -> np.random.Generator:
    return np.random.default_rng(seed)


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    *,
    initializers: Mapping[str, np.ndarray] | None = None,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    opset: int = 18,
    extra_opsets: Mapping[str, int] | None = None,
    output_shapes: Mapping[str, Sequence[int | str]] | None = None,
) -> onnx.ModelProto:
    """A model whose inputs are typed like the given arrays (``shapes`` overrides, e.g. "N").

    Outputs are typed by shape inference; ``output_shapes`` declares float32 outputs it cannot type.
    """
    shapes = dict(shapes or {})
    graph_inputs = [
        helper.make_tensor_value_info(
            name,
            helper.np_dtype_to_tensor_dtype(array.dtype),
            shapes.get(name, array.shape),
        )
        for name, array in inputs.items()
    ]
    graph = helper.make_graph(
        list(nodes),
        "test",
        graph_inputs,
        [
            helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, output_shapes[name])
            if name in (output_shapes or {})
            else helper.make_value_info(name, onnx.TypeProto())
            for name in outputs
        ],
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset)]
    opsets += [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    # The lowest IR version the opsets allow (at least 4, where initializers need not be inputs),
    # so older onnxruntime releases load the models too.
    ir_version = max(4, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    return model


def op_model(op_type: str, inputs: Mapping[str, np.ndarray], n_outputs: int = 1, **kw):
    """One node ``op_type`` over ``inputs`` (in order; an empty name skips an optional input)."""
    opset = kw.pop("opset", 18)
    shapes = kw.pop("shapes", None)
    initializers = kw.pop("initializers", None)
    domain = kw.pop("domain", "")
    names = list(inputs)
    outs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, domain=domain or None, **kw)
    fed = {k: v for k, v in inputs.items() if k and (initializers is None or k not in initializers)}
    return make_model([node], fed, outs, initializers=initializers, shapes=shapes, opset=opset)


def assert_gradients(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    *,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    registry=None,
    seed: int = 0,
    ad_backends=("onnxruntime",),
    symbolic: bool = True,
):
    """The backward graph's VJP (float32, onnxruntime) matches float64 central differences, and
    (for a model with one float output) the backward graph passes :func:`assert_valid_model`.

    ``ad_backends`` may add "reference" where onnxruntime lacks the forward op's kernel itself.
    With ``symbolic`` (the default) the same holds for :func:`symbolic_model` of ``model``, where
    the rules know no input's extents: its VJP must equal the static one, which matched the oracle
    (one more build and run, not a second finite-difference sweep). A case opts out with
    ``symbolic=False`` and a comment saying why its forward needs static extents.
    """
    result = check_vjp(model, feeds, wrt, registry=registry, seed=seed, atol=atol, rtol=rtol, ad_backends=ad_backends)
    assert result.ok, f"gradient mismatch\n{result}\nAD: {result.ad}\nFD: {result.fd}"
    for name in wrt:
        assert np.any(result.fd[name] != 0) or np.all(result.ad[name] == 0)
    floats = [o for o in model.graph.output if o.type.tensor_type.elem_type in _FLOAT_ELEM]
    if len(floats) == 1 and floats[0].type.tensor_type.HasField("shape"):  # the graph ad_vjp ran
        assert_valid_model(backward_model(model, floats[0].name, wrt, registry=registry, seed="input")[0])
    if symbolic:
        _assert_symbolic_gradients(model, feeds, wrt, result.ad, registry, seed, atol, rtol, ad_backends)
    return result


def _assert_symbolic_gradients(model, feeds, wrt, static_ad, registry, seed, atol, rtol, backends):
    symbolic = symbolic_model(model)
    cotangents = random_cotangents(model, feeds, seed)
    floats = [i for i, r in enumerate(cotangents) if r is not None]
    if len(floats) == 1 and symbolic.graph.output[floats[0]].type.tensor_type.HasField("shape"):
        # (the graph ad_vjp builds, built once: checked, then run)
        proto, autodiff = backward_model(symbolic, symbolic.graph.output[floats[0]].name, wrt,
                                         registry=registry, seed="input")
        assert_valid_model(proto)
        outputs = Evaluator(proto, backends=tuple(backends))({**feeds, autodiff.seed_name: cotangents[floats[0]]})
        named = dict(zip([o.name for o in proto.graph.output], outputs))
        ad = {x: named[autodiff.gradient_names[x]] for x in wrt}
    else:
        ad = ad_vjp(symbolic, feeds, wrt, cotangents, registry, backends=backends)
    for name in wrt:
        want, got = np.asarray(static_ad[name], np.float64), np.asarray(ad[name], np.float64)
        assert got.shape == want.shape, f"symbolic inputs: grad of {name} shaped {got.shape}, not {want.shape}"
        scale = max(1.0, float(np.max(np.abs(want), initial=0.0, where=np.isfinite(want))))
        close = np.isclose(got, want, rtol=rtol, atol=atol * scale, equal_nan=True)
        assert close.all(), (f"symbolic inputs: grad of {name} differs from the static one\n"
                             f"symbolic: {got}\nstatic: {want}")


def assert_valid_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` passes onnx's full checker and its strict type and shape inference (returned);
    it types no sequence with a dimension name that inference made up ("unk__3"): a sequence's
    one element type then claims its unequal elements equal, and onnxruntime reuses one element's
    buffer for another; and no MatMul multiplies a Transpose of a matrix by a vector, which
    onnxruntime 1.32's MatmulTransposeFusion miscomputes."""
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    for graph in proto_graphs(model.graph):
        for info in (*graph.input, *graph.output, *graph.value_info):
            names = _sequence_dim_names(info.type)
            assert not any(n.startswith("unk__") for n in names), (
                f"'{info.name}' in graph '{graph.name}' is a sequence whose element type names "
                f"dimensions {sorted(names)}, which onnx's inference made up")
    ranks = {info.name: len(info.type.tensor_type.shape.dim)
             for graph in proto_graphs(inferred.graph) for info in (*graph.input, *graph.output, *graph.value_info)
             if info.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for graph in proto_graphs(inferred.graph) for t in graph.initializer})
    # Through the Identities and matrix Reshapes that onnxruntime removes before it fuses.
    transposed = set()
    for graph in proto_graphs(inferred.graph):
        for n in graph.node:
            if n.domain not in ("", "ai.onnx") or ranks.get(n.input[0] if n.input else "") != 2:
                continue
            through = n.op_type in ("Identity", "Reshape") and n.input[0] in transposed and ranks.get(n.output[0]) == 2
            if n.op_type == "Transpose" or through:
                transposed.add(n.output[0])
    for graph in proto_graphs(inferred.graph):
        for node in graph.node:
            if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
                a, b = node.input
                assert not (a in transposed and ranks.get(b) == 1), (
                    f"MatMul '{node.name}' multiplies a transposed matrix by a vector ({a}, {b})")
    return inferred


def _sequence_dim_names(kind: onnx.TypeProto, inside: bool = False) -> set[str]:
    field = kind.WhichOneof("value")
    if field == "tensor_type":
        return {d.dim_param for d in kind.tensor_type.shape.dim if d.dim_param} if inside else set()
    if field == "sequence_type":
        return _sequence_dim_names(kind.sequence_type.elem_type, True)
    if field == "optional_type":
        return _sequence_dim_names(kind.optional_type.elem_type, inside)
    return set()


def numpy_dropout_mask(shape, ratio, step, micro_batch=0, salt=0) -> np.ndarray:
    """The mask hashed_dropout is to draw, from its definition: uint32 arithmetic (numpy wraps it
    modulo 2^32 as the graph's Add and Mul do), the tables read with bit masks and shifts."""
    low, high = dropout_tables()

    def h(x):
        x = np.asarray(x, np.uint32)
        return low[x & np.uint32(0xFFFF)] + high[x >> np.uint32(16)]

    with np.errstate(over="ignore"):
        key = h(h(np.uint32(step)) + np.uint32(micro_batch))
        k1 = h(key + np.uint32(salt))
        k2 = h(k1 + np.uint32(1))
        index = np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape)
        drawn = h(h(index + k1) + k2)
    return (drawn >> np.uint32(8)).astype(np.float32) >= np.float32(ratio) * np.float32(2**24)


def small_cnn(seed: int = 0) -> onnx.ModelProto:
    """A classifier of [N, 1, 4, 4] images into 3 classes (logits, no loss): a 3×3 Conv ("conv")
    with BatchNormalization and Relu, then a Gemm ("fc"); weights conv.weight and fc.weight."""
    generator = np.random.default_rng(seed)
    arrays = {
        "conv.weight": generator.standard_normal((4, 1, 3, 3)) * 0.3, "conv.bias": np.zeros(4),
        "bn.gamma": np.ones(4), "bn.beta": np.zeros(4), "bn.mean": np.zeros(4), "bn.var": np.ones(4),
        "fc.weight": generator.standard_normal((3, 64)) * 0.1, "fc.bias": np.zeros(3),
    }
    nodes = [
        helper.make_node("Conv", ["X", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "bn.gamma", "bn.beta", "bn.mean", "bn.var"], ["b"], name="bn"),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "small_cnn", [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", 1, 4, 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.asarray(a, np.float32), name) for name, a in arrays.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def small_cnn_data(examples: int = 24, seed: int = 1) -> dict[str, np.ndarray]:
    """Images and labels :func:`small_cnn` can learn: each class's images shifted by its index."""
    generator = np.random.default_rng(seed)
    labels = generator.integers(0, 3, examples)
    X = generator.standard_normal((examples, 1, 4, 4)) + labels[:, None, None, None]
    return {"X": X.astype(np.float32), "labels": labels.astype(np.int64)}
