"""LoRA adapters in the ecosystem's formats: a peft adapter directory and onnxruntime's ``.onnx_adapter``.

peft (``PeftModel.from_pretrained(base, directory)``) reads ``adapter_config.json`` and
``adapter_model.safetensors``, whose keys are ``<prefix><module>.lora_A.weight`` [r, in] and
``<prefix><module>.lora_B.weight`` [out, r] (``prefix`` "base_model.model.", the module named as
in the base model peft wraps). Ours are ``A`` [in, r] and ``B`` [r, out] in the orientation
``X @ W_eff``, the module's product: peft's are their transposes, whether the file stores the
weight as the module does or transposed. The module names are the ones parameter recovery found
in the export (the manifest's ``modules``); :func:`peft_modules` maps them onto the peft model's.

onnxruntime's multi-LoRA feeds an adapter's tensors, by name, to graph inputs of the model
(``RunOptions.add_active_adapter``). :func:`adapter_input_model` makes the adapters such inputs,
with empty (rank 0) defaults so that the model without an active adapter is the base model, and a
symbolic rank; the scale alpha/r is left to the adapter file (:func:`onnx_adapter_arrays` writes
``scale · B``), so one model runs adapters of any rank and alpha.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_autodiff.errors import TrainingError, names_summary
from onnx_autodiff.training.lora import Adapter
from onnx_autodiff.training.manifest import LoraRecord, Manifest

PEFT_PREFIX = "base_model.model."
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
RANK_DIM = "lora_rank"  # the symbolic rank of the adapter inputs
_WEIGHT = ".weight"


def lora_record(manifest: Manifest, what: str) -> LoraRecord:
    """The artifacts' LoRA record, or a TrainingError saying that ``what`` needs adapters."""
    lora = manifest.lora
    if not lora or not lora.adapters:
        raise TrainingError(f"{what} needs LoRA adapters: generate the artifacts with lora=LoraConfig(rank=...) "
                            "(on the command line --lora RANK)")
    return lora


def default_strip(manifest: Manifest) -> str:
    """The wrapper's attribute that every module parameter lies under (``lm.`` of a module whose
    forward calls ``self.lm``, a transformers model), when removing it leaves names of submodules'
    parameters; else "" (the names as they are)."""
    names = [n for module in manifest.modules or () for n in (module.name, *module.aliases)]
    firsts = {n.split(".", 1)[0] for n in names}
    if len(firsts) != 1 or not all(n.count(".") >= 2 for n in names):
        return ""
    return f"{firsts.pop()}."


def peft_modules(manifest: Manifest, strip: str | None = None) -> list[tuple[Adapter, str, bool]]:
    """Each adapter of ``manifest`` with the name of its module in the model peft wraps (the module
    parameter's name less ``.weight`` and less ``strip``; None: :func:`default_strip`) and whether
    the module multiplies by its weight as it is (GPT-2's Conv1D: peft's ``fan_in_fan_out``)
    rather than transposed (``nn.Linear``)."""
    lora = lora_record(manifest, "a peft adapter")
    strip = default_strip(manifest) if strip is None else strip
    by_initializer = {module.initializer: module for module in manifest.modules or ()}
    unnamed = [a.weight for a in lora.adapters if a.weight not in by_initializer]
    if unnamed:
        raise TrainingError(f"the LoRA adapters of {names_summary(unnamed)} have no module name: a peft adapter names "
                            "each module, and only a model exported from PyTorch records them (parameter recovery "
                            "found none for these weights); save_onnx_adapter() writes adapters by tensor name")
    found = []
    for adapter in lora.adapters:
        parameter = by_initializer[adapter.weight]
        name = parameter.name
        if not name.endswith(_WEIGHT):
            raise TrainingError(f"the LoRA adapter of '{adapter.weight}' adapts the module parameter '{name}', which is "
                                "no module's 'weight': peft adapts a module's weight")
        module = name[: -len(_WEIGHT)]
        if not module.startswith(strip) or len(module) == len(strip):
            raise TrainingError(f"the module name '{module}' does not start with strip='{strip}': give the prefix of "
                                "the exported module's names that the model peft wraps lacks ('' keeps them as they are)")
        found.append((adapter, module[len(strip):], parameter.transposed == adapter.transposed))
    return found


def _peft_key(prefix: str, module: str, part: str) -> str:
    return f"{prefix}{module}.lora_{part}.weight"


def _target_modules(manifest: Manifest, strip: str, modules: Sequence[str]) -> list[str]:
    """peft's ``target_modules``: the leaf names (``q_proj``) when they select exactly ``modules``
    among the exported module's weights, else the full module names."""
    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
    weights = {p.name[len(strip): -len(_WEIGHT)] for p in manifest.modules or ()
               if p.name.startswith(strip) and p.name.endswith(_WEIGHT)}
    selected = {w for w in weights if any(w == leaf or w.endswith(f".{leaf}") for leaf in leaves)}
    return leaves if selected == set(modules) else sorted(modules)


def _alpha_text(alpha: float) -> int | float:
    return int(alpha) if float(alpha).is_integer() else float(alpha)


def checked_for_peft(manifest: Manifest, strip: str | None = None) -> list[tuple[Adapter, str, bool]]:
    """:func:`peft_modules`, after checking that the artifacts train the adapters alone (a peft
    LoRA adapter of bias "none" holds nothing else)."""
    found = peft_modules(manifest, strip)
    adapters = set(manifest.lora.tensors)
    extra = [p for p in manifest.params if p not in adapters]
    if extra:
        raise TrainingError(f"the artifacts also train {names_summary(extra)} (train_biases, train_norms or requires_grad), "
                            "which a peft LoRA adapter does not hold: its model would differ from the trained one; "
                            "trainer.module_state_dict() has their values")
    return found


def peft_adapter(manifest: Manifest, values: Mapping[str, np.ndarray], strip: str | None = None,
                 prefix: str = PEFT_PREFIX, config: Mapping | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """The ``adapter_config.json`` entries and the ``adapter_model.safetensors`` arrays of the
    adapters' ``values`` (by our names); ``config`` adds or replaces entries (task_type,
    base_model_name_or_path, ...)."""
    found = checked_for_peft(manifest, strip)
    strip = default_strip(manifest) if strip is None else strip
    lora_config = manifest.lora.config
    arrays = {}
    for adapter, module, _ in found:
        arrays[_peft_key(prefix, module, "A")] = np.ascontiguousarray(values[adapter.A].T)
        arrays[_peft_key(prefix, module, "B")] = np.ascontiguousarray(values[adapter.B].T)
    modules = [module for _, module, _ in found]
    rank = int(lora_config.rank)
    entries = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": _alpha_text(rank if lora_config.alpha is None else lora_config.alpha),
        "lora_dropout": float(lora_config.dropout),
        "target_modules": _target_modules(manifest, strip, modules),
        "bias": "none",
        "fan_in_fan_out": all(as_is for _, _, as_is in found),
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    entries.update(config or {})
    return entries, arrays


def read_peft_adapter(directory: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """The config and the arrays of a peft adapter directory."""
    from onnx_autodiff.training.values import load_safetensors

    directory = os.fspath(directory)
    config_path, weights_path = os.path.join(directory, PEFT_CONFIG), os.path.join(directory, PEFT_WEIGHTS)
    if not os.path.isdir(directory):
        raise TrainingError(f"no such peft adapter directory: {directory}")
    if not os.path.isfile(config_path):
        raise TrainingError(f"{directory} holds no {PEFT_CONFIG}: not a peft adapter directory")
    if not os.path.isfile(weights_path):
        bin_file = os.path.isfile(os.path.join(directory, "adapter_model.bin"))
        raise TrainingError(f"{directory} holds no {PEFT_WEIGHTS}" + (
            " (adapter_model.bin, a pickle, is not read: save it with save_pretrained(..., safe_serialization=True))"
            if bin_file else ""))
    try:
        with open(config_path, encoding="utf-8") as stream:
            config = json.load(stream)
    except (OSError, ValueError) as error:
        raise TrainingError(f"cannot read {config_path}: {error}") from error
    if not isinstance(config, dict):
        raise TrainingError(f"{config_path} is not a JSON object")
    try:
        arrays = load_safetensors(weights_path)
    except (OSError, ValueError) as error:
        raise TrainingError(f"cannot read {weights_path}: {error}") from error
    return config, arrays


# peft options whose adapters compute something else than X @ W + scale · X @ A @ B on the weights
_UNSUPPORTED = {"use_dora": "DoRA (use_dora)", "lora_bias": "a bias on lora_B (lora_bias)",
                "use_qalora": "QALoRA (use_qalora)", "layer_replication": "layer_replication",
                "trainable_token_indices": "trainable tokens (trainable_token_indices)",
                "target_parameters": "target_parameters", "alpha_pattern": "per-module alpha (alpha_pattern)",
                "modules_to_save": "modules_to_save", "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)"}


def peft_values(manifest: Manifest, checkpoint: Mapping[str, np.ndarray], directory: str | os.PathLike,
                strip: str | None = None, prefix: str = PEFT_PREFIX) -> dict[str, np.ndarray]:
    """Our adapters' values (by our names, in the checkpoint's dtypes) from the peft adapter in
    ``directory``, every key, shape, the rank and the scale checked first."""
    lora = lora_record(manifest, "loading a peft adapter")
    found = peft_modules(manifest, strip)
    config, arrays = read_peft_adapter(directory)
    where = os.fspath(directory)
    if config.get("peft_type") != "LORA":
        raise TrainingError(f"{where} holds a {config.get('peft_type')} adapter, not LoRA (peft_type LORA)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise TrainingError(f"{where} uses {what}, which these LoRA artifacts do not compute")
    if config.get("bias", "none") != "none":
        raise TrainingError(f"{where} trains biases too (bias={config['bias']!r}); these LoRA artifacts hold adapters alone")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise TrainingError(f"{where}: {PEFT_CONFIG} has r={r!r} and lora_alpha={alpha!r}, not a positive rank and alpha")
    rank, scale = int(lora.config.rank), float(lora.scale)
    if r != rank and not config.get("rank_pattern"):
        raise TrainingError(f"{where} has rank r={r}; the artifacts' adapters have rank {rank}: generate them with "
                            f"LoraConfig(rank={r}, alpha={_alpha_text(alpha)})")
    values, claimed = {}, set()
    for adapter, module, _ in found:
        for part, ours in (("A", adapter.A), ("B", adapter.B)):
            key = _peft_key(prefix, module, part)
            if key not in arrays:
                held = sorted(k for k in arrays if k.endswith(f".lora_{part}.weight"))
                raise TrainingError(f"{where} lacks '{key}' (the adapter of module parameter {module}.weight): it holds "
                                    f"{names_summary(held, 3) or 'no lora_' + part + ' weights'}; strip= and prefix= "
                                    f"map the exported module's names onto the peft model's (strip is "
                                    f"'{default_strip(manifest) if strip is None else strip}', prefix '{prefix}')")
            array = np.asarray(arrays[key]).T
            want = checkpoint[ours]
            if array.shape != want.shape:
                raise TrainingError(f"'{key}' has shape {array.T.shape}; the artifacts' adapter {ours} needs "
                                    f"{want.T.shape} (peft's [r, in] and [out, r]; rank {rank})")
            value = np.array(array, dtype=want.dtype)
            if not np.isfinite(value).all():
                raise TrainingError(f"'{key}' holds NaN or Inf: refusing to load it")
            values[ours] = value
            claimed.add(key)
        rank_here = values[adapter.A].shape[1]
        here = alpha / (math.sqrt(rank_here) if config.get("use_rslora") else rank_here)
        if not math.isclose(here, scale, rel_tol=1e-6):
            form = "lora_alpha/sqrt(r)" if config.get("use_rslora") else "lora_alpha/r"
            raise TrainingError(f"{where} scales its adapters by {form} = {here:g}; the artifacts' scale is alpha/rank = "
                                f"{scale:g}: generate them with the adapter's rank and alpha")
    unclaimed = sorted(set(arrays) - claimed)
    if unclaimed:
        raise TrainingError(f"{where} also holds {names_summary(unclaimed, 3)}, which the artifacts have no adapter for "
                            "(their LoRA targets differ): the model would differ from peft's")
    return values


def adapter_input_model(proto: onnx.ModelProto, manifest: Manifest) -> onnx.ModelProto:
    """``proto`` (the inference model) with the adapters of ``manifest`` as graph inputs
    ``[in, lora_rank]`` and ``[lora_rank, out]`` whose defaults are empty (rank 0: the base model),
    multiplied without the scale (:func:`onnx_adapter_arrays` folds it into B)."""
    from onnx_autodiff.training.lora import unmerged

    lora = lora_record(manifest, "the adapter-input model")
    proto = unmerged(proto, dataclasses.replace(lora.config, alpha=None), lora.adapters)  # alpha None: scale 1, no Mul
    graph = proto.graph
    inits = {t.name: i for i, t in enumerate(graph.initializer)}
    names = set(lora.tensors)
    # the rank-sized values between the two MatMuls: their recorded shapes would name the old rank
    inner = {out for node in graph.node if names & set(node.input) for out in node.output}
    kept = [v for v in graph.value_info if v.name not in names and v.name not in inner]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    for adapter in lora.adapters:
        for part, name in (("A", adapter.A), ("B", adapter.B)):
            tensor = graph.initializer[inits[name]]
            rows, cols = tensor.dims
            dtype = tensor.data_type
            empty = np.zeros([rows, 0] if part == "A" else [0, cols], helper.tensor_dtype_to_np_dtype(dtype))
            tensor.CopyFrom(numpy_helper.from_array(empty, name))
            graph.input.append(helper.make_tensor_value_info(name, dtype, [rows, RANK_DIM] if part == "A" else [RANK_DIM, cols]))
    if proto.ir_version < 4:  # an initializer that is also a graph input is its default from IR 4
        proto.ir_version = 4
    return proto


def onnx_adapter_arrays(manifest: Manifest, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors of the ``.onnx_adapter`` file: A, and B multiplied by the scale alpha/r."""
    lora = lora_record(manifest, "an .onnx_adapter file")
    scale = float(lora.scale)
    arrays = {}
    for adapter in lora.adapters:
        a, b = values[adapter.A], values[adapter.B]
        arrays[adapter.A] = np.ascontiguousarray(a)
        arrays[adapter.B] = np.ascontiguousarray((b.astype(np.float64) * scale).astype(b.dtype))
    return arrays


def onnx_adapter_bytes(arrays: Mapping[str, np.ndarray], adapter_version: int = 1, model_version: int = 1) -> bytes:
    """``arrays`` in onnxruntime's adapter format (``onnxruntime.AdapterFormat``)."""
    import tempfile

    import onnxruntime as ort

    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(int(adapter_version))
    adapter.set_model_version(int(model_version))
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    adapter.set_parameters(values)
    with tempfile.TemporaryDirectory() as scratch:  # the writer takes a path: written here, then read back
        path = os.path.join(scratch, "adapter.onnx_adapter")
        adapter.export_adapter(path)
        with open(path, "rb") as stream:
            return stream.read()


def write_peft_adapter(directory: str | os.PathLike, entries: Mapping, arrays: Mapping[str, np.ndarray]) -> None:
    """``adapter_model.safetensors`` (peft's metadata: format "pt") and ``adapter_config.json`` in
    ``directory`` (made when missing), each written atomically."""
    from onnx_autodiff.files import write_atomically
    from onnx_autodiff.training.values import safetensors_writer

    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise TrainingError(f"{directory} is a file: a peft adapter is a directory")
    os.makedirs(directory, exist_ok=True)
    write_atomically(os.path.join(directory, PEFT_WEIGHTS), safetensors_writer(arrays, {"format": "pt"}))
    text = json.dumps(dict(entries), indent=2, sort_keys=True) + "\n"
    write_atomically(os.path.join(directory, PEFT_CONFIG), text.encode())
