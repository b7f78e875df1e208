"""AccumulationStepPass: each gradient added to its accumulator where the micro-batch counts."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from training.generation.build_models import values

from onnx_autodiff.modelfile import to_proto
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.accumulation import AccumulationStepPass
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.targets import ONNXRUNTIME


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_the_accumulators_gain_the_gradients_where_the_micro_batch_counts():
    params, grads, (loss,) = values("p", "q"), values("dp", "dq"), values("loss", shape=())
    namer = Namer([v.name for v in (*params, *grads, loss)], prefix="opt")
    outputs = Outputs(OpBuilder(18, namer), namer)
    model = ir.Model(ir.Graph([*grads, loss], [], nodes=[], opset_imports={"": 18}), ir_version=8)
    result = AccumulationStepPass(outputs, params, grads, loss, ONNXRUNTIME)(model)
    assert result.model is model and result.modified
    outputs.publish(result.kept, "kept")
    outputs.add_nodes_to(model.graph)
    assert [a.name for a in result.accumulators] == ["p.grad_acc", "q.grad_acc"]
    assert [(c.key, c.output) for c in outputs.carry] == [("p.grad_acc", "p.grad_acc.new"), ("q.grad_acc", "q.grad_acc.new")]
    model.graph.inputs.extend(result.accumulators)
    model.graph.outputs.extend(outputs.values)
    proto = to_proto(model)
    g, acc = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    feeds = {"dp": g, "dq": 2 * g, "p.grad_acc": acc, "q.grad_acc": acc}
    new_p, new_q, kept = run(proto, {**feeds, "loss": np.array(1, np.float32)})
    np.testing.assert_array_equal(new_p, acc + g)
    np.testing.assert_array_equal(new_q, acc + 2 * g)
    assert kept
    *unchanged, kept = run(proto, {**feeds, "loss": np.array(np.nan, np.float32)})
    assert not kept and all((u == acc).all() for u in unchanged)
