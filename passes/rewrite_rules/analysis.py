"""What the cleanup's rules know of values: their dims, the one number a value holds everywhere
(its fill), axes and permutations, broadcasting; whether zeros fit and how they make constants;
and the MatchResult their checks return. Constants, axes and zeros themselves come from the
toolkit (:func:`~onnx_autodiff.toolkit.shapes.constant`, ``axes``, ``zeros``), read with
``computed=False``: the cleanup folds computed constants itself."""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.toolkit import shapes
from onnx_autodiff.toolkit.builder import CONSTANT_TYPES_BEFORE_9, FLOAT_TYPES

# Dims of a value: per axis an int (static), a str (named symbolic) or None (unknown).
Dims = tuple
SMALL = 16  # a zero tensor at most this large becomes a Constant, a larger one a ConstantOfShape
_FILL_HEAD = 64  # elements fill() compares before the whole tensor
_FILL_OPS = frozenset({"Constant", "ConstantOfShape", "Expand", "Identity", "Cast", "CastLike"})

_CASTABLE = {*FLOAT_TYPES, ir.DataType.BOOL,
             *(t for t in ir.DataType if t.name.startswith(("INT", "UINT")) and t.bitwidth >= 8)}


def verdict(holds: bool, reason: str) -> MatchResult:
    """A check's MatchResult: success when ``holds``, else a failure saying ``reason`` (one shared
    object per reason: onnxscript only reads a check's result, and the checks run on most nodes
    of every sweep)."""
    return _SUCCESS if holds else _failure(reason)


_SUCCESS = MatchResult()


@functools.lru_cache(maxsize=None)
def _failure(reason: str) -> MatchResult:
    return MatchResult().fail(reason)


def opset(model: ir.Model) -> int:
    """The model's default-domain opset (the rules' conditions on it read the model's, in every graph)."""
    return default_opset(model) or 1


def static(d: Dims | None) -> bool:
    return d is not None and all(isinstance(x, int) for x in d)


def same(a: Dims | None, b: Dims | None) -> bool:
    """Whether two shapes are known to be equal (unnamed symbolic dims never are)."""
    return a is not None and b is not None and len(a) == len(b) and all(x is not None and x == y for x, y in zip(a, b))


def broadcast(*shapes_: Dims | None) -> Dims | None:
    """The multidirectional broadcast of the shapes where it is known, else None."""
    if any(s is None for s in shapes_):
        return None
    rank = max(len(s) for s in shapes_)
    out = []
    for axis in range(rank):
        dim: int | str | None = 1
        for s in shapes_:
            d = s[axis - rank + len(s)] if axis - rank + len(s) >= 0 else 1
            if d == 1 or d == dim:
                continue
            if dim == 1:
                dim = d
            elif isinstance(d, int) and isinstance(dim, str) or isinstance(d, str) and isinstance(dim, int):
                dim = d if isinstance(d, int) else dim  # a valid model's symbolic dim equals the number
            else:
                return None
        if dim is None:
            return None
        out.append(dim)
    return tuple(out)


def fill(value: ir.Value | None) -> float | None:
    """The one number every element of ``value`` holds, when the graph says so: a constant, a
    ConstantOfShape, and Expand, Identity or Cast of one."""
    if value is None:
        return None
    node = value.producer()
    # (most values a rule asks about are neither constant nor made by an op fill looks through)
    if value.const_value is None and (node is None or node.op_type not in _FILL_OPS):
        return None
    if value.const_value is not None or node.op_type == "Constant":
        array = shapes.constant(value, computed=False)
        if array is None or array.size == 0 or array.dtype.kind not in "biuf":
            return None
        flat = array.reshape(-1)
        first = flat[0]
        # its first elements first: a weight is no fill, and a frozen one stored beside the model
        # is then not read whole (every page of it mapped) to say so
        if array.size > 1 and not bool(np.all(flat[:_FILL_HEAD] == first)):
            return None
        return float(first) if array.size == 1 or bool(np.all(array == first)) else None
    if node.domain != "":  # (a value without a producer returned above, or was a constant)
        return None
    if node.op_type == "ConstantOfShape":
        tensor = shapes.attr(node, "value")
        return 0.0 if tensor is None else float(tensor.numpy().flat[0])
    if node.op_type in ("Expand", "Identity"):
        return fill(node.inputs[0])
    if node.op_type in ("Cast", "CastLike") and value.dtype in _CASTABLE:
        inner = fill(node.inputs[0])
        if inner is None:
            return None
        with np.errstate(all="ignore"):
            return float(np.array(inner).astype(value.dtype.numpy()))
    return None


def normalized(axes_: list[int] | ir.Value | None, rank: int | None) -> list[int] | None:
    """The axes made non-negative and sorted; None when they are not known before run time or
    one is out of range."""
    if not isinstance(axes_, list) or rank is None or any(not -rank <= a < rank for a in axes_):
        return None
    return sorted(a % rank for a in axes_)


def perm(node: ir.Node, rank: int | None) -> list[int] | None:
    """A Transpose's permutation (without the attribute: the axes reversed, when the rank is known)."""
    given = shapes.attr(node, "perm")
    if given is not None:
        return [int(p) for p in given]
    return None if rank is None else list(reversed(range(rank)))


def produced_by(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The default-domain ``op_type`` node producing ``value``, if that is what produces it."""
    node = None if value is None else value.producer()
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def concat_axis(node: ir.Node, opset_: int) -> int | None:
    """A Concat's axis made non-negative where its rewrites apply: opset 5 on (their Reshape
    takes its shape as an input), a known output rank, two inputs or more."""
    out, axis = shapes.dims(node.outputs[0]), shapes.attr(node, "axis")
    if opset_ < 5 or not out or len(node.inputs) < 2 or axis is None:
        return None
    return axis % len(out)


def only_use(value: ir.Value) -> bool:
    """Whether one node input reads ``value`` and nothing else does (no graph output either: an
    inner graph's output read from outside counts as one)."""
    return len(value.uses()) == 1 and not value.is_graph_output()


def renamable(value: ir.Value, graph: ir.Graph | ir.Function) -> bool:
    """Whether ``value`` can take a graph output's name: a node of ``graph`` makes it, and it is no
    graph output itself."""
    producer = value.producer()
    return producer is not None and producer.graph is graph and not value.is_graph_output()


def zeros_fit(like: ir.Value, opset_: int) -> bool:
    """Whether the cleanup can make zeros like ``like`` from constants: a static shape and a numeric dtype;
    before opset 9 (no ConstantOfShape, Constant of float tensors only) a small float tensor."""
    shape = shapes.dims(like)
    if not static(shape) or like.dtype is None or like.dtype.numpy().kind not in "biuf":
        return False
    return opset_ >= 9 or size(shape) <= SMALL and like.dtype in CONSTANT_TYPES_BEFORE_9


def new_constant(op, array: np.ndarray) -> ir.Value:
    """A Constant node's output that carries its tensor, type and shape (the next rules in the same
    sweep read them; a function cannot hold the initializer ``op.initializer`` would make)."""
    tensor = ir.Tensor(array) if isinstance(array, np.ndarray) else ir.tensor(array)  # (the former without protocol checks)
    value = op.Constant(value=constant_attribute(tensor))
    value.type, value.shape, value.const_value = ir.TensorType(tensor.dtype), ir.Shape(tensor.shape), tensor
    return value


def constant_attribute(tensor: ir.Tensor) -> ir.Attr:
    """A Constant's ``value`` attribute holding ``tensor``, for the rules' replacements: given the
    tensor alone, onnx-ir tells its attribute type by protocol checks that take longer than the
    rest of a replacement."""
    return ir.AttrTensor("value", tensor)


def size(shape: Dims) -> int:
    """The number of elements of a static shape (math.prod: numpy's reduction of a few ints costs
    more than the checks that ask)."""
    return math.prod(shape)
