"""LoRA: low-rank adapters on the weights of MatMul and Gemm, with peft's semantics.

A *target* is a 2-D float initializer ``W`` (not a graph input) that is read only as the weight
operand (input B) of MatMul or Gemm, directly or through a 2-D Transpose, all its reads in one
orientation. Such a weight gets one adapter however often it is read (tied weights share it):
``<W>.lora_A`` [in, r] (kaiming-uniform with a = √5, i.e. U(±1/√in), as ``peft``) and
``<W>.lora_B`` [r, out] (zeros), in the orientation ``X @ W_eff`` with ``W_eff`` [in, out] the
matrix the node multiplies by (``Wᵀ`` for ``Gemm(transB=1)`` and for ``MatMul(X, Transpose(W))``,
as ``torch.onnx.export`` writes ``nn.Linear``). Every read of ``W`` then computes
``X @ W_eff + scale · (dropout(X) @ A) @ B`` with ``scale = alpha / r``; B = 0 makes the model
equal to the base model until B is trained, and the merged weight
``W_eff + scale · A @ B`` (see :func:`merged_weights`) gives the same function with the original
graph. A weight with any other read (a Gather, an Add, a read inside a subgraph) is no target:
merging it would change those reads too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnx_autodiff.errors import TrainingError, UnknownValueError, UnsupportedModelError, names_summary
from onnx_autodiff.modelfile import from_proto, to_proto
from onnx_autodiff.passes.opsets import default_opset
from onnx_autodiff.passes.metadata import module_names, record_kept
from onnx_autodiff.weights.quantized import (FORMATS, INT4_OPSET, Quantization, QuantizedBase,
                                           nbits_read_as_dequantizelinear, requantized, stored_weight)
from onnx_autodiff.toolkit import FLOAT_TYPES, Namer, OpBuilder, shapes
from onnx_autodiff.toolkit.inference import infer_shapes
from onnx_autodiff.training.values import fresh_initializer

NORMS = frozenset({"LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
                   "RMSNormalization"})
QUANTIZED_BASES = frozenset({"MatMulNBits", "DequantizeLinear"})
_PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What to adapt and how.

    rank: r, the adapters' inner size. alpha: the scale numerator (default: ``rank``, so
    scale = alpha / r = 1, as peft's defaults r = 8, lora_alpha = 8). targets: shell-style
    patterns (:func:`fnmatch.fnmatchcase`, case-sensitive) matched against the whole initializer
    name or, in a model whose parameters were recovered (:mod:`onnx_autodiff.weights.recovery`), the
    module parameter's name, e.g. ``"*q_proj*"``; None: every target weight. dropout: the probability of peft's
    ``lora_dropout`` on the adapters' input (train model only). seed: the seed of A's initial
    values. train_biases: also train every bias (peft ``bias="all"``: a Gemm's C, a Conv's B, a
    1-D initializer added to a MatMul/Gemm/Conv result); train_norms: also train the scale and
    bias of normalization nodes (LayerNormalization, BatchNormalization, InstanceNormalization,
    GroupNormalization, RMSNormalization).

    quantize_base: store the frozen base weights of the products quantized (QLoRA: "int4",
    "int8", "float16"). quantize_format: how the train models read quantized bases, the ones
    stored so and a model's own MatMulNBits alike: "dequantizelinear" (when None) in standard
    operators (:func:`~onnx_autodiff.weights.quantized.nbits_read_as_dequantizelinear` for a
    model's own), holding each weight once where onnxruntime's kernel holds a pre-packed copy
    beside it, for a dequantization at each read; or "matmulnbits", the kernel. The inference
    model keeps a model's own MatMulNBits either way.
    """

    rank: int
    alpha: float | None = None
    targets: Sequence[str] | None = None
    dropout: float = 0.0
    seed: int = 0
    train_biases: bool = False
    train_norms: bool = False
    quantize_base: str | None = None
    quantize_format: str | None = None
    quantize_block: int = 32
    quantize_symmetric: bool = True

    def __post_init__(self) -> None:
        if self.quantize_base is not None:
            self.quantization  # noqa: B018 - checks the options
        elif self.quantize_format is not None and self.quantize_format not in FORMATS:
            raise TrainingError(f"quantize_format must be one of {', '.join(FORMATS)}, not {self.quantize_format!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise TrainingError(f"LoRA rank must be a positive integer, not {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise TrainingError(f"LoRA alpha must be > 0, not {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise TrainingError(f"LoRA dropout must be in [0, 1), not {self.dropout!r}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        elif self.targets is not None:
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def quantization(self) -> Quantization | None:
        """How the frozen base weights are stored (None: as the model stores them)."""
        if self.quantize_base is None:
            return None
        return Quantization(self.quantize_base, self.quantize_format or "dequantizelinear", self.quantize_block,
                            self.quantize_symmetric)

    @property
    def reads_nbits_as_dequantizelinear(self) -> bool:
        """Whether the train models read the model's MatMulNBits weights through DequantizeLinear."""
        return self.quantize_format != "matmulnbits"

    @property
    def scale(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha) / self.rank

    def to_json(self) -> dict:
        return {"rank": int(self.rank), "alpha": self.alpha, "targets": None if self.targets is None else list(self.targets),
                "dropout": self.dropout, "seed": self.seed, "train_biases": self.train_biases,
                "train_norms": self.train_norms, "quantize_base": self.quantize_base,
                "quantize_format": self.quantize_format, "quantize_block": self.quantize_block,
                "quantize_symmetric": self.quantize_symmetric}


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One target's adapter: ``transposed`` when the nodes multiply by Wᵀ (A is then [W.shape[1], r]);
    ``base`` the form the weight is stored in: "float", "Cast" (float16/bfloat16 read through
    Cast), "DequantizeLinear" or "MatMulNBits" (a frozen quantized base)."""

    weight: str
    A: str
    B: str
    transposed: bool
    base: str = "float"


@dataclasses.dataclass
class _Site:
    """Where a target weight is multiplied: the nodes, their orientation, the [rows, cols] of the
    matrix they multiply by (before ``transposed``), its float dtype and the stored form."""

    nodes: list
    transposed: bool
    rows: int
    cols: int
    dtype: ir.DataType
    base: str = "float"


class LoraPass(ir.passes.InPlacePass):
    """Adds a LoRA adapter (A random, B zeros) to every target weight that ``config.targets`` selects."""

    def __init__(self, config: LoraConfig, trained: Sequence[str] = (), merged: bool = False) -> None:
        super().__init__()
        self.config = config
        self.merged = merged  # W + scale·A·B read in W's place (what quantization-aware training quantizes)
        self.trained = tuple(trained)  # other initializers that are trained: never quantized
        self.adapters: list[Adapter] = []
        self.extra: list[str] = []  # the biases and norm parameters the config also trains
        self.quantized: list[str] = []  # the weights that config.quantize_base stored anew
        self.nbits_kept: dict[str, str] = {}  # MatMulNBits nodes left as they are, and why

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        config, graph = self.config, model.graph
        sites, skipped = _targets(graph)
        chosen = _select(config.targets, sites, skipped)
        if config.quantization is not None:
            chosen_names = [w.name for w in chosen]
            self.quantized = _quantized(model, config.quantization, [(w, site) for w, site in sites.items()
                                                                     if site.base == "float" and w.name not in self.trained])
            sites, skipped = _targets(graph)
            chosen = [w for w in sites if w.name in chosen_names]
        opset = default_opset(model) or 1
        if config.dropout and opset < 12:
            raise UnsupportedModelError(f"LoRA dropout needs opset >= 12 (Dropout's training mode); the model imports "
                                        f"opset {opset}: convert it (onnx.version_converter.convert_version) or use dropout 0")
        self.extra = _extra_trainable(graph, config)
        namer = Namer.for_graph(graph, prefix="lora")
        op = OpBuilder(opset, namer, dict(model.opset_imports))
        rng = np.random.default_rng(config.seed)
        self.adapters = []
        for weight in chosen:
            site = sites[weight]
            nodes, transposed = site.nodes, site.transposed
            rows, cols = (site.rows, site.cols) if not transposed else (site.cols, site.rows)
            dtype = site.dtype.numpy()
            bound = 1.0 / np.sqrt(rows)
            stem = (module_names(weight) or [weight.name])[0]  # a folded val_29 is q_proj.weight
            a = fresh_initializer(graph, namer, rng.uniform(-bound, bound, (config.rank, rows)).T.astype(dtype),
                                  f"{stem}.lora_A")
            b = fresh_initializer(graph, namer, np.zeros((config.rank, cols), dtype), f"{stem}.lora_B")
            self.adapters.append(Adapter(weight.name, a.name, b.name, transposed, site.base))
            if site.base != "float":  # a merge replaces the stored form's tensors: they stay tensors
                first = site.nodes[0] if site.base == "MatMulNBits" else weight.uses()[0][0]
                parts = first.inputs[1:4] if site.base == "MatMulNBits" else first.inputs
                record_kept(model, [v.name for v in parts if v is not None and v.is_initializer()])
            if self.merged:
                self._merge(graph, op, namer, weight, site, a, b, stem)
                continue
            for node in nodes:
                self._adapt(graph, op, namer, node, a, b, dtype)
        if config.reads_nbits_as_dequantizelinear:  # after the adapters: they record the model's own form
            stored, self.nbits_kept = nbits_read_as_dequantizelinear(graph)
            if not stored and not self.nbits_kept and config.quantization is None and config.quantize_format == "dequantizelinear":
                raise TrainingError("quantize_format 'dequantizelinear' without quantize_base reads a model's "
                                    "MatMulNBits weights through DequantizeLinear; this model has none")
            record_kept(model, stored)
        return ir.passes.PassResult(model, modified=bool(self.adapters))

    def _merge(self, graph: ir.Graph, op: OpBuilder, namer: Namer, weight: ir.Value, site: _Site, a: ir.Value,
               b: ir.Value, stem: str) -> None:
        """The nodes of ``site`` read W + scale · A·B (its transpose where they multiply by Wᵀ) in W's place."""
        if site.base != "float":
            raise TrainingError(f"LoRA merged into its base '{weight.name}' (quantization-aware training) needs a float "
                                f"base, not one read through {site.base}")
        if self.config.dropout:
            raise TrainingError("LoRA dropout cannot be merged into the base weights (quantization-aware training "
                                "quantizes the merged weight): use dropout 0")
        start = len(op.nodes)
        delta = op.MatMul(a, b)
        if self.config.scale != 1.0:
            delta = op.Mul(delta, op.const(np.array(self.config.scale, site.dtype.numpy())))
        if site.transposed:
            delta = op.Transpose(delta, perm=[1, 0])
        total = op.Add(weight, delta)
        total.name, total.type, total.shape = namer.fresh(f"{stem}.merged"), weight.type, weight.shape
        position = {node: i for i, node in enumerate(graph)}
        graph.insert_before(min(site.nodes, key=position.__getitem__), op.nodes[start:])
        for node in site.nodes:
            for index, value in enumerate(node.inputs):
                if value is weight:
                    node.replace_input_with(index, total)

    def _adapt(self, graph: ir.Graph, op: OpBuilder, namer: Namer, node: ir.Node, a: ir.Value, b: ir.Value, dtype) -> None:
        """``node``'s output plus scale · (dropout(X) @ A) @ B, under the output's name."""
        start = len(op.nodes)
        x = node.inputs[0]
        scale = self.config.scale
        if node.op_type == "Gemm":
            if shapes.attr(node, "transA", 0):
                x = op.Transpose(x, perm=[1, 0])
            scale *= shapes.attr(node, "alpha", 1.0)
        if self.config.dropout:
            x = op.Dropout(x, op.const(np.array(self.config.dropout, np.float32)))
        delta = op.MatMul(op.MatMul(x, a), b)
        if scale != 1.0:
            delta = op.Mul(delta, op.const(np.array(scale, dtype)))
        y = node.outputs[0]
        total = op.Add(y, delta)
        users = [(user, index) for user, index in y.uses() if user is not op.nodes[-1]]
        name = y.name
        y.name = namer.fresh(f"{name}.base")
        total.name, total.type, total.shape = name, y.type, y.shape
        for user, index in users:
            user.replace_input_with(index, total)
        for i, output in enumerate(graph.outputs):
            if output is y:
                graph.outputs[i] = total
        graph.insert_after(node, op.nodes[start:])


def _weight_reads(value: ir.Value, graph: ir.Graph) -> list[tuple[ir.Node, bool]] | str:
    """The MatMul/Gemm nodes that multiply by ``value`` and whether each multiplies by its
    transpose, or why ``value`` is read otherwise."""
    reads = []
    for user, index in value.uses():
        if user.graph is not graph:
            return f"read inside a subgraph ({user.op_type})"
        kind = user.op_type if user.domain in ("", "ai.onnx") else f"{user.domain}.{user.op_type}"
        if kind == "MatMul" and index == 1:
            reads.append((user, False))
        elif kind == "Gemm" and index == 1:
            reads.append((user, bool(shapes.attr(user, "transB", 0))))
        elif kind == "Transpose" and value.shape is not None and len(value.shape) == 2 and not user.outputs[0].is_graph_output():
            inner = _weight_reads(user.outputs[0], graph)
            if isinstance(inner, str):
                return inner
            flips = shapes.attr(user, "perm", [1, 0]) != [0, 1]
            reads.extend((node, transposed != flips) for node, transposed in inner)
        else:
            return f"read by {kind} (input {index})"
    return reads


def _targets(graph: ir.Graph) -> tuple[dict[ir.Value, tuple[list[ir.Node], bool]], dict[str, str]]:
    """The target weights with their nodes and orientation, and why each other 2-D float
    initializer is none."""
    inputs = set(graph.inputs)
    sites, skipped = {}, {}
    for value in graph.initializers.values():
        if value.dtype not in FLOAT_TYPES or value.shape is None or len(value.shape) != 2 or value.const_value is None:
            continue
        reads = "a graph input (a default, not a constant)" if value in inputs else (
            "a graph output" if value.is_graph_output() else _weight_reads(value, graph))
        if isinstance(reads, list) and not reads:
            reads = "read by no node"
        if isinstance(reads, list) and len({transposed for _, transposed in reads}) > 1:
            reads = "multiplied both as it is and transposed"
        if isinstance(reads, str):
            skipped[value.name] = reads
        else:
            rows, cols = value.shape.dims
            sites[value] = _Site([node for node, _ in reads], reads[0][1], rows, cols, value.dtype)
    for node in graph:
        site = _frozen_base(node, graph, inputs)
        if isinstance(site, tuple):
            stored, site = site
            if stored in sites and site.base == "MatMulNBits":  # one packed weight, several kernels
                sites[stored].nodes.extend(site.nodes)
            sites.setdefault(stored, site)
        elif site is not None:
            skipped[node.inputs[1 if node.op_type == "MatMulNBits" else 0].name] = site
    return sites, skipped


def _frozen_base(node: ir.Node, graph: ir.Graph, inputs) -> tuple[ir.Value, _Site] | str | None:
    """A weight stored in a shipped form, as (stored initializer, site): the packed weight of a
    MatMulNBits, or a weight read through DequantizeLinear or through a Cast from float16 or
    bfloat16; why it is no target; None for any other node."""
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        packed = node.inputs[1]
        if packed is None or not packed.is_initializer() or packed in inputs:
            return None
        if len(node.inputs) > 4 and node.inputs[4] is not None:
            return "a MatMulNBits weight with g_idx (act-order)"
        K, N = shapes.attr(node, "K", None), shapes.attr(node, "N", None)
        return packed, _Site([node], False, K, N, node.inputs[2].dtype, "MatMulNBits")
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("DequantizeLinear", "Cast"):
        return None
    stored, weight = node.inputs[0], node.outputs[0]
    if node.op_type == "Cast":
        dtype = ir.DataType(shapes.attr(node, "to", 0))
    else:
        dtype = ir.DataType(shapes.attr(node, "output_dtype", 0)) or (node.inputs[1].dtype if len(node.inputs) > 1 else None)
    if stored is None or not stored.is_initializer() or stored in inputs or stored.const_value is None \
            or len(stored.const_value.shape) != 2 or dtype not in FLOAT_TYPES:
        return None
    if node.op_type == "Cast" and stored.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return None
    if any(user.op_type not in ("MatMul", "Gemm", "Transpose") for user, _ in weight.uses()):
        return None  # a dequantized value read otherwise: not a weight
    reads = _weight_reads(weight, graph)
    if isinstance(reads, list) and len({transposed for _, transposed in reads}) > 1:
        reads = "multiplied both as it is and transposed"
    if isinstance(reads, str) or not reads:
        return reads or None
    rows, cols = (int(d) for d in stored.const_value.shape)
    return stored, _Site([n for n, _ in reads], reads[0][1], rows, cols, dtype, node.op_type)


def quantize_bases(model: ir.Model, spec: Quantization, weights: Sequence[ir.Value | str]) -> list[str]:
    """Stores each of ``weights`` (float LoRA targets of ``model``, or their names) in the form
    ``spec`` gives (QLoRA: a frozen quantized base), in place; returns their names."""
    sites, _ = _targets(model.graph)
    by_name = {w.name: (w, site) for w, site in sites.items() if site.base == "float"}
    names = [w if isinstance(w, str) else w.name for w in weights]
    missing = [n for n in names if n not in by_name]
    if missing:
        raise TrainingError(f"cannot quantize {names_summary(missing)}: no float weight of a MatMul or Gemm")
    return _quantized(model, spec, [by_name[name] for name in names])


def _quantized(model: ir.Model, spec: Quantization, sites: Sequence[tuple[ir.Value, _Site]]) -> list[str]:
    """Stores each (weight, site) as ``spec`` gives; returns the weights' names."""
    if spec.kind == "int4" and spec.format == "dequantizelinear" and (default_opset(model) or 1) < INT4_OPSET:
        raise UnsupportedModelError(f"an int4 base read through DequantizeLinear needs opset {INT4_OPSET}; the model "
                                    f"imports opset {default_opset(model)}: convert it (generate_artifacts does with "
                                    "upgrade_opset) or use quantize_format 'matmulnbits'")
    graph = model.graph
    store = QuantizedBase(graph, Namer.for_graph(graph, prefix="quantized"), spec, model.opset_imports)
    names = []
    for weight, site in sites:
        names.append(weight.name)  # before store() renames the float value
        store.store(weight, site.nodes, site.transposed)
    return names


def _select(patterns: Sequence[str] | None, sites, skipped: Mapping[str, str]) -> list[ir.Value]:
    if patterns is None:
        if not sites:
            raise UnknownValueError(_no_target("the model has no weight for LoRA", skipped))
        return list(sites)
    chosen = []
    for pattern in patterns:
        found = [w for w in sites if any(fnmatch.fnmatchcase(n, pattern) for n in [w.name, *module_names(w)])]
        if not found:
            near = {n: why for n, why in skipped.items() if fnmatch.fnmatchcase(n, pattern)}
            raise UnknownValueError(_no_target(f"LoRA target pattern '{pattern}' matches no weight of a MatMul or Gemm",
                                               near or skipped, names=[w.name for w in sites]))
        chosen.extend(w for w in found if w not in chosen)
    return [w for w in sites if w in chosen]  # the model's order, whatever the patterns' order


def _no_target(what: str, skipped: Mapping[str, str], names: Sequence[str] | None = None) -> str:
    message = what
    if names:
        message += f"; the weights are {names_summary(names)}"
    if skipped:
        reasons = [f"'{n}' is {why}" for n, why in skipped.items()]
        message += "; not adaptable: " + "; ".join(reasons[:6]) + ("; ..." if len(reasons) > 6 else "")
    if names is not None:
        message += ("; the patterns are shell-style (fnmatch) on the whole initializer name or, in a model exported "
                "from PyTorch, module parameter name, e.g. '*q_proj*'")
    return message


def _extra_trainable(graph: ir.Graph, config: LoraConfig) -> list[str]:
    """The biases and normalization parameters that ``config`` asks to train, in graph order."""
    initializers = {v for v in graph.initializers.values() if v.dtype in FLOAT_TYPES}
    found: list[str] = []

    def add(value):
        if value in initializers and value.name not in found:
            found.append(value.name)

    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if config.train_biases:
            if node.op_type in ("Gemm", "Conv", "ConvTranspose") and len(node.inputs) > 2:
                add(node.inputs[2])
            elif node.op_type == "Add" and len(node.inputs) == 2:
                first, second = node.inputs
                for value, other in ((first, second), (second, first)):
                    producer = other.producer() if other is not None else None
                    if (value is not None and value.shape is not None and len(value.shape) == 1 and producer is not None
                            and producer.op_type in _PRODUCTS and producer.domain in ("", "ai.onnx")):
                        add(value)
        if config.train_norms and node.op_type in NORMS:
            for value in node.inputs[1:3]:
                add(value)
    return found


def merged_weights(adapters: Sequence[Adapter | Mapping], scale: float, weights: Mapping[str, np.ndarray],
                   values: Mapping[str, np.ndarray], model: ir.Model | None = None,
                   quantize_again: bool = True) -> dict[str, np.ndarray]:
    """``W + scale · A @ B`` (transposed back for a transposed adapter) for every adapter, from
    the base ``weights`` and the adapter ``values`` by name; each in its weight's dtype (a float16
    base read through Cast stays float16). A quantized base is dequantized from ``model`` (the
    forward model), merged and quantized again in its own scheme: its data, scales and zero
    points are all in the result. ``quantize_again=False``: for every base in a stored form (a
    float16 one too), the merged float64 weight alone, laid out as
    :func:`~onnx_autodiff.weights.quantized.stored_weight` gives it."""
    merged = {}
    for adapter in adapters:
        adapter = adapter if isinstance(adapter, Adapter) else Adapter(**adapter)
        delta = scale * (values[adapter.A].astype(np.float64) @ values[adapter.B].astype(np.float64))
        delta = delta.T if adapter.transposed else delta
        if adapter.base in QUANTIZED_BASES or (adapter.base != "float" and not quantize_again):
            if model is None:
                raise TrainingError(f"merging into the {adapter.base} base of '{adapter.weight}' needs the model")
            w = stored_weight(model, adapter.weight, adapter.base) + delta
            merged.update(requantized(model, adapter.weight, adapter.base, w) if quantize_again else {adapter.weight: w})
            continue
        w = np.asarray(weights[adapter.weight])
        merged[adapter.weight] = (w.astype(np.float64) + delta).astype(w.dtype)
    return merged


def adapt(model: ir.Model, config: LoraConfig, trained: Sequence[str] = (), merged: bool = False) -> LoraPass:
    """Adds the adapters of ``config`` to ``model`` (in place) and returns the pass (its adapters
    and extras); ``trained``: other initializers to be trained, which a ``quantize_base`` leaves as
    they are; ``merged``: the adapters merged into the weights they adapt (see :class:`LoraPass`)."""
    if not isinstance(config, LoraConfig):
        raise TrainingError(f"lora must be an onnx_autodiff.training.lora.LoraConfig, not a {type(config).__name__}")
    if config.quantization is not None and config.quantization.format == "matmulnbits":
        # onnx's inference stops at MatMulNBits (no schema): the shapes after the products it
        # replaces are found while they are still MatMuls
        infer_shapes(model)
    lora = LoraPass(config, trained, merged)
    lora(model)
    return lora


def unmerged(proto: onnx.ModelProto, config: LoraConfig, recorded: Sequence[Adapter]) -> onnx.ModelProto:
    """``proto`` (the forward model) with the ``recorded`` adapters, added as ``config`` (the
    artifacts' record) adds them, without dropout; their values are the initial ones until the
    caller replaces them."""
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    config = LoraConfig(rank=config.rank, alpha=config.alpha, seed=config.seed,  # the kernels kept
                        targets=[glob.escape(a.weight) for a in recorded], quantize_format="matmulnbits")
    model = from_proto(proto)
    lora = adapt(model, config)
    if lora.adapters != list(recorded):
        raise TrainingError("the inference model's adapters differ from those the artifacts recorded (a bug, please report)")
    return to_proto(model)
