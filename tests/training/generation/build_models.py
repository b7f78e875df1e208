"""The models the build's step tests start from: a forward model as the build reads it (onnx-ir, typed by
onnx's inference) and the roles of its initializers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.modelfile import from_proto
from onnx_autodiff.toolkit.inference import onnx_inferred, take_inferred_types
from onnx_autodiff.training.generation.roles import Roles, analyse


def typed(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, ir.Model]:
    """``proto`` typed by onnx's inference, and as onnx-ir: as the build converts its forward model."""
    inferred = onnx_inferred(proto)
    model = from_proto(proto)
    take_inferred_types(model, inferred)
    return inferred, model


def forward(proto: onnx.ModelProto, **options) -> tuple[ir.Model, Roles]:
    """The forward model of ``proto`` as onnx-ir and the roles of its initializers (``options``: those
    of :func:`~onnx_autodiff.training.generation.roles.analyse`)."""
    inferred, model = typed(proto)
    options = {"requires_grad": None, "frozen_params": None, "freeze_batchnorm": False, **options}
    return model, analyse(inferred, options["requires_grad"], options["frozen_params"], options["freeze_batchnorm"],
                          model=model)


def bn_dropout_model(opset: int = 18) -> onnx.ModelProto:
    """X[N, 4] -> Gemm -> BatchNormalization -> Dropout(0.25) -> Relu -> logits[N, 4]."""
    rng = np.random.default_rng(0)
    inits = {"W": rng.standard_normal((4, 4)), "gamma": rng.random(4) + 0.5, "beta": rng.standard_normal(4),
             "mean": rng.standard_normal(4) * 0.1, "var": rng.random(4) + 0.5, "ratio": np.array(0.25)}
    nodes = [
        helper.make_node("Gemm", ["X", "W"], ["h"], transB=1),
        helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["n"], momentum=0.8),
        helper.make_node("Dropout", ["n", "ratio"], ["d"]),
        helper.make_node("Relu", ["d"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def values(*names, shape=(3,)) -> list[ir.Value]:
    """Float values of these names and ``shape``, in no graph yet."""
    return [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(shape))) for n in names]
