"""Building small models for rule tests and checking their gradients against the float64 oracle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_autodiff.conformance import check_vjp

RNG_SEED = 0


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
):
    """The backward graph's VJP (float32, onnxruntime) matches float64 central differences.

    ``ad_backends`` may add "reference" where onnxruntime lacks the forward op's kernel itself.
    """
    result = check_vjp(model, feeds, wrt, registry=registry, seed=seed, atol=atol, rtol=rtol, ad_backends=ad_backends)
    assert result.ok, f"gradient mismatch\n{result}\nAD: {result.ad}\nFD: {result.fd}"
    for name in wrt:
        assert np.any(result.fd[name] != 0) or np.all(result.ad[name] == 0)
    return result
