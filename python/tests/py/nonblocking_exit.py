"""Nonblocking calls at their edges, 2 ranks (RANK, MASTER_PORT set):
1. ``Request.wait(timeout)`` returns False while the call cannot end (the peer has not joined
   it: it waits for a file rank 0 writes only after that wait returned), instead of running
   the call and blocking past the timeout;
2. a call still in flight when its script ends, its communicator dropped without close: the
   interpreter's exit waits for the call, so it completes (its callback runs) and the peer
   sees no failure (rank 1 joins the call a second late).
Prints "rank 0 callback ran ..." and "rank 1 done"."""

import os
import time

import numpy as np

from lightpath import Communicator, StoreServer

r = int(os.environ["RANK"])
port = int(os.environ["MASTER_PORT"])
server = StoreServer("127.0.0.1", port) if r == 0 else None
flag = f"/tmp/lightpath-nonblocking-{port}"
if r == 0 and os.path.exists(flag):
    os.unlink(flag)  # left by a killed run: rank 1 looks only after joining, i.e. after this
comm = Communicator.join(r, 2, f"127.0.0.1:{port}")
first = np.ones(4, dtype=np.float32)
if r == 0:
    req = comm.iallreduce(first)
    assert req.wait(timeout=0.05) is False and not req.done()
    with open(flag, "w"):
        pass
    assert req.wait(timeout=30) is True and first[0] == 2
else:
    while not os.path.exists(flag):
        time.sleep(0.01)
    os.unlink(flag)
    comm.allreduce(first)
buf = np.ones(1 << 20, dtype=np.float32)
if r == 1:
    time.sleep(1.0)  # rank 0's call is still in flight when rank 0's script ends
    comm.allreduce(buf)
    comm.close()
    print("rank 1 done", flush=True)
else:
    comm.iallreduce(buf, callback=lambda err: print(f"rank 0 callback ran: err={err} sum={buf[0]}", flush=True))
    del comm  # dropped without close, the call in flight
    print("rank 0 script ends", flush=True)
