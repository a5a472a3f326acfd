"""A rank dies in the middle of a job; the survivors' next call raises PeerFailedError that
names it, the operation and the call's sequence number. Prints "peer failure reported ...".
Run with 3 ranks; rank 2 dies after 4 allreduces (calls #1-#4: init's barrier is #0), so the
failing call is allreduce #5."""

import os
import time

import numpy as np

import lightpath

comm = lightpath.init()
r = comm.rank
x = np.ones(1000, dtype=np.float32)
for i in range(4):
    comm.allreduce(x)
if r == 2:
    # The others are in allreduce #5, waiting for this rank, when it dies. (Dying at once,
    # while they may still be inside #4, is crates/collectives/tests/processes.rs's test.)
    time.sleep(0.5)
    os._exit(3)  # no goodbye: looks like a crash
try:
    comm.allreduce(x)
except lightpath.PeerFailedError as e:
    assert e.rank == 2 and e.op == "allreduce" and e.seq == 5, (e.rank, e.op, e.seq, str(e))
    assert isinstance(e, lightpath.LightpathError)
    print(f"peer failure reported on rank {r}: rank={e.rank} op={e.op} seq={e.seq}: {e}", flush=True)
else:
    raise AssertionError("allreduce with a dead peer succeeded")
# every later call fails too
try:
    comm.barrier()
except lightpath.LightpathError:
    pass
else:
    raise AssertionError("barrier after a failure succeeded")
os._exit(0)
