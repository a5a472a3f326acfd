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

Calls run synchronously: each collective has finished (with the GIL released while it
communicated) when the method returns, and the returned Work wraps an already completed
``torch.futures.Future`` whose value is the output tensors. ``async_op=True`` therefore
returns a completed Work; there is no overlap of computation and communication yet.

Timeouts: a call fails when a peer makes no progress for torch's process-group timeout
(``init_process_group(timeout=...)``, default 30 minutes) unless ``LIGHTPATH_COLL_TIMEOUT_MS``
is set. A dead peer is noticed at once either way.
"""

import atexit
import datetime
import os
import socket
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp, _create_work_from_future

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


_PLAIN = frozenset([torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16])


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


def _completed(result: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


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
        # Staging tensors for the list forms (all_gather into a list, ...), kept per thread
        # and dtype and grown as needed: a fresh 32 MiB tensor costs ~14 ms of page faults
        # per call here, a reused one nothing.
        self._local = threading.local()
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
    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``numel`` elements, reused by later calls (contents
        undefined)."""
        scratch = self._local.__dict__.setdefault("scratch", {})
        have = scratch.get(dtype)
        if have is None or have.numel() < numel:
            have = torch.empty(numel, dtype=dtype)
            scratch[dtype] = have
        return have[:numel]

    def _each(self, tensors: Sequence[torch.Tensor], what: str, call: Callable[[_Buffer], None]) -> Any:
        for t in tensors:
            b = _Buffer(t, what)
            call(b)
            b.finish()
        return _completed(list(tensors))

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return self._each(tensors, "allreduce", lambda b: self.comm.allreduce(b.array, op=op, dtype=b.dtype))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        if len({t.dtype for t in tensors}) > 1:
            raise InvalidArgumentError("allreduce_coalesced: tensors of different dtypes", None, "allreduce")
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        b = _Buffer(flat, "allreduce_coalesced")
        self.comm.allreduce(b.array, op=op, dtype=b.dtype)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
        return _completed(list(tensors))

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        root = opts.rootRank if opts is not None else 0
        return self._each(tensors, "broadcast", lambda b: self.comm.broadcast(b.array, root=root))

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        root = opts.rootRank if opts is not None else 0
        return self._each(tensors, "reduce", lambda b: self.comm.reduce(b.array, root=root, op=op, dtype=b.dtype))

    def allgather(
        self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self.size():
                raise InvalidArgumentError(
                    f"allgather: {len(outs)} output tensors for {self.size()} ranks", None, "allgather"
                )
            if inp.numel() * inp.element_size() >= _LIST_ALLGATHER_BY_BROADCAST and self._broadcast_each(outs, inp):
                continue
            src = _Buffer(inp, "allgather")
            flat = self._staging(self.size() * src.work.numel(), src.work.dtype).view(
                (self.size(),) + tuple(src.work.shape)
            )
            dst = _Buffer(flat, "allgather")
            self.comm.allgather(src.array, dst.array)
            with torch.no_grad():
                for q, o in enumerate(outs):
                    o.copy_(flat[q].reshape(o.shape))
        return _completed(list(output_tensors))

    def _broadcast_each(self, outs: List[torch.Tensor], inp: torch.Tensor) -> bool:
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
            self.comm.broadcast(b.array, root=q)
            b.finish()
        return True

    def allgather_coalesced(
        self, output_lists: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        for outs, inp in zip(output_lists, input_tensors):
            self.allgather([outs], [inp])
        return _completed(list(output_lists))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        dst, src = _Buffer(output, "all_gather_into_tensor"), _Buffer(input, "all_gather_into_tensor")
        self.comm.allgather(src.array, dst.array)
        dst.finish()
        return _completed([output])

    def reduce_scatter(
        self, output_tensors: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for out, ins in zip(output_tensors, input_lists):
            if len(ins) != self.size():
                raise InvalidArgumentError(
                    f"reduce_scatter: {len(ins)} input tensors for {self.size()} ranks", None, "reduce_scatter"
                )
            flat = self._staging(sum(t.numel() for t in ins), ins[0].dtype)
            torch.cat([t.detach().reshape(-1) for t in ins], out=flat)
            dst, src = _Buffer(out, "reduce_scatter"), _Buffer(flat, "reduce_scatter")
            self.comm.reduce_scatter(src.array, dst.array, op=op, dtype=dst.dtype)
            dst.finish()
        return _completed(list(output_tensors))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        dst, src = _Buffer(output, "reduce_scatter_tensor"), _Buffer(input, "reduce_scatter_tensor")
        self.comm.reduce_scatter(src.array, dst.array, op=op, dtype=dst.dtype)
        dst.finish()
        return _completed([output])

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: Any = None,
    ) -> Any:
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
        self.comm.alltoallv(
            src.array.reshape(-1),
            counts(input, input_split_sizes, "input"),
            dst.array.reshape(-1),
            counts(output, output_split_sizes, "output"),
        )
        dst.finish()
        return _completed([output])

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any = None) -> Any:
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype)
        src, dst = _Buffer(flat_in, "all_to_all"), _Buffer(flat_out, "all_to_all")
        self.comm.alltoallv(
            src.array, [t.numel() for t in input_tensors], dst.array, [t.numel() for t in output_tensors]
        )
        offset = 0
        with torch.no_grad():
            for t in output_tensors:
                t.copy_(flat_out[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return _completed(list(output_tensors))

    def gather(
        self, output_lists: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        root = opts.rootRank if opts is not None else 0
        p, me = self.size(), self.rank()
        inp = input_tensors[0]
        n = inp.numel()
        src = _Buffer(inp.detach().reshape(-1), "gather")
        flat = torch.empty(n * p if me == root else 0, dtype=src.work.dtype)
        dst = _Buffer(flat, "gather")
        send = [n if q == root else 0 for q in range(p)]
        recv = [n if me == root else 0 for _ in range(p)]
        self.comm.alltoallv(src.array.reshape(-1), send, dst.array, recv)
        if me == root:
            with torch.no_grad():
                for q, o in enumerate(output_lists[0]):
                    o.copy_(flat[q * n : (q + 1) * n].view_as(o))
        return _completed(list(output_lists))

    def scatter(
        self, output_tensors: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
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
        self.comm.alltoallv(src.array, send, dst.array.reshape(-1), recv)
        dst.finish()
        return _completed(list(output_tensors))

    def barrier(self, opts: Any = None) -> Any:
        self.comm.barrier()
        return _completed([])

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._each(tensors, "send", lambda b: self.comm.send(b.array, dst))

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._each(tensors, "recv", lambda b: self.comm.recv(b.array, src))

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
