"""The ordered passes that shrink a generated backward graph without changing its results.

``cleanup_passes()`` returns one :class:`CleanupPass`: bounded constant folding (onnxscript's
folder), the local rewrites of :mod:`onnx_autodiff.passes.rewrites` (x·1, x+0, zero gradients,
transpose pairs, Transpose→Gemm, Transposes into Einsum equations, Concat of merging Reshapes,
no-op Reshape/Expand/Reduce/Squeeze/Unsqueeze/Cast, Identity), dead-node removal and, once those
find nothing, common-subexpression elimination, repeated to a fixed point (so a second run changes
nothing); then the main graph's Constant nodes become initializers, and a topological sort. The rewrites decide from
shapes: onnx's shape inference runs first and again after each round that changed the graph
(only where some value still lacks a shape).

Values being differentiated are never folded: a training loop feeds new values of them every
step, so ``Transpose(W)`` folded into a constant would be stale. The pass learns them from
(a) the model's metadata entry :data:`DIFFERENTIATED_KEY`, a JSON list of names that
:class:`~onnx_autodiff.AutodiffPass` records; (b) the ``keep`` option; (c) conservatively, every
floating-point initializer ``W`` for which the graph has an output named ``grad_W`` (or
``grad_W_<n>``). Such initializers are treated as graph inputs while the pass runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

import onnx_ir as ir
from onnx_autodiff.passes import rewrites
from onnx_ir.passes import common

DIFFERENTIATED_KEY = "onnx_autodiff.differentiated"
FOLD_LIMIT = 1024  # elements: larger folded tensors stay computed (a seed Expand(1, Shape(y)) stays a node)
_FLOAT = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE}


def record_differentiated(model: ir.Model, names: Iterable[str]) -> None:
    """Add ``names`` to the model's list of differentiated values (read by :class:`CleanupPass`)."""
    recorded = differentiated(model)
    recorded += [n for n in names if n not in recorded]
    model.metadata_props[DIFFERENTIATED_KEY] = json.dumps(recorded)


def differentiated(model: ir.Model) -> list[str]:
    """The names recorded under :data:`DIFFERENTIATED_KEY` (empty when there are none)."""
    try:
        names = json.loads(model.metadata_props.get(DIFFERENTIATED_KEY, "[]"))
    except ValueError:
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _with_gradient_output(graph: ir.Graph) -> set[str]:
    """Float initializers W with a graph output grad_W or grad_W_<n>."""
    outputs = {v.name for v in graph.outputs if v.name}
    outputs |= {re.sub(r"_\d+$", "", name) for name in outputs}
    return {name for name, v in graph.initializers.items() if v.dtype in _FLOAT and f"grad_{name}" in outputs}


class CleanupPass(ir.passes.InPlacePass):
    """Shrinks a model (its graph, subgraphs and functions) without changing what it computes.

    ``keep`` names further initializers never to fold (see the module's docstring); ``fold=False``
    skips constant folding; ``fold_limit`` bounds the size of folded tensors (elements);
    ``cse=False`` skips common-subexpression elimination (the slowest step on very large graphs).
    Mul by zeros folds to zeros even where the other factor is not finite, as gradients assume.
    """

    def __init__(self, keep: Sequence[str] = (), fold: bool = True, fold_limit: int = FOLD_LIMIT,
                 cse: bool = True, max_rounds: int = 8) -> None:
        super().__init__()
        self.keep = [keep] if isinstance(keep, str) else list(keep)
        self.fold = fold
        self.fold_limit = fold_limit
        self.cse = cse
        self.max_rounds = max_rounds
        self.rounds = 0  # how many rounds the last call took (a fixed point is reached before max_rounds)

    def protected(self, model: ir.Model) -> list[ir.Value]:
        """The initializers treated as graph inputs: differentiated, kept, or with a gradient output."""
        graph = model.graph
        names = set(self.keep) | set(differentiated(model)) | _with_gradient_output(graph)
        return [v for name, v in graph.initializers.items() if name in names]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = _fingerprint(model)
        protected = self.protected(model)
        hidden: dict[ir.Value, ir.TensorProtocol | None] = {}
        try:
            changed = True
            for rounds in range(1, self.max_rounds + 1):
                self.rounds = rounds
                if changed:  # folding can make more shapes known (a Reshape to a folded Shape)
                    _restore(hidden)
                    infer_shapes(model)
                    hidden = _hide(protected)
                changed = self._fold(model)
                changed |= rewrites.Rewriter(model).run() > 0
                changed |= _remove_unused(model)
                if not changed and self.cse:  # last, as it is the slowest step on large graphs
                    changed = common.CommonSubexpressionEliminationPass()(model).modified
                if not changed:
                    break
        finally:
            _restore(hidden)
            for value in protected:
                if value.name not in model.graph.initializers:
                    model.graph.register_initializer(value)  # the caller may still feed it
        _lift_constants(model)
        common.TopologicalSortPass()(model)
        _drop_folding_notes(model)
        return ir.passes.PassResult(model, modified=_fingerprint(model) != before)

    def _fold(self, model: ir.Model) -> bool:
        # The folder writes Constant(value_ints=...) (opset 12 on) and initializers that are not
        # graph inputs (IR version 4 on): older models get the local rewrites only.
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        if not self.fold or opset < 12 or (model.ir_version or 0) < 4:
            return False
        from onnxscript.optimizer import fold_constants

        # The folder's final NameFixPass names absent optional outputs ("" in ONNX), which then
        # count as present (Attention's present_key with nonpad_kv_seqlen is invalid): undo that.
        absent = [out for graph in rewrites._all_graphs(model) for node in graph for out in node.outputs
                  if not out.name]
        modified = fold_constants(model, input_size_limit=self.fold_limit, output_size_limit=self.fold_limit,
                                  should_fold=self._should_fold).modified
        for out in absent:
            if not out.uses() and not out.is_graph_output():
                out.name = ""
        return modified

    def _should_fold(self, node: ir.Node) -> bool | None:
        """Keep fills (ConstantOfShape, Expand of one number) as nodes: folded, they only grow.
        The folder cannot fold multi-output nodes (it would evaluate them, then log a warning)."""
        if len(node.outputs) != 1:
            return False
        if node.domain == "" and node.op_type in ("ConstantOfShape", "Expand"):
            out = rewrites.dims(node.outputs[0])
            if out is None or not all(isinstance(d, int) for d in out) or _size(out) > rewrites.SMALL:
                return False
        return None


def infer_shapes(model: ir.Model) -> None:
    """Give the main graph's node outputs that lack a shape the one onnx's inference finds.

    The rewrites decide from shapes, which the backward values lack. Reads the inferred
    value_info directly: deserialising the whole inferred model costs ten times more.
    """
    missing = {v.name: v for node in model.graph for v in node.outputs
               if (v.shape is None or v.type is None) and v.name}
    if not missing:
        return
    from onnx_autodiff.passes.inference import onnx_inferred

    proto = onnx_inferred(ir.to_proto(model))
    if proto is None:  # without shapes fewer rewrites apply
        return
    for info in (*proto.graph.value_info, *proto.graph.output):
        value = missing.get(info.name)
        if value is None or not info.type.WhichOneof("value"):
            continue
        if value.type is None:
            value.type = ir.serde.deserialize_type_proto_for_type(info.type)
        shape = ir.serde.deserialize_type_proto_for_shape(info.type)
        if value.shape is None and shape is not None:
            value.shape = shape


def _hide(values: list[ir.Value]) -> dict[ir.Value, ir.TensorProtocol | None]:
    """Take the values' data away, so that nothing folds through them (restored by _restore)."""
    hidden = {v: v.const_value for v in values}
    for value in values:
        value.const_value = None
    return hidden


def _restore(hidden: dict[ir.Value, ir.TensorProtocol | None]) -> None:
    for value, tensor in hidden.items():
        value.const_value = tensor


def _remove_dead(graph: ir.Graph) -> int:
    """Remove the nodes nothing reads, detaching the nodes of their subgraphs first: onnx-ir's
    removal leaves the outer values that a removed Loop body read with uses that keep them alive."""
    outputs = set(graph.outputs)
    removed = 0
    for node in reversed(list(graph)):
        if any(out.uses() or out in outputs for out in node.outputs):
            removed += sum(_remove_dead(sub) for sub in rewrites._subgraphs(node))
            continue
        for sub in rewrites._subgraphs(node):
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                for i, value in enumerate(inner.inputs):
                    if value is not None:
                        inner.replace_input_with(i, None)
        graph.remove(node, safe=True)
        removed += 1
    return removed


def _remove_unused(model: ir.Model) -> bool:
    """onnx-ir's dead-node removal, except that Attention keeps its optional outputs: without
    present_key/present_value, onnx's inference gives qk_matmul_output the wrong length when a
    past is given (6 for 18), and the checker then rejects the model."""
    names = {
        out: out.name
        for graph in rewrites._all_graphs(model)
        for node in graph
        if node.op_type == "Attention" and node.domain == "" and len(node.outputs) == 4
        for out in node.outputs[1:3]
        if out.name
    }
    removed = sum(_remove_dead(g) for g in (model.graph, *(f.graph for f in model.functions.values())))
    modified = common.RemoveUnusedNodesPass()(model).modified or removed > 0
    for out, name in names.items():
        producer = out.producer()
        if not out.name and producer is not None and producer.graph is not None and len(producer.outputs) == 4:
            out.name = name
    return modified


def _lift_constants(model: ir.Model) -> bool:
    """Turn the main graph's Constant nodes into initializers (one node fewer each).

    Only the main graph: before IR version 4 an initializer must also be a graph input, and
    functions have no initializers. A Constant that is a graph output stays a node.
    """
    if (model.ir_version or 0) < 4:
        return False
    graph = model.graph
    lifted = False
    for node in list(graph):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attributes) != 1:
            continue
        out = node.outputs[0]
        tensor = rewrites.constant(out)
        if out.is_graph_output() or tensor is None or not out.name or out.name in graph.initializers:
            continue
        if out.const_value is not None:
            tensor = out.const_value
        else:
            tensor = ir.tensor(tensor)
        init = ir.Value(name=out.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                        const_value=tensor)
        out.replace_all_uses_with(init)
        graph.remove(node, safe=True)
        graph.register_initializer(init)
        lifted = True
    return lifted


def _size(shape) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


def _drop_folding_notes(model: ir.Model) -> None:
    """Remove the provenance notes the folder attaches to folded values (noise in saved models)."""
    from onnxscript.optimizer import FOLDED_FROM_KEY

    for value in rewrites._all_values(rewrites._all_graphs(model)):
        value.meta.pop(FOLDED_FROM_KEY, None)
        value.metadata_props.pop(FOLDED_FROM_KEY, None)


def _fingerprint(model: ir.Model) -> tuple:
    return tuple((n.op_type, tuple(id(v) for v in n.inputs)) for n in model.graph)


def cleanup_passes(*, keep: Sequence[str] = (), fold: bool = True, fold_limit: int = FOLD_LIMIT,
                   cse: bool = True, outline: bool = False) -> list[ir.passes.PassBase]:
    """Passes to run after :class:`AutodiffPass` (see :class:`CleanupPass` for the options).

    ``outline=True`` ends with :class:`~onnx_autodiff.passes.outline.OutlinePass`: each rule's
    backward nodes become one call of a model-local function of standard ops.
    """
    passes: list[ir.passes.PassBase] = [CleanupPass(keep=keep, fold=fold, fold_limit=fold_limit, cse=cse)]
    if outline:
        from onnx_autodiff.passes.outline import OutlinePass

        passes.append(OutlinePass())
    return passes
