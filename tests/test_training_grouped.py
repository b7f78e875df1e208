"""The optimiser updates small parameters in groups (one update over a Concat of those of one dtype
and trailing dims, split back): the results are bit-identical to the update of each apart, for
every optimiser, clipping, accumulation and a failed step, and the train model is smaller."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnx_autodiff.training import Trainer, generate_artifacts
from onnx_autodiff.training.optimizers import GROUP_LIMIT, update_groups
from onnx_autodiff.training.targets import ONNXRUNTIME

OPTIMIZERS = [
    ("sgd", {"lr": 0.05}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}),
    ("adam", {"lr": 0.01, "weight_decay": 0.01, "amsgrad": True}),
    ("adamw", {"lr": 0.01}),
]


def blocks(count: int = 6, width: int = 8, dtype=np.float32) -> onnx.ModelProto:
    """x + tanh(x·W_i + b_i)·s_i: groups of equal W (and of the b) shapes, one [width, width + 1]
    weight alone in its group, a scalar s_i (never grouped) and one weight over GROUP_LIMIT."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits, x = [], [], "x"
    for i in range(count):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) * 0.3).astype(dtype), f"W{i}"),
                  numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(dtype), f"b{i}"),
                  numpy_helper.from_array(np.array(0.5 + 0.1 * i, dtype), f"s{i}")]
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Tanh", [f"a{i}"], [f"t{i}"]),
                  helper.make_node("Mul", [f"t{i}", f"s{i}"], [f"u{i}"]),
                  helper.make_node("Add", [x, f"u{i}"], [f"r{i}"])]
        x = f"r{i}"
    wide = GROUP_LIMIT // width + 1  # over the limit: updated alone
    inits += [numpy_helper.from_array((rng.standard_normal((width, width + 1)) * 0.3).astype(dtype), "odd"),
              numpy_helper.from_array((rng.standard_normal((width + 1, wide)) * 0.01).astype(dtype), "big"),
              numpy_helper.from_array((rng.standard_normal((wide, width)) * 0.01).astype(dtype), "back")]
    nodes += [helper.make_node("MatMul", [x, "odd"], ["o"]),
              helper.make_node("MatMul", ["o", "big"], ["g"]),
              helper.make_node("MatMul", ["g", "back"], ["y"])]
    graph = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", elem, [4, width])],
                              [helper.make_tensor_value_info("y", elem, [4, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _parameter(info: onnx.ValueInfoProto):
    import onnx_ir as ir

    dims = [d.dim_value for d in info.type.tensor_type.shape.dim]
    return ir.Value(name=info.name, type=ir.TensorType(ir.DataType(info.type.tensor_type.elem_type)), shape=ir.Shape(dims))


def nodes(graph: onnx.GraphProto) -> int:
    return sum(1 + sum(nodes(a.g) for a in n.attribute if a.type == onnx.AttributeProto.GRAPH) for n in graph.node)


def trained(model, grouped: bool, optimizer, options, accumulate: bool, max_grad_norm, batches):
    # onnxruntime as a target that updates each parameter apart
    target = ONNXRUNTIME if grouped else dataclasses.replace(ONNXRUNTIME, grouped_updates=False)
    artifacts = generate_artifacts(model, loss="mse", optimizer=optimizer, optimizer_options=options,
                                   max_grad_norm=max_grad_norm, gradient_accumulation=accumulate, target=target)
    trainer = Trainer(artifacts, providers=["CPUExecutionProvider"], nonfinite="skip")
    losses = []
    for batch in batches:
        if accumulate:
            trainer.accumulate(batch)
            losses.append(trainer.accumulate(batch))
            trainer.apply()
        else:
            losses.append(trainer.step(batch))
    return artifacts, losses, trainer.state_dict()


@pytest.mark.parametrize("optimizer, options", OPTIMIZERS)
@pytest.mark.parametrize("accumulate, max_grad_norm", [(False, None), (False, 0.5), (True, 1.0)])
def test_grouped_update_is_bit_identical_to_one_by_one(optimizer, options, accumulate, max_grad_norm):
    model = blocks()
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((4, 8)).astype(np.float32), "labels": rng.standard_normal((4, 8)).astype(np.float32)}
               for _ in range(3)]
    batches.insert(2, {"x": np.full((4, 8), np.nan, np.float32), "labels": batches[0]["labels"]})  # a failed step
    alone, want_losses, want = trained(model, False, optimizer, options, accumulate, max_grad_norm, batches)
    together, losses, got = trained(model, True, optimizer, options, accumulate, max_grad_norm, batches)
    assert nodes(together.train_model.graph) < nodes(alone.train_model.graph)
    squares = [n for n in together.train_model.graph.node if n.op_type == "ReduceSumSquare"]
    groups = len(update_groups([v for v in map(_parameter, together.train_model.graph.input) if v.name in together.params]))
    # the finite check sums the squares per group; clipping reads the sum, taken per parameter then
    assert len(squares) == (len(together.params) if max_grad_norm is not None else groups)
    if accumulate:
        accumulating = [n for n in together.accumulate_model.graph.node if n.op_type == "ReduceSumSquare"]
        assert len(accumulating) == groups
        assert nodes(together.apply_model.graph) < nodes(alone.apply_model.graph)
        assert nodes(together.accumulate_model.graph) < nodes(alone.accumulate_model.graph)
    np.testing.assert_array_equal(losses, want_losses)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert got[key].dtype == want[key].dtype


def test_groups_by_dtype_and_trailing_dims():
    import onnx_ir as ir

    from onnx_autodiff.training.optimizers import update_groups

    def value(dtype, *dims):
        return ir.Value(name=None, type=ir.TensorType(dtype), shape=ir.Shape(list(dims)))

    f, d = ir.DataType.FLOAT, ir.DataType.DOUBLE
    params = [value(f, 4, 8), value(f, 2, 8), value(d, 4, 8), value(f, 8), value(f), value(f, 3, 8), value(f, "n", 8),
              value(f, GROUP_LIMIT + 1), value(f, 5)]
    assert update_groups(params) == [[0, 1, 5], [2], [3, 8], [4], [6], [7]]
    assert update_groups(params, None) == [[i] for i in range(len(params))]


def test_grouped_update_of_double_parameters():
    model = blocks(count=3, dtype=np.float64)
    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((4, 8)), "labels": rng.standard_normal((4, 8))} for _ in range(2)]
    _, want_losses, want = trained(model, False, "adamw", {"lr": 0.01}, False, 1.0, batches)
    _, losses, got = trained(model, True, "adamw", {"lr": 0.01}, False, 1.0, batches)
    np.testing.assert_array_equal(losses, want_losses)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
