"""Lightpath's collectives for Python.

``lightpath.init()`` joins the job that the launcher (torchrun, mpirun, srun or
``lightpath launch``) started and returns a :class:`Communicator`; its calls (allreduce,
broadcast, allgather, reduce_scatter, alltoall, barrier, send/recv, ...) work on numpy arrays,
torch CPU tensors (DLPack) and any C-contiguous object with the buffer protocol, in place or
out of place, with the GIL
released while they communicate. Failures raise :class:`LightpathError` subclasses that name
the rank at fault, the operation and its sequence number.

``import lightpath.torch`` registers the ``"lightpath"`` backend of ``torch.distributed``.
"""

import atexit
import threading
from typing import Optional

from . import errors
from ._lightpath import Communicator, Request, StoreServer, _finish_pending
from .errors import (
    AbortedError,
    BootstrapError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    LightpathError,
    MismatchError,
    PeerFailedError,
)

__all__ = [
    "init",
    "world",
    "Communicator",
    "Request",
    "StoreServer",
    "SUM",
    "PROD",
    "MIN",
    "MAX",
    "AVG",
    "errors",
    "LightpathError",
    "PeerFailedError",
    "CollectiveTimeoutError",
    "AbortedError",
    "MismatchError",
    "InvalidArgumentError",
    "BootstrapError",
]

#: Reduction operators (plain strings; the calls also accept "sum", "prod", ...).
SUM = "sum"
PROD = "prod"
MIN = "min"
MAX = "max"
AVG = "avg"

_world: Optional[Communicator] = None
_lock = threading.Lock()


def init() -> Communicator:
    """Joins the job the launcher's environment describes and returns its world communicator.

    Understood environments: ``lightpath launch`` (``LIGHTPATH_RANK``, ...), torchrun or any
    ``env://`` setup (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), Open MPI's
    mpirun (``OMPI_COMM_WORLD_*``) and Slurm's srun (``SLURM_PROCID``, ...). Settings come
    from the ``LIGHTPATH_COLL_*`` variables (timeouts, algorithms, address).

    Calling it again returns the same communicator. It is closed at interpreter exit (so the
    peers see a clean departure), or earlier with ``close()``.

    Raises:
        BootstrapError: no launcher environment, or the rendezvous failed.
    """
    global _world
    with _lock:
        if _world is None or _world.closed:
            _world = Communicator.from_env()
        return _world


def world() -> Communicator:
    """The communicator :func:`init` returned (raises if it was not called)."""
    if _world is None or _world.closed:
        raise LightpathError("lightpath.init() was not called (or its communicator was closed)")
    return _world


@atexit.register
def _close_world() -> None:
    if _world is not None:
        _world.close()


# At exit, before Python finalizes: the nonblocking calls of communicators dropped without
# close (a torch group destroyed with calls in flight) end and their callbacks run.
# (lightpath.torch's handler, registered later, runs before this one and closes live groups.)
atexit.register(_finish_pending)
