"""Fake quantization inserted where the deployed model quantizes (:mod:`~onnx_autodiff.training.qat`),
in its evaluation form: the weights' ranges measured from the weights, the activations' read from
their observers' buffers (the train model's :class:`~.observers.ObserversPass` updates them)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.rules.qdq import RANGES
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, OpBuilder, shapes
from onnx_autodiff.training.qat import QatConfig
from onnx_autodiff.training.values import fresh_initializer

EPSILON = float(np.finfo(np.float32).eps)  # the smallest scale, as torch's observers take it
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_ON_GRID = ("MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity")  # (values kept as they are)
_INTEGERS = {ir.DataType.INT8: np.int8, ir.DataType.UINT8: np.uint8, ir.DataType.INT4: ml_dtypes.int4}


@dataclasses.dataclass(frozen=True)
class Observer:
    """An activation's observer: the buffers holding its range, and the value it observes."""

    minimum: str
    maximum: str
    observed: str


@dataclasses.dataclass(frozen=True)
class FakeQuantization:
    """What the fake quantization of a build added: its config, the activations' observers, the
    values holding a weight's range (which no gradient flows through)."""

    config: QatConfig
    observers: tuple[Observer, ...]
    ranges: tuple[str, ...]
    learned: tuple[str, ...] = ()  # the scales' learned log-factors (parameters)
    # (weight, its fake quantization) of each weight whose range holds all of it (symmetric, not
    # learned): round(w / s) never clips, the straight-through gradient is the identity
    unclipped: tuple[tuple[str, str], ...] = ()

    @property
    def buffers(self) -> list[str]:
        return [name for o in self.observers for name in (o.minimum, o.maximum)]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a weight's scale spreads: one per ``axis`` entry, or blocks of ``block`` along ``axis``
    (the other axis of a 2-D weight being ``channels``)."""

    axis: int
    block: int = 0
    channels: int = 0


class FakeQuantizePass(ir.passes.InPlacePass):
    """QuantizeLinear → DequantizeLinear on the weight and, where the scheme quantizes activations,
    on the first input and the output (after a Relu that alone reads it) of each Conv,
    ConvTranspose, Gemm and MatMul whose weight is computed from initializers alone, unless
    ``config.skip`` names the node or the weight: the QDQ form onnxruntime's quantizer writes, whose
    nodes its quantized kernels replace. An input already fake-quantized (a previous layer's
    output) is read as it is. The model imports ``config.opset`` or newer.
    ``observers``: the activations' observers, whose buffers it adds (range [0, 0] until the first
    step observes one); ``ranges``: the values holding a weight's range; ``quantized``: the nodes' names."""

    def __init__(self, config: QatConfig) -> None:
        super().__init__()
        self.config = config
        self.observers: list[Observer] = []
        self.ranges: list[str] = []
        self.learned: list[str] = []
        self.unclipped: list[tuple[str, str]] = []
        self.quantized: list[str] = []
        self._made: set[ir.Value] = set()  # the fake-quantized activations (read as they are)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, config = model.graph, self.config
        namer = Namer.for_graph(graph, prefix="qat")
        self.op = op = OpBuilder(default_opset(model), namer, dict(model.opset_imports))
        self.graph, self.namer = graph, namer
        activations: dict[ir.Value, ir.Value] = {}
        for node in list(graph):
            layout = _layout(node, config.weight_bits, config.block_size)
            weight = node.inputs[1] if layout is not None else None
            if weight is None or config.skips(node.name, weight.name):
                continue
            start = len(op.nodes)
            read = _transposed(weight)
            if read is not None:  # the stored matrix quantized, then transposed (see _transposed)
                source = read.inputs[0]
                swapped = dataclasses.replace(layout, axis=1 - layout.axis)
                read.replace_input_with(0, self._weight(source, swapped, source.name or node.name))
                graph.insert_before(read, op.nodes[start:])
                start = len(op.nodes)
            else:
                node.replace_input_with(1, self._weight(weight, layout, node.name or weight.name))
            x = node.inputs[0]  # (of the weight's type: these ops read one float type)
            if config.activations and x is not None and not self._on_grid(x):
                if x not in activations:
                    activations[x] = self._activation(x, weight.dtype)
                node.replace_input_with(0, activations[x])
            graph.insert_before(node, op.nodes[start:])
            if config.activations:
                self._output(node, weight.dtype)
            self.quantized.append(node.name or "")
        return ir.passes.PassResult(model, modified=bool(self.quantized))

    @property
    def added(self) -> FakeQuantization:
        return FakeQuantization(self.config, tuple(self.observers), tuple(self.ranges), tuple(self.learned),
                                tuple(self.unclipped))

    def _factor(self, shape: list[int], float_type: ir.DataType, stem: str) -> ir.Value | None:
        """exp(t) of a new parameter t of ``shape`` (0: the observed scale), where the scales are learned."""
        if not self.config.learn_scales:
            return None
        t = fresh_initializer(self.graph, self.namer, np.zeros(shape, float_type.numpy()), f"{stem}_scale_log")
        self.learned.append(t.name)
        return self.op.Exp(t)

    def _weight(self, weight: ir.Value, layout: _Layout, stem: str) -> ir.Value:
        op, config = self.op, self.config
        dtype = ir.DataType.INT4 if config.weight_bits == 4 else ir.DataType.INT8
        rank = len(weight.shape)
        if layout.block:
            w = weight
            size = weight.shape[layout.axis]
            blocks = math.ceil(size / layout.block)
            if blocks * layout.block != size:
                pads = [0] * (2 * rank)
                pads[rank + layout.axis] = blocks * layout.block - size
                w = op.Pad(w, op.const(np.array(pads, np.int64)))
            split = [layout.channels, blocks, layout.block] if layout.axis == 1 else [blocks, layout.block, layout.channels]
            w = op.reshape(w, split)
            axes = [2] if layout.axis == 1 else [1]
            scale_shape = [layout.channels, blocks] if layout.axis == 1 else [blocks, layout.channels]
        else:
            w, axes = weight, [a for a in range(rank) if a != layout.axis]
            scale_shape = [weight.shape[layout.axis]]
        if config.symmetric:
            ranges = [op.reduce("ReduceMax", op.Abs(w), axes, keepdims=False)]
        else:
            ranges = [op.reduce("ReduceMin", w, axes, keepdims=False), op.reduce("ReduceMax", w, axes, keepdims=False)]
        for i, value in enumerate(ranges):
            value.name = self.namer.fresh(f"{stem}_weight_{'max' if len(ranges) == 1 or i else 'min'}")
            self.ranges.append(value.name)
        factor = self._factor(scale_shape, weight.dtype, f"{stem}_weight")
        if config.symmetric:
            scale, zero = symmetric_qparams(op, ranges[0], dtype, scale_shape, factor)
        else:
            scale, zero = affine_qparams(op, *ranges, dtype, factor)
        attributes = {"axis": layout.axis} | ({"block_size": layout.block} if layout.block else {})
        made = quantized(op, weight, scale, zero, dtype, attributes, self.namer, weight.name or stem)
        if config.symmetric and factor is None:
            made.name = self.namer.fresh(f"{weight.name or stem}.fake_quantized")
            self.unclipped.append((weight.name, made.name))
        return made

    def _on_grid(self, x: ir.Value) -> bool:
        """Whether ``x`` is a fake-quantized activation, or what a MaxPool or a change of shape
        makes of one: its values on that grid already, as torch's QAT leaves them and onnxruntime
        reads them (it carries the quantization through those ops)."""
        while x not in self._made:
            producer = x.producer()
            if producer is None or producer.domain not in ("", "ai.onnx") or producer.op_type not in _ON_GRID:
                return False
            x = producer.inputs[0]
        return True

    def _output(self, node: ir.Node, float_type: ir.DataType) -> None:
        """Fake-quantizes what ``node`` gives the next layer: its output, or a Relu's of it where
        only that Relu reads it (what onnxruntime's quantized kernels write, the Relu in their
        range); its readers, and the graph output it may be, read the fake-quantized value under
        the output's name."""
        y = node.outputs[0]
        uses = y.uses()
        if len(uses) == 1 and not y.is_graph_output() and uses[0][0].op_type == "Relu" and uses[0][0].domain in ("", "ai.onnx"):
            y = uses[0][0].outputs[0]
        readers = list(y.uses())
        start = len(self.op.nodes)
        name, output = y.name, y.is_graph_output()
        if output:  # (renamed first: the observer finds what it observes by name)
            y.name = self.namer.fresh(f"{name}_float")
        quantized = self._activation(y, float_type, stem=name)
        self.graph.insert_after(y.producer(), self.op.nodes[start:])
        for user, index in readers:
            user.replace_input_with(index, quantized)
        if output:
            outputs = self.graph.outputs
            outputs[outputs.index(y)] = quantized
            quantized.name = name

    def _activation(self, x: ir.Value, float_type: ir.DataType, stem: str | None = None) -> ir.Value:
        op = self.op
        dtype = float_type.numpy()
        stem = stem or x.name or "x"
        minimum = fresh_initializer(self.graph, self.namer, np.array(0, dtype), f"{stem}_observed_min")
        maximum = fresh_initializer(self.graph, self.namer, np.array(0, dtype), f"{stem}_observed_max")
        self.observers.append(Observer(minimum.name, maximum.name, x.name))
        scale, zero = affine_qparams(op, minimum, maximum, ir.DataType.UINT8, self._factor([], float_type, stem))
        made = quantized(op, x, scale, zero, ir.DataType.UINT8, {}, self.namer, stem)
        self._made.add(made)
        return made


def quantized(op: OpBuilder, x: ir.Value, scale: ir.Value, zero: ir.Value, dtype: ir.DataType, attributes,
              namer: Namer, stem: str) -> ir.Value:
    """``x`` through QuantizeLinear to ``dtype`` and back by DequantizeLinear; the integers, scale
    and zero point named after ``stem`` (what the exported model stores them as)."""
    q = op.QuantizeLinear(x, scale, zero, **attributes)
    q.type = ir.TensorType(dtype)
    for value, suffix in ((q, "quantized"), (scale, "scale"), (zero, "zero_point")):
        value.name = namer.fresh(f"{stem}.{suffix}")
    y = op.DequantizeLinear(q, scale, zero, **attributes)
    y.type, y.shape = x.type, x.shape
    return y


def symmetric_qparams(op: OpBuilder, magnitude: ir.Value, dtype: ir.DataType, shape: list[int], factor=None):
    """The scale and zero point (0, of ``shape``) of a symmetric range ±``magnitude`` in ``dtype``,
    on the restricted range ±qmax (±127, ±7) as onnxruntime's quantizer takes symmetric weights:
    the range's ends fall on integers, no rounding tie (±127.5 on [−128, 127]) clips them. A
    ``factor`` (a learned one) multiplies the scale."""
    qmax = RANGES[dtype][1]
    float_type = (magnitude.dtype or ir.DataType.FLOAT).numpy()
    scale = op.Max(op.Div(magnitude, op.const(np.array(qmax, float_type))), op.const(np.array(EPSILON, float_type)))
    if factor is not None:
        scale = op.Mul(scale, factor)
    return scale, op.const(np.zeros(shape, _INTEGERS[dtype]), dtype=dtype)


def affine_qparams(op: OpBuilder, minimum: ir.Value, maximum: ir.Value, dtype: ir.DataType, factor=None):
    """The scale and zero point of the range [``minimum``, ``maximum``] (widened to hold 0) in
    ``dtype``; a ``factor`` (a learned one) multiplies the scale, and the zero point follows it."""
    qmin, qmax = RANGES[dtype]
    float_type = minimum.dtype.numpy()
    zero_f = op.const(np.array(0, float_type))
    low, high = op.Min(minimum, zero_f), op.Max(maximum, zero_f)
    scale = op.Max(op.Div(op.Sub(high, low), op.const(np.array(qmax - qmin, float_type))),
                   op.const(np.array(EPSILON, float_type)))
    if factor is not None:
        scale = op.Mul(scale, factor)
    zero = op.clip(op.Sub(op.const(np.array(qmin, float_type)), op.Round(op.Div(low, scale))), qmin, qmax)
    return scale, op.Cast(zero, to=dtype)


def _transposed(weight: ir.Value) -> ir.Node | None:
    """The Transpose of a 2-D matrix that alone makes ``weight`` (a PyTorch export's ``x @ W.T``),
    or None. Its input is quantized instead, along the matching axis: the same values, and the form
    onnxruntime's graph optimizer handles (it moves a Transpose below a blocked QuantizeLinear
    without transposing the scales, and the step then fails)."""
    read = weight.producer()
    if read is None or read.op_type != "Transpose" or read.domain not in ("", "ai.onnx") or len(weight.uses()) != 1:
        return None
    source = read.inputs[0]
    if source is None or source.shape is None or len(source.shape) != 2 or list(shapes.attr(read, "perm", [1, 0])) != [1, 0]:
        return None
    return read


def of_initializers(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` is an initializer or computed from initializers alone (within ``depth`` nodes)."""
    if value.is_initializer():
        return True
    producer = value.producer()
    if producer is None or depth == 0 or value.is_graph_input():
        return False
    return all(v is None or of_initializers(v, depth - 1) for v in producer.inputs) and not any(
        attr.type == ir.AttributeType.GRAPH for attr in producer.attributes.values())


def _layout(node: ir.Node, bits: int, block: int) -> _Layout | None:
    """How ``node``'s weight is fake-quantized, or None where it has no float weight computed from
    initializers alone (an initializer; LoRA's merged W + s·A·B)."""
    if node.op_type not in WEIGHTED or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    weight = node.inputs[1]
    if weight is None or weight.dtype not in FLOAT_TYPES or weight.shape is None or not of_initializers(weight):
        return None
    if node.inputs[0] is None or of_initializers(node.inputs[0]):  # a weight's computation (LoRA's A·B), no layer
        return None
    shape = list(weight.shape)
    if not all(isinstance(d, int) for d in shape):
        return None
    if node.op_type in ("Conv", "ConvTranspose"):
        return _Layout(axis=0 if node.op_type == "Conv" else 1) if len(shape) >= 3 else None
    if len(shape) != 2:
        return None
    transposed = node.op_type == "Gemm" and shapes.attr(node, "transB", 0)
    channel, reduction = (0, 1) if transposed else (1, 0)
    if bits == 4:
        return _Layout(axis=reduction, block=block, channels=shape[channel])
    return _Layout(axis=channel)
