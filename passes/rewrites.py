"""Local rewrites that remove the no-ops and zero gradients a generated backward graph is full of."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import onnx_ir as ir

from onnx_autodiff.passes.graphs import all_graphs
from onnx_autodiff.passes.metadata import GRAD_OF
from onnx_autodiff.passes.rewrite_rules import RuleIndex, cleanup_rules


# Dims of a value: a tuple of int (static) or str (named symbolic) or None (unknown) per axis.
Dims = tuple

_F16, _BF16, _F32, _F64 = ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE
_GEMM_TYPES = {_F16, _F32, _F64}
_CASTABLE = {_F16, _BF16, _F32, _F64, ir.DataType.BOOL, *(t for t in ir.DataType if t.name.startswith(("INT", "UINT")) and t.bitwidth >= 8)}
# Ops whose result is zero when one of the listed inputs is all zeros (_ZERO_IF_ALL: every input).
_ZERO_IF_INPUT = {
    "Neg": (0,), "Transpose": (0,), "Reshape": (0,), "Expand": (0,), "Squeeze": (0,),
    "Unsqueeze": (0,), "Flatten": (0,), "Tile": (0,), "Slice": (0,), "Gather": (0,),
    "ReduceSum": (0,), "ReduceMean": (0,), "MatMul": (0, 1), "Mul": (0, 1), "Div": (0,),
}
_ZERO_IF_ALL = {"Add", "Sub", "Sum", "Concat"}
# Reductions that return their input when every reduced axis has length 1 and keepdims=1.
_REDUCE_IDENTITY = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"}
# Ops that return their data input when the output shape equals the input shape.
_SAME_SHAPE_IDENTITY = {"Reshape", "Expand", "Flatten", "Tile"}
SMALL = 16  # a zero tensor at most this large becomes a Constant, a larger one a ConstantOfShape


def dims(value: ir.Value | None) -> Dims | None:
    if value is None or value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else d.value for d in value.shape)


def _static(d: Dims | None) -> bool:
    return d is not None and all(isinstance(x, int) for x in d)


def _same(a: Dims | None, b: Dims | None) -> bool:
    """Whether two shapes are known to be equal (unnamed symbolic dims never are)."""
    return a is not None and b is not None and len(a) == len(b) and all(x is not None and x == y for x, y in zip(a, b))


def broadcast(*shapes: Dims | None) -> Dims | None:
    """The multidirectional broadcast of the shapes where it is known, else None."""
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        dim: int | str | None = 1
        for s in shapes:
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


def attr(node: ir.Node, name: str, default=None):
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value as a numpy array when it is a constant (initializer or Constant node)."""
    if value is None:
        return None
    if value.const_value is not None:
        try:
            return value.const_value.numpy()
        except Exception:  # noqa: BLE001 - external data that is not there: not a known constant
            return None
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain != "":
        return None
    for name, attribute in node.attributes.items():
        if name == "value":
            return attribute.value.numpy()
        if name in ("value_float", "value_floats"):
            return np.asarray(attribute.value, np.float32)
        if name in ("value_int", "value_ints"):
            return np.asarray(attribute.value, np.int64)
    return None


class Rewriter:
    """One sweep of the rewrites over a model's graphs, subgraphs and functions."""

    def __init__(self, model: ir.Model, graphs: list[ir.Graph] | None = None, rules: RuleIndex | None = None) -> None:
        self.model = model
        self.rules = rules if rules is not None else RuleIndex([cleanup_rules()])
        self.opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        self.graphs = all_graphs(model) if graphs is None else graphs
        self._taken: set[str] | None = None
        self.fills: dict[ir.Value, float | None] = {}
        self.captured = _captured_outputs(self.graphs)
        self.count = 0
        # Replaced nodes leave their graphs at the end of the sweep, all at once: each removal
        # copies the list of graph outputs. Until then they are detached and skipped.
        self.dropped: dict[ir.Graph, list[ir.Node]] = {}
        self._gone: set[ir.Node] = set()
        self._positions: dict[ir.Graph, dict[ir.Value, list[int]]] = {}

    # ------------------------------------------------------------------ helpers

    def fresh(self, base: str | None) -> str:
        """A value name used nowhere in the model, derived from ``base``."""
        if self._taken is None:
            self._taken = {v.name for v in _all_values(self.graphs) if v.name and v.producer() not in self._gone}
        base = f"{base or 'v'}_s"
        name, k = base, 0
        while name in self._taken:
            k += 1
            name = f"{base}{k}"
        self._taken.add(name)
        return name

    def fill(self, value: ir.Value | None) -> float | None:
        """The one number every element of ``value`` holds, when the graph says so."""
        if value is None:
            return None
        if value not in self.fills:
            self.fills[value] = self._fill(value)
        return self.fills[value]

    def _fill(self, value: ir.Value) -> float | None:
        array = constant(value)
        if array is not None:
            if array.size == 0 or array.dtype.kind not in "biuf":
                return None
            first = array.flat[0]
            return float(first) if bool(np.all(array == first)) else None
        node = value.producer()
        if node is None or node.domain != "":
            return None
        if node.op_type == "ConstantOfShape":
            tensor = attr(node, "value")
            return 0.0 if tensor is None else float(tensor.numpy().flat[0])
        if node.op_type in ("Expand", "Identity"):
            return self.fill(node.inputs[0])
        if node.op_type in ("Cast", "CastLike") and value.dtype in _CASTABLE:
            inner = self.fill(node.inputs[0])
            if inner is None:
                return None
            with np.errstate(all="ignore"):
                return float(np.array(inner).astype(value.dtype.numpy()))
        return None

    def zeros(self, like: ir.Value) -> list[ir.Node] | None:
        """Nodes making a zero tensor of ``like``'s static shape and dtype."""
        shape = dims(like)
        if not _static(shape) or like.dtype is None or like.dtype.numpy().kind not in "biuf":
            return None
        dtype = like.dtype.numpy()
        size = int(np.prod(shape, dtype=np.int64))
        if size <= SMALL or self.opset < 9:
            if size > SMALL or self.opset < 9 and like.dtype not in _GEMM_TYPES:
                return None  # Constant holds float tensors only before opset 9
            return [_node("Constant", [], self.fresh(like.name), value=ir.tensor(np.zeros(shape, dtype)))]
        shape_node = _node("Constant", [], self.fresh(like.name), value=ir.tensor(np.array(shape, np.int64)))
        fill = _node("ConstantOfShape", [shape_node.outputs[0]], self.fresh(like.name),
                     value=ir.tensor(np.zeros([1], dtype)))
        return [shape_node, fill]

    def axes(self, node: ir.Node, index: int = 1) -> list[int] | None:
        """A node's axes: its input ``index`` from opset 13 (Reduce*: 18) on, else the attribute."""
        if len(node.inputs) > index and node.inputs[index] is not None:
            array = constant(node.inputs[index])
            return None if array is None else [int(a) for a in np.asarray(array).reshape(-1)]
        value = attr(node, "axes")
        return None if value is None else [int(a) for a in value]

    # ------------------------------------------------------------------ driver

    def run(self) -> int:
        """Apply the rewrites once to every node; return how many fired."""
        for graph in self.graphs:
            for node in list(graph):
                if node in self._gone or len(node.outputs) != 1:
                    continue
                rewrite = REWRITES.get(node.op_type) if node.domain == "" else None
                result = rewrite(self, node) if rewrite is not None else None
                if result is None and node not in self._gone and node.domain == "" and (
                    node.op_type in _ZERO_IF_INPUT or node.op_type in _ZERO_IF_ALL
                ):
                    result = self.zero_result(node)
                if result is None and node not in self._gone:
                    result = self.rewrite_by_rules(graph, node)
                if result is not None:
                    self.replace(node, *result) if isinstance(result, tuple) else self.replace(node, result)
        for graph, nodes in self.dropped.items():
            graph.remove(nodes, safe=True)
        self.dropped.clear()
        return self.count

    def rewrite_by_rules(self, graph: ir.Graph, node: ir.Node):
        """The first onnxscript rule of the index that rewrites ``node``: (value, new nodes), or the
        value itself where the replacement is one Identity."""
        for rule in self.rules.rules_for(node):
            delta = rule.try_rewrite(self.model, graph, node)
            if delta is None or len(delta.match.outputs) != 1 or delta.match.outputs[0] is not node.outputs[0]:
                continue
            for tensor in delta.new_initializers:
                graph.initializers.setdefault(tensor.name, tensor)
            value, made = delta.new_outputs[0], list(delta.new_nodes)
            if len(made) == 1 and made[0].op_type == "Identity" and made[0].domain == "" and value is made[0].outputs[0]:
                return made[0].inputs[0]  # the node is a no-op: its readers read the input
            return value, made
        return None

    def drop(self, node: ir.Node) -> None:
        """Take ``node``, whose outputs nothing reads any more, out of the graph (at the end of the sweep)."""
        for i, value in enumerate(node.inputs):
            if value is not None:
                node.replace_input_with(i, None)
        self.dropped.setdefault(node.graph, []).append(node)
        self._gone.add(node)
        self.count += 1

    def output_positions(self, graph: ir.Graph, value: ir.Value) -> list[int]:
        """Where ``value`` stands among the graph's outputs (an index kept up to date by set_output)."""
        if not value.is_graph_output():
            return []
        if graph not in self._positions:
            positions: dict[ir.Value, list[int]] = {}
            for i, out in enumerate(graph.outputs):
                positions.setdefault(out, []).append(i)
            self._positions[graph] = positions
        return list(self._positions[graph].get(value, ()))

    def set_output(self, graph: ir.Graph, i: int, value: ir.Value) -> None:
        positions = self._positions.get(graph)
        if positions is not None:
            old = positions.get(graph.outputs[i])
            if old is not None and i in old:
                old.remove(i)
            positions.setdefault(value, []).append(i)
        graph.outputs[i] = value

    def zero_result(self, node: ir.Node):
        inputs = [v for v in node.inputs if v is not None]
        if not inputs or self.fill(node.outputs[0]) == 0:
            return None
        if node.op_type in _ZERO_IF_ALL:
            zero = all(self.fill(v) == 0 for v in inputs)
        else:
            zero = any(i < len(node.inputs) and self.fill(node.inputs[i]) == 0 for i in _ZERO_IF_INPUT[node.op_type])
        if not zero:
            return None
        made = self.zeros(node.outputs[0])
        return None if made is None else (made[-1].outputs[0], made)

    def replace(self, node: ir.Node, value: ir.Value, new_nodes: list[ir.Node] = ()) -> None:
        """Make ``node``'s output ``value`` (an existing value or the last of ``new_nodes``)."""
        graph = node.graph
        old = node.outputs[0]
        if old in self.captured:
            return  # the output of an inner graph that reads it from outside: leave as it is
        if new_nodes:
            graph.insert_before(node, new_nodes)
            tag = node.metadata_props.get(GRAD_OF)
            for made in new_nodes if tag is not None else ():
                made.metadata_props.setdefault(GRAD_OF, tag)
        if value.type is None:
            value.type = old.type
        if value.shape is None and old.shape is not None:
            value.shape = old.shape
        positions = self.output_positions(graph, old)
        if positions:
            fresh = bool(new_nodes) and value.producer() is new_nodes[-1] and not value.is_graph_output()
            if not fresh:
                identity = _node("Identity", [value], None)
                graph.insert_before(node, [identity])
                value = identity.outputs[0]
            name = old.name
            old.name = None
            value.name = name
            value.type = old.type or value.type
            value.shape = old.shape if old.shape is not None else value.shape
            for i in positions:
                self.set_output(graph, i, value)
        old.replace_all_uses_with(value)
        self.drop(node)
        self.fills.pop(old, None)


def _node(op_type: str, inputs, name: str | None, **attributes) -> ir.Node:
    attrs = [ir.AttrTensor(k, v) if isinstance(v, ir.Tensor) else ir.convenience.convert_attribute(k, v)
             for k, v in attributes.items()]
    node = ir.Node("", op_type, inputs, attributes=attrs, num_outputs=1)
    node.outputs[0].name = name
    if op_type == "Constant":
        tensor = attributes["value"]
        node.outputs[0].type = ir.TensorType(tensor.dtype)
        node.outputs[0].shape = ir.Shape(tensor.shape)
        node.outputs[0].const_value = tensor
    return node


def _all_values(graphs: list[ir.Graph]) -> Iterator[ir.Value]:
    for graph in graphs:
        yield from graph.inputs
        if isinstance(graph, ir.Graph):
            yield from graph.initializers.values()
        for node in graph:
            yield from node.outputs


def _captured_outputs(graphs: list[ir.Graph]) -> set[ir.Value]:
    """Graph outputs produced outside their graph (an inner graph returning an outer value)."""
    found = set()
    for graph in graphs:
        for out in graph.outputs:
            producer = out.producer()
            if producer is not None and producer.graph is not graph:
                found.add(out)
    return found


# ---------------------------------------------------------------------- the rewrites
# Each takes (rewriter, node) and returns None (no change), an existing value that the node's
# output equals, or (value, new nodes) where value is the last new node's output.


def _passthrough(r: Rewriter, node: ir.Node, keep: ir.Value | None, neutral: float, other: ir.Value | None):
    """``keep`` when ``other`` is all ``neutral`` and broadcasting it leaves keep's shape."""
    if keep is None or other is None or r.fill(other) != neutral:
        return None
    out = node.outputs[0]
    if keep.dtype != out.dtype and out.dtype is not None:
        return None
    if _same(broadcast(dims(keep), dims(other)), dims(keep)):
        return keep
    return None


def mul(r: Rewriter, node: ir.Node):
    a, b = node.inputs
    return _passthrough(r, node, a, 1.0, b) or _passthrough(r, node, b, 1.0, a)


def div(r: Rewriter, node: ir.Node):
    a, b = node.inputs
    return _passthrough(r, node, a, 1.0, b)


def add(r: Rewriter, node: ir.Node):
    a, b = node.inputs
    return _passthrough(r, node, a, 0.0, b) or _passthrough(r, node, b, 0.0, a)


def sub(r: Rewriter, node: ir.Node):
    a, b = node.inputs
    return _passthrough(r, node, a, 0.0, b)


def sum_(r: Rewriter, node: ir.Node):
    inputs = list(node.inputs)
    kept = [v for v in inputs if r.fill(v) != 0]
    if len(inputs) == 1:
        return inputs[0]
    if not kept or len(kept) == len(inputs):
        return None
    full = broadcast(*(dims(v) for v in inputs))
    if not _same(broadcast(*(dims(v) for v in kept)), full):
        return None
    if len(kept) == 1:
        return kept[0] if kept[0].dtype == node.outputs[0].dtype else None
    new = ir.Node("", "Add" if len(kept) == 2 else "Sum", kept, num_outputs=1)
    new.outputs[0].name = r.fresh(node.outputs[0].name)
    return new.outputs[0], [new]


def _perm(node: ir.Node, rank: int | None) -> list[int] | None:
    perm = attr(node, "perm")
    if perm is not None:
        return [int(p) for p in perm]
    return None if rank is None else list(reversed(range(rank)))


def transpose(r: Rewriter, node: ir.Node):
    x = node.inputs[0]
    rank = len(dims(x)) if dims(x) is not None else None
    perm = _perm(node, rank)
    if perm is None:
        return None
    if perm == list(range(len(perm))):
        return x
    inner = x.producer()
    terms = _einsum_terms(inner)
    if terms is not None and len(terms[1]) == len(perm) and _only_use(x, r):
        # Transpose(Einsum(..)->o) is the Einsum writing its output letters permuted.
        inputs, out = terms
        new = _node("Einsum", list(inner.inputs), r.fresh(node.outputs[0].name),
                    equation=_equation(inputs, "".join(out[p] for p in perm)))
        return new.outputs[0], [new]
    if inner is not None and inner.op_type == "MatMul" and inner.domain == "":
        return _transposed_matmul(r, node, perm)
    if inner is None or inner.op_type != "Transpose" or inner.domain != "":
        return None
    source = inner.inputs[0]
    first = _perm(inner, len(dims(source)) if dims(source) is not None else len(perm))
    if first is None or len(first) != len(perm):
        return None
    composed = [first[p] for p in perm]
    if composed == list(range(len(composed))):
        return source
    if not _only_use(x, r):
        # The inner Transpose stays for its other readers: composing saves no node, and would
        # turn a swap of the last two axes, which runtimes fuse into a MatMul, into a copy.
        return None
    new = _node("Transpose", [source], r.fresh(node.outputs[0].name), perm=composed)
    return new.outputs[0], [new]


def _transposed_matmul(r: Rewriter, node: ir.Node, perm: list[int]):
    """Transpose(MatMul(a, b)) swapping the last two axes is MatMul(bᵀ, aᵀ), when a or b is itself
    the only use of a Transpose the new one composes with: no more nodes, and the transposes are
    on the inputs, where runtimes fuse them into the product."""
    product = node.inputs[0].producer()
    a, b = product.inputs
    rank = len(perm)
    swap = [*range(rank - 2), rank - 1, rank - 2]
    if rank < 2 or perm != swap or not _only_use(node.inputs[0], r):
        return None
    if dims(a) is None or dims(b) is None or len(dims(a)) != rank or len(dims(b)) != rank:
        return None  # a 1-D operand would make a Transpose feed a product with a vector (_vector_product)

    def absorbs(value: ir.Value) -> bool:
        producer = value.producer()
        return producer is not None and producer.op_type == "Transpose" and producer.domain == "" and _only_use(value, r)

    if not (absorbs(a) or absorbs(b)):
        return None
    ta = _node("Transpose", [a], r.fresh(a.name), perm=swap)
    tb = _node("Transpose", [b], r.fresh(b.name), perm=swap)
    new = _node("MatMul", [tb.outputs[0], ta.outputs[0]], r.fresh(node.outputs[0].name))
    tag = product.metadata_props.get(GRAD_OF)
    for made in (ta, tb, new) if tag is not None else ():
        made.metadata_props[GRAD_OF] = tag  # still the product's gradient
    return new.outputs[0], [ta, tb, new]


def _einsum_terms(node: ir.Node | None) -> tuple[list[str], str] | None:
    """An Einsum's input terms and output term when its equation is explicit, without ellipsis."""
    if node is None or node.op_type != "Einsum" or node.domain != "":
        return None
    equation = str(attr(node, "equation", "")).replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    inputs = lhs.split(",")
    if not arrow or "." in equation or len(inputs) != len(node.inputs):
        return None
    return inputs, out


def _equation(inputs: list[str], out: str) -> str:
    return ",".join(inputs) + "->" + out


def _only_use(value: ir.Value, r: Rewriter) -> bool:
    """Whether one node input reads ``value`` and nothing else does (no graph output either)."""
    return len(value.uses()) == 1 and not value.is_graph_output() and value not in r.captured


def _einsum_transposed_input(value: ir.Value, term: str) -> tuple[ir.Value, str] | None:
    """(x, x's term) when ``value`` = Transpose(x) and every reader of it is an explicit Einsum,
    which can then all read x with the letters permuted (the Transpose then has no reader left)."""
    node = value.producer()
    if node is None or node.op_type != "Transpose" or node.domain != "" or value.is_graph_output():
        return None
    perm = _perm(node, len(term))
    if perm is None or len(perm) != len(term) or not value.uses():
        return None
    if any(_einsum_terms(use.node) is None for use in value.uses()):
        return None
    letters = [""] * len(term)
    for i, p in enumerate(perm):
        letters[p] = term[i]  # axis i of the Transpose is axis perm[i] of x
    return node.inputs[0], "".join(letters)


def einsum(r: Rewriter, node: ir.Node):
    """Einsum(.., Transpose(x), ..) reads x with permuted letters, when only Einsums read the Transpose."""
    terms = _einsum_terms(node)
    if terms is None:
        return None
    inputs, out = terms
    values, changed = list(node.inputs), False
    for i, value in enumerate(values):
        found = None if value is None or value in r.captured else _einsum_transposed_input(value, inputs[i])
        if found is not None:
            values[i], inputs[i] = found
            changed = True
    if not changed:
        return None
    new = _node("Einsum", values, r.fresh(node.outputs[0].name), equation=_equation(inputs, out))
    return new.outputs[0], [new]


def _merged_tail(value: ir.Value, axis: int, r: Rewriter) -> ir.Value | None:
    """x when ``value`` = Reshape(x) only merges x's axes from ``axis`` on into one (and nothing
    else reads ``value``)."""
    node = value.producer()
    if node is None or node.op_type != "Reshape" or node.domain != "" or not _only_use(value, r):
        return None
    x = node.inputs[0]
    dx, dv = dims(x), dims(value)
    if dx is None or dv is None or len(dv) != axis + 1 or len(dx) < axis + 2 or not _same(dx[:axis], dv[:axis]):
        return None
    return x


def concat(r: Rewriter, node: ir.Node):
    """Concat of Reshapes that merge the same trailing axes, along the merged axis, is one Reshape
    of the Concat along the first merged axis (the backward of a fused q/k/v projection); a Concat
    of Transposes is one Transpose of a Concat (:func:`_concat_of_transposes`)."""
    out = dims(node.outputs[0])
    if r.opset < 5 or out is None or len(node.inputs) < 2 or attr(node, "axis") is None:
        return None
    axis = attr(node, "axis") % len(out)
    if axis != len(out) - 1:
        return _concat_of_transposes(r, node, axis)
    sources = [None if v is None else _merged_tail(v, axis, r) for v in node.inputs]
    if any(x is None for x in sources):
        return None
    tail = dims(sources[0])[axis + 1 :]  # the axes after the first merged one must agree
    if not all(_same(dims(x)[axis + 1 :], tail) for x in sources) or len({x.dtype for x in sources}) != 1:
        return None
    shape = _node("Constant", [], r.fresh("merged_shape"), value=ir.tensor(np.array([0] * axis + [-1], np.int64)))
    joined = _node("Concat", sources, r.fresh(node.outputs[0].name), axis=axis)
    merged = _node("Reshape", [joined.outputs[0], shape.outputs[0]], r.fresh(node.outputs[0].name))
    return merged.outputs[0], [shape, joined, merged]


def _concat_of_transposes(r: Rewriter, node: ir.Node, axis: int):
    """Concat(Transpose(x_i, p_i)) = Transpose(Concat(Transpose(x_i, r_i)), p) for the most common
    perm p, r_i = p_i after p⁻¹ (no node where that is the identity): one Transpose of the joined
    tensor instead of one per input, when that leaves fewer Transposes (the backward of attention
    heads split from one projection)."""
    rank = len(dims(node.outputs[0]))
    perms, sources = [], []
    for value in node.inputs:
        producer = None if value is None else value.producer()
        if producer is None or producer.op_type != "Transpose" or producer.domain != "" or not _only_use(value, r):
            return None
        perms.append(_perm(producer, rank))
        sources.append(producer.inputs[0])
    if any(p is None or len(p) != rank for p in perms):
        return None
    common = max(perms, key=lambda p: (perms.count(p), -perms.index(p)))
    inverse = [common.index(k) for k in range(rank)]
    residues = [[p[inverse[k]] for k in range(rank)] for p in perms]
    identity = list(range(rank))
    if sum(residue != identity for residue in residues) + 1 >= len(perms):
        return None
    made, inputs = [], []
    for source, residue in zip(sources, residues):
        if residue != identity:
            made.append(_node("Transpose", [source], r.fresh(source.name), perm=residue))
            source = made[-1].outputs[0]
        inputs.append(source)
    joined = _node("Concat", inputs, r.fresh(node.outputs[0].name), axis=common[axis])
    result = _node("Transpose", [joined.outputs[0]], r.fresh(node.outputs[0].name), perm=common)
    return result.outputs[0], [*made, joined, result]


def _transposed_2d(value: ir.Value) -> ir.Value | None:
    """The input of a 2-D Transpose producing ``value``."""
    node = value.producer()
    if node is None or node.op_type != "Transpose" or node.domain != "":
        return None
    source = node.inputs[0]
    if dims(source) is None or len(dims(source)) != 2 or _perm(node, 2) != [1, 0]:
        return None
    return source


def matmul(r: Rewriter, node: ir.Node):
    a, b = node.inputs
    out = node.outputs[0]
    vector = _vector_product(r, a, b, out)
    if vector is not None:
        return vector
    if r.opset < 11 or out.dtype not in _GEMM_TYPES:
        return None
    if dims(a) is None or dims(b) is None or len(dims(a)) != 2 or len(dims(b)) != 2:
        return None
    ta, tb = _transposed_2d(a), _transposed_2d(b)
    if ta is None and tb is None:
        return None
    new = _node("Gemm", [ta or a, tb or b], r.fresh(out.name), transA=int(ta is not None), transB=int(tb is not None))
    return new.outputs[0], [new]


def _vector_product(r: Rewriter, a: ir.Value, b: ir.Value, out: ir.Value):
    """MatMul(Mᵀ, v) is MatMul(v, M) and MatMul(v, Mᵀ) is MatMul(M, v) for a 1-D v: no Transpose
    of a matrix feeding a product with a vector, which onnxruntime 1.32's MatmulTransposeFusion
    turns into a FusedMatMul that miscomputes the first form."""
    for transposed, vector, first in ((a, b, True), (b, a, False)):
        matrix = _transposed_2d(transposed)
        if matrix is not None and dims(vector) is not None and len(dims(vector)) == 1:
            new = _node("MatMul", [vector, matrix] if first else [matrix, vector], r.fresh(out.name))
            return new.outputs[0], [new]
    return None


def gemm(r: Rewriter, node: ir.Node):
    if r.opset < 11 or len(node.inputs) < 2:
        return None
    a, b = node.inputs[:2]
    ta, tb = _transposed_2d(a), _transposed_2d(b)
    if ta is None and tb is None:
        return None
    attributes = {k: v.value for k, v in node.attributes.items()}
    if ta is not None:
        attributes["transA"] = 1 - int(attributes.get("transA", 0))
    if tb is not None:
        attributes["transB"] = 1 - int(attributes.get("transB", 0))
    new = _node("Gemm", [ta or a, tb or b, *node.inputs[2:]], r.fresh(node.outputs[0].name), **attributes)
    return new.outputs[0], [new]


def same_shape(r: Rewriter, node: ir.Node):
    x, out = node.inputs[0], node.outputs[0]
    if _static(dims(x)) and _same(dims(x), dims(out)) and x.dtype == out.dtype:
        return x
    if node.op_type == "Expand":
        target = constant(node.inputs[1])
        if target is not None and dims(x) is not None and len(target) <= len(dims(x)) and np.all(target == 1):
            return x
    if node.op_type == "Reshape":
        inner = x.producer()
        target = constant(node.inputs[1])
        if (inner is not None and inner.op_type == "Reshape" and inner.domain == "" and target is not None
                and not np.any(target == 0)):
            new = _node("Reshape", [inner.inputs[0], node.inputs[1]], r.fresh(out.name))
            return new.outputs[0], [new]
    return None


def reduce(r: Rewriter, node: ir.Node):
    x = node.inputs[0]
    if attr(node, "keepdims", 1) != 1 or dims(x) is None:
        return None
    axes = r.axes(node)
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        return None  # run-time axes
    if not axes:
        return x if attr(node, "noop_with_empty_axes", 0) == 1 else None
    rank = len(dims(x))
    if all(-rank <= a < rank and dims(x)[a] == 1 for a in axes) and x.dtype == node.outputs[0].dtype:
        return x
    return None


def _normalized(axes: list[int] | None, rank: int | None) -> list[int] | None:
    if axes is None or rank is None or any(not -rank <= a < rank for a in axes):
        return None
    return sorted(a % rank for a in axes)


def squeeze(r: Rewriter, node: ir.Node):
    """Squeeze(Unsqueeze(x, axes), axes) is x."""
    inner = node.inputs[0].producer()
    if inner is None or inner.op_type != "Unsqueeze" or inner.domain != "":
        return None
    x = inner.inputs[0]
    if dims(x) is None:
        return None
    rank = len(dims(x)) + len(r.axes(inner) or [])
    axes = _normalized(r.axes(node), rank)
    if axes is not None and axes == _normalized(r.axes(inner), rank):
        return x
    return None


def unsqueeze(r: Rewriter, node: ir.Node):
    """Unsqueeze(Squeeze(x, axes), axes) is x (an explicit Squeeze removes exactly those axes)."""
    inner = node.inputs[0].producer()
    if inner is None or inner.op_type != "Squeeze" or inner.domain != "":
        return None
    x = inner.inputs[0]
    if dims(x) is None:
        return None
    rank = len(dims(x))
    axes = _normalized(r.axes(node), rank)
    if axes and axes == _normalized(r.axes(inner), rank):
        return x
    return None


def identity(r: Rewriter, node: ir.Node):
    """Identity(x) is x; a graph output keeps its name (x takes it when x is free to be renamed)."""
    x, out = node.inputs[0], node.outputs[0]
    graph = node.graph
    positions = r.output_positions(graph, out)
    if not positions:
        return x
    producer = x.producer()
    if producer is None or producer.graph is not graph or x.is_graph_output() or x in r.captured:
        return None
    name, x_shape = out.name, out.shape if out.shape is not None else x.shape
    for i in positions:
        r.set_output(graph, i, x)
    out.replace_all_uses_with(x)
    out.name = None
    x.name = name
    x.type = out.type or x.type
    x.shape = x_shape
    r.drop(node)
    return None


REWRITES: dict[str, Callable[[Rewriter, ir.Node], object]] = {
    "Mul": mul,
    "Div": div,
    "Add": add,
    "Sub": sub,
    "Sum": sum_,
    "Transpose": transpose,
    "Einsum": einsum,
    "Concat": concat,
    "MatMul": matmul,
    "Gemm": gemm,
    **{op: same_shape for op in _SAME_SHAPE_IDENTITY},
    **{op: reduce for op in _REDUCE_IDENTITY},
    "Squeeze": squeeze,
    "Unsqueeze": unsqueeze,
    "Identity": identity,
}
