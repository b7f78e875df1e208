"""The ordered passes that shrink a generated backward graph without changing its results.

``cleanup_passes()`` returns one :class:`CleanupPass`: bounded constant folding (onnxscript's
folder), the onnxscript rewrite rules of :mod:`onnx_autodiff.passes.rewrite_rules`, one rule set
per family (no-ops: x·1, x/1, x+0, x−0, a Sum with zeros, Identity, Reshape/Expand/Flatten/Tile/
Reduce* that change nothing, Squeeze∘Unsqueeze; zero gradients propagating; transpose pairs,
Transpose of a MatMul, Transposes into Einsum equations, Concat of Transposes; Reshape of a
Reshape, Concat of merging Reshapes; exact Casts), swept over every graph by
:mod:`onnx_autodiff.passes.rewrites`, and the lowering for the target
runtime (:mod:`~onnx_autodiff.passes.rewrite_rules.lowering`: Transpose→Gemm, bias sums by a
product with ones, ...), dead-node removal and
common-subexpression elimination, repeated to a fixed point (so a second run changes nothing);
then the main graph's Constant nodes become initializers, and a topological sort where the graph
is out of order. The rewrites decide from shapes: onnx's shape inference runs first and again after
each round that changed the graph, where some value still lacks a shape (for a few values, each
one's node is inferred alone first). Each step costs time linear in the graph's size.

Values being differentiated are never folded: a training loop feeds new values of them every
step, so ``Transpose(W)`` folded into a constant would be stale. The pass learns them from the
model's metadata alone: the entry :data:`DIFFERENTIATED_KEY`, a JSON list of names that
:class:`~onnx_autodiff.AutodiffPass` records, and :data:`~onnx_autodiff.passes.metadata.KEPT_KEY`;
and from the ``keep`` option. Such initializers are treated as graph inputs while the pass runs.
(Output names say nothing: a model whose metadata was dropped needs ``keep``.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import onnx
import onnx_ir as ir
from onnx_autodiff.passes import progress, rewrites
from onnx_autodiff.passes.metadata import DIFFERENTIATED_KEY, differentiated, kept  # noqa: F401 - DIFFERENTIATED_KEY: public here too
from onnx_autodiff.passes.outline import OutlinePass
from onnx_autodiff.passes.rewrite_rules import RuleIndex, analysis, cleanup_rules, lowering_rules
from onnx_autodiff.toolkit import FLOAT_TYPES, all_graphs, detach, shapes, subgraphs
from onnx_autodiff.toolkit.inference import infer_shapes
from onnx_ir.passes import common
from onnxscript.optimizer import FOLDED_FROM_KEY, fold_constants

FOLD_LIMIT = 1024  # elements: larger folded tensors stay computed (a seed Expand(1, Shape(y)) stays a node)


@dataclasses.dataclass
class CleanupResult(ir.passes.PassResult):
    """What one call of :class:`CleanupPass` did: the model and ``modified`` (as every
    ``PassResult``) and how many rounds it took (a fixed point is reached before ``max_rounds``)."""

    rounds: int = 0


class CleanupPass(ir.passes.InPlacePass):
    """Shrinks a model (its graph, subgraphs and functions) without changing what it computes.

    ``keep`` names further initializers never to fold (see the module's docstring); ``fold=False``
    skips constant folding; ``fold_limit`` bounds the size of folded tensors (elements);
    ``cse=False`` skips common-subexpression elimination; ``rules``: onnxscript ``RewriteRule`` or
    ``RewriteRuleSet`` objects applied in every round after the project's own
    (:func:`~onnx_autodiff.passes.rewrite_rules.cleanup_rules`), on each node whose op ends their
    pattern. Mul by zeros folds to zeros even where the other factor is not finite, as gradients assume.
    ``target``: the runtime whose lowering rules (:func:`~onnx_autodiff.passes.rewrite_rules.lowering_rules`)
    turn the rules' canonical forms into the ones it runs fastest, applied last in each round;
    None keeps canonical graphs.

    Calling the pass returns a :class:`CleanupResult` (``rounds``). ``ir.passes.PassManager``
    returns a plain ``PassResult`` of its own: in a pipeline, read the pass's ``last_result`` (or
    ``rounds``, a view of it: 0 before the first call).
    """

    def __init__(self, keep: Sequence[str] = (), fold: bool = True, fold_limit: int = FOLD_LIMIT,
                 cse: bool = True, max_rounds: int = 8, rules: Sequence = (),
                 target: str | None = "onnxruntime") -> None:
        super().__init__()
        lowering = () if target is None else (lowering_rules(target),)
        self.rules = RuleIndex([cleanup_rules(), *rules, *lowering])
        self.target = target
        self.keep = [keep] if isinstance(keep, str) else list(keep)
        self.fold = fold
        self.fold_limit = fold_limit
        self.cse = cse
        self.max_rounds = max_rounds
        self.last_result: CleanupResult | None = None

    @property
    def rounds(self) -> int:
        """How many rounds the last call took (0 before the first call)."""
        return 0 if self.last_result is None else self.last_result.rounds

    def protected(self, model: ir.Model) -> list[ir.Value]:
        """The initializers treated as graph inputs: those the model's metadata names, differentiated
        (:func:`~onnx_autodiff.passes.metadata.differentiated`) or kept
        (:data:`~onnx_autodiff.passes.metadata.KEPT_KEY`), and ``keep``."""
        graph = model.graph
        names = set(self.keep) | set(differentiated(model)) | set(kept(model))
        return [v for name, v in graph.initializers.items() if name in names]

    def call(self, model: ir.Model) -> CleanupResult:
        result = self._shrink(model)
        self.last_result = result
        return result

    def _shrink(self, model: ir.Model) -> CleanupResult:
        protected = self.protected(model)
        hidden: dict[ir.Value, ir.TensorProtocol | None] = {}
        graphs = all_graphs(model)
        # Nothing here adds a subgraph: without one, the list of graphs stays the same.
        flat = len(graphs) == 1 + len(model.functions)
        modified = False
        rounds = 0
        try:
            changed = True
            for rounds in range(1, self.max_rounds + 1):
                stage = f"cleanup, round {rounds}"
                if changed:  # folding can make more shapes known (a Reshape to a folded Shape)
                    progress.report(stage, 0, 5)
                    _restore(hidden)
                    infer_shapes(model, missing_only=True)
                    hidden = _hide(protected)
                # Common subexpressions in every round: the one that finds the fixed point checks them too.
                progress.report(stage, 1, 5)
                changed = self._fold(model, graphs if flat else all_graphs(model))
                graphs = graphs if flat else all_graphs(model)
                progress.report(stage, 2, 5)
                changed |= rewrites.Rewriter(model, graphs, self.rules).run() > 0
                if not changed and rounds > 1:
                    # The last round ended with the dead-node removal and the common-subexpression
                    # elimination, which leave nothing for a second sweep of their own (a merge
                    # or a removal makes no node dead or equal to another): with nothing folded
                    # or rewritten since, they would find nothing either.
                    break
                progress.report(stage, 3, 5)
                changed |= _remove_unused(model)
                progress.report(stage, 4, 5)
                if self.cse:
                    changed |= eliminate_common_subexpressions(model.graph)
                modified |= changed
                if not changed:
                    break
        finally:
            _restore(hidden)
            for value in protected:
                if value.name not in model.graph.initializers:
                    model.graph.register_initializer(value)  # the caller may still feed it
                    modified = True
        modified |= _lift_constants(model)
        if not all(_in_order(g) for g in (model.graph, *model.functions.values())):  # else it stays as it is
            modified |= common.TopologicalSortPass()(model).modified
        _drop_folding_notes(graphs if flat else all_graphs(model))
        return CleanupResult(model, modified, rounds)

    def _fold(self, model: ir.Model, graphs: list[ir.Graph]) -> bool:
        # The folder writes Constant(value_ints=...) (opset 12 on) and initializers that are not
        # graph inputs (IR version 4 on): older models get the local rewrites only.
        if not self.fold or analysis.opset(model) < 12 or (model.ir_version or 0) < 4:
            return False
        # The folder's final NameFixPass names absent optional outputs ("" in ONNX), which then
        # count as present (Attention's present_key with nonpad_kv_seqlen is invalid): undo that.
        absent = [out for graph in graphs for node in graph for out in node.outputs if not out.name]
        modified = fold_constants(model, input_size_limit=self.fold_limit, output_size_limit=self.fold_limit,
                                  should_fold=self._should_fold).modified
        for out in absent:
            if not out.uses() and not out.is_graph_output():
                out.name = ""
        return modified

    def _should_fold(self, node: ir.Node) -> bool | None:
        """Keep fills (ConstantOfShape, Expand of one number) as nodes: folded, they only grow.
        The folder cannot fold multi-output nodes (it would evaluate them, then log a warning).
        It folds every Transpose whatever its size: a frozen weight's would become a second,
        in-memory copy of it (a multi-GB model's external data read into the model)."""
        if len(node.outputs) != 1:
            return False
        if node.domain == "" and node.op_type == "Transpose":
            shape = shapes.dims(node.inputs[0])
            if not analysis.static(shape) or analysis.size(shape) > self.fold_limit:
                return False
        if node.domain == "" and node.op_type in ("ConstantOfShape", "Expand"):
            out = shapes.dims(node.outputs[0])
            if not analysis.static(out) or analysis.size(out) > analysis.SMALL:
                return False
        return None


class LoweringPass(ir.passes.InPlacePass):
    """The lowering rules of ``target`` alone (:func:`~onnx_autodiff.passes.rewrite_rules.lowering_rules`),
    swept over the graphs, subgraphs and functions until none applies, removing the nodes they
    leave unread: for a model whose other nodes are already in their final form (a train model's
    optimiser step, built after the cleanup of its backward graph), where a whole cleanup would
    find nothing else to do."""

    def __init__(self, target: str, max_rounds: int = 8) -> None:
        super().__init__()
        self.rules = RuleIndex([lowering_rules(target)])
        self.target = target
        self.max_rounds = max_rounds

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for _ in range(self.max_rounds):
            infer_shapes(model, missing_only=True)  # the rules decide from shapes
            if rewrites.Rewriter(model, all_graphs(model), self.rules).run() == 0:
                break
            _remove_unused(model)
            modified = True
        if modified and not all(_in_order(g) for g in (model.graph, *model.functions.values())):
            common.TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=modified)


class RemoveUnusedPass(ir.passes.InPlacePass):
    """onnx-ir's RemoveUnusedNodesPass as the cleanup does it (the same removals: dead nodes,
    trailing omitted inputs, unused optional outputs, unused initializers), reading each op type's
    schema once instead of each node's: on the backward model of the 20,001-node chain (66,675
    nodes), onnx-ir's pass takes 0.56 s and this 0.39 s (collector paused, onnx-ir 1.1), for nodes
    the cleanup has already cleared of such leftovers."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=_remove_unused(model))


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
    dead: list[ir.Node] = []
    removed = 0
    for node in reversed(list(graph)):
        if any(out.uses() or out in outputs for out in node.outputs):
            removed += sum(_remove_dead(sub) for sub in subgraphs(node))
            continue
        for sub in subgraphs(node):
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                detach(inner)
        detach(node)  # its producers, further up, may then be dead too
        dead.append(node)
    if dead:  # at once: each removal copies the list of graph outputs
        graph.remove(dead)
    return removed + len(dead)


# Ops whose equal calls may give different results: never merged.
_NONDETERMINISTIC = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial"})
CSE_TENSOR_LIMIT = 10  # elements: larger Constant tensors (weights) are not compared


def eliminate_common_subexpressions(graph: ir.Graph) -> bool:
    """onnx-ir's CommonSubexpressionEliminationPass on ``graph`` (the same merges), with the
    duplicates removed at once: that pass removes them one by one, and each removal copies the
    list of graph outputs (quadratic in a model with thousands of gradient outputs). On the
    backward model of the 20,001-node chain (66,675 nodes, 6,667 graph outputs), onnx-ir's pass
    takes 6.15 s and this 0.39 s, for the same 60,007 nodes (collector paused, onnx-ir 1.1,
    each on its own copy of the backward model that autodiff_pass makes of build_time.py's res20001).

    Where a duplicate's graph output would need an Identity of the kept node's output (the kept
    one is a graph output too: equal gradients), the duplicate stays and only its readers move:
    the Identity saves no node, and the folder turns it back into the duplicate, so the rounds
    would never reach a fixed point."""
    first: dict[tuple, ir.Node] = {}
    duplicates: list[ir.Node] = []
    moved = False
    positions: dict[ir.Value, list[int]] | None = None
    for node in graph:
        key = _cse_key(node)
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        if any(out.is_graph_output() for out in node.outputs):
            if positions is None:
                positions = {}
                for i, out in enumerate(graph.outputs):
                    positions.setdefault(out, []).append(i)
            if any(len(positions.get(old, ())) > (0 if new.is_graph_output() else 1)
                   for old, new in zip(node.outputs, kept.outputs)):
                for old, new in zip(node.outputs, kept.outputs):
                    for user, index in list(old.uses()):
                        user.replace_input_with(index, new)
                        moved = True
                continue
            for old, new in zip(node.outputs, kept.outputs):  # kept's outputs take their names
                for i in positions.pop(old, ()):
                    new.name = old.name
                    graph.outputs[i] = new
                    positions[new] = [i]
        ir.convenience.replace_all_uses_with(node.outputs, kept.outputs)
        duplicates.append(node)
    if duplicates:
        graph.remove(duplicates, safe=True)
    return moved or bool(duplicates)


def _cse_key(node: ir.Node) -> tuple | None:
    """What makes two nodes equal for onnx-ir's CSE (None: never merged: subgraphs, large
    tensors, random ops)."""
    attributes = {}
    for name, attribute in node.attributes.items() if node.attributes else ():
        value = attribute.value
        if attribute.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return None
        if attribute.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
            value = tuple(value)
        elif attribute.type is ir.AttributeType.TENSOR:
            if value.size > CSE_TENSOR_LIMIT:
                return None
            array = value.numpy()
            value = (array.shape, str(array.dtype), array.tobytes())
        attributes[name] = value
    if node.op_type in _NONDETERMINISTIC and node.domain == "":
        return None
    return (node.op_identifier(), len(node.outputs), tuple(map(id, node.inputs)),
            tuple(sorted(attributes.items())))


def _remove_unused(model: ir.Model) -> bool:
    """Dead nodes, then what onnx-ir's RemoveUnusedNodesPass does besides: drop trailing omitted
    inputs, unused optional outputs of standard ops and unused initializers (True when a node or
    an initializer went). That pass reads every node's schema each round; here only the schemas of
    the nodes with several outputs (and BatchNormalization's, whose inference-mode attribute it
    drops) are read, once per op type."""
    removed = sum(_remove_dead(g) for g in (model.graph, *(f.graph for f in model.functions.values())))
    _trim(model.graph, model.graph.opset_imports.get(""))
    graph = model.graph
    unused = [name for name, value in graph.initializers.items()
              if not (value.uses() or value.is_graph_output() or value.is_graph_input())]
    for name in unused:
        del graph.initializers[name]
    for function in model.functions.values():
        _trim(function, function.opset_imports.get(""))
    return removed > 0 or bool(unused)


def _trim(graph: ir.Graph | ir.Function, opset: int | None) -> None:
    outputs = frozenset(graph.outputs)
    for node in graph:
        inputs = node.inputs
        if inputs and inputs[-1] is None:
            count = len(inputs)
            while count and inputs[count - 1] is None:
                count -= 1
            node.resize_inputs(count)
        if opset is not None and node.domain == "" and (len(node.outputs) > 1 or node.op_type == "BatchNormalization"):
            _drop_optional_outputs(node, outputs, opset)
        for sub in subgraphs(node):
            _trim(sub, opset)


def _drop_optional_outputs(node: ir.Node, graph_outputs: frozenset[ir.Value], opset: int) -> None:
    """onnx-ir's removal of a node's unused optional outputs (the trailing ones go, the others
    lose their name)."""
    options = _output_options(node.op_type, opset)
    if options is None:
        return
    has_training_mode, optional = options
    if node.op_type == "BatchNormalization":  # before opset 14 the outputs select the mode
        mode = node.attributes.get("training_mode")
        if not has_training_mode or mode is not None and (
                mode.is_ref() or mode.type != ir.AttributeType.INT or mode.as_int() != 0):
            return
        node.attributes.pop("training_mode", None)
    if optional is None:
        return
    named = {out: out.name for out in node.outputs} if node.op_type == "Attention" else {}
    for out, is_optional in zip(node.outputs, optional):
        if is_optional and out not in graph_outputs and not out.uses():
            out.name = ""
    count = len(node.outputs)
    while count and not node.outputs[count - 1].name:
        count -= 1
    node.resize_outputs(count)
    if node.op_type == "Attention" and count == 4:
        # Attention keeps present_key/value beside qk_matmul_output: without them, onnx's
        # inference gives that output the wrong length when a past is given (6 for 18), and the
        # checker then rejects the model.
        for out in node.outputs[1:3]:
            out.name = named[out]


def optional_outputs(op_type: str, opset: int) -> tuple[bool, ...] | None:
    """Which outputs of the standard op ``op_type`` at ``opset`` are optional (None: none are, their
    number varies or the op has no schema)."""
    options = _output_options(op_type, opset)
    return None if options is None else options[1]


@functools.lru_cache(maxsize=None)
def _output_options(op_type: str, opset: int) -> tuple[bool, tuple[bool, ...] | None] | None:
    """(whether the op has a training_mode attribute, which outputs are optional: None when none
    are or their number varies); None for an op without a schema."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain="")
    except onnx.defs.SchemaError:
        return None
    kinds = [out.option for out in schema.outputs]
    option = onnx.defs.OpSchema.FormalParameterOption
    optional = None
    if option.Variadic not in kinds and option.Optional in kinds:
        optional = tuple(kind == option.Optional for kind in kinds)
    return "training_mode" in schema.attributes, optional


def _in_order(graph: ir.Graph | ir.Function) -> bool:
    """Whether every node follows the producers of its inputs (False for a graph with subgraphs,
    whose order also depends on what they read)."""
    seen: set[ir.Node] = set()
    for node in graph:
        if any(True for _ in subgraphs(node)):
            return False
        for value in node.inputs:
            producer = None if value is None else value.producer()
            if producer is not None and producer not in seen and producer.graph is node.graph:
                return False
        seen.add(node)
    return True


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
        tensor = shapes.constant(out, computed=False)
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



def _drop_folding_notes(graphs: list[ir.Graph]) -> None:
    """Remove the provenance notes the folder attaches to folded values (noise in saved models)."""
    for value in rewrites._all_values(graphs):
        value.meta.pop(FOLDED_FROM_KEY, None)
        value.metadata_props.pop(FOLDED_FROM_KEY, None)



def cleanup_passes(*, keep: Sequence[str] = (), fold: bool = True, fold_limit: int = FOLD_LIMIT,
                   cse: bool = True, outline: bool = False, rules: Sequence = (),
                   target: str | None = "onnxruntime") -> list[ir.passes.PassBase]:
    """Passes to run after :class:`AutodiffPass` (see :class:`CleanupPass` for the options;
    ``rules``: extra onnxscript rewrite rules, applied with the project's; ``target``: the runtime
    the graph is lowered for, None for canonical graphs).

    ``outline=True`` ends with :class:`~onnx_autodiff.passes.outline.OutlinePass`: each rule's
    backward nodes become one call of a model-local function of standard ops.
    """
    passes: list[ir.passes.PassBase] = [CleanupPass(keep=keep, fold=fold, fold_limit=fold_limit, cse=cse, rules=rules,
                                                    target=target)]
    if outline:
        passes.append(OutlinePass())
    return passes
