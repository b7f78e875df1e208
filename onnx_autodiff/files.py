"""Writing files: atomically (never half-written, nothing left behind), with ordinary permissions."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Callable
from typing import BinaryIO


def write_atomically(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``,
    so ``path`` is never half-written and nothing is left behind when writing fails. ``data`` is
    the bytes, or a function that writes them to the stream it is given (streaming a large file).

    The file gets the mode an ordinary ``open(path, "wb")`` gives: a replaced file keeps its mode,
    a new one gets 0o666 less the umask (mkstemp's private 0o600 would surprise users)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    while True:
        temporary = os.path.join(directory, f".onnx-autodiff-{secrets.token_hex(6)}.tmp")
        try:  # 0o666: the kernel applies the umask (and a directory's default ACL) as for any new file
            handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(handle, "wb") as stream:
            if callable(data):
                data(stream)
            else:
                stream.write(data)
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def json_text(document, levels: int = 2) -> str:
    """``document`` as JSON with sorted keys, the keys of its objects down to ``levels`` deep each
    on a line of its own (indented by one space a level) and their values on that line: readable,
    and written by json's C encoder (``indent`` takes the pure-Python one, which puts every element
    of every list on a line: for the artifacts of 10,000 parameters, 2.6 MB in 0.13 s)."""
    if not isinstance(document, dict) or not document or levels == 0:
        return json.dumps(document, sort_keys=True)
    items = ",\n".join(f"{json.dumps(key)}: {json_text(value, levels - 1)}" for key, value in sorted(document.items()))
    return "{\n " + items.replace("\n", "\n ") + "\n}"  # (a newline in a string is written as \\n)
