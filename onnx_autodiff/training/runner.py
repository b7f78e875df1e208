"""A step runner: one model of the artifacts (train, eval, accumulate or apply) run on a trainer's state."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnx_autodiff.errors import BatchError, TrainingError
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, proto_graphs
from onnx_autodiff.training.in_place import in_place_keys
from onnx_autodiff.training.manifest import Evaluation, Step
from onnx_autodiff.training.optimizers import compile_coefficient
from onnx_autodiff.training.sessions import ORT_TYPES, Sessions
from onnx_autodiff.training.state import TrainingState
from onnx_autodiff.training.values import shape_text


class StepRunner:
    """One model's session, its signature's inputs and its IO bindings (one per combination of
    the state's current buffers). A run's new values replace the old ones only when the run is
    kept (its loss and new values finite): in place where :func:`in_place_keys` finds the model
    writes them safely, else into the spare buffers, swapped in afterwards."""

    def __init__(self, proto: onnx.ModelProto, signature: Step | Evaluation, kind: str, state: TrainingState,
                 sessions: Sessions, optimizer_state: Collection[str] = ()) -> None:
        self.kind, self.state, self.signature = kind, state, signature
        self.carry = list(signature.carry)
        self.flag = signature.kept
        if self.flag:  # the model keeps nothing of a failed step itself: new values may overwrite old ones
            serialised, self.checked = proto.SerializeToString(), []
            recorded = signature.in_place  # (None in artifacts from before the build recorded it: found here)
            self.in_place = set(recorded) if recorded is not None else in_place_keys(proto, self.carry)
        else:  # artifacts without that flag: new values go to spare buffers, kept when finite (the new
            # parameters, buffers and accumulators, which a non-finite gradient makes non-finite;
            # ``optimizer_state``, the other carried keys, follows from them)
            self.checked = [(key, out) for key, _, out in self.carry if key not in optimizer_state]
            serialised, self.flag = _with_finite_flag(proto, [out for _, out in self.checked])
            self.in_place = set()
        self.session = sessions.open(serialised)
        meta = {i.name: i for i in self.session.get_inputs()}
        self.batch = [(name, ORT_TYPES.get(meta[name].type), meta[name].shape) for name in signature.batch]
        self.reads = list(signature.reads)
        self.scalars = {
            key: (name, ORT_TYPES[meta[name].type], self._scalar(ORT_TYPES[meta[name].type]))
            for key, name in signature.scalars.items()
        }
        # scalar inputs computed from lr and step (Adam's bias corrections; artifacts format 2)
        self.coefficients = {key: compile_coefficient(e) for key, e in signature.coefficients.items()}
        self.loss = signature.loss
        outputs = {o.name: o for o in self.session.get_outputs()}
        # the loss in the model's own float type (a float64 model's is float64)
        self.loss_value = (self._scalar(ORT_TYPES[outputs[self.loss].type])
                           if self.loss and kind != "eval" else None)
        self.flag_value = self._scalar(np.bool_ if signature.kept else np.float32) if self.flag else None
        self.bindings: dict[tuple, object] = {}
        self.generation = state.generation  # of the state's buffers that the bindings hold

    def _scalar(self, dtype):
        from onnxruntime import OrtValue

        return OrtValue.ortvalue_from_numpy(np.zeros((), dtype), self.state.device, 0)

    def feeds(self, batch) -> list[tuple[str, np.ndarray]]:
        """The batch as contiguous arrays of the model's dtypes, checked against the declared shapes."""
        names = [name for name, _, _ in self.batch]
        if isinstance(batch, Mapping):
            missing = [n for n in names if n not in batch]
            extra = sorted(set(batch) - set(names))
            if missing or extra:
                raise BatchError(
                    f"the {self.kind} model takes the batch inputs {names}"
                    + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "")
                )
            values = [batch[n] for n in names]
        else:
            values = list(batch) if isinstance(batch, (list, tuple)) else [batch]
            if len(values) != len(names):
                raise BatchError(f"the {self.kind} model takes {len(names)} batch inputs {names}, not {len(values)}")
        sizes: dict[str, tuple[int, str]] = {}
        feeds = []
        for (name, dtype, shape), value in zip(self.batch, values):
            array = np.asarray(value)
            if dtype is not None and array.dtype != dtype:
                if not np.can_cast(array.dtype, dtype, "same_kind"):
                    raise BatchError(f"batch input '{name}' is {array.dtype}; the model expects {np.dtype(dtype).name}")
                array = array.astype(dtype)
            if shape is not None:
                if array.ndim != len(shape):
                    raise BatchError(f"batch input '{name}' has shape {array.shape}; the model expects rank {len(shape)} {shape_text(shape)}")
                for axis, (want, got) in enumerate(zip(shape, array.shape)):
                    if isinstance(want, int) and want != got:
                        raise BatchError(f"batch input '{name}' has shape {array.shape}; the model expects {shape_text(shape)} (axis {axis} must be {want})")
                    if isinstance(want, str) and want:
                        seen = sizes.setdefault(want, (got, name))
                        if seen[0] != got:
                            raise BatchError(
                                f"batch input '{name}' has shape {array.shape}, but its axis {axis} ({want}) must match "
                                f"'{seen[1]}', where {want} = {seen[0]}"
                            )
            if array.ndim and array.shape[0] == 0:
                raise BatchError(f"batch input '{name}' has shape {array.shape}: the batch is empty; "
                                 f"the {self.kind} model needs at least one example")
            feeds.append((name, np.ascontiguousarray(array)))
        return feeds

    def binding(self):
        """The IO binding of the state's current buffers (made once for each combination)."""
        state = self.state
        if self.generation != state.generation:  # some key has new buffers
            self.bindings.clear()
            self.generation = state.generation
        keys = [key for key, _, _ in self.carry] + [key for key, _ in self.reads]
        signature = tuple(state.parity(key) for key in keys)
        binding = self.bindings.get(signature)
        if binding is None:
            binding = self.session.io_binding()
            for key, name, out in self.carry:
                binding.bind_ortvalue_input(name, state.value(key))
                binding.bind_ortvalue_output(out, state.value(key, spare=key not in self.in_place))
            for key, name in self.reads:
                binding.bind_ortvalue_input(name, state.value(key))
            for name, _, value in self.scalars.values():
                binding.bind_ortvalue_input(name, value)
            if self.loss_value is not None:
                binding.bind_ortvalue_output(self.loss, self.loss_value)
            if self.flag_value is not None:
                binding.bind_ortvalue_output(self.flag, self.flag_value)
            self.bindings[signature] = binding
        return binding

    def _finite(self) -> bool:
        """Whether the new values just written are all finite."""
        if self.flag_value is None or self.flag_value.data_type() == "tensor(bool)":
            return self.flag_value is None or bool(self.flag_value.numpy())
        if math.isfinite(float(self.flag_value.numpy())):
            return True
        # their sum is not finite: a NaN or Inf, or (rarely) finite values whose sum overflows
        return all(np.isfinite(self.state.value(key, spare=True).numpy()).all() for key, _ in self.checked)

    def run(self, batch, scalars: Mapping[str, float]) -> tuple[float | None, bool]:
        """Runs the model; keeps its new values only when the loss and they are finite.
        Returns the loss and whether they were. ``scalars``: lr, step, micro_batch (and
        grad_scale), those the model takes fed as they are, the signature's coefficients computed
        from them (the hashed Dropout's seeds among them)."""
        from onnxruntime import OrtValue

        feeds = self.feeds(batch) if self.batch else []
        binding = self.binding()
        device = self.state.device
        alive = []
        for name, array in feeds:
            value = OrtValue.ortvalue_from_numpy(array, device, 0)
            alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        numbers = {key: number for key, number in scalars.items() if key in self.scalars}
        for key, compute in self.coefficients.items():  # in float64, then in the input's dtype
            numbers[key] = compute(scalars)
        for key, number in numbers.items():
            _, dtype, value = self.scalars[key]
            value.update_inplace(np.asarray(number, dtype))
        try:
            self.session.run_with_iobinding(binding)
        except Exception as error:  # noqa: BLE001 - onnxruntime raises its own types
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TrainingError(f"the {self.kind} step failed on onnxruntime; nothing was updated: {first}") from error
        loss = float(self.loss_value.numpy()) if self.loss_value is not None else None
        if (loss is not None and not math.isfinite(loss)) or not self._finite():
            return loss, False
        for key, _, _ in self.carry:
            if key not in self.in_place:
                self.state.swap(key)
        return loss, True

    def evaluate(self, batch) -> dict[str, np.ndarray]:
        """The eval model's loss and outputs on ``batch``: {"loss": ..., output name: ...}."""
        from onnxruntime import OrtValue

        binding = self.session.io_binding()
        alive = []
        for name, array in self.feeds(batch):
            value = OrtValue.ortvalue_from_numpy(array, self.state.device, 0)
            alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for key, name in self.reads:
            binding.bind_ortvalue_input(name, self.state.value(key))
        names = [self.loss, *self.signature.outputs]
        for name in names:
            binding.bind_output(name, self.state.device)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as error:  # noqa: BLE001
            raise TrainingError(f"the eval model failed on onnxruntime: {str(error).strip().splitlines()[0]}") from error
        results = dict(zip(names, binding.copy_outputs_to_cpu()))
        results["loss"] = results.pop(self.loss)
        return results

    def loss_of(self, session, batch, zeroed: Collection[str] = ()) -> float:
        """The loss of this model's signature run by ``session`` (the model with other
        initializers) on ``batch``, the keys ``zeroed`` read as zeros."""
        feeds = dict(self.feeds(batch))
        for key, name in self.reads:
            value = self.state.host(key)
            feeds[name] = np.zeros_like(value) if key in zeroed else value
        return float(session.run([self.loss], feeds)[0])


def _with_finite_flag(proto: onnx.ModelProto, names: Sequence[str]) -> tuple[bytes, str | None]:
    """``proto`` serialised with one more output: a float32 scalar, the sum of every element of the
    floating-point outputs ``names`` (None: nothing to check). One NaN or Inf makes it non-finite, so
    a step is checked on the device without copying the new values to the host; a finite sum that
    overflows does too, which the caller rules out on the host (rare, so the usual step stays cheap)."""
    types = {v.name: v.type.tensor_type.elem_type for v in proto.graph.output}
    names = [n for n in names if types.get(n) in FLOAT_TYPES]
    if not names:
        return proto.SerializeToString(), None
    namer = Namer(_names(proto.graph), prefix="finite")
    extra, sums = onnx.GraphProto(), []

    def cast(value: str) -> str:
        extra.node.append(helper.make_node("Cast", [value], [namer.fresh(f"{value}.float")], to=TensorProto.FLOAT))
        return extra.node[-1].output[0]

    for name in names:
        dtype = types[name]
        if dtype in (TensorProto.FLOAT16, TensorProto.BFLOAT16):  # summed in float32
            name = cast(name)
        extra.node.append(helper.make_node("ReduceSum", [name], [namer.fresh(f"{name}.sum")], keepdims=0))
        total = extra.node[-1].output[0]
        sums.append(cast(total) if dtype == TensorProto.DOUBLE else total)
    flag = namer.fresh("finite_check")
    extra.node.append(helper.make_node("Sum", sums, [flag]))
    extra.output.append(helper.make_tensor_value_info(flag, TensorProto.FLOAT, []))
    # serialised messages concatenate as a merge (repeated fields append): no copy of a large model
    return proto.SerializeToString() + onnx.ModelProto(graph=extra).SerializeToString(), flag


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every value name of ``graph`` and of its subgraphs."""
    names: set[str] = set()
    for g in proto_graphs(graph):
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        for node in g.node:
            names.update(node.input)
            names.update(node.output)
    return names
