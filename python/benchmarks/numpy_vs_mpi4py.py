"""numpy allreduce (sum, float32, in place) with lightpath and with mpi4py (Open MPI) in the
same mpirun job, alternating rounds; rank 0 prints the best round's mean time per call and
the ratio mpi4py / lightpath (> 1: lightpath is faster).

    mpirun -n 2 python3 python/benchmarks/numpy_vs_mpi4py.py [MAX_BYTES]
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import lightpath

max_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
mpi = MPI.COMM_WORLD
comm = lightpath.init()
assert comm.rank == mpi.Get_rank()

sizes = []
b = 8
while b <= max_bytes:
    sizes.append(b)
    b *= 8 if b < 64 << 10 else 4
if 64 << 10 not in sizes and max_bytes >= 64 << 10:
    sizes.append(64 << 10)
sizes = sorted(set(sizes))


def timed(f, iters):
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t0) / iters


if comm.rank == 0:
    print(f"{comm.size} ranks, transports {comm.transports()}; allreduce time per call (best of 3); ratio = mpi4py / lightpath")
    print(f"{'bytes':>9} {'mpi4py us':>10} {'lightpath us':>13} {'ratio':>7}", flush=True)
for n in sizes:
    # Data, not zeros (see torch_collectives.py); repeated sums overflow to inf harmlessly.
    x = np.ones(n // 4, dtype=np.float32)
    iters = max(5, min(5000, (256 << 20) // (n * 8)))
    fm = lambda: mpi.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # noqa: E731
    fl = lambda: comm.allreduce(x)  # noqa: E731
    fm(), fl()
    best_m = best_l = float("inf")
    for _ in range(3):
        best_m = min(best_m, timed(fm, iters))
        best_l = min(best_l, timed(fl, iters))
    if comm.rank == 0:
        print(f"{n:>9} {best_m * 1e6:>10.1f} {best_l * 1e6:>13.1f} {best_m / best_l:>7.2f}", flush=True)
comm.close()
