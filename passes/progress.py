"""Progress of long builds: the passes report where they are, a caller listens (the command line's
progress bar). Nothing is reported outside :func:`reporting`, and reporting costs next to nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

Listener = Callable[[str, int, int], None]  # (stage, done, total)

_listener: contextvars.ContextVar[Listener | None] = contextvars.ContextVar("onnx_autodiff_progress", default=None)


def report(stage: str, done: int, total: int) -> None:
    """Tell the listener, if any, that ``done`` of ``total`` steps of ``stage`` are done."""
    listener = _listener.get()
    if listener is not None:
        listener(stage, done, total)


@contextlib.contextmanager
def reporting(listener: Listener) -> Iterator[None]:
    """Within: the passes' progress goes to ``listener(stage, done, total)``."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
