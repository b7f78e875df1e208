"""The apply model of gradient accumulation: the optimiser's step by the accumulated gradients,
scaled."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.finish import finish
from onnx_autodiff.training.generation.optimizer_step import OptimizerStepPass, coefficient_signature
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.generation.roles import Roles, proto_default_opset
from onnx_autodiff.training.in_place import in_place_order
from onnx_autodiff.training.manifest import Read, Step
from onnx_autodiff.training.optimizers import Optimizer
from onnx_autodiff.training.targets import Target
from onnx_autodiff.training.values import fresh_value


def apply_model(proto: onnx.ModelProto, roles: Roles, spec: Optimizer, max_grad_norm, state: dict[str, list[str]],
                accumulators: list[str], target: Target, check_output: bool = False) -> tuple[onnx.ModelProto, Step]:
    """The apply model of the forward model ``proto``: [parameters, accumulators, optimiser state,
    lr, step, grad_scale, coefficients] -> [new parameters, new state, kept], stepping by
    ``grad_scale · accumulators``; ``state``: the train model's state names per parameter."""
    inits = {t.name: t for t in proto.graph.initializer}
    reserved = [n for names in state.values() for n in names] + accumulators
    namer = Namer([v.name for v in proto.graph.input] + list(inits) + reserved, prefix="opt")
    opset = max(proto_default_opset(proto), 13)
    op = OpBuilder(opset, namer, {"": opset})
    params, accs = [], []
    for name, acc in zip(roles.params, accumulators):
        t = inits[name]
        dtype = ir.DataType(t.data_type)
        params.append(ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(t.dims))))
        accs.append(ir.Value(name=acc, type=ir.TensorType(dtype), shape=ir.Shape(list(t.dims))))
    lr = fresh_value(namer, "lr", ir.DataType.FLOAT, [])
    step = fresh_value(namer, "step", ir.DataType.INT64, [])
    scale = fresh_value(namer, "grad_scale", ir.DataType.FLOAT, [])
    grads = [op.Mul(a, op.CastLike(scale, a)) for a in accs]
    graph = ir.Graph([*params, *accs, lr, step, scale], [], nodes=[], opset_imports={"": opset}, name="apply")
    model = ir.Model(graph, ir_version=max(proto.ir_version, 8), producer_name="onnx-autodiff")
    outputs = Outputs(op, namer)
    update = OptimizerStepPass(outputs, spec, params, grads, max_grad_norm, target, lr, step,
                               [state.get(p, []) for p in roles.params])(model)
    kept = outputs.publish(update.kept, "kept")
    outputs.add_nodes_to(graph)
    kept_name = kept.name  # (before the cleanup, as the eval model's names)
    inputs = [*params, *accs, *update.state_inputs, lr, step, scale, *update.coefficients.values()]
    proto_out = finish(model, inputs, outputs.values, "apply model", target=target, check_output=check_output)
    return proto_out, Step(
        batch=(),
        carry=tuple(outputs.carry),
        reads=tuple(Read(a.name, a.name) for a in accs),
        scalars={"lr": lr.name, "step": step.name, "grad_scale": scale.name,
                 **{key: value.name for key, value in update.coefficients.items()}},
        loss=None,
        kept=kept_name,
        coefficients=coefficient_signature(spec, update.coefficients),
        in_place=in_place_order(proto_out, outputs.carry),
    )
