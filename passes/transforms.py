"""Function transforms built from the one reverse-mode engine: vjp, jvp, hvp and jacobian.

Forward mode needs no second rule set: the VJP u ↦ uᵀJ is linear in its seed u, so the JVP is the
gradient with respect to u of ⟨VJP(u), t⟩ (reverse over reverse, with u a zero placeholder).
Hessian-vector products are reverse over reverse as well: ∇_x ⟨∇_x f, v⟩, one extra backward sweep
over the first one. Forward over reverse would cost a JVP of the gradient, which here is itself two
reverse sweeps, so reverse over reverse is the cheaper choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import NotDifferentiableError
from onnx_autodiff.modelfile import from_proto, to_proto
from onnx_autodiff.passes.autodiff import (
    AutodiffPass,
    backward_builder,
    check_differentiable,
    choose_variables,
    differentiate,
    find_value,
    is_scalar,
)
from onnx_autodiff.passes.opsets import build_upgrading
from onnx_autodiff.rules import GradRegistry, default_registry
from onnx_autodiff.toolkit import Namer, OpBuilder, infer_shapes, shapes


@dataclasses.dataclass
class TransformResult(ir.passes.PassResult):
    """What one call of a transform pass did: the model and ``modified`` (as every
    ``PassResult``), the input it added per variable (``t_<x>``, ``v_<x>``), its output per key
    (``of``'s name for a JVP, each variable's for the others) and the float initializers the
    default variables left out (constants)."""

    input_names: dict[str, str] = dataclasses.field(default_factory=dict)
    output_names: dict[str, str] = dataclasses.field(default_factory=dict)
    left_out: list[str] = dataclasses.field(default_factory=list)


class _TransformPass(ir.passes.InPlacePass):
    """Shared set-up: find ``of`` and ``wrt``, build on the engine, add inputs and outputs.

    Calling the pass returns a :class:`TransformResult`; ``input_names``, ``output_names`` and
    ``left_out`` on the pass are a view of the last one (``last_result``), which is what a
    pipeline user reads: ``ir.passes.PassManager`` returns a plain ``PassResult`` of its own.
    """

    def __init__(
        self, of: str, wrt: Sequence[str] | str | None = None, registry: GradRegistry | None = None,
        upgrade_opset: bool = True,
    ):
        super().__init__()
        self.upgrade_opset = upgrade_opset  # as AutodiffPass's: convert a model whose rules need a newer opset
        self.of = of
        self.wrt = [wrt] if isinstance(wrt, str) else (None if wrt is None else list(wrt))
        self.registry = registry if registry is not None else default_registry()
        self.last_result: TransformResult | None = None
        self._inputs: dict[str, str] = {}  # what the build in progress adds
        self._outputs: dict[str, str] = {}

    @property
    def input_names(self) -> dict[str, str]:
        """The input the last call added per variable ({} before the first call)."""
        return {} if self.last_result is None else self.last_result.input_names

    @property
    def output_names(self) -> dict[str, str]:
        """The last call's output per key ({} before the first call)."""
        return {} if self.last_result is None else self.last_result.output_names

    @property
    def left_out(self) -> list[str]:
        """The float initializers the last call's default variables left out ([] before a call)."""
        return [] if self.last_result is None else self.last_result.left_out

    def call(self, model: ir.Model) -> TransformResult:
        # The second sweep adds the first one's nodes to the graph: convert the model as it was.
        result = build_upgrading(model, self._build, self.upgrade_opset, pristine=True)
        self.last_result = result
        return result

    def _build(self, model: ir.Model) -> TransformResult:
        infer_shapes(model)
        self._inputs, self._outputs = {}, {}
        graph = model.graph
        y = find_value(graph, self.of, "of")
        check_differentiable(y, "of")
        xs, left_out = choose_variables(model, self.wrt, self.registry)
        namer = Namer.for_graph(graph)
        op = backward_builder(self.registry, model.opset_imports, namer)
        self.model = model
        inputs, outputs = self.build(op, graph, y, xs, namer)
        graph.inputs.extend(inputs)
        graph.extend(op.nodes)
        graph.outputs.extend(outputs)
        for domain, version in op.opsets.items():
            model.opset_imports.setdefault(domain, version)
        return TransformResult(model, True, self._inputs, self._outputs, left_out)

    def build(self, op: OpBuilder, graph, y, xs, namer) -> tuple[list[ir.Value], list[ir.Value]]:
        """The inputs and outputs the transform adds; its nodes go into ``op``."""
        raise NotImplementedError

    def _input_like(self, namer: Namer, prefix: str, x: ir.Value) -> ir.Value:
        value = ir.Value(name=namer.fresh(f"{prefix}_{x.name}"), type=x.type, shape=x.shape)
        self._inputs[x.name] = value.name
        return value

    def _output(self, op: OpBuilder, namer: Namer, key: str, name: str, value: ir.Value, like: ir.Value):
        value = shapes.alias(op, value)
        value.name = namer.fresh(name)
        value.type, value.shape = like.type, like.shape
        self._outputs[key] = value.name
        return value


def _inner_product(op: OpBuilder, pairs) -> ir.Value | None:
    terms = [op.ReduceSum(op.Mul(a, b), keepdims=0) for a, b in pairs if a is not None]
    return shapes.accumulate(op, terms) if terms else None


def _second_sweep(model: ir.Model, op: OpBuilder, s, wrt, extra_inputs) -> list[ir.Value | None]:
    """∂s/∂w for each w, differentiating through the forward and the first backward nodes.

    The first sweep's nodes join the graph and shape inference types them, since rules read
    ranks and shapes.
    """
    if s is None:
        return [None] * len(wrt)
    graph = model.graph
    graph.extend(op.nodes)
    op.nodes.clear()
    graph.inputs.extend(extra_inputs)
    infer_shapes(model)
    for value in extra_inputs:
        graph.inputs.remove(value)
    return differentiate(graph, [(s, shapes.ones_like(op, s))], wrt, op)


class JvpPass(_TransformPass):
    """Adds a tangent input ``t_<x>`` per x and the output ``jvp_<of>`` = Σ_x (∂of/∂x)·t_x."""

    def build(self, op, graph, y, xs, namer):
        placeholder = shapes.zeros(op, y)  # the VJP is linear in its seed: any value will do
        grads = differentiate(graph, [(y, placeholder)], xs, op)
        tangents = [self._input_like(namer, "t", x) for x in xs]
        s = _inner_product(op, zip(grads, tangents))
        (jvp,) = _second_sweep(self.model, op, s, [placeholder], tangents)
        jvp = shapes.zeros(op, y) if jvp is None else jvp
        return tangents, [self._output(op, namer, y.name, f"jvp_{y.name}", jvp, y)]


class HvpPass(_TransformPass):
    """Adds a direction input ``v_<x>`` per x and outputs ``hvp_<x>`` = Σ_z (∂²of/∂x∂z)·v_z.

    ``of`` must have one element (a loss).
    """

    def build(self, op, graph, y, xs, namer):
        if not is_scalar(y):
            raise NotDifferentiableError(f"hvp needs a one-element 'of'; '{y.name}' is {shapes.dims(y)}")
        grads = differentiate(graph, [(y, shapes.ones_like(op, y))], xs, op)
        directions = [self._input_like(namer, "v", x) for x in xs]
        s = _inner_product(op, zip(grads, directions))
        hvps = _second_sweep(self.model, op, s, xs, directions)
        outputs = []
        for x, h in zip(xs, hvps):
            h = shapes.zeros(op, x) if h is None else h
            outputs.append(self._output(op, namer, x.name, f"hvp_{x.name}", h, x))
        return directions, outputs


class JacobianPass(_TransformPass):
    """Outputs ``jac_<x>`` of shape (*of.shape, *x.shape): one VJP per element of ``of``.

    The VJPs run in a Loop, ``chunk`` seeds per iteration, so memory stays bounded; the number
    of elements of ``of`` may be known only at run time (a symbolic batch).
    """

    def __init__(self, of, wrt=None, registry=None, chunk: int = 1, upgrade_opset: bool = True):
        super().__init__(of, wrt, registry, upgrade_opset)
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, not {chunk}")
        self.chunk = chunk

    def build(self, op, graph, y, xs, namer):
        shapes.require_opset(op, 11, "the jacobian's Loop without loop-carried values and its OneHot seeds")
        size = op.Size(y)
        chunk = op.const(np.array(self.chunk, np.int64))
        trips = op.Div(op.Sub(op.Add(size, chunk), op.const(np.array(1, np.int64))), chunk)
        body = op.child()
        step = ir.Value(name=namer.fresh(), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
        go = ir.Value(name=namer.fresh(), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        # OneHot has no bfloat16 values: such seeds are made in float and cast.
        bfloat16 = y.dtype == ir.DataType.BFLOAT16
        values = body.const(np.array([0.0, 1.0], np.float32), like=None if bfloat16 else y)
        rows: list[list[ir.Value]] = [[] for _ in xs]
        for k in range(self.chunk):
            index = body.Add(body.Mul(step, chunk), body.const(np.array(k, np.int64)))
            hot = body.OneHot(body.unsqueeze(index, [0]), size, values, axis=-1)
            seed = _reshape(body, body.Cast(hot, to=int(y.dtype)) if bfloat16 else hot, body.Shape(y))
            for row, x, g in zip(rows, xs, differentiate(list(graph), [(y, seed)], xs, body)):
                g = shapes.zeros(body, x) if g is None else g
                row.append(body.unsqueeze(g, [0]))
        stacked = [r[0] if len(r) == 1 else body.Concat(*r, axis=0) for r in rows]
        loop_body = body.graph([step, go], [body.const(np.array(True)), *stacked], name="jacobian_rows")
        # An explicit condition: a trailing empty input is dropped by onnx-ir's unused-node removal
        # (which cleanup runs), and a Loop needs its second input's place.
        results = op.Loop(trips, op.const(np.array(True)), body=loop_body, _outputs=len(xs))
        results = results if isinstance(results, tuple) else (results,)
        outputs = []
        for x, r in zip(xs, results):
            shape = op.Concat(op.Shape(y), op.Shape(x), axis=0)
            # Each iteration stacked `chunk` rows: flatten them, keep the first size(y), reshape.
            count = op.unsqueeze(op.Mul(trips, chunk), [0])
            flat = _reshape(op, r, op.Concat(count, op.Shape(x), axis=0))
            rows_kept = op.Slice(flat, op.const(np.array([0], np.int64)), op.unsqueeze(size, [0]),
                                 op.const(np.array([0], np.int64)))
            jac = _reshape(op, rows_kept, shape)
            out = self._output(op, namer, x.name, f"jac_{x.name}", jac, x)
            y_dims, x_dims = shapes.dims(y), shapes.dims(x)
            out.shape = None if y_dims is None or x_dims is None else ir.Shape(
                [d if d is not None else None for d in (*y_dims, *x_dims)]
            )
            outputs.append(out)
        return [], outputs


def _reshape(op: OpBuilder, x: ir.Value, shape: ir.Value) -> ir.Value:
    """x reshaped to a run-time shape whose zeros are extents (an empty ``of`` or x), where the
    opset has allowzero (14)."""
    return op.Reshape(x, shape, allowzero=1) if op.opset >= 14 else op.Reshape(x, shape)


def _functional(transform: ir.passes.InPlacePass, model):
    """Apply ``transform`` to a copy of ``model`` (ir.Model or ModelProto); return the same kind."""
    if isinstance(model, onnx.ModelProto):
        result = transform(from_proto(model)).model
        return to_proto(result)
    return transform(model.clone()).model


def vjp(model, of: str, wrt=None, registry=None, **options):
    """The model with gradient outputs ``grad_<x>`` (seed input per :class:`AutodiffPass`); input untouched."""
    return _functional(AutodiffPass(of, wrt, registry, **options), model)


def jvp(model, of: str, wrt=None, registry=None):
    """The model with tangent inputs ``t_<x>`` and the output ``jvp_<of>``; input untouched."""
    return _functional(JvpPass(of, wrt, registry), model)


def hvp(model, of: str, wrt=None, registry=None):
    """The model with direction inputs ``v_<x>`` and outputs ``hvp_<x>``; input untouched."""
    return _functional(HvpPass(of, wrt, registry), model)


def jacobian(model, of: str, wrt=None, registry=None, chunk: int = 1):
    """The model with outputs ``jac_<x>`` of shape (*of.shape, *x.shape); input untouched."""
    return _functional(JacobianPass(of, wrt, registry, chunk), model)
