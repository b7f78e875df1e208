"""A step model, train or accumulate, built from the forward model by the build's passes in order:
training mode, the target's lowered training forward, the loss, the gradients, the cleanup, the
optimiser's step (or the accumulation), then finished and written once."""

from __future__ import annotations

import dataclasses

import onnx
import onnx_ir as ir

from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.accumulation import AccumulationStepPass
from onnx_autodiff.training.generation.batchnorm_in_standard_ops import BatchNormInStandardOpsPass
from onnx_autodiff.training.generation.clean_backward import CleanBackwardPass
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.generation.differentiate import DifferentiatePass
from onnx_autodiff.training.generation.evaluation import EvalCut, prepared_alike
from onnx_autodiff.training.generation.finish import FinishPass, written
from onnx_autodiff.training.generation.hashed_dropout import DROPOUT_SEEDS, HashedDropoutPass
from onnx_autodiff.training.generation.loss import AttachLossPass
from onnx_autodiff.training.generation.observers import ObserversPass
from onnx_autodiff.training.generation.optimizer_step import OptimizerStepPass, coefficient_signature
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.generation.roles import Roles
from onnx_autodiff.training.generation.training_mode import TrainingModePass
from onnx_autodiff.training.in_place import in_place_order
from onnx_autodiff.training.losses import LossSpec
from onnx_autodiff.training.manifest import Evaluation, Read, Step


@dataclasses.dataclass
class StepModel:
    """A train or accumulate model, written, and its signature; ``labels``: the label inputs' names;
    ``state``: the optimiser state's input names per parameter (a train model's); ``evaluation``:
    the eval model cut out of a train model, with its signature (None where it is built apart)."""

    model: onnx.ModelProto
    signature: Step
    labels: list[str]
    state: dict[str, list[str]]
    evaluation: tuple[onnx.ModelProto, Evaluation] | None = None


@dataclasses.dataclass
class Backward:
    """The forward model in training mode, its loss's gradients appended and cleaned up: its batch
    inputs (labels apart) and state inputs, the loss and the gradients, the buffers' new statistics,
    the hashed Dropout's seeds (inputs too); ``cut``: the input and output names of the eval model
    inside it, where the forward is the eval model's (else None)."""

    batch: list[ir.Value]
    labels: list[ir.Value]
    reads: list[ir.Value]
    loss: ir.Value
    grads: list[ir.Value]
    updates: dict[str, ir.Value]
    seeds: dict[str, ir.Value]
    cut: tuple[list[str], list[str]] | None
    step: ir.Value | None = None  # the optimiser's step where the forward reads it (observers)


def backward(model: ir.Model, kind: str, roles: Roles, loss_spec: LossSpec, config: ArtifactsConfig) -> Backward:
    """The passes up to the backward's cleanup on the forward model ``model`` (changed in place)."""
    target = config.runtime
    graph = model.graph
    mode = TrainingModePass(roles, training=True)(model)
    namer, updates = mode.namer, mode.updates
    seeds: dict[str, ir.Value] = {}
    if target.batchnorm_in_standard_ops:
        updates = BatchNormInStandardOpsPass(namer, updates)(model).updates
    if target.hashed_dropout:
        seeds = HashedDropoutPass(namer)(model).seeds
    batch = [v for v in graph.inputs if v.name not in roles.state and v not in seeds.values()]
    reads = [v for v in graph.inputs if v.name in roles.state]
    step = None
    if roles.quantization is not None:
        observed = ObserversPass(roles.quantization, namer)(model)
        updates, step = {**updates, **observed.updates}, observed.step
    same_as_eval = kind == "train" and prepared_alike(model, bool(updates), target)
    attached = AttachLossPass(loss_spec, namer)(model)
    loss, labels, others = attached.loss, attached.labels, attached.others
    # The eval model is this forward model and loss with the same names (as evaluation.eval_model
    # makes it), cut out of the finished train model where it can be.
    cut = None
    if same_as_eval and not any(v.is_graph_input() for v in (loss, *others)) and len({loss, *others}) == 1 + len(others):
        cut = [v.name for v in (*batch, *labels, *reads)], [v.name for v in (loss, *others)]
    DifferentiatePass(loss, labels, roles.params, config.registry)(model)
    cleaned = CleanBackwardPass(target, updates)(model)
    return Backward(batch, labels, reads, cleaned.loss, cleaned.grads, cleaned.updates, seeds, cut, step)


def step_model(model: ir.Model, kind: str, roles: Roles, loss_spec: LossSpec, spec, config: ArtifactsConfig) -> StepModel:
    """The ``kind`` ("train" or "accumulate") model of the forward model ``model`` (onnx-ir, changed
    in place): [batch, labels, parameters, optimiser state or accumulators, buffers, scalars] ->
    [loss, new parameters and state or accumulators, new buffers, kept]."""
    target, graph = config.runtime, model.graph
    found = backward(model, kind, roles, loss_spec, config)
    namer = Namer.for_graph(graph, prefix="opt")
    outputs = Outputs(OpBuilder(default_opset(model), namer, dict(model.opset_imports)), namer)
    inputs_by_name = {v.name: v for v in graph.inputs}
    params = [inputs_by_name[p] for p in roles.params]
    loss_out = outputs.add_loss(found.loss)
    if kind == "train":
        update = OptimizerStepPass(outputs, spec, params, found.grads, config.max_grad_norm, target, step=found.step,
                                   loss=found.loss)(model)
        kept, carried_inputs, coefficients = update.kept, update.state_inputs, update.coefficients
        state = {p.name: [s.name for s in inputs] for p, inputs in zip(params, update.states)}
        scalars, tail = update.scalars(), [update.lr, update.step, *coefficients.values()]
    else:
        accumulation = AccumulationStepPass(outputs, params, found.grads, found.loss, target)(model)
        kept, carried_inputs, coefficients = accumulation.kept, accumulation.accumulators, {}
        state, scalars, tail = {}, {}, []
    for name in roles.buffers:
        if name in found.updates:
            # not returned by the If on kept: onnxruntime's BatchNormalization writes the statistics it
            # returns into the buffers of its inputs unless they are graph outputs (the trainer gives
            # them spare buffers, kept only when the step is)
            outputs.add_carried(inputs_by_name[name], found.updates[name])
    kept_out = outputs.publish(kept, "kept")
    outputs.add_nodes_to(graph)  # (the Identities that publish the buffers and kept)
    added = list(outputs.op.nodes)
    for domain, version in outputs.op.opsets.items():
        model.opset_imports.setdefault(domain, version)
    buffer_names = set(roles.buffers)
    buffers = [v for v in graph.inputs if v.name in buffer_names]
    scalars.update({key: value.name for key, value in found.seeds.items()})
    inputs = [*found.batch, *found.labels, *params, *carried_inputs, *buffers, *tail, *found.seeds.values()]
    loss_name, kept_name = loss_out.name, kept_out.name  # (before the lowering, as the eval model's)
    FinishPass(inputs, outputs.values, target, cleaned=added)(model)
    cut = EvalCut.find(model, *found.cut) if found.cut is not None else None
    proto = written(model, f"{kind} model", config.check_output)
    signature = Step(
        batch=tuple(v.name for v in (*found.batch, *found.labels)),
        carry=tuple(outputs.carry),
        reads=() if kind == "train" else tuple(Read(p.name, p.name) for p in params),
        scalars=scalars,
        loss=loss_name,
        kept=kept_name,
        # how the runner computes the scalar inputs other than lr and step
        coefficients={**coefficient_signature(spec, coefficients), **{key: DROPOUT_SEEDS[key] for key in found.seeds}},
        in_place=in_place_order(proto, outputs.carry),
    )
    evaluation = None
    if cut is not None:
        names = found.cut[1]
        evaluation = cut.model(proto, config.check_output), Evaluation(
            batch=signature.batch, reads=tuple(Read(v.name, v.name) for v in found.reads), loss=names[0],
            outputs=tuple(names[1:]))
    return StepModel(proto, signature, [v.name for v in found.labels], state, evaluation)
