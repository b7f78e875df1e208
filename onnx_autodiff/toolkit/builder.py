"""The op builder backward templates are written with: ``op.Mul(dY, B)`` emits one standard ONNX node."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import OpsetTooOldError
from onnx_autodiff.toolkit.graphs import graph_and_subgraphs, initializers_to_constants

FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
)
CONSTANT_TYPES_BEFORE_9 = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16})
SHARED_SIZE = 64  # elements: the largest array input a sharing builder makes one Constant for (axes, shapes, scalars)


def may_be_float(value: ir.Value) -> bool:
    """Whether ``value`` can carry a gradient: a floating-point dtype, or one not known yet."""
    return value.dtype is None or value.dtype in FLOAT_TYPES


_INT64_RESULT = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "SequenceLength"})
_BOOL_RESULT = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
     "IsNaN", "IsInf"}
)


class Namer:
    """Fresh, deterministic names that collide with no name already in the model."""

    def __init__(self, taken: Iterable[str] = (), prefix: str = "bwd") -> None:
        self.taken = set(taken)
        self.prefix = prefix
        self._count = 0

    def fresh(self, hint: str | None = None) -> str:
        base = hint or f"{self.prefix}{self._count}"
        if hint is None:
            self._count += 1
        name, suffix = base, 0
        while name in self.taken:
            suffix += 1
            name = f"{base}_{suffix}" if hint else f"{self.prefix}{self._count}"
            if hint is None:
                self._count += 1
        self.taken.add(name)
        return name

    @classmethod
    def for_graph(cls, graph: ir.Graph | ir.Function, prefix: str = "bwd") -> Namer:
        """A namer avoiding the names of the graph's values and nodes, its subgraphs' included
        (``graph``: a model's or a function's, which reads no outer value)."""
        names: set[str | None] = set()
        # (graph_and_subgraphs walks a large graph faster than onnx-ir's RecursiveGraphIterator;
        # every value a node reads is an input, an initializer or a node's output of these graphs)
        for held in graph_and_subgraphs(graph):
            names.update([v.name for v in held.inputs])
            names.update([v.name for v in held.outputs])
            if isinstance(held, ir.Graph):
                names.update(held.initializers)
            for node in held:
                names.add(node.name)
                for out in node.outputs:
                    names.add(out.name)
        names.discard(None)
        names.discard("")
        return cls(names, prefix)


Differentiate = Callable[["OpBuilder", Sequence[ir.Node], Sequence[tuple[ir.Value, ir.Value]], Sequence[ir.Value]],
                         list["ir.Value | None"]]
"""The engine's reverse pass as a callback: ``(op, nodes, seeds, xs)`` emits into ``op``."""


class OpBuilder:
    """Emits nodes for one backward pass.

    ``op.<OpType>(*inputs, **attributes)`` appends a node and returns its output (a tuple when
    ``_outputs`` > 1). Inputs may be ``ir.Value``, None (an omitted optional input), numpy arrays,
    lists of ints (int64 tensors) or Python numbers (a scalar of the first input's dtype).
    Attributes set to None are left out. Methods in lower case emit the form right for ``opset``.

    ``share_numbers``: a Python number, list or small array (at most :data:`SHARED_SIZE`
    elements) given as an input becomes one Constant per value and dtype for the whole builder
    (the backward of a 5,000-block chain with biases read 5,000 Constants of 1 from Tanh's rule
    and 5,000 of the axes [0] from the bias sums, each then inferred, folded and merged by the
    cleanup). Only for a builder whose nodes go into one graph in the order emitted: the first use
    then comes after it.
    """

    def __init__(self, opset: int, namer: Namer, opsets: dict[str, int] | None = None,
                 differentiate: Differentiate | None = None, share_numbers: bool = False) -> None:
        self.opset = opset
        self.opsets = dict(opsets or {"": opset})
        self.namer = namer
        self.nodes: list[ir.Node] = []
        self._differentiate = differentiate
        self._numbers: dict[tuple, ir.Value] | None = {} if share_numbers else None

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return functools.partial(self.emit, op_type)

    def emit(self, op_type: str, *inputs, _outputs: int = 1, _domain: str = "", **attributes):
        values = list(inputs)
        if not all(v is None or type(v) is ir.Value for v in values):  # numbers, arrays: constants
            like = _like(inputs)
            values = [self._as_value(v, like) for v in inputs]
        if not _domain:
            if op_type == "CastLike" and self.opset < 15 and values[1].dtype is not None:
                return self.Cast(values[0], to=int(values[1].dtype))  # the same node, before CastLike existed
        keep = _min_inputs(op_type, self.opsets.get(_domain, self.opset), _domain)
        while len(values) > keep and values[-1] is None:
            values.pop()
        if not _domain:
            _require_op(op_type, self.opset, len(values))  # (omitted trailing inputs not counted)
        attrs = {k: v for k, v in attributes.items() if v is not None}
        name = self.namer.fresh(f"{self.namer.prefix}_{op_type}_{len(self.nodes)}")
        dtype = _result_dtype(op_type, values, attrs)
        # Outputs made named and typed: cheaper than setting a node's own outputs' name and dtype.
        outputs = [
            ir.Value(
                name=self.namer.fresh(),
                type=ir.TensorType(dtype) if dtype is not None and (i == 0 or op_type == "Split") else None,
            )
            for i in range(_outputs)
        ]
        node = ir.Node(
            _domain, op_type, values, attributes=[_attribute(k, v) for k, v in attrs.items()], outputs=outputs, name=name
        )
        self.nodes.append(node)
        if _domain and _domain not in self.opsets:
            self.opsets[_domain] = 1
        return outputs[0] if _outputs == 1 else tuple(outputs)

    def const(self, value, dtype: ir.DataType | None = None, like: ir.Value | None = None):
        """A Constant node; ``dtype`` or the dtype of ``like`` (CastLike when it is unknown)."""
        if dtype is None and like is not None:
            dtype = like.dtype
        array = np.asarray(value, dtype=dtype.numpy() if dtype is not None else None)
        if dtype is None and like is None and array.dtype == np.float64:
            array = array.astype(np.float32)
        if dtype is None and array.dtype.kind in "iu" and like is None:
            array = array.astype(np.int64)
        target = ir.DataType.from_numpy(array.dtype)
        if self.opset < 9 and target not in CONSTANT_TYPES_BEFORE_9:
            # Constant holds only float tensors before opset 9: store as float, Cast back.
            out = self.Cast(self.Constant(value=ir.Tensor(array.astype(np.float32))), to=int(target))
        else:
            out = self.Constant(value=ir.Tensor(array))
        out.dtype = target
        if dtype is None and like is not None:
            return self.CastLike(out, like)
        return out

    def _as_value(self, value, like: ir.Value | None):
        if value is None or _is_value(value):
            return value
        if isinstance(value, (list, tuple)):
            value = np.asarray(value, dtype=np.int64)
        if isinstance(value, np.ndarray):
            return self._shared(value, None, lambda: self.const(value))
        if isinstance(value, (int, float, np.number)):
            if like is not None and like.dtype is None:  # (CastLike to like: that value's own)
                return self.const(value, like=like)
            return self._shared(np.asarray(value), None if like is None else like.dtype,
                                lambda: self.const(value, like=like))
        raise TypeError(f"cannot use {type(value).__name__} as a node input")

    def _shared(self, array: np.ndarray, dtype: ir.DataType | None, make) -> ir.Value:
        """``make()``, or where the builder shares numbers (see the class), the value it made
        before for an equal small ``array`` made ``dtype``."""
        if self._numbers is None or array.size > SHARED_SIZE:
            return make()
        key = (dtype, array.dtype.str, array.shape, array.tobytes())
        if key not in self._numbers:
            self._numbers[key] = make()
        return self._numbers[key]

    # Subgraphs: what control-flow rules build their bodies with.

    def child(self) -> OpBuilder:
        """A builder for a subgraph body: the same names, opsets and engine, its own nodes."""
        child = OpBuilder(self.opset, self.namer, self.opsets, self._differentiate, self._numbers is not None)
        child.opsets = self.opsets
        return child

    def differentiate(self, nodes, seeds, xs) -> list[ir.Value | None]:
        """Σ_k dy_k·∂y_k/∂x for the (y_k, dy_k) seeds through ``nodes``, emitted into this builder."""
        if self._differentiate is None:
            raise RuntimeError("differentiate() needs a builder created by the engine")
        return self._differentiate(self, nodes, seeds, xs)

    def inline(self, graph: ir.Graph, bindings: Sequence[ir.Value | None]) -> tuple[list[ir.Value], list[ir.Node]]:
        """Copies ``graph``'s nodes here with its inputs bound to ``bindings``, under fresh names.

        Returns the copies of its outputs and the copied nodes. Outer-scope values stay shared;
        the graph's own initializers (a branch's constants) come as Constant nodes first, since the
        graph receiving the copies does not hold them.
        """
        clone = graph.clone(allow_outer_scope_values=True)
        for inner, outer in zip(clone.inputs, bindings):
            if outer is not None:
                inner.replace_all_uses_with(outer, replace_graph_outputs=True)
        initializers_to_constants(clone)
        outputs = list(clone.outputs)
        nodes = list(clone)
        clone.outputs.clear()
        clone.remove(nodes)
        for node in nodes:
            self._rename(node)
        self.nodes.extend(nodes)
        return outputs, nodes

    def _rename(self, node: ir.Node) -> None:
        node.name = self.namer.fresh(f"{self.namer.prefix}_{node.op_type}_{len(self.nodes)}")
        for out in node.outputs:
            if out.name:
                out.name = self.namer.fresh()
        for attribute in node.attributes.values():
            graphs = ()
            if attribute.type == ir.AttributeType.GRAPH:
                graphs = (attribute.value,)
            elif attribute.type == ir.AttributeType.GRAPHS:
                graphs = attribute.value
            for graph in graphs:
                for value in graph.inputs:
                    value.name = self.namer.fresh()
                for inner in graph:
                    self._rename(inner)

    def graph(self, inputs: Sequence[ir.Value], outputs: Sequence[ir.Value], name: str) -> ir.Graph:
        """A subgraph holding this builder's nodes; outputs not produced here get an Identity."""
        produced = {out for node in self.nodes for out in node.outputs}
        fixed, taken = [], set()  # (a set: an optimiser's If returns tens of thousands of values)
        for value in outputs:
            if value not in produced or value in taken:
                value = self.Identity(value)
                produced.add(value)
            fixed.append(value)
            taken.add(value)
        return ir.Graph(list(inputs), fixed, nodes=self.nodes, name=name, opset_imports={})

    # Forms that changed across opsets. Axes are Python ints or an int64 ir.Value.

    def reduce(self, op_type: str, x, axes, keepdims: bool = True, noop_with_empty_axes=None):
        """Reduce* over ``axes`` (None: all axes), as an input from opset 13/18, else an attribute."""
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        keep = int(bool(keepdims))
        if axes is None:
            return self.emit(op_type, x, keepdims=keep)
        if axes_as_input:
            return self.emit(op_type, x, _axes(axes), keepdims=keep,
                             noop_with_empty_axes=noop_with_empty_axes)
        if _is_value(axes):
            raise ValueError(f"{op_type} at opset {self.opset} needs constant axes")
        return self.emit(op_type, x, axes=list(axes), keepdims=keep)

    def reduce_sum(self, x, axes, keepdims: bool = True):
        return self.reduce("ReduceSum", x, axes, keepdims)

    def unsqueeze(self, x, axes):
        if self.opset >= 13:
            return self.Unsqueeze(x, _axes(axes))
        return self.Unsqueeze(x, axes=list(axes))

    def squeeze(self, x, axes):
        if self.opset >= 13:
            return self.Squeeze(x, _axes(axes))
        return self.Squeeze(x, axes=list(axes))

    def reshape(self, x, shape):
        """Reshape to ``shape``: an input from opset 5, else an attribute (then ints only)."""
        if self.opset >= 5:
            return self.Reshape(x, shape if _is_value(shape) else list(shape))
        return self.Reshape(x, shape=list(shape))

    def slice(self, x, starts, ends, axes=None):
        """Slice: inputs from opset 10 (or where one is a value), else attributes."""
        if self.opset >= 10 or any(_is_value(v) for v in (starts, ends, axes)):
            return self.Slice(x, *(v if v is None or _is_value(v) else list(v) for v in (starts, ends, axes)))
        return self.Slice(x, starts=list(starts), ends=list(ends), axes=None if axes is None else list(axes))

    def clip(self, x, low: float, high: float):
        """Clip to [low, high]: inputs from opset 11, else attributes."""
        if self.opset >= 11:
            return self.Clip(x, low, high)
        return self.Clip(x, min=float(low), max=float(high))

    def split(self, x, sizes: Sequence[int] | ir.Value, axis: int, count: int | None = None):
        count = count if count is not None else len(sizes)
        if self.opset >= 13:
            return self._tuple(self.Split(x, _axes(sizes), axis=axis, _outputs=count))
        return self._tuple(self.Split(x, axis=axis, split=list(sizes), _outputs=count))

    @staticmethod
    def _tuple(result):
        return result if isinstance(result, tuple) else (result,)


@functools.lru_cache(maxsize=None)
def _require_op(op_type: str, opset: int, inputs: int) -> None:
    """Refuse a default-domain op that ``opset`` lacks, or whose form there takes fewer than
    ``inputs`` inputs (Slice's starts, ReduceSum's axes as inputs), naming the first opset that has
    it, so that no backward holds a node its model's opset does not define (the passes then convert
    the model: :mod:`onnx_autodiff.passes.opsets`)."""
    if not onnx.defs.has(op_type, ""):
        return  # (not a standard op: the checker names it)
    if onnx.defs.has(op_type, opset, "") and onnx.defs.get_schema(op_type, opset, "").max_input >= inputs:
        return
    first = min((s.since_version for s in onnx.defs.get_all_schemas_with_history()
                 if s.name == op_type and s.domain == "" and s.since_version > opset and s.max_input >= inputs),
                default=None)
    if first is None:
        return  # (no opset has that form: the checker names it)
    form = f" with {inputs} inputs" if onnx.defs.has(op_type, opset, "") else ""
    raise OpsetTooOldError(f"{op_type}{form} needs opset {first} or later (the model has {opset})", first)


@functools.lru_cache(maxsize=None)
def _min_inputs(op_type: str, opset: int, domain: str) -> int:
    """How many inputs the schema requires positionally (omitted optional ones stay as "")."""
    try:
        return onnx.defs.get_schema(op_type, opset, domain).min_input
    except onnx.defs.SchemaError:
        return 0


def _attribute(name: str, value) -> ir.Attr:
    """An ir.Attr for the common Python types, without onnx-ir's slower generic conversion."""
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, (float, np.floating)):
        return ir.AttrFloat32(name, float(value))
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, np.ndarray):
        return ir.AttrTensor(name, ir.Tensor(value))
    if isinstance(value, ir.Tensor):
        return ir.AttrTensor(name, value)
    if isinstance(value, ir.Graph):
        return ir.AttrGraph(name, value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, np.integer)) for v in value):
        return ir.AttrInt64s(name, [int(v) for v in value])
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (float, int)) for v in value):
        return ir.AttrFloat32s(name, [float(v) for v in value])
    return ir.convenience.convert_attribute(name, value)


def _is_value(x) -> bool:
    """``isinstance(x, ir.Value)``, quick for the plain values and Python numbers builders mostly
    see (onnx-ir's classes derive from typing Protocols, whose isinstance check is slow)."""
    return type(x) is ir.Value or (type(x) not in _PLAIN_INPUTS and isinstance(x, ir.Value))


_PLAIN_INPUTS = frozenset({type(None), int, float, bool, list, tuple, np.ndarray})


def _axes(axes):
    return axes if _is_value(axes) else np.asarray(list(axes), dtype=np.int64)


def _like(inputs) -> ir.Value | None:
    """The input whose dtype Python numbers take: a float one, else one of unknown dtype (via
    CastLike), else an integer one; a bool one only when nothing else is there."""
    ranked = []
    for value in inputs:
        if _is_value(value):
            dtype = value.dtype
            if dtype in FLOAT_TYPES:
                return value
            rank = 0 if dtype is None else (2 if dtype == ir.DataType.BOOL else 1)
            ranked.append((rank, len(ranked), value))
    return min(ranked)[2] if ranked else None


_SAME_AS_INPUT = {"Where": 1, "OneHot": 2}
_UNTYPED = frozenset({
    "Constant", "EyeLike", "If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike",
    "RandomUniformLike", "Multinomial", "SequenceMap", "SplitToSequence", "SequenceConstruct",
    "SequenceEmpty", "SequenceInsert", "SequenceErase", "SequenceAt", "Optional", "OptionalGetElement",
})


def _result_dtype(op_type: str, inputs: Sequence[ir.Value | None], attrs: dict):
    if op_type in _INT64_RESULT:
        return ir.DataType.INT64
    if op_type in _BOOL_RESULT:
        return ir.DataType.BOOL
    if op_type == "Cast":
        return ir.DataType(attrs["to"])
    if op_type == "CastLike":
        return inputs[1].dtype
    if op_type == "DequantizeLinear":  # the scale's type (output_dtype, opset 23, aside)
        return ir.DataType(attrs["output_dtype"]) if attrs.get("output_dtype") else inputs[1].dtype
    if op_type == "ConstantOfShape":
        value = attrs.get("value")
        if value is None:
            return ir.DataType.FLOAT
        return ir.DataType.from_numpy(value.dtype) if isinstance(value, np.ndarray) else value.dtype
    if op_type in _UNTYPED:
        return None
    index = _SAME_AS_INPUT.get(op_type, 0)
    source = inputs[index] if len(inputs) > index else None
    return source.dtype if source is not None else None
