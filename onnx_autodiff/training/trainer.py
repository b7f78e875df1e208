"""The Trainer: runs training artifacts on onnxruntime with parameters and state kept as OrtValues."""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.errors import BatchError, TrainingError
from onnx_autodiff.modelfile import from_proto, over_limit, save_model, tensor_array, to_inline_proto, uses_external_data
from onnx_autodiff.passes.lift import lifted_in, read_back, write_back
from onnx_autodiff.weights.quantized import as_read
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, proto_graphs
from onnx_autodiff.training import distributed
from onnx_autodiff.training.artifacts import FROZEN_IN_PLACE, TrainingArtifacts
from onnx_autodiff.training.manifest import Evaluation, Manifest, ModuleParameter, Step
from onnx_autodiff.training.optimizers import compile_coefficient
from onnx_autodiff.files import write_atomically
from onnx_autodiff.training.values import arrays_writer, load_arrays, owned_copy, shape_text


LARGE_STATE = 1 << 30  # bytes of parameters and optimiser state from which the CPU arena is off

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
}


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


def _rows(batch) -> int:
    """The number of examples in ``batch`` (the length of its first array)."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else (
        batch[0] if isinstance(batch, (list, tuple)) else batch)
    return len(np.asarray(first)) if np.ndim(first) else 1


# Elementwise writers: each output element is computed from the input elements at its own index,
# so the node may write into the buffer of an input it reads.
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Identity"}


def in_place_keys(proto: onnx.ModelProto, carry: Sequence[tuple[str, str, str]]) -> set[str]:
    """The carried keys whose new value may be written over the old one in a run of ``proto``:
    the node writing the new value is elementwise, a Split that reads no view of the old value (a
    grouped update's), or an If each of whose branches writes it so,
    and every other node reading the old value is one of its ancestors, so it has run before
    (onnxruntime runs nodes in a dependency order, and an If's branch once the If may run)."""
    safe = _writable(proto.graph, {out: name for _, name, out in carry})
    return {key for key, _, out in carry if out in safe}


def _writable(graph: onnx.GraphProto, writes: Mapping[str, str]) -> set[str]:
    """The new values of ``writes`` (new value's name -> old value's name) that a run of ``graph``
    may write over the old ones (see :func:`in_place_keys`)."""
    wanted = set(writes.values())
    index = {}  # a bit per node that reads a carried input
    for position, node in enumerate(graph.node):
        for name in _reads(node) & wanted:
            index.setdefault(position, len(index))
    readers: dict[str, int] = {}
    producer: dict[str, int] = {}
    ancestors: list[int] = []  # per node: the reader bits of the node and of its ancestors
    for position, node in enumerate(graph.node):
        bits = 0
        for name in _reads(node):
            if name in producer:
                bits |= ancestors[producer[name]]
            if name in wanted:
                readers[name] = readers.get(name, 0) | (1 << index[position])
        ancestors.append(bits | (1 << index[position] if position in index else 0))
        for name in node.output:
            producer[name] = position
    safe, by_if = set(), {}
    for out, name in writes.items():
        writer = producer.get(out)
        if writer is None or readers.get(name, 0) & ~ancestors[writer]:
            continue
        node = graph.node[writer]
        if node.op_type in _ELEMENTWISE:
            safe.add(out)
        elif node.op_type == "Split" and node.domain in ("", "ai.onnx") and not set(node.input) & _views(graph, name):
            # a grouped update's (optimizers.split_back, after the If): it reads the group's new
            # value or a copy of its old values (their Concat), never their buffers, which their
            # readers, all ancestors, are done with
            safe.add(out)
        elif node.op_type == "If" and node.domain in ("", "ai.onnx"):
            by_if.setdefault(writer, {})[out] = name
    for writer, outs in by_if.items():  # each branch must write the value in place itself
        node = graph.node[writer]
        position = {out: i for i, out in enumerate(node.output)}
        for attribute in node.attribute:
            branch = attribute.g
            inner = [branch.output[position[out]].name for out in outs]
            once = {n for n, count in collections.Counter(inner).items() if count == 1}  # one value returned twice: neither
            ok = _writable(branch, {n: name for n, name in zip(inner, outs.values()) if n in once})
            outs = {out: name for out, n, name in zip(outs, inner, outs.values()) if n in ok}
        safe.update(outs)
    return safe


# Kernels whose output may be a view of their input's buffer in onnxruntime (no copy).
_VIEWS = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def _views(graph: onnx.GraphProto, name: str) -> set[str]:
    """``name`` and the values of ``graph`` that may share its buffer (views of it, transitively)."""
    found = {name}
    for node in graph.node:
        if node.op_type in _VIEWS and node.input and node.input[0] in found:
            found.update(node.output)
    return found


def _reads(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads: its inputs and the outer values its subgraphs use."""
    names = set(node.input)
    for attribute in node.attribute:
        for sub in [attribute.g] if attribute.HasField("g") else attribute.graphs:
            for graph in proto_graphs(sub):
                for inner in graph.node:
                    names.update(inner.input)
    names.discard("")
    return names


_SHAREABLE = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)


def _shared_frozen(artifacts: TrainingArtifacts, options) -> dict[str, tuple]:
    """The large frozen weights of the models (floating-point initializers of at least
    ``FROZEN_IN_PLACE`` bytes stored in a file: a LoRA base), each mapped from its file once and
    given to every session through ``options`` (``add_initializer``), with pre-packing off: each
    kernel that pre-packs a constant keeps a packed copy of it (the forward's and the backward's
    products one each), and each session would map the file itself. The pages are read when a step
    first uses them, and only those (an embedding's rows). Returns {name: (array, OrtValue)}, which
    must outlive the sessions; nothing where a model runs MatMulNBits, whose kernels need their
    packed weights."""
    from onnxruntime import OrtValue

    models = [m for m in (artifacts.train_model, artifacts.eval_model, artifacts.accumulate_model) if m is not None]
    if any(node.op_type == "MatMulNBits" for m in models for g in proto_graphs(m.graph) for node in g.node):
        return {}
    state, found = set(artifacts.checkpoint), {}
    for model in models:
        for tensor in model.graph.initializer:
            if (tensor.data_location == TensorProto.EXTERNAL and tensor.data_type in _SHAREABLE
                    and tensor.name not in state and tensor.name not in found
                    and int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
                    >= FROZEN_IN_PLACE):
                found[tensor.name] = tensor
    if not found:
        return {}
    options.add_session_config_entry("session.disable_prepacking", "1")
    shared = {}
    for name, tensor in found.items():
        array = tensor_array(tensor, artifacts.base_dir)  # mapped, read-only; onnxruntime only reads it
        value = OrtValue.ortvalue_from_numpy(array, "cpu", 0)
        options.add_initializer(name, value)
        shared[name] = (array, value)
    return shared


def _session_options(artifacts: TrainingArtifacts, session_options):
    """``session_options`` (the trainer's own where None) reading the artifacts' external tensors
    from their folder."""
    import onnxruntime as ort

    if session_options is None:
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # the memory pattern adds a planned block of every activation beside the arena's
        # (GPT benchmark: a step's peak +100 MB) and no measurable speed
        session_options.enable_mem_pattern = False
        # warnings only about the models' form, which is ours: frozen weights stored as half
        # floats are overridable inputs on purpose (one warning per weight otherwise)
        session_options.log_severity_level = 3
        # onnxruntime's arena would keep one step's gradient buffers and take new ones for the
        # next (4x the parameters' memory where 3x will do): large models allocate directly
        if sum(a.nbytes for a in artifacts.checkpoint.values()) >= LARGE_STATE:
            session_options.enable_cpu_mem_arena = False
    if artifacts.base_dir:  # the models' external tensors are read from there
        session_options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.path.abspath(artifacts.base_dir))
    return session_options


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime has it, then CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class _Runner:
    """One model's session, its input metadata and its IO bindings (one per buffer parity)."""

    def __init__(self, trainer: Trainer, proto: onnx.ModelProto, signature: Step | Evaluation, kind: str) -> None:
        import onnxruntime as ort

        self.trainer, self.kind = trainer, kind
        self.carry = list(signature.carry)
        self.flag = signature.kept
        if self.flag:  # the model keeps nothing of a failed step itself: new values may overwrite old ones
            serialised, self.checked = proto.SerializeToString(), []
            self.in_place = in_place_keys(proto, self.carry)
        else:  # artifacts without that flag: new values go to spare buffers, kept when finite (the new
            # parameters, buffers and accumulators, which a non-finite gradient makes non-finite)
            state = set(trainer.artifacts.checkpoint) - set(trainer.manifest.params) - set(trainer.manifest.buffers)
            self.checked = [(key, out) for key, _, out in self.carry if key not in state]
            serialised, self.flag = _with_finite_flag(proto, [out for _, out in self.checked])
            self.in_place = set()
        self.session = ort.InferenceSession(serialised, sess_options=trainer.session_options, providers=trainer.providers)
        meta = {i.name: i for i in self.session.get_inputs()}
        self.batch = [(name, _ORT_TYPES.get(meta[name].type), meta[name].shape) for name in signature.batch]
        self.reads = list(signature.reads)
        self.scalars = {
            key: (name, _ORT_TYPES[meta[name].type], self._scalar(_ORT_TYPES[meta[name].type]))
            for key, name in signature.scalars.items()
        }
        # scalar inputs computed from lr and step (Adam's bias corrections; artifacts format 2)
        self.coefficients = {key: compile_coefficient(e) for key, e in signature.coefficients.items()}
        self.loss = signature.loss
        outputs = {o.name: o for o in self.session.get_outputs()}
        # the loss in the model's own float type (a float64 model's is float64)
        self.loss_value = (self._scalar(_ORT_TYPES[outputs[self.loss].type])
                           if self.loss and kind != "eval" else None)
        self.flag_value = self._scalar(np.bool_ if signature.kept else np.float32) if self.flag else None
        self.bindings: dict[tuple, object] = {}

    def _scalar(self, dtype):
        from onnxruntime import OrtValue

        return OrtValue.ortvalue_from_numpy(np.zeros((), dtype), self.trainer.device, 0)

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
        trainer = self.trainer
        keys = [key for key, _, _ in self.carry] + [key for key, _ in self.reads]
        signature = tuple(trainer._parity(key) for key in keys)
        binding = self.bindings.get(signature)
        if binding is None:
            binding = self.session.io_binding()
            for key, name, out in self.carry:
                binding.bind_ortvalue_input(name, trainer._value(key))
                binding.bind_ortvalue_output(out, trainer._value(key, spare=key not in self.in_place))
            for key, name in self.reads:
                binding.bind_ortvalue_input(name, trainer._value(key))
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
        return all(np.isfinite(self.trainer._value(key, spare=True).numpy()).all() for key, _ in self.checked)

    def run(self, batch, scalars: Mapping[str, float]) -> tuple[float | None, bool]:
        """Runs the model; keeps its new values only when the loss and they are finite.
        Returns the loss and whether they were. ``scalars``: lr, step, micro_batch (and
        grad_scale), those the model takes fed as they are, the signature's coefficients computed
        from them (the hashed Dropout's seeds among them)."""
        from onnxruntime import OrtValue

        feeds = self.feeds(batch) if self.batch else []
        binding = self.binding()
        device = self.trainer.device
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
                self.trainer._swap(key)
        return loss, True


class Trainer:
    """Runs training artifacts on onnxruntime; parameters, state and buffers stay on the device.

    ``step(batch)`` takes the batch as a dict or in the order of ``batch_names`` (model inputs, then
    labels) and returns the loss; ``accumulate(batch)`` / ``apply()`` do the same in micro-batches
    (artifacts built with ``gradient_accumulation=True``); ``evaluate(batch)`` runs the eval model;
    ``export()`` returns the inference model with the trained initializers.

    A step whose loss or gradients are not finite (NaN or ±Inf; the models' ``kept`` flag checks the
    loss and the sum of the squared gradients, in the graph) keeps nothing of the step: with ``nonfinite="raise"`` (the default) it raises a
    :class:`TrainingError` naming the step; with ``nonfinite="skip"`` it returns the loss and counts
    the step in ``skipped_steps`` (not in ``step_count``), as AMP's gradient scaler does; a
    non-finite micro-batch then makes ``apply()`` skip the whole step. A checkpoint holding NaN or
    Inf is refused.

    Frozen weights stored in a file (a LoRA base read with external data) are held once: with the
    default ``session_options`` on the CPU, each weight of at least ``FROZEN_IN_PLACE`` bytes is
    mapped from its file, read when a step first needs it, and shared by the train, eval and
    accumulate sessions, which pre-pack no constant (a packed copy per kernel reading it).

    ``comm``: an MPI communicator (mpi4py) of several ranks trains data-parallel: each rank steps on
    its slice of the global batch, the gradients are summed over the ranks before the one update
    they all apply (see :mod:`onnx_autodiff.training.distributed`); the artifacts need
    ``gradient_accumulation=True``.
    """

    def __init__(self, artifacts: TrainingArtifacts | str | os.PathLike, lr: float | None = None,
                 providers: Sequence | None = None, session_options=None, checkpoint: Mapping | None = None,
                 nonfinite: str = "raise", comm=None) -> None:
        if nonfinite not in ("raise", "skip"):
            raise TrainingError(f"nonfinite must be 'raise' or 'skip', not {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._poisoned = False  # skip mode: a pending micro-batch was not finite
        self._failure: str | None = None  # with ranks: what was not finite here, told when all decide
        if not isinstance(artifacts, TrainingArtifacts):
            artifacts = TrainingArtifacts.load(artifacts)
        self.artifacts = artifacts
        self.manifest: Manifest = artifacts.manifest
        self.optimizer = artifacts.optimizer
        self.lr = float(self.optimizer.lr if lr is None else lr)
        self.providers = list(providers) if providers is not None else default_providers()
        own_options = session_options is None
        session_options = _session_options(artifacts, session_options)
        self.session_options = session_options
        self._values: dict[str, list] = {}
        self._current: dict[str, int] = {}
        self._runners: dict[str, _Runner] = {}
        self.step_count = 0
        self._micro_batches = 0
        first = self.providers[0] if self.providers else "CPUExecutionProvider"
        first = first[0] if isinstance(first, tuple) else first
        self.device = "cuda" if first == "CUDAExecutionProvider" else "cpu"
        self.comm = comm if distributed.size(comm) > 1 else None
        # the frozen weights (a LoRA base) mapped once from their file, for every session
        self._frozen = _shared_frozen(artifacts, session_options) if own_options and self.device == "cpu" else {}
        if self.comm is None:
            self._runner("train")
        elif artifacts.accumulate_model is None:
            raise TrainingError("data-parallel training sums the ranks' gradients between the accumulate and apply "
                                "models: generate the artifacts with gradient_accumulation=True")
        self.load_state_dict(checkpoint if checkpoint is not None else artifacts.checkpoint)
        if self.comm is not None:  # every rank starts from rank 0's state
            distributed.broadcast(self.comm, [self._value(key).numpy() for key in self.artifacts.checkpoint])

    # state storage: two OrtValues per key, the current one and a spare the next step writes

    def _value(self, key: str, spare: bool = False):
        pair = self._values[key]
        index = self._current[key] ^ int(spare)
        if pair[index] is None:
            from onnxruntime import OrtValue

            current = pair[self._current[key]]
            pair[index] = OrtValue.ortvalue_from_shape_and_type(
                current.shape(), _ORT_TYPES[current.data_type()], self.device, 0
            )
        return pair[index]

    def _host(self, key: str) -> np.ndarray:
        # a copy: on the CPU, OrtValue.numpy() is a view of a buffer that later steps overwrite
        return np.array(self._value(key).numpy(), copy=True)

    def _parity(self, key: str) -> int:
        if key not in self._values:
            raise TrainingError(f"the checkpoint has no value for '{key}'")
        return self._current[key]

    def _swap(self, key: str) -> None:
        self._current[key] ^= 1

    def _set(self, key: str, array: np.ndarray, owned: bool = False) -> None:
        """``array`` as ``key``'s current value (``owned``: a fresh array the trainer may keep)."""
        from onnxruntime import OrtValue

        array = np.ascontiguousarray(array)
        pair = self._values.get(key)
        if pair is not None:
            current = pair[self._current[key]]
            if tuple(current.shape()) == array.shape and _ORT_TYPES[current.data_type()] == array.dtype:
                current.update_inplace(array)
                return
        self._values[key] = [OrtValue.ortvalue_from_numpy(array if owned else array.copy(), self.device, 0), None]
        self._current[key] = 0
        for runner in self._runners.values():
            runner.bindings.clear()

    def _runner(self, kind: str) -> _Runner:
        if kind not in self._runners:
            proto = {"train": self.artifacts.train_model, "eval": self.artifacts.eval_model,
                     "accumulate": self.artifacts.accumulate_model, "apply": self.artifacts.apply_model}[kind]
            if proto is None:
                raise TrainingError(f"these artifacts have no {kind} model: generate them with gradient_accumulation=True")
            self._runners[kind] = _Runner(self, proto, self.manifest.signature(kind), kind)
        return self._runners[kind]

    @property
    def layout(self) -> dict:
        """The manifest as ``artifacts.json`` holds it (a new dict at each call)."""
        return self.artifacts.layout

    @property
    def batch_names(self) -> list[str]:
        return list(self.manifest.train.batch)

    # training

    def step(self, batch, lr: float | None = None) -> float:
        """One optimiser step on ``batch``; returns the loss (before the update).

        Data-parallel (``comm`` of several ranks): ``batch`` is this rank's slice of the global
        batch (possibly empty, where the last batch of an epoch does not split among the ranks),
        the update is the one of the whole batch, and the loss returned is the whole batch's (the
        ranks' losses weighted by their examples)."""
        if self._micro_batches:
            raise TrainingError("accumulated gradients are pending: call apply() before step()")
        if self.comm is not None:
            rows = _rows(batch)
            counts = self.comm.allgather(rows)  # the last batch of an epoch may not split evenly
            loss = self.accumulate(batch) if rows else self._accumulate_nothing()
            self._apply(lr, share=rows * len(counts) / sum(counts))
            return sum(n * value for n, value in zip(counts, self.comm.allgather(loss))) / sum(counts)
        runner, number = self._runner("train"), self.step_count + 1
        loss, finite = runner.run(batch, {"lr": self.lr if lr is None else lr, "step": number, "micro_batch": 0})
        if finite:
            self.step_count += 1
        elif self.nonfinite == "skip":
            self.skipped_steps += 1
        else:
            raise self._not_finite(f"step {number}", loss, runner, batch)
        return loss

    def accumulate(self, batch) -> float:
        """Adds the gradients of ``batch`` to the accumulators; returns its loss."""
        runner = self._runner("accumulate")
        if self._micro_batches == 0:
            self._zero_accumulators()
        loss, finite = runner.run(batch, {"step": self.step_count + 1, "micro_batch": self._micro_batches})
        if not finite and self.nonfinite == "raise" and self.comm is None:  # with ranks: all decide in apply()
            raise self._not_finite(f"micro-batch {self._micro_batches + 1} of step {self.step_count + 1}", loss, runner, batch)
        if not finite and self.comm is not None and not self._poisoned:
            self._failure = f"micro-batch {self._micro_batches + 1}: {self._cause(loss, runner, batch)}"
        self._poisoned |= not finite
        self._micro_batches += 1
        return loss

    def _zero_accumulators(self) -> None:
        runner = self._runner("accumulate")  # the accumulators come first in carry, one per parameter read
        for (acc, _, _), (param, _) in zip(runner.carry, runner.reads):
            value = self._value(param)
            self._set(acc, np.zeros(value.shape(), _ORT_TYPES[value.data_type()]))

    def _accumulate_nothing(self) -> float:
        """A rank without examples in this step: zero gradients, its share of the update none."""
        self._zero_accumulators()
        self._micro_batches = 1
        return 0.0

    def apply(self, lr: float | None = None) -> None:
        """One optimiser step with the mean of the accumulated gradients (with ranks: of all ranks',
        each rank having accumulated as many micro-batches of equal size)."""
        self._apply(lr)

    def _apply(self, lr: float | None, share: float = 1.0) -> None:
        """``share``: this rank's examples over the mean number per rank (1 when they split evenly)."""
        if self._micro_batches == 0:
            raise TrainingError("apply() needs accumulate() first: no gradient has been accumulated")
        runner, number = self._runner("apply"), self.step_count + 1
        ranks = distributed.size(self.comm)
        if self.comm is not None:
            self._combine_ranks(number, share)
        scalars = {"lr": self.lr if lr is None else lr, "step": number,
                   "grad_scale": 1.0 / (self._micro_batches * ranks)}
        finite = not self._poisoned and runner.run(None, scalars)[1]
        if not finite and self.nonfinite == "raise":
            raise self._not_finite(f"step {number}", None, runner, None)
        if finite:
            self.step_count += 1
        else:
            self.skipped_steps += 1
        self._micro_batches = 0
        self._poisoned, self._failure = False, None

    def _combine_ranks(self, number: int, share: float) -> None:
        """Sums the ranks' accumulated gradients and averages the buffers, each weighted by its
        rank's ``share`` of the examples, in place; when a micro-batch was not finite on some rank,
        every rank skips the step (or raises, naming those ranks)."""
        failed = distributed.failed_ranks(self.comm, self._poisoned)
        if failed:
            if self.nonfinite == "raise":
                here = f" (here, {self._failure})" if self._failure else ""
                self._micro_batches, self._poisoned, self._failure = 0, False, None
                raise TrainingError(f"step {number}: not finite on rank {', '.join(map(str, failed))} of "
                                    f"{self.comm.Get_size()}{here}; nothing was updated on any rank")
            self._poisoned = True  # every rank skips the step
            return
        buffers = self.manifest.buffers
        accumulators = [key for key, _, _ in self._runner("accumulate").carry if key not in buffers]
        distributed.sum_in_place(self.comm, [self._value(key).numpy() for key in accumulators], share)
        distributed.mean_in_place(self.comm, [self._value(key).numpy() for key in buffers], share)

    def _not_finite(self, what: str, loss: float | None, runner: _Runner, batch) -> TrainingError:
        """The error for a step that was not kept, naming what was not finite."""
        return TrainingError(f"{what}: {self._cause(loss, runner, batch)}. Nothing was updated; "
                             "Trainer(..., nonfinite='skip') skips such steps instead")

    def _cause(self, loss: float | None, runner: _Runner, batch) -> str:
        """What was not finite in a step that was not kept."""
        if loss is None or math.isfinite(loss):
            cause = ("the update is not finite: " if loss is None else f"the loss is {loss:g} but ")
            cause += "a gradient (or the new value of a parameter) is NaN or Inf"
        else:
            cause = f"the loss is {loss}"
        feeds = runner.feeds(batch) if batch is not None else []
        bad = [f"'{name}'" for name, array in feeds
               if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all()]
        if bad:
            cause += f"; batch input {', '.join(bad)} holds NaN or Inf"
        return cause

    def evaluate(self, batch) -> dict[str, np.ndarray]:
        """The eval model on ``batch`` (inputs and labels): {"loss": ..., model outputs...}."""
        from onnxruntime import OrtValue

        runner = self._runner("eval")
        binding = runner.session.io_binding()
        alive = []
        for name, array in runner.feeds(batch):
            value = OrtValue.ortvalue_from_numpy(array, self.device, 0)
            alive.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for key, name in runner.reads:
            binding.bind_ortvalue_input(name, self._value(key))
        names = [runner.loss, *self.manifest.eval.outputs]
        for name in names:
            binding.bind_output(name, self.device)
        try:
            runner.session.run_with_iobinding(binding)
        except Exception as error:  # noqa: BLE001
            raise TrainingError(f"the eval model failed on onnxruntime: {str(error).strip().splitlines()[0]}") from error
        results = dict(zip(names, binding.copy_outputs_to_cpu()))
        results["loss"] = results.pop(runner.loss)
        return results

    def merge_cost(self, batch) -> dict[str, float]:
        """The eval loss of ``batch`` with the LoRA adapters as trained ("adapted") and with them
        merged into their bases as ``export()`` writes them ("merged"): what merging costs, the
        rounding of a float16 base or the quantizing again of a quantized one (a float base's is
        float rounding). The merged loss runs the eval model with the merged initializers and B = 0."""
        import onnxruntime as ort

        lora = self.manifest.lora
        if not lora:
            raise TrainingError("merge_cost needs LoRA adapters (the artifacts have none)")
        adapted = float(self.evaluate(batch)["loss"])
        merged = self._merged_bases(lora.weights)
        proto = onnx.ModelProto()
        proto.CopyFrom(self.artifacts.eval_model)
        for i, tensor in enumerate(proto.graph.initializer):
            if tensor.name not in merged:
                continue
            part = merged[tensor.name]
            if list(tensor.dims) == list(part.shape) and tensor.data_type == helper.np_dtype_to_tensor_dtype(part.dtype):
                proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(part, tensor.name))
            else:  # a MatMulNBits base the eval model reads through DequantizeLinear
                proto.graph.initializer[i].CopyFrom(as_read(tensor, part))
        options = self.session_options
        if any(name in self._frozen for name in merged):  # the shared weights would override the merged ones
            options = _session_options(self.artifacts, None)
            for name, (_, value) in self._frozen.items():
                if name not in merged:
                    options.add_initializer(name, value)
        session = ort.InferenceSession(proto.SerializeToString(), sess_options=options, providers=self.providers)
        runner = self._runner("eval")
        zeros = {a.B for a in lora.adapters}
        feeds = dict(runner.feeds(batch))
        for key, name in runner.reads:
            value = self._host(key)
            feeds[name] = np.zeros_like(value) if key in zeros else value
        loss = session.run([runner.loss], feeds)[0]
        return {"adapted": adapted, "merged": float(loss)}

    # state

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: self._host(name) for name in self.manifest.params}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, optimiser state and buffers as numpy arrays, with ``__step__``."""
        state = {key: self._host(key) for key in self.artifacts.checkpoint}
        state["__step__"] = np.array(self.step_count, np.int64)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Loads parameters, optimiser state and buffers; checks every value before changing any."""
        missing = sorted(set(self.artifacts.checkpoint) - set(state))
        if missing:
            raise TrainingError(f"the checkpoint lacks {missing}")
        arrays = {}
        for key, want in self.artifacts.checkpoint.items():
            array = np.asanyarray(state[key])  # a memory map stays one (owned_copy reads its file)
            if array.shape != want.shape:
                raise TrainingError(f"checkpoint value '{key}' has shape {array.shape}, not {want.shape}")
            arrays[key] = owned_copy(array, want.dtype)  # the one copy the trainer keeps
            if np.issubdtype(want.dtype, np.inexact) and not np.isfinite(arrays[key]).all():
                bad = arrays[key].size - int(np.count_nonzero(np.isfinite(arrays[key])))
                raise TrainingError(f"checkpoint value '{key}' holds {bad} NaN or Inf of its {arrays[key].size} values: "
                                    "refusing to load it (a diverged run or a damaged file); load an earlier checkpoint")
        for key, array in arrays.items():
            self._set(key, array, owned=True)
        self.step_count = int(state.get("__step__", 0))
        self._micro_batches = 0
        self._poisoned = False

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        write_atomically(os.fspath(path), arrays_writer(path, self.state_dict()))

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        self.load_state_dict(load_arrays(path))

    def export(self, path: str | os.PathLike | None = None, merge: bool = True,
               external_data: bool | None = None) -> onnx.ModelProto:
        """The inference (forward) model with the trained parameters and buffers as initializers,
        also written to ``path`` when given (never half-written).

        The file gets its tensors in ``path``.data beside it when ``external_data``, when the
        model is over protobuf's 2 GB or when the artifacts keep tensors in external files
        (``None``: those two); the proto returned then names that data file instead of holding
        the tensors. Without ``path`` the proto holds every tensor (up to 2 GB).

        With LoRA adapters, ``merge=True`` gives the input model's graph and initializer names with
        each adapted weight W replaced by W + scale·A·B; ``merge=False`` keeps the adapter nodes and
        ``<W>.lora_A``/``<W>.lora_B`` initializers (without dropout), W unchanged."""
        from onnx_autodiff.training.lora import unmerged

        proto = onnx.ModelProto()
        proto.CopyFrom(self.artifacts.inference_model)
        trained = {key: self._value(key).numpy() for key in [*self.manifest.params, *self.manifest.buffers]}
        lora = self.manifest.lora
        if lora and not merge:
            proto = unmerged(self._bases_lifted(proto), lora.config, lora.adapters)
        elif lora:
            trained.update(self._merged_bases(lora.weights))
        trained.update(self._copies(trained))
        return self._written(proto, trained, path, external_data)

    def _written(self, proto: onnx.ModelProto, trained: dict, path, external_data) -> onnx.ModelProto:
        """``proto`` with the ``trained`` values as its initializers (and in the Constant nodes the
        file stores weights in), written to ``path`` when given."""
        if self.manifest.constants:
            write_back(proto.graph, self.manifest.constants, trained)
        if external_data or uses_external_data(proto) or over_limit(sum(a.nbytes for a in trained.values())):
            return self._export_large(proto, trained, path, external_data)
        for i, tensor in enumerate(proto.graph.initializer):
            if tensor.name in trained:
                proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(trained[tensor.name], tensor.name))
        if path is not None:
            write_atomically(os.fspath(path), proto.SerializeToString(deterministic=True))
        return proto

    def _copies(self, trained: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors of the exported file that hold a copy of a trained parameter (a tied
        weight stored twice, as it is or transposed), set from it."""
        copies = {}
        for module in self.manifest.modules or ():
            value = trained.get(module.initializer)
            if value is not None:
                for name, transposed in module.copies:
                    copies[name] = np.ascontiguousarray(value.T) if transposed else value
        return copies

    def module_state_dict(self) -> dict[str, np.ndarray]:
        """The module's parameters by module name, in the module's layout (a folded ``weight.T``
        transposed back; a tied parameter under each of its names), as PyTorch's
        ``module.state_dict()`` keys them: for a model exported from PyTorch, so that a checkpoint
        can be compared with the module or loaded into it (``load_state_dict(..., strict=False)``
        after ``torch.from_numpy``). Trained parameters have their current values (LoRA's merged
        into their base), the others the model's. An empty dict for models not exported from PyTorch."""
        modules = self.manifest.modules
        if not modules:
            return {}
        values = self._trained_or_stored({module.initializer for module in modules})
        values.update(self._dequantized_bases({module.initializer: module for module in modules}))
        state = {}
        for module in modules:
            stored = values[module.initializer]
            value = np.ascontiguousarray(stored.T) if module.transposed else stored
            for name in [module.name, *module.aliases]:
                state[name] = value
        return state

    def _dequantized_bases(self, entries: Mapping[str, ModuleParameter]) -> dict[str, np.ndarray]:
        """The module parameters among ``entries`` (by initializer) that a quantized or float16
        base stores, as float32 arrays in the stored layout (module_state_dict transposes by the
        entry), their LoRA adapters merged in without quantizing again."""
        from onnx_autodiff.training.lora import merged_weights
        from onnx_autodiff.weights.quantized import frozen_bases, stored_weight

        lora = self.manifest.lora
        model = from_proto(self.artifacts.inference_model, self.artifacts.base_dir)
        bases = {name: node.op_type for name, node in frozen_bases(model.graph).items() if name in entries}
        adapters = [a for a in (lora.adapters if lora else ()) if a.weight in bases]
        values = {key: self._value(key).numpy() for a in adapters for key in (a.A, a.B)}
        merged = merged_weights(adapters, lora.scale, {}, values, model, quantize_again=False) if adapters else {}
        values = {}
        for name, base in bases.items():
            w = merged[name] if name in merged else stored_weight(model, name, base)
            if base == "MatMulNBits" and not entries[name].transposed:  # W [K, N] to the layout read as the module's
                w = w.T
            values[name] = np.ascontiguousarray(w.astype(np.float32))
        return values

    def load_module_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Sets the trained parameters from a module's ``state_dict()`` (arrays by module name, in
        the module's layout; extra keys are ignored). Checks every value before changing any."""
        arrays = {}
        for module in self.manifest.modules or ():
            key = module.initializer
            if key not in self.manifest.params:
                continue
            name = next((n for n in [module.name, *module.aliases] if n in state), None)
            if name is None:
                raise TrainingError(f"the state lacks the module parameter '{module.name}'")
            array = np.asarray(state[name])
            array = array.T if module.transposed else array
            want = self.artifacts.checkpoint[key]
            if array.shape != want.shape:
                raise TrainingError(f"module parameter '{name}' has shape {array.shape[::-1] if module.transposed else array.shape}, "
                                    f"not {tuple(module.shape)}")
            arrays[key] = owned_copy(array, want.dtype)
        if not arrays:
            raise TrainingError("the artifacts record no module parameters (the model was not exported from PyTorch)")
        for key, array in arrays.items():
            self._set(key, array, owned=True)

    # LoRA adapters in peft's and onnxruntime's formats (onnx_autodiff.training.adapters)

    def _adapter_values(self, what: str) -> dict[str, np.ndarray]:
        """The current A and B of every LoRA adapter, by name."""
        from onnx_autodiff.training.adapters import lora_record

        return {key: self._host(key) for key in lora_record(self.manifest, what).tensors}

    def save_peft_adapter(self, directory: str | os.PathLike, strip: str | None = None,
                          prefix: str = "base_model.model.", config: Mapping | None = None) -> dict:
        """Writes the LoRA adapters as a peft adapter directory (``adapter_model.safetensors``,
        ``adapter_config.json``), for ``peft.PeftModel.from_pretrained(base_model, directory)``;
        returns the config written. The keys are ``<prefix><module>.lora_A.weight`` [r, in] and
        ``...lora_B.weight`` [out, r], ``<module>`` the module name recovered from the export less
        ``.weight`` and less ``strip``: the prefix of the exported module's names that the model
        peft wraps lacks (None: the wrapper's attribute when every parameter lies under one, e.g.
        ``lm.`` of a module that calls ``self.lm``, a transformers model; "": the names as they are).
        ``config``: more or other ``adapter_config.json`` entries (task_type, base_model_name_or_path).
        Needs module names (a model exported from PyTorch) and adapters alone (no trained extras)."""
        from onnx_autodiff.training.adapters import peft_adapter, write_peft_adapter

        entries, arrays = peft_adapter(self.manifest, self._adapter_values("a peft adapter"), strip, prefix, config)
        write_peft_adapter(directory, entries, arrays)
        return entries

    def load_peft_adapter(self, directory: str | os.PathLike, strip: str | None = None,
                          prefix: str = "base_model.model.") -> None:
        """Sets the LoRA adapters from a peft adapter directory (one peft saved, or
        :meth:`save_peft_adapter`), names mapped as there; the rank, the scale (lora_alpha / r),
        every key and shape are checked before anything changes. The optimiser state and the step
        count stay as they are."""
        from onnx_autodiff.training.adapters import peft_values

        for key, array in peft_values(self.manifest, self.artifacts.checkpoint, directory, strip, prefix).items():
            self._set(key, array, owned=True)

    def save_onnx_adapter(self, path: str | os.PathLike, adapter_version: int = 1, model_version: int = 1) -> None:
        """Writes the LoRA adapters in onnxruntime's ``.onnx_adapter`` format (``onnxruntime.AdapterFormat``)
        for the model :meth:`export_adapter_model` writes: A, and B multiplied by alpha / r, under
        the model's input names (``<W>.lora_A``, ``<W>.lora_B``). Never half-written."""
        from onnx_autodiff.training.adapters import onnx_adapter_arrays, onnx_adapter_bytes

        arrays = onnx_adapter_arrays(self.manifest, self._adapter_values("an .onnx_adapter file"))
        write_atomically(os.fspath(path), onnx_adapter_bytes(arrays, adapter_version, model_version))

    def export_adapter_model(self, path: str | os.PathLike | None = None, external_data: bool | None = None) -> onnx.ModelProto:
        """The inference model with the LoRA adapters as graph inputs ``<W>.lora_A`` [in, lora_rank]
        and ``<W>.lora_B`` [lora_rank, out] for onnxruntime's multi-LoRA: one session runs the
        adapter that ``RunOptions.add_active_adapter`` names (files of :meth:`save_onnx_adapter`,
        of any rank and alpha: B carries the scale) or, with none active, the base model (the
        inputs' defaults are empty, rank 0). The other trained parameters are initializers as in
        :meth:`export`; ``path`` and ``external_data`` as there."""
        from onnx_autodiff.training.adapters import adapter_input_model

        proto = adapter_input_model(self._bases_lifted(self.artifacts.inference_model), self.manifest)
        adapters = set(self.manifest.lora.tensors)
        trained = {key: self._value(key).numpy() for key in [*self.manifest.params, *self.manifest.buffers]
                   if key not in adapters}
        trained.update(self._copies(trained))
        return self._written(proto, trained, path, external_data)

    def _bases_lifted(self, proto: onnx.ModelProto) -> onnx.ModelProto:
        """``proto`` with the LoRA base weights it stores as Constant nodes as initializers, where
        the adapters are added beside them."""
        if not self.manifest.constants:
            return proto
        return lifted_in(proto, self.manifest.constants, self.manifest.lora.weights)

    def _trained_or_stored(self, names) -> dict[str, np.ndarray]:
        """``names``' current values: trained ones from the trainer, LoRA bases merged with their
        adapters, the others as the model stores them."""
        values = {name: self._host(name) for name in names if name in self._values}
        merged = self._merged_bases(set(names))
        values.update(merged)
        values.update(self._stored(set(names) - set(values)))
        return values

    def _merged_bases(self, names: set[str]) -> dict[str, np.ndarray]:
        """The LoRA base weights among ``names`` with their adapters' current values merged in."""
        from onnx_autodiff.training.lora import QUANTIZED_BASES, merged_weights

        lora = self.manifest.lora
        adapters = [a for a in lora.adapters if a.weight in names] if lora else []
        if not adapters:
            return {}
        values = {key: self._value(key).numpy() for a in adapters for key in (a.A, a.B)}
        quantized = any(a.base in QUANTIZED_BASES for a in adapters)
        model = from_proto(self.artifacts.inference_model, self.artifacts.base_dir) if quantized else None
        return merged_weights(adapters, lora.scale, self._stored({a.weight for a in adapters}), values, model)

    def _stored(self, names: set[str]) -> dict[str, np.ndarray]:
        """Initializers of the inference model as it stores them (external ones mapped from their
        file), and the weights it stores as Constant nodes."""
        found = {t.name: tensor_array(t, self.artifacts.base_dir)
                 for t in self.artifacts.inference_model.graph.initializer if t.name in names}
        if self.manifest.constants and len(found) < len(names):
            found.update(read_back(self.artifacts.inference_model.graph, self.manifest.constants, set(names) - set(found)))
        return found

    def _export_large(self, proto: onnx.ModelProto, trained: dict, path, external_data) -> onnx.ModelProto:
        """export() through onnx-ir, which streams the tensors to the data file (no proto holds them)."""
        model = from_proto(proto, self.artifacts.base_dir)
        for name, array in trained.items():
            if name in model.graph.initializers:  # views of the trained values: nothing is copied
                model.graph.initializers[name].const_value = ir.Tensor(array, name=name)
        if path is None:
            return to_inline_proto(model)
        if external_data is None and uses_external_data(proto):  # as the artifacts keep it
            external_data = True
        written = save_model(model, path, external_data)
        return onnx.load(os.fspath(path), load_external_data=not written)
