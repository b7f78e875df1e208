"""Data-parallel training over MPI (mpi4py): gradients summed, statistics averaged, one update everywhere.

Every rank runs the same artifacts on its slice of each global batch. The Trainer sums the
accumulated gradients of all ranks in place (``Allreduce`` on the OrtValues' own buffers) and
applies the same update on each, so the ranks' parameters stay equal; BatchNormalization's
running statistics are averaged. A failure on one rank must not leave the others waiting in a
collective: :func:`abort_on_error` prints the error and aborts the whole job.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable

import numpy as np

from onnx_autodiff.errors import TrainingError

# Set by the launchers of MPICH (Hydra), Open MPI and PMIx for every rank they start.
_LAUNCHER_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
ABORT_GRACE = 0.5  # seconds between a failing rank's message and its abort


def world():
    """``MPI.COMM_WORLD`` when this process was started by mpiexec with other ranks, else None
    (a process started alone trains alone, without importing MPI)."""
    if not any(name in os.environ for name in _LAUNCHER_VARIABLES):
        return None
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise TrainingError("started by mpiexec, but mpi4py is not installed: "
                            'pip install "onnx-autodiff[mpi]"') from error
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def size(comm) -> int:
    return 1 if comm is None else comm.Get_size()


def rank(comm) -> int:
    return 0 if comm is None else comm.Get_rank()


def broadcast(comm, arrays: Iterable[np.ndarray]) -> None:
    """Rank 0's values into every rank's arrays (in place)."""
    for array in arrays:
        comm.Bcast(array, root=0)


def sum_in_place(comm, arrays: Iterable[np.ndarray], weight: float = 1.0) -> None:
    """The sum over the ranks of each array times its rank's ``weight``, in place."""
    from mpi4py import MPI

    for array in arrays:
        if weight != 1.0:
            array *= array.dtype.type(weight)
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)


def mean_in_place(comm, arrays: Iterable[np.ndarray], weight: float = 1.0) -> None:
    """The mean over the ranks of each floating-point array times its rank's ``weight``, in place
    (other arrays stay as they are: every rank advanced them alike)."""
    for array in arrays:
        if np.issubdtype(array.dtype, np.inexact):
            sum_in_place(comm, [array], weight)
            array /= array.dtype.type(comm.Get_size())


def failed_ranks(comm, failed: bool) -> list[int]:
    """The ranks where ``failed`` is true, known to all ranks."""
    return [r for r, flag in enumerate(comm.allgather(bool(failed))) if flag]


def any_rank(comm, flag: bool) -> bool:
    """Whether ``flag`` is true on some rank (every rank gets the same answer)."""
    return flag if comm is None else any(comm.allgather(bool(flag)))


@contextlib.contextmanager
def abort_on_error(comm):
    """On an exception in this rank: its message on stderr, then MPI_Abort, so the other ranks
    exit too instead of waiting in a collective for this one (mpiexec exits non-zero)."""
    try:
        yield
    except BaseException as error:  # KeyboardInterrupt and SystemExit included
        if comm is None:
            raise
        code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
        if code == 0:
            raise
        if not isinstance(error, SystemExit):
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            print(f"onnx-autodiff: error on rank {comm.Get_rank()} of {comm.Get_size()}: {message}",
                  file=sys.stderr, flush=True)
            # mpiexec forwards a rank's output asynchronously, and the abort can tear that down
            # before the message is through (seen once under load: nothing on stderr at all)
            time.sleep(ABORT_GRACE)
        comm.Abort(code)
