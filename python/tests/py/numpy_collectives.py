"""Every Communicator call on numpy arrays (and other buffer-protocol objects), checked
against values computed locally. Run as every rank of a job (any launcher lightpath.init
understands); prints "numpy collectives correct on rank R" at the end."""

import array
import sys

import numpy as np

import lightpath
from lightpath import errors

comm = lightpath.init()
r, p = comm.rank, comm.size
assert lightpath.init() is comm


def rank_values(rank, n, dtype):
    return (np.arange(n) % 7 + 3 * rank + 1).astype(dtype)


DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8]
for dtype in DTYPES:
    for n in [0, 1, 5, 1000, 70_001]:
        all_inputs = [rank_values(q, n, dtype) for q in range(p)]
        mine = all_inputs[r]
        # out of place
        out = np.empty_like(mine)
        comm.allreduce(mine, out)
        want = np.sum(np.stack(all_inputs).astype(np.float64), axis=0).astype(dtype) if dtype != np.uint8 else np.sum(np.stack(all_inputs), axis=0, dtype=np.uint8)
        assert np.array_equal(out, want), (dtype, n, out[:5], want[:5])
        assert np.array_equal(mine, rank_values(r, n, dtype)), "input changed"
        # in place, max and min
        buf = mine.copy()
        comm.allreduce(buf, op=lightpath.MAX)
        assert np.array_equal(buf, np.max(np.stack(all_inputs), axis=0) if n else buf)
        buf = mine.copy()
        comm.allreduce(buf, op="min")
        assert np.array_equal(buf, np.min(np.stack(all_inputs), axis=0) if n else buf)
        # reduce to the last rank
        buf = mine.copy()
        comm.reduce(buf, root=p - 1, op="sum")
        if r == p - 1:
            assert np.array_equal(buf, want)
        else:
            assert np.array_equal(buf, mine)
        # broadcast from rank 0
        buf = mine.copy()
        comm.broadcast(buf, root=0)
        assert np.array_equal(buf, all_inputs[0])
        # allgather: out of place and in place
        out = np.empty(n * p, dtype=dtype)
        comm.allgather(mine, out)
        assert np.array_equal(out, np.concatenate(all_inputs))
        out2 = np.zeros(n * p, dtype=dtype)
        out2[r * n:(r + 1) * n] = mine
        comm.allgather(None, out2)
        assert np.array_equal(out2, np.concatenate(all_inputs))
        # reduce_scatter: block q of each rank's input
        big = [np.concatenate([rank_values(q, n, dtype)] * p) for q in range(p)]
        out = np.empty(n, dtype=dtype)
        comm.reduce_scatter(big[r], out)
        assert np.array_equal(out, want)
        # alltoall: block j of rank q's input is q*10+j
        send = np.concatenate([np.full(n, (r * 10 + j) % 250, dtype=dtype) for j in range(p)])
        recv = np.empty_like(send)
        comm.alltoall(send, recv)
        assert np.array_equal(recv, np.concatenate([np.full(n, (q * 10 + r) % 250, dtype=dtype) for q in range(p)]))

# 2-D arrays and avg
m = np.full((3, 4), float(r + 1), dtype=np.float64)
comm.allreduce(m, op="avg")
assert np.allclose(m, (p + 1) / 2), m
# allgatherv: rank q contributes q+1 int64 elements
mine = np.full(r + 1, r, dtype=np.int64)
out = np.empty(sum(q + 1 for q in range(p)), dtype=np.int64)
comm.allgatherv(mine, out, [q + 1 for q in range(p)])
assert np.array_equal(out, np.concatenate([np.full(q + 1, q, dtype=np.int64) for q in range(p)]))
# alltoallv: rank r sends j+1 elements to rank j
send = np.concatenate([np.full(j + 1, r, dtype=np.int32) for j in range(p)])
recv = np.empty((r + 1) * p, dtype=np.int32)
comm.alltoallv(send, [j + 1 for j in range(p)], recv, [r + 1] * p)
assert np.array_equal(recv, np.concatenate([np.full(r + 1, q, dtype=np.int32) for q in range(p)]))
# bfloat16 through a 2-byte view (1.0 is 0x3f80)
bf = np.full(8, 0x3F80, dtype=np.uint16)
comm.allreduce(bf, dtype="bf16")
assert int(bf[0]) == {1: 0x3F80, 2: 0x4000, 3: 0x4040, 4: 0x4080}.get(p, int(bf[0])), hex(bf[0])
# Other buffer-protocol objects: bytearray, array.array, memoryview of part of an array
ba = bytearray([r + 1] * 16)
comm.allreduce(ba)
assert ba == bytearray([sum(q + 1 for q in range(p)) % 256] * 16)
aa = array.array("d", [float(r)] * 10)
comm.allreduce(aa, op="max")
assert list(aa) == [float(p - 1)] * 10
whole = np.zeros(100, dtype=np.float32)
whole[10:20] = r + 1
comm.allreduce(memoryview(whole)[10:20])
assert np.all(whole[10:20] == sum(q + 1 for q in range(p))) and np.all(whole[:10] == 0)
# send/recv in a ring (even ranks send first)
if p > 1:
    nxt, prv = (r + 1) % p, (r - 1) % p
    got = np.empty(33, dtype=np.float32)
    msg = np.full(33, r, dtype=np.float32)
    if r % 2 == 0:
        comm.send(msg, nxt)
        comm.recv(got, prv)
    else:
        comm.recv(got, prv)
        comm.send(msg, nxt)
    assert np.all(got == prv)
comm.barrier()

# Bad input: clear exceptions on this rank, nothing sent, the communicator still works.
def raises(exc, f, *a, **k):
    try:
        f(*a, **k)
    except exc as e:
        return e
    raise AssertionError(f"{f.__name__} did not raise {exc.__name__}")

raises(BufferError, comm.allreduce, np.zeros((4, 4), dtype=np.float32)[:, 1])  # not contiguous
raises(BufferError, comm.allreduce, b"read-only bytes")  # not writable
raises(TypeError, comm.allreduce, np.zeros(4, dtype=np.complex64))
raises(TypeError, comm.allreduce, np.zeros(4, dtype=np.int8))
raises(TypeError, comm.allreduce, np.zeros(4, dtype=">f4"))
raises(ValueError, comm.allreduce, np.zeros(4, dtype=np.float32), op="xor")
raises(ValueError, comm.allreduce, np.zeros(4, dtype=np.float32), dtype="complex")
raises(TypeError, comm.allreduce, np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.float32))
raises(TypeError, comm.reduce_scatter, np.zeros(4 * p, dtype=np.float64), np.zeros(2, dtype=np.float32))
comm.allreduce(np.zeros(4, dtype=np.longlong), np.zeros(4, dtype=np.int64))  # "q" and "l": both i64
same = np.zeros(8, dtype=np.float32)
raises(ValueError, comm.allreduce, same, same)  # overlapping in and out
e = raises(errors.InvalidArgumentError, comm.allreduce, np.zeros(4, dtype=np.float32), np.zeros(5, dtype=np.float32))
assert e.op == "allreduce" and e.rank is None, vars(e)
raises(errors.InvalidArgumentError, comm.broadcast, np.zeros(4), root=p)
raises(errors.InvalidArgumentError, comm.send, np.zeros(4), r)
check = np.ones(4, dtype=np.float32)
comm.allreduce(check)
assert np.all(check == p)

# The GIL is released while a call waits: another thread runs meanwhile. Rank 0 enters a
# barrier late; the others' barrier waits, and their counting thread keeps counting.
import threading
import time
if p > 1:
    ticks = 0
    stop = False

    def count():
        global ticks
        while not stop:
            ticks += 1
            time.sleep(0.001)

    if r == 0:
        time.sleep(0.5)
        comm.barrier()
    else:
        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.01)
        before = ticks
        comm.barrier()
        after = ticks
        stop = True
        t.join()
        assert after - before > 50, f"only {after - before} ticks while waiting in barrier: GIL held?"

# Nonblocking calls: started in order (interleaved with a blocking one), waited in another
# order; callbacks run once, with the call's outcome, before wait returns.
n = 50_000
seen = []
a = rank_values(r, n, np.float64)
b = np.empty(n * p, dtype=np.float64)
c = np.full(7, r, dtype=np.int32)
req_a = comm.iallreduce(a, callback=lambda err: seen.append(("a", err)))
req_b = comm.iallgather(rank_values(r, n, np.float64), b, callback=lambda err: seen.append(("b", err)))
comm.broadcast(c, root=p - 1)  # blocking, between them: runs after a and b
req_bar = comm.ibarrier()
req_s = comm.ireduce_scatter(np.concatenate([np.full(3, r + 1, np.int64)] * p), np.empty(3, np.int64))
assert np.all(c == p - 1)
assert req_b.wait() is True and req_a.wait() is True and req_bar.wait() is True
assert req_a.done() and req_b.done()
assert sorted(name for name, _ in seen) == ["a", "b"] and all(err is None for _, err in seen), seen
assert np.allclose(a, np.sum([rank_values(q, n, np.float64) for q in range(p)], axis=0))
assert np.array_equal(b, np.concatenate([rank_values(q, n, np.float64) for q in range(p)]))
req_s.wait()
# A nonblocking call whose request is dropped at once still runs and keeps its buffers alive.
dropped = np.ones(1000, dtype=np.float32)
comm.iallreduce(dropped)
del dropped
pending = [comm.iallreduce(np.full(4, q, dtype=np.int64)) for q in range(64)]
assert all(req.wait(timeout=30) for req in pending)
# Bad input is refused when the call is started, and nothing is issued.
raises(TypeError, comm.iallreduce, np.zeros(4, dtype=np.int8))
raises(errors.InvalidArgumentError, comm.ibroadcast, np.zeros(4), root=p)
ok = np.ones(2, dtype=np.float32)
comm.iallreduce(ok).wait()
assert np.all(ok == p)
# blocking=True: the call has run when it returns (None), its callback too.
called = []
assert comm.iallreduce(ok, blocking=True, callback=called.append) is None
assert called == [None] and np.all(ok == p * p), (called, ok)

sub = comm.split(r % 2, key=-r)
assert sub.size == len(range(r % 2, p, 2)) and sub.rank == (sub.size - 1 - r // 2), (sub.size, sub.rank)
x = np.array([r], dtype=np.int64)
sub.allreduce(x)
assert x[0] == sum(range(r % 2, p, 2))
sub.close()
assert sub.closed
e = raises(errors.LightpathError, sub.barrier)
assert "closed" in str(e)
print(f"transports {comm.transports()}")
print(f"numpy collectives correct on rank {r}", flush=True)
