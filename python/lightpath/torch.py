"""A ``torch.distributed`` backend named ``"lightpath"`` for CPU tensors.

Importing this module registers the backend; then::

    import lightpath.torch  # noqa: F401
    torch.distributed.init_process_group("lightpath")

works under torchrun, under mpirun (with ``init_method`` or the ``env://`` variables set) and
with any other rendezvous torch supports. The process group implements what DDP and
FSDP-style code call: allreduce (and coalesced), broadcast, reduce, allgather,
``all_gather_into_tensor`` (``_allgather_base``), gather, scatter, reduce_scatter,
``reduce_scatter_tensor`` (``_reduce_scatter_base``), alltoall, ``alltoall_base``
(``all_to_all_single``), barrier, send and recv.

Bootstrap: from the store torch hands the backend, not from the launcher's environment.
Rank 0 serves a small rendezvous store of its own on a free port and publishes its address
through torch's store; every rank reads it and joins there. This works with every
``init_method`` (``env://``, ``tcp://``, ``file://``), for subgroups (``new_group`` gives each
group its own prefixed store, hence its own mesh) and never competes for ``MASTER_PORT`` with
the TCPStore torch itself serves there. The address rank 0 advertises is, in order:
``LIGHTPATH_COLL_ADDR``, the host of torch's TCPStore, ``MASTER_ADDR``, this host's name.

Calls are asynchronous, as with torch's own backends: each method starts its collective
(or collectives) on Lightpath's call thread and returns a Work at once, so DDP's bucket
allreduces overlap the rest of the backward pass and ``async_op=True`` returns before the
data moved. Calls run one at a time in the order they were started, on every rank. The
Work's ``wait()`` waits without the GIL and raises the call's ``lightpath.errors``
exception; ``get_future()`` is a ``torch.futures.Future`` whose value is the output tensors,
completed (or failed) on a thread of Lightpath's once the call ended and its outputs were
copied into place. Until then the tensors belong to the call: do not read or write them.

Timeouts: a call fails when a peer makes no progress for torch's process-group timeout
(``init_process_group(timeout=...)``, default 30 minutes) unless ``LIGHTPATH_COLL_TIMEOUT_MS``
is set. A dead peer is noticed at once either way.
"""

import atexit
import collections
import datetime
import os
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp, Work, _create_work_from_future

from ._lightpath import Communicator, StoreServer
from .errors import InvalidArgumentError

__all__ = ["ProcessGroupLightpath", "BACKEND_NAME"]

#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND_NAME = "lightpath"

_STORE_KEY = "lightpath/store"

_OPS: List[Tuple[Any, str]] = [
    (ReduceOp.SUM, "sum"),
    (ReduceOp.PRODUCT, "prod"),
    (ReduceOp.MIN, "min"),
    (ReduceOp.MAX, "max"),
]
if hasattr(ReduceOp, "AVG"):
    _OPS.append((ReduceOp.AVG, "avg"))


# The RedOpType code inside a ReduceOp (`int(op.op)`) -> name: an int lookup per call
# (0.6 us) instead of hashing the pybind enum (1.5 us) or comparing through pybind.
_BY_CODE = {int(getattr(known, "op", known)): name for known, name in _OPS}


def _op_name(op: Any) -> str:
    try:
        name = _BY_CODE.get(int(op.op))
    except (AttributeError, TypeError):
        name = None
    if name is not None:
        return name
    for known, name in _OPS:
        if op == known:
            return name
    raise InvalidArgumentError(
        f"reduce op {op} is not supported by the lightpath backend (SUM, PRODUCT, MIN, MAX, AVG)",
        None,
        "reduce_op",
    )


# A call's completion callback: None, or the call's exception.
Callback = Callable[[Optional[BaseException]], None]
# Starts one collective: with a callback (nonblocking: returns its lightpath.Request), or with
# None and True (blocking: returns once the call ended, raising its error).
_Start = Callable[[Optional[Callback], bool], Any]

_PLAIN = frozenset(
    [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16]
)


class _Buffer:
    """A CPU tensor as a numpy array sharing its memory (a contiguous copy for
    non-contiguous tensors, written back by ``finish``) and the element type to reduce it as."""

    __slots__ = ("tensor", "work", "array", "dtype")

    def __init__(self, tensor: torch.Tensor, what: str) -> None:
        self.tensor = tensor
        self.dtype: Optional[str] = None
        # Fast path (DDP's buckets): a plain contiguous CPU tensor is its own numpy array.
        if (
            tensor.dtype in _PLAIN
            and not tensor.requires_grad
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
        ):
            self.work = tensor
            self.array = tensor.numpy()
            return
        if tensor.device.type != "cpu":
            raise InvalidArgumentError(
                f"{what}: the lightpath backend takes CPU tensors, got one on {tensor.device}", None, what
            )
        work = tensor.detach()
        if not work.is_contiguous():
            work = work.contiguous()
        self.work = work
        if work.is_complex():
            work = torch.view_as_real(work)
        if work.dtype == torch.bfloat16:
            work, self.dtype = work.view(torch.int16), "bf16"
        elif work.dtype == torch.bool:
            work = work.view(torch.uint8)
        self.array = work.numpy()

    def finish(self) -> None:
        if self.work is not self.tensor and self.work.data_ptr() != self.tensor.data_ptr():
            with torch.no_grad():
                self.tensor.copy_(self.work)


class _Work(Work):
    """The Work of one process-group call: the collectives it started, and the future that
    completes once they all ended and the outputs are in place (see the module's docs)."""

    def __init__(self, result: Any, on_done: Optional[Callable[[], None]]) -> None:
        super().__init__()
        self._result = result
        self._on_done = on_done
        self._future: torch.futures.Future = torch.futures.Future()
        self._requests: List[Any] = []
        self._left = 0
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._claimed = False

    # -- the calls' side ---------------------------------------------------------------------
    def _start(self, starts: Sequence["_Start"]) -> "_Work":
        """Starts the calls in order, each with this work's callback. A call refused at its
        start (bad input) raises here; the calls started before it still run, and the work
        fails with that error once they ended."""
        self._left = len(starts) + 1  # +1: the start itself, so the work cannot end early
        _keep(self)
        try:
            for start in starts:
                self._requests.append(start(self._one_ended, False))
        except BaseException as e:
            with self._lock:
                self._left -= len(starts) - len(self._requests)
            self._one_ended(e)
            raise
        self._one_ended(None)
        return self

    def _one_ended(self, error: Optional[BaseException]) -> None:
        # Runs with the GIL, on the completion thread or in a Request.wait, once per call.
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            if self._left:
                return
        if self._error is None and self._on_done is not None:
            try:
                self._on_done()
            except BaseException as e:  # a copy back failed: the work fails with it
                self._error = e
        self._on_done = None
        if self._error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(self._error)
        self._finished.set()
        _release(self)

    # -- torch's side ------------------------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Waits (without the GIL) until the calls ended and the outputs are in place; raises
        the first call's error. ``timeout`` (a timedelta; 0, torch's default, is none): a
        RuntimeError if the calls have not ended by then (they keep running)."""
        self._claimed = True
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        deadline = time.monotonic() + seconds if seconds else None
        for request in self._requests:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ended = request.wait(left)
            except Exception:
                continue  # the call's error: this work's, raised below
            if not ended:
                raise RuntimeError(f"lightpath: the call did not end within {seconds} s")
        # Each request's wait returns once its callback ran; the last one completes the work.
        self._finished.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not self._finished.is_set():
            raise RuntimeError(f"lightpath: the call did not end within {seconds} s")
        _release(self)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        self._claimed = True
        _release(self)
        return self._future

    def is_completed(self) -> bool:
        return self._finished.is_set()

    def is_success(self) -> bool:
        return self._finished.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        pass


_C10D_FILE = dist.distributed_c10d.__file__


def _caller_waits() -> bool:
    """Whether the process-group method running was called by torch.distributed's Python API
    for a blocking call (``async_op=False``, or ``send``/``recv``): that function waits for
    the Work at once, so the collective runs right here instead, with no hand-over to the
    call thread and back (which costs more than a small call itself). Anything else (DDP's
    C++ reducer, ``async_op=True``, a direct call) gets an asynchronous Work."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    if f is None or f.f_code.co_filename != _C10D_FILE:
        return False
    if f.f_code.co_name in ("send", "recv"):
        return True
    return f.f_locals.get("async_op", True) is False


def _launch(result: Any, on_done: Optional[Callable[[], None]], starts: Sequence[_Start]) -> Work:
    """Starts the collectives of one process-group call, in order, and returns its Work
    (see ``_caller_waits`` for when they run before it returns)."""
    if _caller_waits():
        for start in starts:
            start(None, True)
        if on_done is not None:
            on_done()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)
    return _Work(result, on_done)._start(starts)


# Works torch's C++ side may still call into. C++ callers (DDP's reducer) hold a Work without
# a Python reference to it, and a Python subclass's methods are found only while its Python
# object lives; so each work is kept here until it has ended and was claimed (waited for, or
# its future taken: what every caller of a Work does). Works nobody claims are let go, oldest
# first, beyond _UNCLAIMED_LIMIT ended ones.
_kept: Dict[int, _Work] = {}
# The ended, unclaimed ones among them, oldest first (by id; a work claimed later leaves).
_unclaimed: "collections.OrderedDict[int, None]" = collections.OrderedDict()
_UNCLAIMED_LIMIT = 4096


def _keep(work: _Work) -> None:
    _kept[id(work)] = work


def _release(work: _Work) -> None:
    if not work._finished.is_set():
        return
    key = id(work)
    if work._claimed:
        _kept.pop(key, None)
        _unclaimed.pop(key, None)
        return
    if key in _kept:
        _unclaimed[key] = None
        while len(_unclaimed) > _UNCLAIMED_LIMIT:
            try:
                oldest, _ = _unclaimed.popitem(last=False)
            except KeyError:  # another thread emptied it meanwhile
                break
            _kept.pop(oldest, None)


class _Staging:
    """Scratch tensors for the list forms (all_gather into a list, ...), reused by later
    calls: a fresh 32 MiB tensor costs ~14 ms of page faults per call here, a reused one
    nothing. A tensor is taken for one call and given back when that call ended, so calls in
    flight never share one."""

    def __init__(self) -> None:
        self._free: Dict[torch.dtype, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get(dtype, [])
            for i, t in enumerate(free):
                if t.numel() >= numel:
                    return free.pop(i)
        return torch.empty(numel, dtype=dtype)

    def give(self, tensor: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(tensor.dtype, [])
            free.append(tensor)
            if len(free) > 4:  # keep the four largest
                del free[min(range(len(free)), key=lambda i: free[i].numel())]


def _advertised_host(store: Any) -> str:
    explicit = os.environ.get("LIGHTPATH_COLL_ADDR")
    if explicit:
        return explicit
    inner = store
    for _ in range(8):  # unwrap PrefixStores down to the TCPStore, if any
        if isinstance(inner, dist.TCPStore):
            return inner.host
        nxt = getattr(inner, "underlying_store", None)
        if nxt is None:
            break
        inner = nxt
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    return socket.gethostbyname(socket.gethostname())


_live: "weakref.WeakSet[ProcessGroupLightpath]" = weakref.WeakSet()

# From this many bytes per rank, an all-gather into a list of tensors broadcasts each rank's
# block straight into its output tensor instead of gathering into a staging tensor and
# copying every block out (`ProcessGroupLightpath._broadcast_each`). Below it the copies are
# cheap and one collective call beats one call per rank.
_LIST_ALLGATHER_BY_BROADCAST = int(os.environ.get("LIGHTPATH_TORCH_LIST_ALLGATHER_MIN", 256 << 10))


class ProcessGroupLightpath(ProcessGroup):
    """A process group whose collectives run over a :class:`lightpath.Communicator`.

    Made by ``torch.distributed`` when a group uses the ``"lightpath"`` backend; see the
    module's documentation for how it bootstraps and what it supports.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        server = None
        if rank == 0:
            server = StoreServer("0.0.0.0", 0)
            store.set(_STORE_KEY, f"{_advertised_host(store)}:{server.port}")
        address = store.get(_STORE_KEY).decode()
        call_timeout = None if os.environ.get("LIGHTPATH_COLL_TIMEOUT_MS") else timeout.total_seconds()
        try:
            self.comm = Communicator.join(
                rank, size, address, prefix="", timeout=call_timeout, init_timeout=timeout.total_seconds()
            )
        finally:
            # join ends with a barrier: once it returns every rank is connected and the
            # rendezvous store is no longer needed.
            if server is not None:
                server.close()
        self._staging = _Staging()
        _live.add(self)

    # -- names -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's C++ name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def close(self) -> None:
        """Leaves the group cleanly (also done at interpreter exit)."""
        self.comm.close()

    # -- helpers ---------------------------------------------------------------------------
    def _each(
        self, tensors: Sequence[torch.Tensor], what: str, start: Callable[[_Buffer, Optional[Callback], bool], Any]
    ) -> Work:
        """One call per tensor, each on the tensor itself (or a contiguous copy written back)."""
        bufs = [_Buffer(t, what) for t in tensors]
        return _launch(
            list(tensors),
            lambda: [b.finish() for b in bufs],
            [lambda done, now, b=b: start(b, done, now) for b in bufs],
        )

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Work:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        comm = self.comm
        return self._each(
            tensors,
            "allreduce",
            lambda b, done, now: comm.iallreduce(b.array, op=op, dtype=b.dtype, callback=done, blocking=now),
        )

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        if len({t.dtype for t in tensors}) > 1:
            raise InvalidArgumentError("allreduce_coalesced: tensors of different dtypes", None, "allreduce")
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        b = _Buffer(flat, "allreduce_coalesced")

        def copy_back() -> None:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n

        return _launch(
            list(tensors),
            copy_back,
            [lambda done, now: self.comm.iallreduce(b.array, op=op, dtype=b.dtype, callback=done, blocking=now)],
        )

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Work:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        root = opts.rootRank if opts is not None else 0
        comm = self.comm
        return self._each(
            tensors, "broadcast", lambda b, done, now: comm.ibroadcast(b.array, root=root, callback=done, blocking=now)
        )

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        root = opts.rootRank if opts is not None else 0
        comm = self.comm
        return self._each(
            tensors,
            "reduce",
            lambda b, done, now: comm.ireduce(b.array, root=root, op=op, dtype=b.dtype, callback=done, blocking=now),
        )

    def allgather(
        self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Work:
        starts: List[Callable[[Callback], Any]] = []
        afters: List[Callable[[], None]] = []
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self.size():
                raise InvalidArgumentError(
                    f"allgather: {len(outs)} output tensors for {self.size()} ranks", None, "allgather"
                )
            if inp.numel() * inp.element_size() >= _LIST_ALLGATHER_BY_BROADCAST and self._broadcast_each(
                outs, inp, starts, afters
            ):
                continue
            src = _Buffer(inp, "allgather")
            staging = self._staging.take(self.size() * src.work.numel(), src.work.dtype)
            flat = staging[: self.size() * src.work.numel()].view((self.size(),) + tuple(src.work.shape))
            dst = _Buffer(flat, "allgather")
            starts.append(
                lambda done, now, src=src, dst=dst: self.comm.iallgather(
                    src.array, dst.array, callback=done, blocking=now
                )
            )

            def copy_out(
                outs: List[torch.Tensor] = outs, flat: torch.Tensor = flat, staging: torch.Tensor = staging
            ) -> None:
                with torch.no_grad():
                    for q, o in enumerate(outs):
                        o.copy_(flat[q].reshape(o.shape))
                self._staging.give(staging)

            afters.append(copy_out)
        return _launch(list(output_tensors), lambda: [f() for f in afters], starts)

    def _broadcast_each(
        self,
        outs: List[torch.Tensor],
        inp: torch.Tensor,
        starts: List[Callable[[Callback], Any]],
        afters: List[Callable[[], None]],
    ) -> bool:
        """All-gather into a list by one broadcast per rank, each straight into its output
        tensor (rank ``q``'s own block copied in first). For large blocks this saves the
        staging tensor and the copy of every block out of it (at 4 MiB per rank on 2 ranks the
        copies were half the call). False, having done nothing, unless every output is a
        plain contiguous CPU tensor with the input's element type and count."""
        if not all(
            o.dtype == inp.dtype
            and o.numel() == inp.numel()
            and o.device.type == "cpu"
            and o.is_contiguous()
            and not o.requires_grad
            for o in outs
        ):
            return False
        rank = self.rank()
        with torch.no_grad():
            outs[rank].copy_(inp.reshape(outs[rank].shape))
        for q, o in enumerate(outs):
            b = _Buffer(o, "allgather")
            starts.append(
                lambda done, now, b=b, q=q: self.comm.ibroadcast(b.array, root=q, callback=done, blocking=now)
            )
            afters.append(b.finish)
        return True

    def allgather_coalesced(
        self, output_lists: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Work:
        return self.allgather(output_lists, input_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        dst, src = _Buffer(output, "all_gather_into_tensor"), _Buffer(input, "all_gather_into_tensor")
        return _launch(
            [output],
            dst.finish,
            [lambda done, now: self.comm.iallgather(src.array, dst.array, callback=done, blocking=now)],
        )

    def reduce_scatter(
        self, output_tensors: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None
    ) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        starts: List[Callable[[Callback], Any]] = []
        afters: List[Callable[[], None]] = []
        for out, ins in zip(output_tensors, input_lists):
            if len(ins) != self.size():
                raise InvalidArgumentError(
                    f"reduce_scatter: {len(ins)} input tensors for {self.size()} ranks", None, "reduce_scatter"
                )
            numel = sum(t.numel() for t in ins)
            staging = self._staging.take(numel, ins[0].dtype)
            flat = staging[:numel]
            torch.cat([t.detach().reshape(-1) for t in ins], out=flat)
            dst, src = _Buffer(out, "reduce_scatter"), _Buffer(flat, "reduce_scatter")
            starts.append(
                lambda done, now, src=src, dst=dst: self.comm.ireduce_scatter(
                    src.array, dst.array, op=op, dtype=dst.dtype, callback=done, blocking=now
                )
            )

            def after(dst: _Buffer = dst, staging: torch.Tensor = staging) -> None:
                dst.finish()
                self._staging.give(staging)

            afters.append(after)
        return _launch(list(output_tensors), lambda: [f() for f in afters], starts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        dst, src = _Buffer(output, "reduce_scatter_tensor"), _Buffer(input, "reduce_scatter_tensor")
        return _launch(
            [output],
            dst.finish,
            [
                lambda done, now: self.comm.ireduce_scatter(
                    src.array, dst.array, op=op, dtype=dst.dtype, callback=done, blocking=now
                )
            ],
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: Any = None,
    ) -> Work:
        p = self.size()

        def counts(t: torch.Tensor, splits: List[int], what: str) -> List[int]:
            if not splits:
                if t.numel() % p:
                    raise InvalidArgumentError(
                        f"all_to_all_single: the {what} ({t.numel()} elements) does not split into {p} equal blocks",
                        None,
                        "alltoall",
                    )
                return [t.numel() // p] * p
            row = t[0].numel() if t.dim() > 0 and t.shape[0] > 0 else 1
            return [s * row for s in splits]

        dst, src = _Buffer(output, "all_to_all_single"), _Buffer(input, "all_to_all_single")
        send, recv = counts(input, input_split_sizes, "input"), counts(output, output_split_sizes, "output")
        return _launch(
            [output],
            dst.finish,
            [
                lambda done, now: self.comm.ialltoallv(
                    src.array.reshape(-1), send, dst.array.reshape(-1), recv, callback=done, blocking=now
                )
            ],
        )

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any = None) -> Work:
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype)
        src, dst = _Buffer(flat_in, "all_to_all"), _Buffer(flat_out, "all_to_all")
        send, recv = [t.numel() for t in input_tensors], [t.numel() for t in output_tensors]

        def copy_out() -> None:
            offset = 0
            with torch.no_grad():
                for t in output_tensors:
                    t.copy_(flat_out[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

        return _launch(
            list(output_tensors),
            copy_out,
            [lambda done, now: self.comm.ialltoallv(src.array, send, dst.array, recv, callback=done, blocking=now)],
        )

    def gather(
        self, output_lists: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Work:
        root = opts.rootRank if opts is not None else 0
        p, me = self.size(), self.rank()
        inp = input_tensors[0]
        n = inp.numel()
        src = _Buffer(inp.detach().reshape(-1), "gather")
        flat = torch.empty(n * p if me == root else 0, dtype=src.work.dtype)
        dst = _Buffer(flat, "gather")
        send = [n if q == root else 0 for q in range(p)]
        recv = [n if me == root else 0 for _ in range(p)]

        def copy_out() -> None:
            if me == root:
                with torch.no_grad():
                    for q, o in enumerate(output_lists[0]):
                        o.copy_(flat[q * n : (q + 1) * n].view_as(o))

        return _launch(
            list(output_lists),
            copy_out,
            [
                lambda done, now: self.comm.ialltoallv(
                    src.array.reshape(-1), send, dst.array, recv, callback=done, blocking=now
                )
            ],
        )

    def scatter(
        self, output_tensors: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None
    ) -> Work:
        root = opts.rootRank if opts is not None else 0
        p, me = self.size(), self.rank()
        out = output_tensors[0]
        n = out.numel()
        if me == root:
            flat_in = torch.cat([t.detach().reshape(-1) for t in input_lists[0]])
        else:
            flat_in = torch.empty(0, dtype=out.dtype)
        src, dst = _Buffer(flat_in, "scatter"), _Buffer(out, "scatter")
        send = [n if me == root else 0 for _ in range(p)]
        recv = [n if q == root else 0 for q in range(p)]
        return _launch(
            list(output_tensors),
            dst.finish,
            [
                lambda done, now: self.comm.ialltoallv(
                    src.array, send, dst.array.reshape(-1), recv, callback=done, blocking=now
                )
            ],
        )

    def barrier(self, opts: Any = None) -> Work:
        return _launch([], None, [lambda done, now: self.comm.ibarrier(callback=done, blocking=now)])

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Work:
        comm = self.comm
        return self._each(tensors, "send", lambda b, done, now: comm.isend(b.array, dst, callback=done, blocking=now))

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Work:
        comm = self.comm
        return self._each(tensors, "recv", lambda b, done, now: comm.irecv(b.array, src, callback=done, blocking=now))

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        raise InvalidArgumentError(
            "recv from any source is not supported by the lightpath backend: name the source rank", None, "recv"
        )


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupLightpath:
    return ProcessGroupLightpath(store, rank, size, timeout)


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:  # type: ignore[attr-defined]
        dist.Backend.register_backend(BACKEND_NAME, _create)


@atexit.register
def _close_all() -> None:
    # A rank that exits without closing looks dead to its peers.
    for pg in list(_live):
        pg.close()


_register()
