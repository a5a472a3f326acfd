"""A rank of a torch job over the "lightpath" backend dies; the survivors' Work raises
lightpath.PeerFailedError naming it, the operation and the call's sequence number, from
``wait()``, from its future and from the next blocking call, instead of returning garbage or
hanging. Prints "torch peer failure reported ...". Run with 3 ranks (torch's env://
variables set); rank 2 dies after 4 allreduces (calls #1-#4: joining's barrier is #0), so
the failing call is allreduce #5."""

import os
import time

import torch
import torch.distributed as dist

import lightpath
import lightpath.torch  # noqa: F401  (registers the backend)

dist.init_process_group("lightpath")
r = dist.get_rank()
x = torch.ones(1000)
for i in range(4):
    dist.all_reduce(x)
if r == 2:
    # The others are in allreduce #5, waiting for this rank, when it dies.
    time.sleep(0.5)
    os._exit(3)  # no goodbye: looks like a crash
work = dist.all_reduce(x, async_op=True)
try:
    work.wait()
except lightpath.PeerFailedError as e:
    assert e.rank == 2 and e.op == "allreduce" and e.seq == 5, (e.rank, e.op, e.seq, str(e))
    reported = e
else:
    raise AssertionError("allreduce with a dead peer succeeded")
assert work.is_completed() and not work.is_success()
try:
    work.get_future().wait()
except lightpath.PeerFailedError as e:
    assert e is reported, (e, reported)
else:
    raise AssertionError("the failed allreduce's future has a value")
# every later call fails too, blocking ones included
try:
    dist.barrier()
except lightpath.LightpathError:
    pass
else:
    raise AssertionError("barrier after a failure succeeded")
e = reported
print(f"torch peer failure reported on rank {r}: rank={e.rank} op={e.op} seq={e.seq}: {e}", flush=True)
os._exit(0)
