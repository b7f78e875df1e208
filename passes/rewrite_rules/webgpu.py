"""The WebGPU lowering: the ops and types that onnxruntime-web's WebGPU execution provider lacks
(1.30, measured from its node-placement log), rewritten into ops it runs, so that every compute
node of a train model runs on the GPU (``cleanup_passes(target="webgpu")``).

onnxruntime falls back to its CPU provider node by node, copying tensors between the devices at
each boundary. The provider has no kernel for LogSoftmax, SoftmaxCrossEntropyLoss,
NegativeLogLikelihoodLoss, Sum or Sign, and without its ``enableInt64`` option (off by default)
none for int64 compute (Cast, Unsqueeze, Equal, Where of int64): only Gather and GatherElements
read int64, as indices. Labels are int64, so every op on them runs on the CPU, unless the labels
are first looked up in a table (a Gather of int64 indices) that turns them into int32 class ids.
(Its BatchNormalization accepts training mode but fails to run it: a node of three outputs, which
the rules' sweep leaves alone, so the train models of this target build it in standard ops before
differentiating, in :mod:`onnx_autodiff.training.artifacts`.) The rules:

- ``Sum(a, b, c, ...)`` is ``((a + b) + c) + ...``;
- ``Sign(x)`` is ``Where(x > 0, 1, Where(x < 0, −1, x − x))``;
- ``LogSoftmax(x)`` over its axes A is ``s − log Σ_A exp(s)`` with ``s = x − max_A x``;
- ``SoftmaxCrossEntropyLoss`` is that LogSoftmax over the class axis followed by the
  NegativeLogLikelihoodLoss below;
- ``NegativeLogLikelihoodLoss(logp, t, w)`` is ``l[n, d] = −Σ_c [c = t'] w[c] logp[n, c, d]``,
  reduced (none; sum; mean: divided by ``Σ_n,d w[t']`` over the labels not ignored), where
  ``t' = T[t]`` is the label's class id, −1 where it is ignored (so no class is selected);
- the cross-entropy gradient's ``ScatterElements(x, Unsqueeze(t), GatherElements(x, Unsqueeze(t)) − a)``
  over the class axis is ``Where(Equal(Unsqueeze(t), k), x − a, x)`` with ``k`` the classes;
- ``Equal(t, k)`` and ``Equal(Unsqueeze(t), k)`` of labels ``t`` and int64 constants ``k`` (the
  cross-entropy gradient's one-hot and ignore mask) compare ``T[t]`` with ``T``'s id of ``k``.

The label table ``T`` (see :func:`label_table`) is exact on the labels such a loss accepts: class
ids in [0, C) and its ignore_index; onnxruntime's CPU kernels reject any other label, while the
lookup leaves it undefined (a class id of no class, -2, or an id of the wrapped index). A rule on
labels applies only where a SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss reads them with a
static class count C, which says what their values are. The loss itself is decomposed only once
nothing else computes on its labels in int64 (its gradient's masks rewritten first), since after
that nothing in the graph would say what the labels' values are.

The target "webgpu" (:data:`.lowering.TARGETS`) applies these rules, then onnxruntime's own
lowerings (:mod:`.lowering`): Gemm, the bias sums as products with ones, Max and Cast of the masks
all run on the WebGPU provider.

Dropout in training mode has no WebGPU kernel either (session creation fails), and its random mask
differs between runtimes. :func:`hashed_dropout` builds it from a hash of each element's index, the
step and the micro-batch instead, in uint32 Add, Sub, Mul, Div, Cast and Gather (the provider has
no bitwise ops, and the multiply-add mixers that stand in for their XORs were measured to leave
strong correlations; a tabulation hash has none measurable). The train models of this target
apply it before differentiating, as they do BatchNormalization's training mode, with the step and
micro-batch as inputs (:mod:`onnx_autodiff.training.artifacts`): every runtime then draws the
same masks, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule

from onnx_autodiff.passes.rewrite_rules.analysis import new_constant, opset, verdict
from onnx_autodiff.toolkit.shapes import constant, dims, rank
from onnx_autodiff.toolkit import shapes

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})
_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
LABEL_TABLE_PADDING = 1 << 16  # at most this many entries beyond the C classes (for the ignore_index)
IGNORED_ID = -1  # the class id of the ignored label: no class has it
UNUSED_ID = -2  # the id of the table's other entries, indices no valid label takes
NEVER_ID = -3  # the id of a compared constant that no valid label equals
# The model's opset, noted on a rule's root node by its check: a replacement sees the matched
# values but not the model, and the axes of Reduce* and Unsqueeze are inputs or attributes by opset.
_OPSET = "onnx_autodiff.webgpu.opset"


def _noted_opset(context, node: ir.Node) -> int:
    version = opset(context.model)
    node.meta[_OPSET] = version
    return version


def _const(op, array) -> ir.Value:
    return new_constant(op, np.asarray(array))


def _reduce(op, kind: str, x: ir.Value, axes: list[int] | None, keepdims: int, version: int) -> ir.Value:
    """ReduceSum/ReduceMax over ``axes`` (None: all of them), axes as an input from the opset that
    takes them so (ReduceSum 13, the others 18)."""
    if axes is None:
        return getattr(op, kind)(x, keepdims=keepdims)
    if version >= (13 if kind == "ReduceSum" else 18):
        return getattr(op, kind)(x, _const(op, np.array(axes, np.int64)), keepdims=keepdims)
    return getattr(op, kind)(x, axes=axes, keepdims=keepdims)


def _unsqueeze(op, x: ir.Value, axes: list[int], version: int) -> ir.Value:
    if version >= 13:
        return op.Unsqueeze(x, _const(op, np.array(axes, np.int64)))
    return op.Unsqueeze(x, axes=axes)


# Sum: a chain of Add


def _sum_of_tensors(context, node: ir.Node):
    return verdict(bool(node.inputs) and all(v is not None for v in node.inputs), "not a Sum of tensors")


def _sum(op, x):
    return op.Sum(x, _allow_other_inputs=True, _check=_sum_of_tensors, _outputs=["y"])


def _chain_of_adds(op, x, y):
    """Sum(a, b, c, ...) = ((a + b) + c) + ...: Add broadcasts as Sum does (multidirectionally)."""
    terms = list(y.producer().inputs)
    total = terms[0]
    if len(terms) == 1:
        return op.Identity(total)
    for term in terms[1:]:
        total = op.Add(total, term)
    return total


# Sign (the gradient of Abs: l1 losses, BCE with logits)


def _float_sign(context, node: ir.Node):
    return verdict(node.inputs[0].dtype in _FLOATS, "not a float or float16 Sign")


def _sign(op, x):
    return op.Sign(x, _check=_float_sign)


def _sign_by_comparisons(op, x):
    """sign(x) = 1 where x > 0, −1 where x < 0, else x − x: 0 for ±0 (+0, as the kernel gives) and
    NaN for NaN."""
    dtype = x.dtype.numpy()
    zero, one, minus_one = (_const(op, np.array(v, dtype)) for v in (0, 1, -1))
    return op.Where(op.Greater(x, zero), one, op.Where(op.Less(x, zero), minus_one, op.Sub(x, x)))


# LogSoftmax


def _log_softmax_axes(node: ir.Node, version: int) -> list[int] | None:
    """The axes LogSoftmax normalises over: its axis from opset 13, before that every axis from
    it on (the input read as a matrix [prod(dims[:axis]), prod(dims[axis:])]); None when unknown."""
    axis = shapes.attr(node, "axis", -1 if version >= 13 else 1)
    if version >= 13:
        return [axis]
    r = rank(node.inputs[0])
    return None if r is None or not -r <= axis < r else list(range(axis % r, r))


def _float_log_softmax(context, node: ir.Node):
    version = _noted_opset(context, node)
    if node.inputs[0].dtype not in _FLOATS:
        return verdict(False, "not a float or float16 LogSoftmax")
    return verdict(_log_softmax_axes(node, version) is not None, "the rank of the input is unknown")


def _log_softmax(op, x):
    return op.LogSoftmax(x, _allow_other_attributes=True, _check=_float_log_softmax, _outputs=["y"])


def _stable_log_softmax(op, x: ir.Value, axes: list[int], version: int) -> ir.Value:
    """log softmax(x) = s − log Σ exp(s), s = x − max x over ``axes`` (the max subtracted first, so
    that exp overflows nowhere: onnxruntime's kernel computes it so)."""
    shifted = op.Sub(x, _reduce(op, "ReduceMax", x, axes, 1, version))
    return op.Sub(shifted, op.Log(_reduce(op, "ReduceSum", op.Exp(shifted), axes, 1, version)))


def _decomposed_log_softmax(op, x, y):
    node = y.producer()
    version = node.meta[_OPSET]
    return _stable_log_softmax(op, x, _log_softmax_axes(node, version), version)


# Labels: the lookup table of class ids


def label_table(classes: int, ignore_index: int | None) -> np.ndarray:
    """The int32 class ids of labels, indexed by the label (as Gather indexes, negative indices
    counting from the end): T[c] = c for a class 0 <= c < C, T[ignore_index] = -1, the other
    entries -2. Long enough to hold ignore_index: C + |ignore_index| entries for a negative one
    (index ignore_index is then entry C), ignore_index + 1 for one of C or more, else C.

    On the labels a loss accepts (classes, ignore_index) T is one-to-one, so comparing T[t] with
    T's id of k (:func:`label_ids`) says whether t = k."""
    length = classes
    if ignore_index is not None:
        length = classes - ignore_index if ignore_index < 0 else max(classes, ignore_index + 1)
    table = np.full(length, UNUSED_ID, np.int32)
    table[:classes] = np.arange(classes, dtype=np.int32)
    if ignore_index is not None:
        table[ignore_index] = IGNORED_ID
    return table


def label_ids(values: np.ndarray, classes: int, ignore_index: int | None) -> np.ndarray:
    """The ids that :func:`label_table` gives labels equal to ``values``: c for a class, -1 for
    ignore_index, -3 (an id no label has) for a value no valid label takes."""
    values = np.asarray(values, np.int64)
    ids = np.where((values >= 0) & (values < classes), values, NEVER_ID)
    if ignore_index is not None:
        ids = np.where(values == ignore_index, IGNORED_ID, ids)
    return ids.astype(np.int32)


def _table_fits(classes: int, ignore_index: int | None) -> bool:
    extra = 0 if ignore_index is None else (-ignore_index if ignore_index < 0 else ignore_index + 1 - classes)
    return 0 < classes < 2**31 - 1 and extra <= LABEL_TABLE_PADDING


def _loss_domain(node: ir.Node) -> tuple[int, int | None] | None:
    """(C, ignore_index) of a cross-entropy or NLL loss whose scores have a static class axis 1."""
    shape = dims(node.inputs[0])
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        return None
    return shape[1], shapes.attr(node, "ignore_index")


def label_domain(labels: ir.Value) -> tuple[int, int | None] | None:
    """(C, ignore_index) when a SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss reads
    ``labels`` (int64) as its labels with C static (all of them agreeing); else None."""
    if labels.dtype != ir.DataType.INT64:
        return None
    found = None
    for user, index in labels.uses():
        if user.domain == "" and user.op_type in _LOSSES and index == 1:
            domain = _loss_domain(user)
            if domain is None or found is not None and domain != found:
                return None
            found = domain
    return found if found is not None and _table_fits(*found) else None


def _label_lookup(op, labels: ir.Value, classes: int, ignore_index: int | None) -> ir.Value:
    """The labels' int32 class ids T[labels]: a Gather, which reads int64 indices on the GPU. The
    lookup an earlier rewrite made in the labels' graph is reused (common-subexpression
    elimination leaves tables of more than a few elements apart)."""
    table = label_table(classes, ignore_index)
    for user, index in labels.uses():
        if (user.op_type == "Gather" and user.domain == "" and index == 1 and user.graph is labels.graph
                and shapes.attr(user, "axis", 0) == 0):
            data = constant(user.inputs[0], computed=False)
            if data is not None and data.dtype == table.dtype and np.array_equal(data, table):
                return user.outputs[0]
    return op.Gather(_const(op, table), labels, axis=0)


# Equal of labels and constants (the one-hot and the ignore mask of the loss's gradient)


def _compared_labels(a: ir.Value) -> tuple[ir.Value, ir.Node | None] | None:
    """(labels, the Unsqueeze between, if any) when ``a`` is labels or an Unsqueeze of them whose
    values a loss says (see :func:`label_domain`)."""
    if a.dtype != ir.DataType.INT64:
        return None
    node = a.producer()
    if node is not None and node.op_type == "Unsqueeze" and node.domain == "" and label_domain(node.inputs[0]):
        return node.inputs[0], node
    return (a, None) if label_domain(a) else None


def _equal_of_labels(context, node: ir.Node):
    a, k = node.inputs
    if a is None or k is None or a.dtype != ir.DataType.INT64:
        return verdict(False, "not an Equal of int64 values")
    values = constant(k, computed=False)
    if values is None or values.size > LABEL_TABLE_PADDING:
        return verdict(False, "not a comparison with a small constant")
    _noted_opset(context, node)
    return verdict(_compared_labels(a) is not None, "not labels a loss reads with a static class count")


def _label_equal(op, a, k):
    return op.Equal(a, k, _check=_equal_of_labels)


def _equal_of_ids(op, a, k):
    """t = k  <=>  T[t] = id(k) on the labels the loss accepts (T one-to-one there; id(k) = -3,
    no label's id, when k is no valid label); Unsqueeze(t) = k likewise, the Unsqueeze moved
    after the lookup (elementwise, it commutes with Unsqueeze)."""
    labels, unsqueeze = _compared_labels(a)
    classes, ignore_index = label_domain(labels)
    ids = _label_lookup(op, labels, classes, ignore_index)
    if unsqueeze is not None:
        axes = shapes.attr(unsqueeze, "axes")
        ids = op.Unsqueeze(ids, axes=axes) if axes is not None else op.Unsqueeze(ids, unsqueeze.inputs[1])
    return op.Equal(ids, _const(op, label_ids(constant(k, computed=False), classes, ignore_index)))


# The cross-entropy gradient's label term: a ScatterElements at the labels


def _scatter_of_labels(context, node: ir.Node):
    x, indices, _ = node.inputs
    _noted_opset(context, node)
    shape = dims(x)
    compared = _compared_labels(indices) if indices is not None else None
    if compared is None or compared[1] is None or shape is None or len(shape) < 2:
        return verdict(False, "not indices of labels a loss reads, unsqueezed")
    classes, _ = label_domain(compared[0])
    return verdict(shape[1] == classes and shapes.axes(compared[1], computed=False) == [1]
                   and shapes.attr(node, "reduction", "none") == "none",
                   "not a ScatterElements over the class axis 1 at the labels")


def _label_term(op, x, indices, a):
    at_labels = op.Sub(op.GatherElements(x, indices, axis=1), a)
    return op.ScatterElements(x, indices, at_labels, axis=1, _check=_scatter_of_labels, _outputs=["y"])


def _label_term_by_mask(op, x, indices, a, y):
    """x with a taken off at each label: Where(one-hot(t), x − a, x), whose one-hot the label
    comparison below rewrites (the ScatterElements and GatherElements read int64 labels)."""
    shape = dims(x)
    class_ids = _const(op, np.arange(shape[1], dtype=np.int64).reshape([shape[1], *[1] * (len(shape) - 2)]))
    return op.Where(op.Equal(indices, class_ids), op.Sub(x, a), x)


# SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss


def _decomposable_loss(context, node: ir.Node):
    version = _noted_opset(context, node)
    scores, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    if version < 13:
        return verdict(False, "opset before 13 (Unsqueeze and ReduceSum take their axes as attributes)")
    if scores.dtype not in _FLOATS or weights is not None and weights.dtype != scores.dtype:
        return verdict(False, "not float or float16 scores (and weights)")
    if shapes.attr(node, "reduction", "mean") not in ("none", "sum", "mean"):
        return verdict(False, "an unknown reduction")
    domain = None if labels is None else label_domain(labels)
    if domain is None or domain != _loss_domain(node):
        return verdict(False, "not int64 labels with a static class count (that every loss reading them agrees on)")
    # Anything else computing on the labels must be lowered first: once decomposed, the loss no
    # longer says what values they take.
    for user, index in labels.uses():
        if not (user.domain == "" and index == 1 and user.op_type in (*_LOSSES, "Gather")):
            return verdict(False, f"{user.op_type} still reads the labels")
    return verdict(True, "")


def _cross_entropy(op, scores, labels):
    return op.SoftmaxCrossEntropyLoss(scores, labels, _allow_other_inputs=True, _allow_other_attributes=True,
                                      _check=_decomposable_loss, _outputs=["y"])


def _nll(op, logp, labels):
    return op.NegativeLogLikelihoodLoss(logp, labels, _allow_other_inputs=True, _allow_other_attributes=True,
                                        _check=_decomposable_loss, _outputs=["y"])


def _negative_log_likelihood(op, node: ir.Node, logp: ir.Value, labels: ir.Value, version: int) -> ir.Value:
    """l[n, d...] = −Σ_c [c = T[t]] w[c] logp[n, c, d...], reduced by the node's reduction (mean:
    divided by Σ [c = T[t]] w[c] over every n, c, d, the weight of the labels not ignored). Where
    selects rather than multiplies, so that a −inf log-probability of another class (a masked
    logit) stays out of the sum, as the kernel's gather keeps it out."""
    classes, ignore_index = label_domain(labels)
    r = len(dims(node.inputs[0]))
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    dtype = logp.dtype.numpy() if logp.dtype is not None else node.inputs[0].dtype.numpy()
    ids = _unsqueeze(op, _label_lookup(op, labels, classes, ignore_index), [1], version)  # (N, 1, d...)
    class_ids = _const(op, np.arange(classes, dtype=np.int32).reshape([classes, *[1] * (r - 2)]))
    chosen = op.Equal(ids, class_ids)  # (N, C, d...): the label's one-hot, no class where ignored
    zero = _const(op, np.array(0, dtype))
    if weights is not None:
        class_weights = op.Reshape(weights, _const(op, np.array([classes, *[1] * (r - 2)], np.int64))) if r > 2 else weights
        logp = op.Mul(logp, class_weights)
    per_item = op.Neg(_reduce(op, "ReduceSum", op.Where(chosen, logp, zero), [1], 0, version))  # (N, d...)
    reduction = shapes.attr(node, "reduction", "mean")
    if reduction == "none":
        return per_item
    total = _reduce(op, "ReduceSum", per_item, None, 0, version)
    if reduction == "sum":
        return total
    selected = op.Cast(chosen, to=int(node.inputs[0].dtype)) if weights is None else op.Where(chosen, class_weights, zero)
    return op.Div(total, _reduce(op, "ReduceSum", selected, None, 0, version))


def _decomposed_cross_entropy(op, scores, labels, y):
    node = y.producer()
    version = node.meta[_OPSET]
    logp = _stable_log_softmax(op, scores, [1], version)
    return _negative_log_likelihood(op, node, logp, labels, version)


def _decomposed_nll(op, logp, labels, y):
    node = y.producer()
    return _negative_log_likelihood(op, node, logp, labels, node.meta[_OPSET])


def webgpu_rules() -> list[RewriteRule]:
    # The label comparisons before the losses: a loss is decomposed once they are rewritten.
    return [
        RewriteRule(_label_term, _label_term_by_mask, name="webgpu_label_term_by_mask"),
        RewriteRule(_label_equal, _equal_of_ids, remove_nodes=False, name="webgpu_label_equal_by_lookup"),
        RewriteRule(_cross_entropy, _decomposed_cross_entropy, remove_nodes=False, name="webgpu_cross_entropy_decomposed"),
        RewriteRule(_nll, _decomposed_nll, remove_nodes=False, name="webgpu_nll_decomposed"),
        RewriteRule(_log_softmax, _decomposed_log_softmax, remove_nodes=False, name="webgpu_log_softmax_decomposed"),
        RewriteRule(_sum, _chain_of_adds, remove_nodes=False, name="webgpu_sum_as_adds"),
        RewriteRule(_sign, _sign_by_comparisons, remove_nodes=False, name="webgpu_sign_by_comparisons"),
    ]


# Dropout in training mode: masks from a hash of each element's index, the step and the micro-batch

DROPOUT_TABLE_SIZE = 1 << 16  # the hash reads a uint32 as two 16-bit halves, one table each
_KEPT_BITS = 24  # the hash's top 24 bits, a float32 integer exactly, decide whether an element is kept


def dropout_tables() -> tuple[np.ndarray, np.ndarray]:
    """The hash's two tables of 2^16 uint32: the top halves of splitmix64(1), splitmix64(2), ...
    (computed here, not drawn from numpy's generators, whose streams may change between versions:
    the models, and their masks, stay the same bytes)."""
    with np.errstate(over="ignore"):
        z = np.arange(1, 2 * DROPOUT_TABLE_SIZE + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    words = (z >> np.uint64(32)).astype(np.uint32)
    return words[:DROPOUT_TABLE_SIZE], words[DROPOUT_TABLE_SIZE:]


def _uint32(op, number: int) -> ir.Value:
    return _const(op, np.array(number, np.uint32))


def _tabulated(op, x: ir.Value, tables) -> ir.Value:
    """H(x) = T_low[x mod 2^16] + T_high[x div 2^16] (mod 2^32) of uint32 ``x``: tabulation
    hashing, with sums for its XORs, Div and Sub for its shifts and masks."""
    low_table, high_table = tables
    high = op.Div(x, _uint32(op, DROPOUT_TABLE_SIZE))
    low = op.Sub(x, op.Mul(high, _uint32(op, DROPOUT_TABLE_SIZE)))
    int32 = int(ir.DataType.INT32)  # Gather's indices (the provider reads no int64 but as indices)
    return op.Add(op.Gather(low_table, op.Cast(low, to=int32), axis=0),
                  op.Gather(high_table, op.Cast(high, to=int32), axis=0))


def dropout_key(op, step: ir.Value, micro_batch: ir.Value, tables) -> ir.Value:
    """The key of one micro-batch's masks, H(H(step) + micro_batch), from uint32 scalars: a train
    step's masks are those of its step's micro-batch 0."""
    return _tabulated(op, op.Add(_tabulated(op, step, tables), micro_batch), tables)


def hashed_dropout(op, x: ir.Value, ratio: ir.Value, key: ir.Value, salt: int, tables) -> tuple[ir.Value, ir.Value]:
    """(y, mask) of Dropout(x, ratio) in training mode: element i of ``x`` (row-major) is kept when
    u_i >= ratio, y = x·mask/(1 − ratio) (the kernel's scale, in float32). u_i = (h_i div 2^8)/2^24
    with h_i = H(H(i + k1) + k2), k1 = H(key + salt), k2 = H(k1 + 1): ``salt`` (the node's number)
    gives each Dropout its own masks. One round of H leaves the masks of blocks of 2^16 elements
    shifted copies of each other, two do not. P(kept) = 1 − ⌈ratio·2^24⌉/2^24.

    The gradient rules see y = x·m, m = Where(mask, scale, 0): dx = dy·m, through the same mask."""
    float32, uint32, int32 = (int(t) for t in (ir.DataType.FLOAT, ir.DataType.UINT32, ir.DataType.INT32))
    k1 = _tabulated(op, op.Add(key, _uint32(op, salt)), tables)
    k2 = _tabulated(op, op.Add(k1, _uint32(op, 1)), tables)
    count = op.Cast(op.Size(x), to=int32)  # int32: the provider's Range; a shape computation on the CPU
    positions = op.Range(_const(op, np.array(0, np.int32)), count, _const(op, np.array(1, np.int32)))
    index = op.Reshape(op.Cast(positions, to=uint32), op.Shape(x))
    h = _tabulated(op, op.Add(_tabulated(op, op.Add(index, k1), tables), k2), tables)
    draw = op.Cast(op.Div(h, _uint32(op, 1 << (32 - _KEPT_BITS))), to=float32)  # exact: below 2^24
    rate = ratio if ratio.dtype == ir.DataType.FLOAT else op.Cast(ratio, to=float32)
    mask = op.GreaterOrEqual(draw, op.Mul(rate, _const(op, np.array(2.0**_KEPT_BITS, np.float32))))
    one = _const(op, np.array(1, np.float32))
    scale = op.Div(one, op.Sub(one, rate))
    zero = _const(op, np.array(0, np.float32))
    if x.dtype != ir.DataType.FLOAT:
        scale, zero = op.Cast(scale, to=int(x.dtype)), op.Cast(zero, to=int(x.dtype))
    return op.Mul(x, op.Where(mask, scale, zero)), mask
