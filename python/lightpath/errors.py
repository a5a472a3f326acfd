"""Exceptions raised by lightpath's collectives.

Every failure of a collective call says which rank is at fault (a world rank), which
operation failed and its sequence number on the communicator (the n-th call, counted alike on
every rank), so that a job's logs point at one call on one rank.
"""

from typing import Optional

__all__ = [
    "LightpathError",
    "PeerFailedError",
    "CollectiveTimeoutError",
    "AbortedError",
    "MismatchError",
    "InvalidArgumentError",
    "BootstrapError",
]


class LightpathError(RuntimeError):
    """A collective call failed.

    Attributes:
        rank: the world rank at fault (None when the error names none).
        op: the operation (``"allreduce"``, ...), None for bootstrap errors.
        seq: the call's sequence number on its communicator, if any.
        reporter: for :class:`AbortedError`, the rank that aborted the job.
    """

    def __init__(
        self,
        message: str,
        rank: Optional[int] = None,
        op: Optional[str] = None,
        seq: Optional[int] = None,
        reporter: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.seq = seq
        self.reporter = reporter


class PeerFailedError(LightpathError):
    """A peer's process ended or its connection broke while the call needed it."""


class CollectiveTimeoutError(LightpathError):
    """A peer made no progress within the timeout (``LIGHTPATH_COLL_TIMEOUT_MS``)."""


class AbortedError(LightpathError):
    """Another rank aborted the job; ``rank`` is the one it blamed, ``reporter`` itself."""


class MismatchError(LightpathError):
    """Ranks called different collectives (found with ``LIGHTPATH_COLL_DEBUG=1``)."""


class InvalidArgumentError(LightpathError, ValueError):
    """The call's arguments are inconsistent on this rank (nothing was sent)."""


class BootstrapError(LightpathError):
    """Joining the job failed (environment, store, connections)."""
