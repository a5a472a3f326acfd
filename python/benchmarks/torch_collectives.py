"""The same torch.distributed calls on gloo and on lightpath, side by side in one job.

The default group is gloo; a second group over the same ranks uses "lightpath". For each call
(all_reduce, all_gather with a tensor list, broadcast) and size (float32 tensors, 8 B to
64 MiB per rank), both groups run the same number of back-to-back calls, alternating
gloo/lightpath rounds so that machine noise hits both; rank 0 prints the mean time per call
of the best round and the ratio gloo/lightpath (> 1: lightpath is faster).

    python3 -m torch.distributed.run --nproc_per_node 2 --redirects 1 --tee 1 --standalone \
        python/benchmarks/torch_collectives.py [MAX_BYTES]
"""

import sys
import time

import torch
import torch.distributed as dist

import lightpath.torch  # noqa: F401

max_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
dist.init_process_group("gloo")
lp = dist.new_group(list(range(dist.get_world_size())), backend="lightpath")
gloo = dist.group.WORLD
rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)

sizes = []
b = 8
while b <= max_bytes:
    sizes.append(b)
    b *= 8 if b < 64 << 10 else 4
if 64 << 10 not in sizes and max_bytes >= 64 << 10:
    sizes.append(64 << 10)
sizes = sorted(set(sizes))


def calls(op, n, group):
    # Data, not zeros: a zeroed allocation is untouched memory whose reads all hit one shared
    # zero page, and on this kind of VM even written zeros copy ~1.5x faster than data
    # (scripts/coll_compare.sh). Repeated sums overflow to inf, which costs nothing extra.
    x = torch.ones(n // 4)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0, group=group)
    outs = [torch.empty(n // 4) for _ in range(size)]
    return lambda: dist.all_gather(outs, x, group=group)


def timed(f, iters):
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t0) / iters


if rank == 0:
    transports = lp.comm.transports() if hasattr(lp, "comm") else "?"
    print(f"{size} ranks, lightpath transports {transports}; time per call (best of 3 rounds); ratio = gloo / lightpath", flush=True)
    print(f"{'op':<11} {'bytes':>9} {'gloo us':>10} {'lightpath us':>13} {'ratio':>7}", flush=True)
for op in ["all_reduce", "all_gather", "broadcast"]:
    for n in sizes:
        iters = max(5, min(2000, (256 << 20) // (n * 8)))
        fg, fl = calls(op, n, gloo), calls(op, n, lp)
        fg(), fl()  # warm up (connections, buffers)
        best_g = best_l = float("inf")
        for _ in range(3):
            best_g = min(best_g, timed(fg, iters))
            best_l = min(best_l, timed(fl, iters))
        if rank == 0:
            print(f"{op:<11} {n:>9} {best_g * 1e6:>10.1f} {best_l * 1e6:>13.1f} {best_g / best_l:>7.2f}", flush=True)
dist.destroy_process_group()
