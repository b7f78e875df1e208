"""Gradient accumulation: the accumulate step's sums, the apply model's step by the scaled sums."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from training.generation.build_models import typed, values
from test_training import mlp

from onnx_autodiff.modelfile import to_proto
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.accumulation import accumulation_step, apply_model
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.generation.roles import analyse
from onnx_autodiff.training.optimizers import SGD
from onnx_autodiff.training.targets import ONNXRUNTIME


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_the_accumulators_gain_the_gradients_where_the_micro_batch_counts():
    params, grads, (loss,) = values("p", "q"), values("dp", "dq"), values("loss", shape=())
    namer = Namer([v.name for v in (*params, *grads, loss)], prefix="opt")
    outputs = Outputs(OpBuilder(18, namer), namer)
    result = accumulation_step(outputs, params, grads, loss, ONNXRUNTIME)
    outputs.publish(result.kept, "kept")
    assert [a.name for a in result.accumulators] == ["p.grad_acc", "q.grad_acc"]
    assert [(c.key, c.output) for c in outputs.carry] == [("p.grad_acc", "p.grad_acc.new"), ("q.grad_acc", "q.grad_acc.new")]
    graph = ir.Graph([*grads, loss, *result.accumulators], outputs.values, nodes=outputs.op.nodes, opset_imports={"": 18})
    model = to_proto(ir.Model(graph, ir_version=8))
    g, acc = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    feeds = {"dp": g, "dq": 2 * g, "p.grad_acc": acc, "q.grad_acc": acc}
    new_p, new_q, kept = run(model, {**feeds, "loss": np.array(1, np.float32)})
    np.testing.assert_array_equal(new_p, acc + g)
    np.testing.assert_array_equal(new_q, acc + 2 * g)
    assert kept
    *unchanged, kept = run(model, {**feeds, "loss": np.array(np.nan, np.float32)})
    assert not kept and all((u == acc).all() for u in unchanged)


def test_the_apply_model_steps_by_the_scaled_accumulators():
    proto, model = typed(mlp())
    roles = analyse(proto, None, None, False, model=model)
    accumulators = [f"{p}.grad_acc" for p in roles.params]
    applied, signature = apply_model(proto, roles, SGD(lr=0.1), None, {}, accumulators, ONNXRUNTIME)
    assert [r.input for r in signature.reads] == accumulators and signature.loss is None
    assert list(signature.scalars) == ["lr", "step", "grad_scale"]
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    sums = {acc: np.ones_like(initial[p]) for p, acc in zip(roles.params, accumulators)}
    feeds = {**{p: initial[p] for p in roles.params}, **sums, "lr": np.array(0.5, np.float32),
             "step": np.array(1, np.int64), "grad_scale": np.array(0.25, np.float32)}
    *new, kept = run(applied, feeds)
    assert kept
    for p, value in zip(roles.params, new):
        np.testing.assert_allclose(value, initial[p] - 0.5 * 0.25, rtol=1e-6)
