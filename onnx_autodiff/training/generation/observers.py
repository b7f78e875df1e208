"""The fake quantization's observers in training mode: each activation's range a moving average of
its batches' minima and maxima while the optimiser's step is within the calibration steps, then
frozen; no gradient flows through a range."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_autodiff.passes.autodiff import stop_gradient
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.fake_quantize import FakeQuantization
from onnx_autodiff.training.values import fresh_value


@dataclasses.dataclass
class Observed(ir.passes.PassResult):
    """The new ranges by the name of the buffer each replaces, and the step input they read (the
    optimiser's 1-based step, which the optimiser's update reads too)."""

    updates: dict[str, ir.Value]
    step: ir.Value


class ObserversPass(ir.passes.InPlacePass):
    """Updates each observer of ``quantization`` from the batch (its buffers graph inputs already:
    :class:`~.training_mode.TrainingModePass`): the first step's batch's range, then
    old + c·(batch − old), while step ≤ calibration steps; the fake quantization reads the new range."""

    def __init__(self, quantization: FakeQuantization, namer: Namer) -> None:
        super().__init__()
        self.quantization = quantization
        self.namer = namer

    def call(self, model: ir.Model) -> Observed:
        graph, config = model.graph, self.quantization.config
        op = OpBuilder(default_opset(model), self.namer, dict(model.opset_imports))
        values = {v.name: v for v in graph.inputs}
        for node in graph:
            values.update((out.name, out) for out in node.outputs)
        for name in self.quantization.ranges:
            stop_gradient(values[name])
        for weight, made in self.quantization.unclipped:
            if weight in values:  # (a frozen weight, an initializer still, needs no gradient)
                self._straight_through(graph, op, values[weight], values[made])
        position = {node: i for i, node in enumerate(graph)}
        start = len(op.nodes)
        step = fresh_value(self.namer, "step", ir.DataType.INT64, [])
        observing = op.LessOrEqual(step, op.const(np.array(config.calibration_steps, np.int64)))
        first = op.Equal(step, op.const(np.array(1, np.int64)))
        rates = {}  # per float type: the weight of the batch's range this step (1, the constant, 0)
        for dtype in dict.fromkeys(values[o.minimum].dtype for o in self.quantization.observers):
            number = lambda n: op.const(np.array(n, dtype.numpy()))  # noqa: E731
            rates[dtype] = op.Where(first, number(1), op.Where(observing, number(config.averaging_constant), number(0)))
        if len(graph):
            graph.insert_before(graph.node(0), op.nodes[start:])
        updates: dict[str, ir.Value] = {}
        for observer in self.quantization.observers:
            x = values[observer.observed]
            olds = [values[observer.minimum], values[observer.maximum]]
            readers = [list(old.uses()) for old in olds]
            earliest = min((user for uses in readers for user, _ in uses), key=position.__getitem__)
            start = len(op.nodes)
            news = []
            for old, reduce in zip(olds, ("ReduceMin", "ReduceMax")):
                seen = stop_gradient(op.reduce(reduce, x, None, keepdims=False))
                # old + rate·(seen − old): the first batch's range as it is (0 + 1·seen), the
                # moving average while observing, the range unchanged after
                new = stop_gradient(op.Add(old, op.Mul(rates[old.dtype], op.Sub(seen, old))))
                new.name = self.namer.fresh(f"{old.name}_new")
                news.append(new)
                updates[old.name] = new
            graph.insert_before(earliest, op.nodes[start:])
            for uses, new in zip(readers, news):
                for user, index in uses:
                    user.replace_input_with(index, new)
        graph.inputs.append(step)
        return Observed(model, bool(updates), updates, step)

    @staticmethod
    def _straight_through(graph: ir.Graph, op: OpBuilder, w: ir.Value, fake: ir.Value) -> None:
        """``fake`` (w fake-quantized, never clipped) read as w + stop_gradient(fake − w): the same
        values (fake − w is exact, Sterbenz: fake is 0 or within a factor 2 of w), and a gradient
        that passes to w unchanged, as the straight-through estimator's all-true mask gives it,
        with no backward nodes for the pair."""
        readers = list(fake.uses())
        start = len(op.nodes)
        same = op.Add(w, stop_gradient(op.Sub(fake, w)))
        same.type, same.shape = fake.type, fake.shape
        graph.insert_after(fake.producer(), op.nodes[start:])
        for user, index in readers:
            user.replace_input_with(index, same)
