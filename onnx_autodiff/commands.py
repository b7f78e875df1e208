"""What the ``onnx-autodiff`` subcommands share: the two kinds of error (exit 2 and exit 1, one
line each), reading the input model, writing outputs, counts and notes, the progress bar."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import BinaryIO

import onnx
import onnx_ir as ir

from onnx_autodiff.errors import AutodiffError, names_summary
from onnx_autodiff.files import write_atomically
from onnx_autodiff.modelfile import check_model, from_proto, full_output_check, save_model
from onnx_autodiff.passes import progress

NO_UPGRADE_HELP = ("refuse, instead of converting with onnx.version_converter, a model whose gradient "
                   "rules need a newer opset than it imports")
PROGRESS_DELAY = 2.0  # seconds of building before a progress bar shows (on a terminal)
CHECK_OUTPUT_HELP = ("check the written model with onnx.checker's full check (strict shape inference of the "
                     "whole graph) instead of the structural one")
EXTERNAL_DATA_HELP = ("write the tensors to OUTPUT.data beside the model (done anyway for models over "
                      "protobuf's 2 GB limit and for models read with external data)")




class UsageError(Exception):
    """Bad command-line usage: exit 2 with one line."""


class CommandError(Exception):
    """An ordinary failure the user can fix (an invalid input model, an unwritable output): exit 1 with one line."""


def read_model_proto(path: str) -> onnx.ModelProto:
    """The ModelProto in ``path`` without its external data (tensors stored beside the file stay
    there), checked by onnx.checker so that a bad input is blamed on the input."""
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory, not a model file")
    if not os.path.isfile(path):
        raise UsageError(f"no such model file: {path}")
    if os.path.getsize(path) == 0:
        raise CommandError(f"cannot read {path} as an ONNX model: the file is empty")
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as error:  # noqa: BLE001 - any parse failure is a malformed model
        raise CommandError(f"cannot read {path} as an ONNX model: {type(error).__name__}: {error}") from error
    if not proto.HasField("graph"):  # some other protobuf, or bytes that happen to parse
        raise CommandError(f"cannot read {path} as an ONNX model: it holds no graph")
    try:  # tensors stored beside it are read from there (small ones) or checked as inputs
        check_model(proto, os.path.dirname(os.path.abspath(path)))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise CommandError(f"the input model {path} is invalid (onnx.checker): {_brief(error)}{_unshaped(proto)}") from error
    return proto


def _unshaped(proto: onnx.ModelProto) -> str:
    """Names the graph inputs and outputs whose tensor type has no shape: the checker's message
    ("Field 'shape' of 'type' is required") does not."""
    names = [v.name for v in (*proto.graph.input, *proto.graph.output)
             if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")]
    if not names:
        return ""
    declare = "declares" if len(names) == 1 else "declare"
    return (f" ({', '.join(repr(n) for n in names)} {declare} no shape: ONNX requires at least the rank "
            "of graph inputs and outputs; symbolic dimensions such as ['batch', 4] will do)")


def load_model(path: str) -> ir.Model:
    """The model in ``path``; tensors stored beside it are read from their file when used."""
    proto = read_model_proto(path)
    try:
        return from_proto(proto, os.path.dirname(os.path.abspath(path)))
    except Exception as error:  # noqa: BLE001
        raise CommandError(f"{path} is not a well-formed ONNX model: {error}") from error


def _brief(error: BaseException, limit: int = 400) -> str:
    """An error's message on one line, cut to ``limit`` characters (checker messages embed whole nodes)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_output_path(path: str) -> None:
    """Refuse an output path that cannot be a file before any work is done."""
    if os.path.isdir(path):
        raise UsageError(f"-o {path} is a directory: name the output file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"output directory does not exist: {directory}")


def write_file(path: str, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``data`` (bytes, or a function writing them to a stream) atomically (never half-written);
    a permission error or a full disk is one plain line."""
    try:
        write_atomically(path, data)
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from error


def save_output(model: ir.Model, path: str, external_data: bool = False, check_output: bool = False) -> str:
    """Check the generated ``model`` (onnx.checker's structural check; its full check when
    ``check_output``, see :func:`~onnx_autodiff.modelfile.full_output_check`) and write it to
    ``path`` (never half-written), its tensors in ``path``.data when asked, when it is over
    protobuf's 2 GB or when it was read with external data; returns what to add to the success
    line ("" or where the tensors went)."""
    check_output_path(path)
    full = full_output_check(check_output)
    try:
        written = save_model(model, path, True if external_data else None,
                             check=lambda generated: _check_generated(generated, full))
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from error
    return f" (tensors in {os.path.basename(path)}.data)" if written else ""


def _check_generated(model: onnx.ModelProto | str, full: bool = True) -> None:
    """onnx.checker on the generated model (a proto, or the path of a file with its data beside it)."""
    try:
        check_model(model, full=full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        first = str(error).strip().splitlines()[0]
        raise AutodiffError(f"the generated model fails the ONNX checker (a bug, please report): {first}")


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def note_left_out(left_out: Sequence[str], option: str = "--wrt", verb: str = "differentiate",
                  quantized_names: Sequence[str] = ()) -> None:
    """One line on stderr naming the float initializers that the default variables left out as
    constants, and one naming the quantized weights (``quantized_names``) among them."""
    quantized_names = set(quantized_names)
    quantized = [n for n in left_out if n in quantized_names]
    left_out = [n for n in left_out if n not in quantized_names]
    if quantized:
        print(f"onnx-autodiff: note: {count(len(quantized), 'quantized weight')} {'stays' if len(quantized) == 1 else 'stay'} frozen "
              f"({names_summary(quantized, 3)}); LoRA (--lora RANK) trains adapters on them", file=sys.stderr)
    if left_out:
        are = "is a constant and was" if len(left_out) == 1 else "are constants and were"
        done = verb + ("d" if verb.endswith("e") else "ed")
        print(
            f"onnx-autodiff: note: {count(len(left_out), 'float initializer')} {are} not {done} "
            f"({names_summary(left_out, 3)}); name them with {option} to {verb} them",
            file=sys.stderr,
        )


@contextlib.contextmanager
def progress_bar():
    """Within: a progress bar on stderr, when it is a terminal, shown once the build has taken
    PROGRESS_DELAY seconds (tqdm's delay), and gone when it ends."""
    if not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm

    bar = tqdm(total=1, delay=PROGRESS_DELAY, leave=False, file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
    shown = [""]

    def listen(stage: str, done: int, total: int) -> None:
        if stage != shown[0]:  # a new stage: the same bar, its clock running since the start
            shown[0] = stage
            bar.set_description_str(stage, refresh=False)
            bar.total, bar.n, bar.last_print_n = max(total, 1), 0, 0
        bar.update(done - bar.n)

    try:
        with progress.reporting(listen):
            yield
    finally:
        bar.close()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {text!r}")
    return value


@contextlib.contextmanager
def collector_paused():
    """Within: Python's cyclic garbage collector is paused (process-wide; as it was afterwards).
    While a large model is built it would rescan the ever larger graphs many times (half the build
    time of a 20,000-node model); the garbage a build leaves (removed nodes) is collected once,
    afterwards. The passes leave the collector alone: the command line builds inside this, and so
    can a caller."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
