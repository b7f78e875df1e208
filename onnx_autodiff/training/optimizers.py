"""Optimisers as graphs: the table of optimiser classes (:mod:`~onnx_autodiff.training.update_rules`:
SGD, Adam and AdamW with torch.optim's semantics), their specs made and read, and the update nodes
every one shares (clipping, the finite check, the gate of a failed step, grouped updates)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError
from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.toolkit.shapes import cast_like, typed_like
from onnx_autodiff.training import update_rules  # noqa: F401  (registers the built-in optimisers)
from onnx_autodiff.training.update_rules.adam import Adam, AdamW  # noqa: F401  (imported from here too)
from onnx_autodiff.training.update_rules.base import (  # noqa: F401  (register_optimizer imported from here too)
    OPTIMIZER_CLASSES, Optimizer, StepScalars, register_optimizer)
from onnx_autodiff.training.update_rules.sgd import SGD  # noqa: F401  (imported from here too)
from onnx_autodiff.training.values import dim_value, fresh_value

# The optimisers' names, as registered (the command line's --optimizer choices).
OPTIMIZERS = OPTIMIZER_CLASSES.names


def make_optimizer(optimizer, **options):
    """An optimiser spec from a registered name ("sgd", "adam", "adamw", ...) and torch-style
    options, or as given."""
    if isinstance(optimizer, Optimizer):
        return dataclasses.replace(optimizer, **options) if options else optimizer
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZER_CLASSES:
        instances = "/".join(cls.__name__ for cls in OPTIMIZER_CLASSES.values())
        raise TrainingError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)} or an {instances} instance")
    cls = OPTIMIZER_CLASSES[optimizer.lower()]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TrainingError(f"{cls.__name__} has no option {unknown}; its options are {sorted(fields)}")
    return cls.from_options(**options)


def optimizer_to_json(spec: Optimizer) -> dict:
    return {"name": spec.name, **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}}


def optimizer_from_json(data: dict) -> Optimizer:
    data = dict(data)
    return make_optimizer(data.pop("name"), **data)


# Per-step coefficients (Adam's bias corrections, AdamW's decay): the runner computes them in
# float64 from lr, the step number and the hyper-parameters, as torch.optim does in Python floats,
# and feeds each as a scalar input of the parameters' precision (float32; float64 where a parameter
# is float64); the graphs then hold no float64 that the model does not (onnxruntime-web's WebGPU
# and reduced-type WebAssembly builds have no float64 Cast). The layout records each as an expression:
# a number, "lr" or "step" (the values the runner feeds the inputs of those names), or
# [operator, operand, ...] with the operators of COEFFICIENT_OPERATORS; ["float32", "lr"] is lr
# rounded to float32, as the lr input holds it.
COEFFICIENT_OPERATORS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "pow": math.pow,  # C's pow, as onnxruntime's Pow of doubles
    "sqrt": math.sqrt,
    "float32": lambda a: float(np.float32(a)),
}


def coefficient_formulas(spec: Optimizer) -> dict[str, list]:
    """The per-step coefficients ``spec``'s update reads, by key, as layout expressions (see
    :func:`evaluate_coefficient`); none for SGD, which reads lr and step themselves."""
    return spec.coefficient_formulas()


def compile_coefficient(expression):
    """A function of {"lr": ..., "step": ...} computing a coefficient expression
    (:func:`coefficient_formulas`) in float64; checks the expression once, here."""
    if isinstance(expression, str):
        def read(values, name=expression):
            if name not in values:
                raise TrainingError(f"a coefficient reads '{name}', which the runner does not give ({sorted(values)})")
            return float(values[name])
        return read
    if isinstance(expression, (int, float)) and not isinstance(expression, bool):
        number = float(expression)
        return lambda values: number
    if not isinstance(expression, (list, tuple)) or not expression or expression[0] not in COEFFICIENT_OPERATORS:
        raise TrainingError(f"unknown coefficient expression {expression!r}: the artifacts need a newer onnx-autodiff")
    operator, operands = COEFFICIENT_OPERATORS[expression[0]], [compile_coefficient(x) for x in expression[1:]]
    if len(operands) == 1:
        (a,) = operands
        return lambda values: operator(a(values))
    a, b = operands
    return lambda values: operator(a(values), b(values))


def evaluate_coefficient(expression, values: Mapping[str, float]) -> float:
    """The value of a coefficient expression (:func:`coefficient_formulas`) in float64, ``values``
    giving "lr" and "step"."""
    return compile_coefficient(expression)(values)


def step_kept(op: OpBuilder, grads, loss: ir.Value | None = None) -> tuple[ir.Value, ir.Value]:
    """(kept, Σ‖g‖²): kept is True when the loss (when given) and the float32 sum of the squared
    gradients are finite, i.e. no gradient is NaN or ±Inf (nor so large that its square is)."""
    float32 = ir.DataType.FLOAT
    squares = []
    for g in grads:  # in float32 (float16 squares overflow early); a double sum cast down
        square = op.ReduceSumSquare(g if g.dtype in (float32, ir.DataType.DOUBLE) else op.Cast(g, to=float32), keepdims=0)
        squares.append(op.Cast(square, to=float32) if g.dtype == ir.DataType.DOUBLE else square)
    total = op.Sum(*squares) if len(squares) > 1 else squares[0]
    checked = total if loss is None else op.Add(total, op.Abs(cast_like(op, loss, total)))
    kept = op.Less(op.Abs(checked), op.const(float("inf"), dtype=float32))  # Less is False for NaN
    kept.shape = ir.Shape([])  # a model output: typed here, not by a shape inference of the whole model
    return kept, total


def when_kept(op: OpBuilder, kept: ir.Value, build, olds: list[ir.Value]) -> list[ir.Value]:
    """The values ``build(branch)`` returns, one per old value and typed like it, when ``kept``;
    an Identity of each old value otherwise. One If: a failed step changes nothing, and a step
    that counts pays no gate per value (a Where(kept, g, 0) per gradient costs a full pass over
    each: the figures are in benchmarks/README.md, "Training")."""
    update = op.child()
    then_branch = update.graph([], build(update), name="update")
    unchanged = op.child()
    else_branch = unchanged.graph([], olds, name="keep")
    news = op.If(kept, then_branch=then_branch, else_branch=else_branch, _outputs=len(olds))
    news = list(news) if isinstance(news, tuple) else [news]
    # typed and shaped like the old values, not left to shape inference (each is a new value of one)
    for values in (then_branch.outputs, else_branch.outputs, news):
        typed_like(values, olds)
    return news


# Tensors of at most this many elements are updated in groups: one update over the Concat (along
# axis 0) of those of one dtype and the same dims but the first, split back after. The updates
# are elementwise, so each element goes through the same float operations as alone and the results
# are bit-identical (tests/test_training_grouped.py); a train model then has a few nodes per group
# instead of about 17 per parameter (the If's outputs, AdamW's 13 nodes, the kept branch's copies:
# 170,000 nodes for the 10,000 parameters of a 20,001-node chain, most of its build time, and a
# node's dispatch at every step). A larger tensor costs more to copy into the group and out than
# its nodes cost to run apart, so it keeps its own. Measured (AdamW train step on onnxruntime, a
# residual chain with a W and a bias per block, grouped against one by one): 1,000 parameters of
# 16×16 13 ms against 26 ms, 500 of 32×32 8.3 against 14.1 ms, 400 of 64×64 9.7 against 13.6 ms,
# 200 of 128×128 12.6 against 11.6 ms (slower: the limit lies between).
GROUP_LIMIT = 4096


def update_groups(params: list[ir.Value], limit: int | None = GROUP_LIMIT) -> list[list[int]]:
    """The indices of ``params`` in groups updated together (see :data:`GROUP_LIMIT`), in the order
    of their first member; a parameter alone where it has no partner, a dynamic or rank-0 shape,
    more than ``limit`` elements, or ``limit`` is None."""
    groups: dict[object, list[int]] = {}
    for i, p in enumerate(params):
        dims = [dim_value(d) for d in p.shape] if p.shape is not None else None
        small = (limit is not None and dims and p.dtype is not None and all(isinstance(d, int) for d in dims)
                 and math.prod(dims) <= limit)
        key = (p.dtype, tuple(dims[1:])) if small else i
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def joined(op: OpBuilder, groups: list[list[int]], rows: list[ir.Value]) -> list[ir.Value]:
    """Per group, the Concat along axis 0 of its rows (a lone row as it is), shaped where the rows are."""
    values = []
    for members in groups:
        if len(members) == 1:
            values.append(rows[members[0]])
            continue
        first = rows[members[0]]
        value = op.Concat(*(rows[i] for i in members), axis=0)
        if all(rows[i].shape is not None for i in members):
            value.shape = ir.Shape([sum(_rows(rows[i]) for i in members), *first.shape[1:]])
        values.append(value)
    return values


def split_back(op: OpBuilder, groups: list[list[int]], values: list[ir.Value], rows: list[ir.Value]) -> list[ir.Value]:
    """Per row of ``rows``, its part of its group's value in ``values`` (joined like ``rows`` by
    :func:`joined`): a Split along axis 0 per group, a lone row's value as it is; in row order."""
    parts: list[ir.Value | None] = [None] * len(rows)
    for members, value in zip(groups, values):
        if len(members) == 1:
            parts[members[0]] = value
            continue
        for i, part in zip(members, op.split(value, [_rows(rows[i]) for i in members], axis=0)):
            parts[i] = part
    return parts


def _rows(value: ir.Value) -> int:
    return dim_value(value.shape[0])


def emit_update(op: OpBuilder, spec, params, grads, lr: ir.Value, step: ir.Value, namer: Namer, max_grad_norm,
                 state_names=None, loss: ir.Value | None = None, coefficients: dict | None = None,
                 group_limit: int | None = GROUP_LIMIT):
    """Optimiser nodes: returns (state inputs per param, new params, new states per param, kept).

    ``group_limit``: parameters of at most this many elements are updated in groups
    (:data:`GROUP_LIMIT`); None updates each apart.

    ``coefficients``: a dict that gets the scalar inputs the update reads besides lr and step, by
    key of :func:`coefficient_formulas` (graph inputs the caller adds, fed as the layout's
    expressions compute them); needed for Adam and AdamW.

    ``kept`` is a bool scalar, True when the step counts: the loss (when given) and the sum of
    the squared gradients are finite. The update runs only then (:func:`when_kept`); otherwise
    every new value is its old one, so a trainer may write the new values over the old ones and
    still keep nothing of a failed step. The update also waits for the whole backward pass.
    """
    groups = update_groups(params, group_limit)
    grad_groups = joined(op, groups, grads)  # read by the update and by the finite check
    # The finite check sums the squares of the groups (a node per group, not per parameter: the
    # sum is only compared with infinity); clipping scales by the sum, which is then taken per
    # parameter, so that the results stay those of each parameter's update apart.
    kept, total = step_kept(op, grads if max_grad_norm is not None else grad_groups, loss)
    formulas = coefficient_formulas(spec)
    if formulas and coefficients is None:
        raise TrainingError(f"{type(spec).__name__}'s update reads per-step coefficients: give emit_update a coefficients dict")
    # one input per coefficient, in float32, or float64 where a parameter is (cast per parameter dtype)
    wide = ir.DataType.DOUBLE if any(p.dtype == ir.DataType.DOUBLE for p in params) else ir.DataType.FLOAT
    for key in formulas:
        coefficients[key] = fresh_value(namer, key, wide, [])
    states = []
    for i, p in enumerate(params):
        shape = [dim_value(x) for x in p.shape]
        if state_names is None:
            states.append([fresh_value(namer, f"{p.name}.{s}", p.dtype, shape) for s in spec.state_names()])
        else:
            states.append([ir.Value(name=n, type=ir.TensorType(p.dtype), shape=ir.Shape(shape)) for n in state_names[i]])
            namer.taken.update(state_names[i])

    # Per column (the parameters, then each state), the old values joined by group: what the
    # update reads and a failed step returns. The If then has an output per group and column, each
    # split back after it, not one per value in each of its branches.
    columns = [params, *(list(column) for column in zip(*states))]
    olds = [joined(op, groups, column) for column in columns]

    def build(op):  # the new values by column, then by group, as the If returns them
        news = _update(op, spec, olds[0], grad_groups, olds[1:], lr, step, total, max_grad_norm, coefficients)
        return [value for column in news for value in column]

    news = when_kept(op, kept, build, [value for column in olds for value in column])
    count = len(groups)
    rows = [split_back(op, groups, news[c * count:(c + 1) * count], params) for c in range(len(columns))]
    new_states = [[row[i] for row in rows[1:]] for i in range(len(params))]
    return states, rows[0], new_states, kept


def _update(op: OpBuilder, spec: Optimizer, params, grads, states, lr: ir.Value, step: ir.Value, total: ir.Value,
            max_grad_norm, coefficients: Mapping[str, ir.Value] | None = None) -> list[list[ir.Value]]:
    """One step of ``spec``'s update (:meth:`~.update_rules.base.Optimizer.update`), elementwise,
    on ``params``, ``grads`` and each column of ``states`` (parameters or groups of them joined,
    :func:`joined`), after the clipping: the new values by column, the parameters' then each
    state's (``total``: the sum of the squared gradients; ``coefficients``: the scalar inputs of
    :func:`coefficient_formulas` by key)."""
    float32 = ir.DataType.FLOAT
    coef = None
    if max_grad_norm is not None:
        # torch.nn.utils.clip_grad_norm_: g ·= min(max_norm / (‖g‖₂ + 1e-6), 1) over all gradients
        coef = op.Min(op.Div(op.const(float(max_grad_norm), dtype=float32), op.Add(op.Sqrt(total), 1e-6)), 1.0)
    # scalar coefficients: computed by the runner in float64, like torch's Python-float arithmetic
    # (coefficient_formulas), fed in float32 or float64, cast per parameter dtype
    scalars = StepScalars(op, lr, step, coefficients)

    def update(p, g, *inputs):
        """One parameter's (or one group's) new value and new states: elementwise."""
        if coef is not None:
            g = op.Mul(g, cast_like(op, coef, g))
        return spec.update(op, p, g, list(inputs), scalars)

    return [list(column) for column in zip(*(update(*row) for row in zip(params, grads, *states)))]
