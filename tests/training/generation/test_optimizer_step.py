"""OptimizerStepPass: the update of each parameter and its state as carried outputs, grouped where
the target runs grouped updates."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from training.generation.build_models import values

from onnx_autodiff.modelfile import to_proto
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.optimizer_step import OptimizerStepPass
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.optimizers import SGD, AdamW
from onnx_autodiff.training.targets import ONNXRUNTIME, WEBGPU


def stepped(spec, target, max_grad_norm=None):
    """The model of one optimiser step of two parameters and their gradients (graph inputs)."""
    params, grads = values("p", "q"), values("dp", "dq")
    namer = Namer([v.name for v in (*params, *grads)], prefix="opt")
    outputs = Outputs(OpBuilder(18, namer), namer)
    model = ir.Model(ir.Graph([*params, *grads], [], nodes=[], opset_imports={"": 18}), ir_version=8)
    step = OptimizerStepPass(outputs, spec, params, grads, max_grad_norm, target)(model)
    assert step.model is model and step.modified
    kept = outputs.publish(step.kept, "kept")
    outputs.add_nodes_to(model.graph)
    model.graph.inputs.extend([*step.state_inputs, step.lr, step.step, *step.coefficients.values()])
    model.graph.outputs.extend(outputs.values)
    return model, step, outputs, kept


def test_sgd_steps_each_parameter_and_carries_it():
    model, step, outputs, kept = stepped(SGD(lr=0.1), ONNXRUNTIME)
    assert [(c.key, c.output) for c in outputs.carry] == [("p", "p.new"), ("q", "q.new")]
    assert step.scalars() == {"lr": step.lr.name, "step": step.step.name} and step.states == [[], []]
    session = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    p, q, dp, dq = (np.arange(3, dtype=np.float32) + i for i in range(4))
    new_p, new_q, ok = session.run(None, {"p": p, "q": q, "dp": dp, "dq": dq, step.lr.name: np.array(0.5, np.float32),
                                          step.step.name: np.array(1, np.int64)})
    np.testing.assert_allclose(new_p, p - 0.5 * dp)
    np.testing.assert_allclose(new_q, q - 0.5 * dq)
    assert ok


def test_adamw_state_and_coefficients():
    _, step, outputs, _ = stepped(AdamW(lr=0.1), ONNXRUNTIME)
    assert [[s.name for s in states] for states in step.states] == [["p.exp_avg", "p.exp_avg_sq"], ["q.exp_avg", "q.exp_avg_sq"]]
    assert set(step.coefficients) <= set(step.scalars()) and step.coefficients
    assert [c.key for c in outputs.carry] == ["p", "q", "p.exp_avg", "p.exp_avg_sq", "q.exp_avg", "q.exp_avg_sq"]


def test_grouped_updates_where_the_target_runs_them():
    grouped, *_ = stepped(SGD(lr=0.1), ONNXRUNTIME)
    apart, *_ = stepped(SGD(lr=0.1), WEBGPU)
    assert any(n.op_type == "Concat" for n in grouped.graph.all_nodes())
    assert not any(n.op_type == "Concat" for n in apart.graph.all_nodes())


def test_the_nodes_follow_those_emitted_before_in_the_builders_order():
    """The pass adds the builder's nodes from where the graph's last addition left off: those the
    caller emitted before it (an apply model's scaled gradients) first, with the builder's names."""
    params, grads = values("p"), values("dp")
    namer = Namer(["p", "dp"], prefix="opt")
    outputs = Outputs(OpBuilder(18, namer), namer)
    scaled = [outputs.op.Mul(g, g) for g in grads]
    model = ir.Model(ir.Graph([*params, *grads], [], nodes=[], opset_imports={"": 18}), ir_version=8)
    OptimizerStepPass(outputs, SGD(lr=0.1), params, scaled, None, ONNXRUNTIME)(model)
    assert list(model.graph) == outputs.op.nodes and list(model.graph)[0].op_type == "Mul"
