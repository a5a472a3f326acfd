"""Type stubs for lightpath's native module (src/lib.rs)."""

from typing import Any, Callable, List, Optional

# Anything with the buffer protocol (numpy arrays, bytearray, memoryview, array.array, ...)
# or DLPack on the CPU (torch tensors). Buffers must be C-contiguous; outputs writable.
Buffer = Any

# Called once a nonblocking call has ended: with None, or with the call's exception.
Callback = Optional[Callable[[Optional[BaseException]], Any]]

class Request:
    """A nonblocking call started by a ``Communicator.i*`` method. Its buffers belong to the
    call until ``wait`` returns; dropping the request does not cancel the call."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits (GIL released) and raises the call's error; False if ``timeout`` seconds
        passed first. The callback has run when this returns True."""
    def done(self) -> bool:
        """Whether the call has ended and its callback ran."""

class Communicator:
    """A group of ranks and the collective calls among them.

    Every rank must make the same calls in the same order. Reductions take the element type
    from the buffer (float32/64/16, int32/64, uint8) or from ``dtype`` ("f32", "f64", "f16",
    "bf16", "i32", "i64", "u8" or the numpy names); the other calls move bytes. The GIL is
    released while a call communicates. Failures raise ``lightpath.errors`` exceptions.
    """

    @staticmethod
    def from_env() -> "Communicator":
        """Joins the job the launcher's environment describes (see ``lightpath.init``)."""
    @staticmethod
    def join(
        rank: int,
        size: int,
        store: str,
        prefix: str = "",
        timeout: Optional[float] = None,
        init_timeout: Optional[float] = None,
    ) -> "Communicator":
        """Joins ``size`` ranks as ``rank`` at the rendezvous store ``"host:port"``."""
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
    @property
    def size(self) -> int:
        """Number of ranks in the group."""
    @property
    def world_ranks(self) -> List[int]:
        """World rank of each member, in group order."""
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
    def transports(self) -> List[Optional[str]]:
        """How this rank reaches each world rank (None for itself), e.g. "rdma/shm"."""
    def allreduce(self, buf: Buffer, out: Optional[Buffer] = None, op: str = "sum", dtype: Optional[str] = None) -> None:
        """``out`` = op over every rank's ``buf`` (in place on ``buf`` when ``out`` is None)."""
    def reduce(self, buf: Buffer, root: int = 0, op: str = "sum", dtype: Optional[str] = None) -> None:
        """The root's ``buf`` = op over every rank's ``buf``; others unchanged."""
    def broadcast(self, buf: Buffer, root: int = 0) -> None:
        """Every rank's ``buf`` = the root's."""
    def allgather(self, buf: Optional[Buffer], out: Buffer) -> None:
        """``out`` = every rank's ``buf`` in rank order; ``buf=None``: in place in ``out``."""
    def allgatherv(self, buf: Buffer, out: Buffer, counts: List[int]) -> None:
        """Allgather of ``counts[r]`` elements from rank ``r``."""
    def reduce_scatter(self, buf: Buffer, out: Buffer, op: str = "sum", dtype: Optional[str] = None) -> None:
        """``out`` = op over every rank's block ``rank`` of ``buf`` (``size`` blocks)."""
    def alltoall(self, buf: Buffer, out: Buffer) -> None:
        """Block ``j`` of ``buf`` to rank ``j``; block ``i`` of ``out`` from rank ``i``."""
    def alltoallv(self, buf: Buffer, send_counts: List[int], out: Buffer, recv_counts: List[int]) -> None:
        """Alltoall with element counts per peer."""
    def barrier(self) -> None:
        """Returns once every rank has entered."""
    def send(self, buf: Buffer, peer: int) -> None:
        """Sends ``buf`` to ``peer`` (which receives as many bytes)."""
    def recv(self, buf: Buffer, peer: int) -> None:
        """Receives ``len(buf)`` bytes from ``peer``."""
    # Nonblocking forms: start the call and return at once. Calls of a process run in the
    # order they were started, blocking and nonblocking alike. ``blocking=True`` runs the call
    # before returning None instead (a failure raises; the callback gets None).
    def iallreduce(
        self, buf: Buffer, out: Optional[Buffer] = None, op: str = "sum", dtype: Optional[str] = None, callback: Callback = None, blocking: bool = False
    ) -> Optional[Request]: ...
    def ireduce(
        self, buf: Buffer, root: int = 0, op: str = "sum", dtype: Optional[str] = None, callback: Callback = None, blocking: bool = False
    ) -> Optional[Request]: ...
    def ibroadcast(self, buf: Buffer, root: int = 0, callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def iallgather(self, buf: Optional[Buffer], out: Buffer, callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def iallgatherv(self, buf: Buffer, out: Buffer, counts: List[int], callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def ireduce_scatter(
        self, buf: Buffer, out: Buffer, op: str = "sum", dtype: Optional[str] = None, callback: Callback = None, blocking: bool = False
    ) -> Optional[Request]: ...
    def ialltoall(self, buf: Buffer, out: Buffer, callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def ialltoallv(
        self, buf: Buffer, send_counts: List[int], out: Buffer, recv_counts: List[int], callback: Callback = None, blocking: bool = False
    ) -> Optional[Request]: ...
    def ibarrier(self, callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def isend(self, buf: Buffer, peer: int, callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def irecv(self, buf: Buffer, peer: int, callback: Callback = None, blocking: bool = False) -> Optional[Request]: ...
    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Ranks with the same color form a new communicator (ordered by key, then rank)."""
    def abort(self, reason: str) -> None:
        """Makes every rank's current or next call raise ``AbortedError``."""
    def close(self) -> None:
        """Leaves the job cleanly (nonblocking calls still running end first); later calls
        raise."""
    def __enter__(self) -> "Communicator": ...
    def __exit__(self, *args: Any) -> None: ...

class StoreServer:
    """A rendezvous store (TCPStore protocol) served by this process until closed."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None: ...
    @property
    def port(self) -> int:
        """The port it listens on."""
    def close(self) -> None:
        """Stops serving."""
