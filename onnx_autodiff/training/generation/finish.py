"""The last steps of each model the build makes: its inputs and outputs set, cleaned up and lowered
for the target, its frozen weights' reads placed, its outputs typed; then written as a proto, once,
and checked."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.modelfile import check_model, full_output_check, to_proto
from onnx_autodiff.passes.cleanup import cleanup_passes
from onnx_autodiff.passes.lowering import LoweringPass
from onnx_autodiff.passes.unused import RemoveUnusedPass, remove_unused_after
from onnx_autodiff.training.generation.frozen_reads import FrozenReadsPass
from onnx_autodiff.training.targets import Target


class FinishPass(ir.passes.InPlacePass):
    """The model with these inputs and outputs, cleaned up and lowered for ``target`` unless
    ``cleaned`` lists the nodes added since its cleanup (then only what those nodes and the
    outputs it had leave unused is removed, and the added nodes lowered where the target needs
    it), its frozen weights read as the target holds them once (:class:`~.frozen_reads.FrozenReadsPass`),
    every output typed and shaped."""

    def __init__(self, inputs: list[ir.Value], outputs: list[ir.Value], target: Target,
                 cleaned: list[ir.Node] | None = None) -> None:
        super().__init__()
        self.inputs = inputs
        self.outputs = outputs
        self.target = target
        self.cleaned = cleaned

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, target = model.graph, self.target
        previous = list(graph.outputs)
        graph.inputs.clear()
        graph.inputs.extend(self.inputs)
        graph.outputs.clear()
        graph.outputs.extend(self.outputs)
        if self.cleaned is None:
            ir.passes.PassManager(cleanup_passes(target=target.lowering))(model)
        elif target.lowered_optimizer:
            ir.passes.PassManager([RemoveUnusedPass(), LoweringPass(target)])(model)
        else:
            remove_unused_after(graph, self.cleaned, [v for v in previous if not v.is_graph_output()])
        FrozenReadsPass(target)(model)
        if any(v.shape is None or v.type is None for v in graph.outputs):
            ShapeInferencePass(strict_mode=False)(model)
        untyped = [v.name for v in graph.outputs if v.shape is None or v.type is None]
        if untyped:
            raise TrainingError(f"the shapes of {untyped} are unknown: declare them in the model's outputs or value_info")
        return ir.passes.PassResult(model, True)


def written(model: ir.Model, what: str, check_output: bool) -> onnx.ModelProto:
    """``model`` (finished, dropped after) as a checked proto; external tensors stay references to
    their files."""
    _forget_intermediate_types(model.graph)
    return checked(to_proto(model), what, check_output)


def finish(model: ir.Model, inputs: list[ir.Value], outputs: list[ir.Value], what: str, target: Target,
           check_output: bool = False) -> onnx.ModelProto:
    """``model`` finished (:class:`FinishPass`, cleaned up whole) and :func:`written`."""
    FinishPass(inputs, outputs, target)(model)
    return written(model, what, check_output)


def checked(proto: onnx.ModelProto, what: str, check_output: bool) -> onnx.ModelProto:
    """``proto`` after onnx.checker's structural check (its full check where
    :func:`~onnx_autodiff.modelfile.full_output_check` says)."""
    try:
        check_model(proto, full=full_output_check(check_output))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        first = str(error).strip().splitlines()[0]
        raise TrainingError(f"the generated {what} fails the ONNX checker (a bug, please report): {first}") from error
    return proto


def _forget_intermediate_types(graph: ir.Graph) -> None:
    """Drops the types and shapes of the values the main graph's nodes compute, except its
    outputs', so that they are not written as value_info: runtimes and onnx's checker infer them
    again from the inputs', and writing them was a third of converting a train model of 60,000
    nodes to protobuf (and of its file). Called on a model about to be converted and dropped."""
    outputs = frozenset(graph.outputs)
    for node in graph:
        for value in node.outputs:
            if value not in outputs:
                value.type = None
                value.shape = None
