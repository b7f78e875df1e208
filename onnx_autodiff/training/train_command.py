"""``onnx-autodiff train MODEL --data DATA -o OUTDIR``: trains a forward model (or training
artifacts built earlier) on the arrays of an npz or safetensors file.

OUTDIR holds the whole run, so that ``--resume`` rebuilds the identical trainer from it alone:

- ``artifacts/``: the training artifacts, generated from MODEL (or copied from the artifacts
  directory MODEL names); a resumed run trains these, whatever MODEL is by then;
- ``checkpoint``: a safetensors file, the trainer's state (parameters, optimiser state, buffers,
  ``__step__``) with the run in its header's metadata (``onnx_autodiff.train``: the options,
  the number of examples, the position — epoch, batch, the epoch's loss so far — and the
  metrics of the epochs done); written after every epoch and on Ctrl-C;
- ``metrics.csv``: one row per epoch, ``epoch,loss,lr[,val_loss][,val_accuracy]`` (``lr``: the
  learning rate of the epoch's last step);
- ``model.onnx``: the trained inference model (``Trainer.export``), when the run ends: the last
  epoch's, or with ``--keep-best`` the epoch's of the lowest validation loss, whose state
  ``best-checkpoint`` holds;
- with ``--save-onnx-adapter PATH``, ``adapter_inputs.onnx``: the model whose inputs the adapters
  are (``Trainer.export_adapter_model``), beside the adapter file at PATH;
- ``loss.png``: the losses per epoch, when matplotlib is installed.

The schedule is deterministic: epoch ``e`` (from 0) visits the N examples in the order
``numpy.random.default_rng([seed, e]).permutation(N)``, in batches of ``--batch-size``; the last
batch of an epoch holds the remainder (every example is seen once per epoch), and a batch size
over N gives one batch of all N. An epoch's loss is the mean of its batch losses weighted by their
sizes; the validation data is evaluated in file order, in batches of the same size.

``--lr-schedule`` and ``--warmup-steps`` record the learning-rate schedule in the run's artifacts
(:mod:`~onnx_autodiff.training.schedules`; its last step the run's last, ``--epochs`` times the
batches per epoch). ``--early-stopping PATIENCE`` ends the run after the epoch that makes
PATIENCE epochs without a lower validation loss.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import signal
import sys
import threading
import time
import types

import numpy as np
from onnx import helper

from onnx_autodiff.commands import (CommandError, UsageError, collector_paused, count, non_negative_int, note_left_out,
                                    positive_int, progress_bar, write_file)
from onnx_autodiff.errors import TrainingError, names_summary
from onnx_autodiff.passes import progress
from onnx_autodiff.training import distributed
from onnx_autodiff.training.artifacts import TrainingArtifacts, quantized_weight_names
from onnx_autodiff.training.cli import add_generation_arguments, artifacts_from_args
from onnx_autodiff.training.losses import IGNORE_INDEX  # (no class: neither checked nor counted in the accuracy)
from onnx_autodiff.training.manifest import Manifest
from onnx_autodiff.training.schedules import SCHEDULES, LRSchedule
from onnx_autodiff.training.trainer import Trainer
from onnx_autodiff.training.values import (
    load_arrays,
    safetensors_metadata,
    safetensors_writer,
    shape_text,
)

RUN_KEY = "onnx_autodiff.train"  # the checkpoint's metadata entry that holds the run
RUN_FORMAT = 1
DATA_SUFFIXES = (".npz", ".safetensors")
INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C
ADAPTER_INPUTS_MODEL = "adapter_inputs.onnx"  # --save-onnx-adapter: the model whose inputs the adapters are
BEST_CHECKPOINT = "best-checkpoint"  # --keep-best: the state of the epoch of the lowest validation loss


def add_arguments(parser) -> None:
    """Arguments of ``onnx-autodiff train``."""

    parser.add_argument("model", help="forward .onnx model, or a directory of training artifacts (holding artifacts.json)")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help=".npz or .safetensors file: one array per model input, named like it, and 'labels' "
                             "when the loss takes them, one row per example")
    parser.add_argument("-o", "--output", required=True, metavar="OUTDIR",
                        help="directory of the run: model.onnx, checkpoint, metrics.csv, loss.png, artifacts/")
    generation = add_generation_arguments(parser)
    parser.add_argument("--epochs", type=positive_int, default=1, help="epochs to train in all (default 1)")
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="examples per step (default 32); the last batch of an epoch holds the remainder")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the example order (default 0)")
    parser.add_argument("--val-data", metavar="FILE", help="validation arrays, as --data: loss (and accuracy) per epoch")
    parser.add_argument("--lr-schedule", choices=SCHEDULES,
                        help="the learning rate over the run: constant, or decaying linearly or as a cosine to 0 at "
                             "the run's last step, after --warmup-steps (default: the optimiser's throughout)")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=0, metavar="N",
                        help="raise the learning rate linearly from 0 over the first N steps (default 0)")
    parser.add_argument("--keep-best", action="store_true",
                        help="export the epoch of the lowest validation loss, not the last (needs --val-data)")
    parser.add_argument("--early-stopping", type=positive_int, metavar="PATIENCE",
                        help="stop when the validation loss has not fallen for PATIENCE epochs (needs --val-data)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in OUTDIR from its checkpoint (same options; --epochs may grow)")
    parser.add_argument("--save-peft-adapter", metavar="DIR",
                        help="with LoRA, also write the adapters as a peft adapter directory (adapter_model.safetensors, "
                             "adapter_config.json) for PeftModel.from_pretrained; needs a model exported from PyTorch")
    parser.add_argument("--peft-strip", metavar="PREFIX",
                        help="the prefix of the exported module's names that the model peft wraps lacks (default: the "
                             "wrapper's attribute when every parameter lies under one, e.g. 'lm.'; '' for none)")
    parser.add_argument("--save-onnx-adapter", metavar="PATH",
                        help="with LoRA, also write the adapters as an onnxruntime .onnx_adapter file, and "
                             f"OUTDIR/{ADAPTER_INPUTS_MODEL}, the model that takes them as inputs "
                             "(RunOptions.add_active_adapter)")
    parser.set_defaults(run=run, generation_options=generation)


def run(args) -> int:
    """``onnx-autodiff train``; exit 0, or INTERRUPTED after Ctrl-C (the checkpoint saved), or raises
    one of the command line's errors."""

    out = args.output
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"-o {out} is a file: name the directory of the run")
    for option, path in (("--data", args.data), ("--val-data", args.val_data)):
        if path is not None and not path.endswith(DATA_SUFFIXES):
            raise UsageError(f"{option} {path}: give an .npz or .safetensors file")
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{option}: no such file: {path}")
    for option, given in (("--keep-best", args.keep_best), ("--early-stopping", args.early_stopping)):
        if given and args.val_data is None:
            raise UsageError(f"{option} compares the validation losses of the epochs: give --val-data")
    comm = distributed.world()  # under mpiexec: data-parallel, rank 0 writing every file and line
    ranks = distributed.size(comm)
    if comm is not None and args.qat is not None:
        raise UsageError(f"--qat {args.qat} does not combine with data-parallel training (mpiexec) yet: its "
                         "gradient accumulation's models do not count the optimiser's steps the observers read")
    if args.batch_size % ranks:
        raise UsageError(f"--batch-size {args.batch_size} is the global batch: it must divide among the {ranks} "
                         f"ranks (give a multiple of {ranks})")
    with distributed.abort_on_error(comm):
        return _run(args, comm)


def _run(args, comm) -> int:
    out, leader = args.output, distributed.rank(comm) == 0
    start = time.perf_counter()
    checkpoint = os.path.join(out, "checkpoint")
    with progress_bar() if leader else contextlib.nullcontext():  # on a terminal: the build, then the batches
        if args.resume:
            artifacts, run_state, state = _resumed(args)
        elif leader:  # the other ranks read the artifacts rank 0 writes
            artifacts, run_state, state = _started(args, gradient_accumulation=comm is not None)
        if leader or args.resume:
            data = _checked_data(args.data, "--data", artifacts, args.batch_size)
            run_state.check_examples(_examples(data), args.data, out)
        directory = os.path.join(out, "artifacts")
        if leader and not args.resume:
            _save_artifacts(_scheduled(artifacts, args, run_state.examples), directory, args.model)
        if comm is not None:
            comm.Barrier()
        trainer = Trainer(directory, lr=args.lr, comm=comm)  # as a resumed run will: the same models, read back
        _check_adapter_options(args, trainer.manifest)
        if not leader and not args.resume:
            run_state, state = RunState(_settings(args)), None
            data = _checked_data(args.data, "--data", trainer.artifacts, args.batch_size)
            run_state.check_examples(_examples(data), args.data, out)
        val = _checked_data(args.val_data, "--val-data", trainer.artifacts, args.batch_size) if args.val_data else None
        if state is not None:
            trainer.load_state_dict(state)
        finished = _train(trainer, run_state, data, val, args)
    if not leader:
        return 0 if finished else INTERRUPTED
    if not finished:
        batches = -(-run_state.examples // args.batch_size)
        print(f"onnx-autodiff: interrupted after {run_state.batch} of {batches} batches of epoch {run_state.epoch + 1}: "
              f"the run is saved in {checkpoint}; continue it with --resume", file=sys.stderr)
        return INTERRUPTED
    written = _finish(trainer, run_state, out, args.keep_best) + _save_adapters(trainer, args)
    history = run_state.history
    on = f" on {distributed.size(comm)} ranks" if comm is not None else ""
    print(f"wrote {', '.join(written)}: {count(len(history), 'epoch')}, {count(trainer.step_count, 'step')}{on} "
          f"({time.perf_counter() - start:.2f} s); loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
    return 0


def _scheduled(artifacts: TrainingArtifacts, args, examples: int) -> TrainingArtifacts:
    """``artifacts`` with the run's learning-rate schedule in their manifest (as they are without
    --lr-schedule and --warmup-steps)."""
    if args.lr_schedule is None and not args.warmup_steps:
        return artifacts
    total = args.epochs * -(-examples // args.batch_size)
    try:
        schedule = LRSchedule(args.lr_schedule or "constant", args.warmup_steps, total)
    except TrainingError as error:
        raise UsageError(str(error)) from error
    return dataclasses.replace(artifacts, manifest=dataclasses.replace(artifacts.manifest, lr_schedule=schedule))


def _best_epoch(history: list[dict]) -> dict | None:
    """The first epoch of the lowest validation loss (None: none validated)."""
    validated = [row for row in history if "val_loss" in row]
    return min(validated, key=lambda row: row["val_loss"]) if validated else None


def _stalled(history: list[dict], patience: int | None) -> bool:
    """Whether the last ``patience`` epochs brought no lower validation loss."""
    best = _best_epoch(history)
    return bool(patience) and best is not None and history[-1]["epoch"] - best["epoch"] >= patience


class RunState:
    """Where a run stands: its options, its data's size, the position and the metrics so far."""

    def __init__(self, settings: dict, examples: int | None = None, epoch: int = 0, batch: int = 0,
                 loss_sum: float = 0.0, history: list | None = None) -> None:
        self.settings, self.examples = settings, examples
        self.epoch, self.batch, self.loss_sum = epoch, batch, loss_sum  # epochs done; batches done of the next
        self.history = list(history or [])  # one dict per epoch done: epoch, loss, val_loss, val_accuracy

    def to_json(self) -> str:
        return json.dumps({"format": RUN_FORMAT, **vars(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data = json.loads(text)
        if data.pop("format", None) != RUN_FORMAT:
            raise TrainingError(f"the run was written in an unsupported format ({RUN_FORMAT} is read)")
        return cls(**data)

    def check_examples(self, examples: int, path: str, out: str) -> None:

        if self.examples is None:
            self.examples = examples
        elif examples != self.examples:
            raise CommandError(f"--data {path} holds {examples} examples, but the run in {out} trained on "
                               f"{self.examples}: resume it on the same data")


def _settings(args) -> dict:
    """The options that shape a run (a resumed one must have the same), as JSON reads them back."""
    names = [*args.generation_options, "batch_size", "seed", "lr_schedule", "warmup_steps", "keep_best", "early_stopping"]
    return json.loads(json.dumps({name: getattr(args, name) for name in names}))


def _started(args, gradient_accumulation: bool = False) -> tuple[TrainingArtifacts, RunState, None]:
    """A new run: the artifacts of MODEL (generated, or read from its directory); no state yet.
    Data-parallel runs need the accumulate and apply models (``gradient_accumulation``)."""

    checkpoint = os.path.join(args.output, "checkpoint")
    if os.path.exists(checkpoint):
        raise UsageError(f"{args.output} holds a run already ({checkpoint}): add --resume to continue it, "
                         "or choose another -o")
    if os.path.isdir(args.model):
        given = [_flag(name, getattr(args, name)) for name in args.generation_options
                 if name != "lr" and getattr(args, name) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)}: {args.model} holds training artifacts, built with their own "
                             "options (--lr alone applies to them)")
        artifacts = _load_artifacts(args.model)
    else:
        with collector_paused():  # (see generate_artifacts)
            artifacts = artifacts_from_args(args, gradient_accumulation, _label_shape(args.data))
        note_left_out(artifacts.left_out, "--requires-grad", "train", quantized_weight_names(artifacts.inference_model))
    return artifacts, RunState(_settings(args)), None


def _label_shape(path: str) -> list | None:
    """The shape of the data's 'labels' ([None, ...]: any number of examples), which decides the
    class axis of cross_entropy's logits where their shape leaves it open; None without one."""
    try:
        labels = load_arrays(path).get("labels")
    except (OSError, ValueError, EOFError):
        return None  # (the data's check says what is wrong with the file)
    return None if labels is None or labels.ndim == 0 else [None, *labels.shape[1:]]


def _resumed(args) -> tuple[TrainingArtifacts, RunState, dict]:
    """The run in OUTDIR, checked against the options given, and the trainer state it reached."""

    checkpoint = os.path.join(args.output, "checkpoint")
    if not os.path.isfile(checkpoint):
        raise UsageError(f"nothing to resume: {checkpoint} does not exist (start the run without --resume)")
    state, run_state = _read_checkpoint(checkpoint)
    settings = _settings(args)
    for name, value in run_state.settings.items():
        if settings.get(name) != value:
            raise UsageError(f"the run in {args.output} was started with {_flag(name, value)}, not "
                             f"{_flag(name, settings.get(name))}: resume it with its options (only --epochs may change)")
    if args.epochs < run_state.epoch:
        raise UsageError(f"the run in {args.output} has trained {run_state.epoch} epochs already: "
                         f"--epochs {args.epochs} asks for fewer")
    directory = os.path.join(args.output, "artifacts")
    if not os.path.isfile(os.path.join(directory, "artifacts.json")):
        raise UsageError(f"the run in {args.output} lacks its artifacts ({directory}): it cannot continue; start a new run in another -o")
    artifacts = TrainingArtifacts.load(directory)
    schedule = artifacts.manifest.lr_schedule
    if schedule is not None and schedule.kind != "constant":
        total = args.epochs * -(-run_state.examples // args.batch_size)
        if total != schedule.total_steps:
            raise UsageError(f"the run in {args.output} decays its learning rate over {schedule.total_steps} steps: "
                             f"resume it with its --epochs, not {args.epochs} ({total} steps)")
    return artifacts, run_state, state


def _flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return f"no {flag}"
    if value is True:
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def _load_artifacts(directory: str) -> TrainingArtifacts:

    if not os.path.isfile(os.path.join(directory, "artifacts.json")):
        raise UsageError(f"{directory} is a directory without artifacts.json: give an .onnx model or a directory "
                         "of training artifacts")
    return TrainingArtifacts.load(directory)


def _save_artifacts(artifacts: TrainingArtifacts, directory: str, model: str) -> None:

    if os.path.isdir(directory) and os.path.samefile(directory, model):
        return  # MODEL is this run's own artifacts directory
    try:
        artifacts.save(directory)
    except OSError as error:  # each file is written atomically: none is half-written
        raise CommandError(f"cannot write the artifacts to {directory}: {error.strerror or error}") from error


def _read_checkpoint(path: str) -> tuple[dict, RunState]:
    """The trainer state and the run of a checkpoint the train command wrote."""

    try:
        state, metadata = load_arrays(path), safetensors_metadata(path)
        return state, RunState.from_json(metadata[RUN_KEY])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CommandError(f"{path} is not a checkpoint of onnx-autodiff train ({type(error).__name__}: {error})") from error


def _batch_specs(artifacts: TrainingArtifacts) -> dict[str, tuple[np.dtype, list | None]]:
    """The train model's batch inputs: numpy dtype and declared dimensions (int, symbol or None)."""
    inputs = {v.name: v.type.tensor_type for v in artifacts.train_model.graph.input}
    specs = {}
    for name in artifacts.manifest.train.batch:
        tensor = inputs[name]
        dims = ([d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
                if tensor.HasField("shape") else None)
        specs[name] = (np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)), dims)
    return specs


def _classes(artifacts: TrainingArtifacts) -> tuple[str, str, int | None, int] | None:
    """(labels, scored output, number of classes or None, class axis) when the labels are class
    indices (integer labels, as cross_entropy takes): the accuracy compares them with the argmax of
    the scored output along its class axis (1, or what the artifacts record: causal_lm's and ctc's
    labels are not one class per position of the output)."""
    labels, axis = artifacts.manifest.labels, artifacts.manifest.class_axis
    if axis is None or len(labels) != 1 or _batch_specs(artifacts)[labels[0]][0].kind not in "iu":
        return None
    scored = artifacts.manifest.eval.outputs[0]
    output = next(v for v in artifacts.eval_model.graph.output if v.name == scored).type.tensor_type
    dims = output.shape.dim if output.HasField("shape") else []
    classes = dims[axis].dim_value if len(dims) > axis and dims[axis].HasField("dim_value") else None
    return labels[0], scored, classes, axis


def _checked_data(path: str, option: str, artifacts: TrainingArtifacts, batch_size: int) -> dict[str, np.ndarray]:
    """The arrays of ``path`` that the model takes, checked against its inputs: present, one row
    per example in each, the declared shape and a dtype the Trainer casts to, class labels in range."""

    try:
        arrays = load_arrays(path)
    except (OSError, ValueError, EOFError) as error:
        raise CommandError(f"cannot read {option} {path}: {error}") from error
    specs = _batch_specs(artifacts)
    missing = [name for name in specs if name not in arrays]
    if missing:
        holds = names_summary(sorted(arrays)) or "no arrays"
        raise CommandError(f"{option} {path} has no array {', '.join(map(repr, missing))}: the model takes "
                           f"{', '.join(specs)} (the file holds {holds})")
    data = {name: arrays[name] for name in specs}
    for name, (dtype, dims) in specs.items():
        array = data[name]
        wanted = f"the model takes {name} {shape_text(dims)}" if dims is not None else "the model takes one row per example"
        if array.ndim == 0 or (dims is not None and (array.ndim != len(dims) or any(
                isinstance(want, int) and want != got for want, got in zip(dims[1:], array.shape[1:])))):
            raise CommandError(f"{option} {path}: '{name}' has shape {list(array.shape)}; {wanted}")
        if not np.can_cast(array.dtype, dtype, "same_kind"):
            raise CommandError(f"{option} {path}: '{name}' is {array.dtype}; the model takes {dtype}")
        if dims and isinstance(dims[0], int) and (batch_size != dims[0] or len(array) % dims[0]):
            raise CommandError(f"{option} {path}: the model takes batches of exactly {dims[0]} ({name} {shape_text(dims)}): "
                               f"use --batch-size {dims[0]} and a multiple of {dims[0]} examples (there are {len(array)})")
    lengths = {name: len(array) for name, array in data.items()}
    if len(set(lengths.values())) > 1:
        counts = ", ".join(f"{name} {count}" for name, count in lengths.items())
        raise CommandError(f"{option} {path}: the arrays differ in length ({counts}): give each one row per example")
    if not _examples(data):
        raise CommandError(f"{option} {path} holds no examples")
    classes = _classes(artifacts)
    if classes is not None and classes[2] is not None:
        labels, scored, count, _ = classes
        values = np.asarray(data[labels])
        bad = values[((values < 0) | (values >= count)) & (values != IGNORE_INDEX)]
        if bad.size:
            raise CommandError(f"{option} {path}: '{labels}' holds {bad.size} value{'s' if bad.size != 1 else ''} "
                               f"outside the {count} classes of '{scored}' (e.g. {bad.flat[0]}): class indices "
                               f"are 0 to {count - 1}, or {IGNORE_INDEX} to ignore an example")
    return data


def _examples(data: dict[str, np.ndarray]) -> int:
    return len(next(iter(data.values()))) if data else 0


def _order(seed: int, epoch: int, examples: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the examples (the module's docstring documents it)."""
    return np.random.default_rng([seed, epoch]).permutation(examples)


def _train(trainer: Trainer, run_state: RunState, data: dict, val: dict | None, args) -> bool:
    """Trains from the run's position to ``args.epochs``, saving the checkpoint after each epoch;
    False when Ctrl-C stopped it (the checkpoint then holds the position reached)."""
    from tqdm import tqdm

    examples, size = run_state.examples, args.batch_size
    batches = -(-examples // size)
    checkpoint = os.path.join(args.output, "checkpoint")
    comm = trainer.comm
    leader, ranks = distributed.rank(comm) == 0, distributed.size(comm)

    def save() -> None:
        if leader:
            write_file(checkpoint, safetensors_writer(trainer.state_dict(), {RUN_KEY: run_state.to_json()}))

    with _deferred_interrupt() as interrupt:
        while run_state.epoch < args.epochs:
            order = _order(run_state.settings["seed"], run_state.epoch, examples)
            stage = f"epoch {run_state.epoch + 1}/{args.epochs}"
            while run_state.batch < batches:
                rows = order[run_state.batch * size:(run_state.batch + 1) * size]
                mine = np.array_split(rows, ranks)[distributed.rank(comm)]  # this rank's slice of the batch
                loss = trainer.step({name: array[mine] for name, array in data.items()})
                run_state.loss_sum += loss * len(rows)
                run_state.batch += 1
                if leader:
                    progress.report(stage, run_state.batch, batches)
                if distributed.any_rank(comm, interrupt.requested):  # every rank stops at the same step
                    save()
                    return False
            last_lr = trainer.learning_rate_after(max(trainer.step_count - 1, 0))  # the epoch's last step's
            row = {"epoch": run_state.epoch + 1, "loss": run_state.loss_sum / examples, "lr": last_lr}
            if val is not None and leader:
                row.update(_validation(trainer, val, size))
            run_state.history.append(row)
            run_state.epoch, run_state.batch, run_state.loss_sum = run_state.epoch + 1, 0, 0.0
            if leader and args.keep_best and _best_epoch(run_state.history) is row:
                write_file(os.path.join(args.output, BEST_CHECKPOINT), safetensors_writer(trainer.state_dict()))
            save()
            if leader:
                write_file(os.path.join(args.output, "metrics.csv"), _metrics_csv(run_state.history))
                tqdm.write(f"{stage}: " + ", ".join(_shown(key, value) for key, value in row.items() if key != "epoch"),
                           file=sys.stdout)
            if distributed.any_rank(comm, interrupt.requested):
                return run_state.epoch >= args.epochs
            stalled = distributed.any_rank(comm, leader and _stalled(run_state.history, args.early_stopping))
            if stalled:
                if leader:
                    best = _best_epoch(run_state.history)
                    print(f"onnx-autodiff: note: stopped after epoch {run_state.epoch}: the validation loss has not "
                          f"fallen for {count(args.early_stopping, 'epoch')} (lowest {best['val_loss']:.4f}, epoch "
                          f"{best['epoch']})", file=sys.stderr)
                return True
    return True



def _shown(key: str, value: float) -> str:
    return f"{key} {value:.1%}" if key.endswith("accuracy") else f"{key} {value:.4f}"


def _validation(trainer: Trainer, val: dict, size: int) -> dict[str, float]:
    """The validation loss (batches weighted by their sizes) and, for class labels, the accuracy."""
    classes = _classes(trainer.artifacts)
    examples = _examples(val)
    loss_sum, correct, counted = 0.0, 0, 0
    for start in range(0, examples, size):
        batch = {name: array[start:start + size] for name, array in val.items()}
        results = trainer.evaluate(batch)
        rows = _examples(batch)
        loss_sum += float(results["loss"]) * rows
        if classes is not None:
            labels = np.asarray(batch[classes[0]])
            kept = labels != IGNORE_INDEX
            correct += int(np.count_nonzero(results[classes[1]].argmax(classes[3])[kept] == labels[kept]))
            counted += int(np.count_nonzero(kept))
    metrics = {"val_loss": loss_sum / examples}
    if counted:
        metrics["val_accuracy"] = correct / counted
    return metrics


def _metrics_csv(history: list[dict]) -> bytes:
    columns = ["epoch", "loss", *(c for c in ("lr", "val_loss", "val_accuracy") if any(c in row for row in history))]
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, lineterminator="\n")  # floats as repr: they read back exactly
    writer.writeheader()
    writer.writerows(history)
    return text.getvalue().encode()


def _finish(trainer: Trainer, run_state: RunState, out: str, keep_best: bool = False) -> list[str]:
    """Writes the trained model (with ``keep_best``, the best epoch's), the metrics and the plot;
    returns the paths written."""

    model = os.path.join(out, "model.onnx")
    best = _best_epoch(run_state.history) if keep_best else None
    if best is not None and best is not run_state.history[-1]:
        trainer.load_state_dict(load_arrays(os.path.join(out, BEST_CHECKPOINT)))
        print(f"onnx-autodiff: note: {model} is epoch {best['epoch']}'s, of the lowest validation loss "
              f"({best['val_loss']:.4f})", file=sys.stderr)
    try:
        trainer.export(model)
    except OSError as error:
        raise CommandError(f"cannot write {model}: {error.strerror or error}") from error
    written = [model, os.path.join(out, "checkpoint"), os.path.join(out, "metrics.csv")]
    write_file(written[-1], _metrics_csv(run_state.history))
    plot = _loss_plot(run_state.history)
    if plot is not None:
        written.append(os.path.join(out, "loss.png"))
        write_file(written[-1], plot)
    else:
        print("onnx-autodiff: note: loss.png is not written: matplotlib is not installed "
              "(pip install 'onnx-autodiff[examples]' brings it)", file=sys.stderr)
    return written


def _check_adapter_options(args, manifest: Manifest) -> None:
    """Before training: --save-peft-adapter and --save-onnx-adapter need LoRA adapters (and peft
    their module names), so that a long run does not fail at its end."""
    from onnx_autodiff.training.adapters import checked_for_peft

    given = [(flag, path) for flag, path in (("--save-peft-adapter", args.save_peft_adapter),
                                             ("--save-onnx-adapter", args.save_onnx_adapter)) if path is not None]
    if args.peft_strip is not None and args.save_peft_adapter is None:
        raise UsageError("--peft-strip needs --save-peft-adapter DIR")
    if given and not manifest.lora:
        raise UsageError(f"{given[0][0]} writes LoRA adapters: add --lora RANK (the artifacts have none)")
    if args.save_peft_adapter is not None:
        if os.path.exists(args.save_peft_adapter) and not os.path.isdir(args.save_peft_adapter):
            raise UsageError(f"--save-peft-adapter {args.save_peft_adapter} is a file: name a directory")
        checked_for_peft(manifest, args.peft_strip)
    if args.save_onnx_adapter is not None and os.path.isdir(args.save_onnx_adapter):
        raise UsageError(f"--save-onnx-adapter {args.save_onnx_adapter} is a directory: name the file")


def _save_adapters(trainer: Trainer, args) -> list[str]:
    """Writes the adapters that --save-peft-adapter and --save-onnx-adapter ask for; returns the paths."""
    written = []
    try:
        if args.save_peft_adapter is not None:
            trainer.save_peft_adapter(args.save_peft_adapter, strip=args.peft_strip)
            written.append(args.save_peft_adapter)
        if args.save_onnx_adapter is not None:
            trainer.save_onnx_adapter(args.save_onnx_adapter)
            model = os.path.join(args.output, ADAPTER_INPUTS_MODEL)
            trainer.export_adapter_model(model)
            written += [args.save_onnx_adapter, model]
    except OSError as error:
        raise CommandError(f"cannot write the adapters: {error.strerror or error}"
                           + (f" ({error.filename})" if error.filename else "")) from error
    return written


def _loss_plot(history: list[dict]):
    """A writer of the losses per epoch as a PNG, or None without matplotlib (an optional extra)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    figure = Figure(figsize=(6, 4), layout="tight")
    axes = figure.subplots()
    axes.plot([row["epoch"] for row in history], [row["loss"] for row in history], marker="o", label="training")
    validated = [row for row in history if "val_loss" in row]
    if validated:
        axes.plot([row["epoch"] for row in validated], [row["val_loss"] for row in validated], marker="o", label="validation")
    axes.set(xlabel="epoch", ylabel="loss")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend()
    # no software version in the file: the same run writes the same bytes
    return lambda stream: figure.savefig(stream, format="png", metadata={"Software": None})


@contextlib.contextmanager
def _deferred_interrupt():
    """Within: a first Ctrl-C (SIGINT) only sets ``requested``, so that the loop stops between
    steps and the checkpoint it saves is consistent; a second one interrupts at once."""
    state = types.SimpleNamespace(requested=False)
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield state
        return

    def handle(signum, frame):
        if state.requested:
            raise KeyboardInterrupt
        state.requested = True

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
