"""Every torch.distributed call the lightpath backend implements, on CPU tensors, checked
against values computed locally. Run under torchrun or mpirun; prints "torch collectives
correct on rank R". (Not a gloo comparison: torch 1.13's gloo lacks all_gather_into_tensor.)"""

import datetime
import os
import time

import torch
import torch.distributed as dist

import lightpath.torch  # noqa: F401  (registers the backend)

backend = "lightpath"
if "OMPI_COMM_WORLD_RANK" in os.environ:  # mpirun: torch needs the env:// variables
    os.environ.setdefault("RANK", os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ.setdefault("WORLD_SIZE", os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
r, p = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == backend, dist.get_backend()


def val(rank, shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) % 5 + rank + 1).reshape(shape).to(dtype)


for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]:
    shape = (3, 7)
    ins = [val(q, shape, dtype) for q in range(p)]
    want = sum(i.to(torch.float64) for i in ins).to(dtype)
    t = ins[r].clone()
    dist.all_reduce(t)
    assert torch.equal(t, want), (dtype, t, want)
    t = ins[r].clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t, ins[p - 1]), dtype
    t = ins[r].clone()
    work = dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True)
    work.wait()
    assert torch.equal(t, ins[0]) and work.is_completed(), dtype
    assert torch.equal(work.get_future().value()[0], ins[0])
    t = ins[r].clone()
    dist.broadcast(t, src=p - 1)
    assert torch.equal(t, ins[p - 1])
    t = ins[r].clone()
    dist.reduce(t, dst=0)
    # non-root buffers: unchanged with lightpath, scratch space with gloo
    assert torch.equal(t, want) if r == 0 else (backend != "lightpath" or torch.equal(t, ins[r]))
    outs = [torch.empty(shape, dtype=dtype) for _ in range(p)]
    dist.all_gather(outs, ins[r])
    assert all(torch.equal(o, i) for o, i in zip(outs, ins))
    big = torch.empty((p * 3, 7), dtype=dtype)
    dist.all_gather_into_tensor(big, ins[r])
    assert torch.equal(big, torch.cat(ins))
    # reduce_scatter (list and tensor forms): block q of every rank's input is val(q)
    out = torch.empty(shape, dtype=dtype)
    dist.reduce_scatter(out, [val(q, shape, dtype) * 1 for q in range(p)])
    assert torch.equal(out, (val(r, shape, dtype).to(torch.float64) * p).to(dtype)), (dtype, out)
    out = torch.empty(shape, dtype=dtype)
    dist.reduce_scatter_tensor(out, torch.cat([val(q, shape, dtype) for q in range(p)]))
    assert torch.equal(out, (val(r, shape, dtype).to(torch.float64) * p).to(dtype))

# all_gather into a list of large blocks (over the backend's per-rank broadcasts when every
# output is contiguous, through its staging tensor when one is not) and from a transposed input
n = 96 * 1024  # 384 KiB of float32 per rank: above LIGHTPATH_TORCH_LIST_ALLGATHER_MIN's default
ins = [torch.arange(n, dtype=torch.float32) * (q + 1) + q for q in range(p)]
outs = [torch.full((n,), -1.0) for _ in range(p)]
dist.all_gather(outs, ins[r])
assert all(torch.equal(o, i) for o, i in zip(outs, ins)), "large all_gather into contiguous outputs"
outs = [torch.full((2 * n,), -1.0)[::2] for _ in range(p)]  # strided: not contiguous
dist.all_gather(outs, ins[r])
assert all(torch.equal(o, i) for o, i in zip(outs, ins)), "large all_gather into strided outputs"
square = [torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256) + q for q in range(p)]
outs = [torch.empty(256, 512) for _ in range(p)]
dist.all_gather(outs, square[r].t())
assert all(torch.equal(o, sq.t()) for o, sq in zip(outs, square)), "large all_gather of a transposed input"

# all_to_all_single, equal and uneven splits; all_to_all with tensor lists
inp = torch.arange(p * 4, dtype=torch.int64) + 100 * r
out = torch.empty(p * 4, dtype=torch.int64)
dist.all_to_all_single(out, inp)
assert torch.equal(out, torch.cat([torch.arange(4) + 4 * r + 100 * q for q in range(p)])), out
inp = torch.cat([torch.full((j + 1, 2), float(r)) for j in range(p)])
out = torch.empty(((r + 1) * p, 2))
dist.all_to_all_single(out, inp, output_split_sizes=[r + 1] * p, input_split_sizes=[j + 1 for j in range(p)])
assert torch.equal(out, torch.cat([torch.full((r + 1, 2), float(q)) for q in range(p)])), out
outs = [torch.empty(2, dtype=torch.int32) for _ in range(p)]
dist.all_to_all(outs, [torch.full((2,), r * 10 + j, dtype=torch.int32) for j in range(p)])
assert all(torch.equal(o, torch.full((2,), q * 10 + r, dtype=torch.int32)) for q, o in enumerate(outs))
# gather / scatter to and from the last rank
g = [torch.empty(3) for _ in range(p)] if r == p - 1 else None
dist.gather(torch.full((3,), float(r)), g, dst=p - 1)
if r == p - 1:
    assert all(torch.equal(x, torch.full((3,), float(q))) for q, x in enumerate(g))
s = torch.empty(3)
dist.scatter(s, [torch.full((3,), float(q * 2)) for q in range(p)] if r == p - 1 else None, src=p - 1)
assert torch.equal(s, torch.full((3,), float(r * 2)))
# non-contiguous and complex tensors
base = torch.ones(4, 6) * (r + 1)
m = base[:, ::2]
assert not m.is_contiguous()
dist.all_reduce(m)
assert torch.equal(m, torch.full((4, 3), float(sum(range(1, p + 1))))) and torch.equal(base[:, 1::2], torch.full((4, 3), float(r + 1))), base
c = torch.full((3,), complex(r, 1))
dist.all_reduce(c)
assert torch.equal(c, torch.full((3,), complex(sum(range(p)), p)))
# send/recv between ranks 0 and 1
if p > 1 and r < 2:
    if r == 0:
        dist.send(torch.arange(10, dtype=torch.float32), dst=1)
        back = torch.empty(5, dtype=torch.int64)
        dist.recv(back, src=1)
        assert torch.equal(back, torch.arange(5) * 7)
    else:
        x = torch.empty(10)
        dist.recv(x, src=0)
        assert torch.equal(x, torch.arange(10, dtype=torch.float32))
        dist.send(torch.arange(5) * 7, dst=0)
dist.barrier()
# a subgroup of the even ranks
evens = dist.new_group(list(range(0, p, 2)), backend=backend)
if r % 2 == 0:
    x = torch.tensor([r])
    dist.all_reduce(x, group=evens)
    assert x.item() == sum(range(0, p, 2))
# bad input raises on this rank only
if backend == "lightpath":
    try:
        dist.all_reduce(torch.zeros(2, dtype=torch.int8))
    except (TypeError, RuntimeError) as e:
        assert "int8" in str(e) or "cannot be reduced" in str(e), e
    else:
        raise AssertionError("int8 allreduce should raise")
    try:
        dist.all_reduce(torch.zeros(2), op=dist.ReduceOp.BXOR)
    except (ValueError, RuntimeError) as e:
        assert "not supported" in str(e), e
    else:
        raise AssertionError("BXOR should raise")

# Asynchronous Work. Rank 0 starts an allreduce with async_op=True and only then tells the
# others (through torch's store) to join it: a backend that ran the call inside all_reduce
# would wait there for ranks that wait for rank 0, and the job would hang.
store = dist.distributed_c10d._get_default_store()
t = torch.full((1000,), float(r + 1))
if r == 0:
    work = dist.all_reduce(t, async_op=True)
    assert not work.is_completed(), "the allreduce ended before the other ranks joined it"
    store.set("async-go", "1")
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0].sum().item())
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert chained.wait() == 1000 * sum(range(1, p + 1)), chained.wait()
else:
    store.wait(["async-go"])
    work = dist.all_reduce(t, async_op=True)
    assert torch.equal(work.get_future().wait()[0], t)
assert torch.equal(t, torch.full((1000,), float(sum(range(1, p + 1))))), t
# Many calls in flight at once, of different kinds, waited in reverse order; list forms use
# staging tensors that calls in flight must not share.
works, checks = [], []
for i in range(20):
    a = torch.full((64,), float(r + i))
    works.append(dist.all_reduce(a, async_op=True))
    checks.append((a, torch.full((64,), float(sum(q + i for q in range(p))))))
    outs = [torch.empty(8, dtype=torch.int64) for _ in range(p)]
    works.append(dist.all_gather(outs, torch.full((8,), r * 100 + i, dtype=torch.int64), async_op=True))
    for q, o in enumerate(outs):
        checks.append((o, torch.full((8,), q * 100 + i, dtype=torch.int64)))
for w in reversed(works):
    w.wait()
for got, want in checks:
    assert torch.equal(got, want), (got, want)
# A Work waited for only after it ended is let go then, with its tensors.
late = dist.all_reduce(torch.ones(4), async_op=True)
while not late.is_completed():
    time.sleep(0.001)
late.wait()
assert id(late) not in lightpath.torch._unclaimed and id(late) not in lightpath.torch._kept
# A Work nobody waits for still completes its future, and the backend lets it go.
for i in range(50):
    dist.all_reduce(torch.ones(4), async_op=True)
dist.barrier()
kept = len(lightpath.torch._kept)
assert kept <= 60, f"{kept} works kept after they ended"

# The process group's Communicator takes torch tensors directly (DLPack).
comm = dist.distributed_c10d._get_default_group().comm
t = torch.full((5,), float(r + 1))
comm.allreduce(t)
assert torch.equal(t, torch.full((5,), float(sum(range(1, p + 1))))), t
b = torch.ones(4, dtype=torch.bfloat16)
comm.allreduce(b)
assert torch.equal(b, torch.full((4,), float(p), dtype=torch.bfloat16)), b
src, out = torch.arange(6, dtype=torch.int64).reshape(2, 3) + 10 * r, torch.empty(6 * p, dtype=torch.int64)
comm.allgather(src, out)
assert torch.equal(out, torch.cat([torch.arange(6) + 10 * q for q in range(p)]))
i8 = torch.full((3,), r, dtype=torch.int8)
comm.broadcast(i8, root=p - 1)
assert torch.equal(i8, torch.full((3,), p - 1, dtype=torch.int8))
for bad, exc in [
    (torch.ones(4, 4)[:, 0], BufferError),  # not contiguous
    (torch.zeros(3, dtype=torch.int8), TypeError),  # not reducible
    (torch.zeros(3, requires_grad=True), BufferError),  # torch refuses to export it
]:
    try:
        comm.allreduce(bad)
    except exc:
        pass
    else:
        raise AssertionError(f"allreduce of {bad} should raise {exc.__name__}")
for _ in range(2000):  # every call takes the tensor from its capsule and frees it once
    comm.allreduce(t[:1])
dist.barrier()
print(f"torch collectives correct on rank {r} ({backend})", flush=True)
dist.destroy_process_group()
