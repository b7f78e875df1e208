"""The numeric oracle: float64 central finite differences of ⟨outputs, r⟩, independent of any rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")


def _widen_tensor(tensor: TensorProto) -> TensorProto:
    if tensor.data_type not in _FLOAT_TYPES:
        return tensor
    array = numpy_helper.to_array(tensor).astype(np.float64)
    return numpy_helper.from_array(array, tensor.name)


def _widen_type(type_proto: onnx.TypeProto) -> None:
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        if type_proto.tensor_type.elem_type in _FLOAT_TYPES:
            type_proto.tensor_type.elem_type = TensorProto.DOUBLE
    elif which == "sequence_type":
        _widen_type(type_proto.sequence_type.elem_type)
    elif which == "optional_type":
        _widen_type(type_proto.optional_type.elem_type)


def _widen_graph(graph: onnx.GraphProto, keep: frozenset[str]) -> None:
    for index, tensor in enumerate(graph.initializer):
        if tensor.name not in keep:
            graph.initializer[index].CopyFrom(_widen_tensor(tensor))
    for value in (*graph.input, *graph.output):
        if value.name not in keep:
            _widen_type(value.type)
    del graph.value_info[:]
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                attribute.t.CopyFrom(_widen_tensor(attribute.t))
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _widen_graph(attribute.g, keep)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _widen_graph(sub, keep)
            elif attribute.name in _DTYPE_ATTRIBUTES and attribute.i in _FLOAT_TYPES:
                attribute.i = TensorProto.DOUBLE
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name in ("value_float", "value_floats"):
                    values = attribute.f if attribute.name == "value_float" else list(attribute.floats)
                    widened = helper.make_attribute(
                        "value", numpy_helper.from_array(np.asarray(values, np.float64))
                    )
                    attribute.CopyFrom(widened)


def to_float64(model: onnx.ModelProto, keep: Sequence[str] = ()) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 (inputs named in ``keep`` stay as they are)."""
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    _widen_graph(widened.graph, frozenset(keep))
    for function in widened.functions:
        for node in function.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.TENSOR:
                    attribute.t.CopyFrom(_widen_tensor(attribute.t))
    return widened


class Evaluator:
    """Runs a model on onnxruntime, falling back to onnx's reference evaluator when it cannot."""

    def __init__(self, model: onnx.ModelProto, prefer: str = "onnxruntime") -> None:
        self.model = model
        self.backend = None
        self._run = None
        errors = []
        order = ("onnxruntime", "reference") if prefer == "onnxruntime" else ("reference",)
        for backend in order:
            try:
                self._run = getattr(self, f"_make_{backend}")()
                self.backend = backend
                break
            except Exception as error:  # noqa: BLE001 - any failure means: try the next backend
                errors.append(f"{backend}: {error}")
        if self._run is None:
            raise RuntimeError("no backend runs the model: " + "; ".join(errors))

    def _make_onnxruntime(self):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(
            self.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return lambda feeds: session.run(None, feeds)

    def _make_reference(self):
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(self.model)
        return lambda feeds: evaluator.run(None, feeds)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(out) for out in self._run(dict(feeds))]


def _float_outputs(model: onnx.ModelProto) -> list[int]:
    return [
        i
        for i, out in enumerate(model.graph.output)
        if out.type.tensor_type.elem_type in (*_FLOAT_TYPES, TensorProto.DOUBLE)
    ]


def random_cotangents(model: onnx.ModelProto, feeds, seed: int = 0) -> list[np.ndarray | None]:
    """One standard-normal r per float output, shaped like that output at ``feeds`` (None if not float)."""
    outputs = Evaluator(model)(feeds)
    rng = np.random.default_rng(seed)
    floats = set(_float_outputs(model))
    cotangents: list[np.ndarray | None] = []
    for i, out in enumerate(outputs):
        if i not in floats:
            cotangents.append(None)
            continue
        r = rng.standard_normal(out.shape).astype(out.dtype)
        cotangents.append(np.where(np.isfinite(out), r, 0).astype(out.dtype))
    return cotangents


def fd_vjp(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    cotangents: Sequence[np.ndarray | None],
    step: float = 1e-6,
) -> dict[str, np.ndarray]:
    """Central finite differences in float64 of f(x) = Σ_k ⟨out_k(x), r_k⟩ for each input in ``wrt``.

    ``wrt`` names graph inputs or initializers; initializers are fed as inputs. Returns the
    VJP per name, in the dtype and shape of the value.
    """
    graph_inputs = {i.name for i in model.graph.input}
    initializers = {t.name: t for t in model.graph.initializer}
    promoted = onnx.ModelProto()
    promoted.CopyFrom(model)
    values: dict[str, np.ndarray] = {}
    for name in wrt:
        if name in feeds:
            values[name] = np.asarray(feeds[name])
        elif name in initializers:
            values[name] = numpy_helper.to_array(initializers[name])
            if name not in graph_inputs:
                promoted.graph.input.append(
                    helper.make_tensor_value_info(
                        name, initializers[name].data_type, list(initializers[name].dims)
                    )
                )
        else:
            raise KeyError(f"'{name}' is neither a fed input nor an initializer")
    keep = [
        i.name
        for i in model.graph.input
        if i.name in feeds and np.asarray(feeds[i.name]).dtype.kind != "f"
    ]
    wide = to_float64(promoted, keep)
    evaluate = Evaluator(wide)
    base = {
        name: (np.asarray(v).astype(np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v))
        for name, v in feeds.items()
    }
    for name, v in values.items():
        base[name] = v.astype(np.float64)
    weights = [None if r is None else np.asarray(r, np.float64) for r in cotangents]

    def objective(point) -> float:
        outs = evaluate(point)
        return float(sum(np.sum(out * r) for out, r in zip(outs, weights) if r is not None))

    result: dict[str, np.ndarray] = {}
    for name, value in values.items():
        grad = np.zeros(value.size, np.float64)
        flat = base[name].reshape(-1)
        for k in range(value.size):
            point = dict(base)
            plus, minus = flat.copy(), flat.copy()
            plus[k] += step
            minus[k] -= step
            point[name] = plus.reshape(value.shape)
            f_plus = objective(point)
            point[name] = minus.reshape(value.shape)
            f_minus = objective(point)
            grad[k] = (f_plus - f_minus) / (2 * step)
        result[name] = grad.reshape(value.shape)
    return result
