"""A small DDP training run: an MLP (with BatchNorm, whose buffers DDP broadcasts every step)
on synthetic data, a few hundred SGD steps. Run under torchrun or mpirun with the backend as
argv[1] and an output path as argv[2]: rank 0 saves the final parameters and buffers, and an
int64 tensor summed with all_reduce every step, so that two runs (lightpath and gloo) can be
compared (tests/py/compare_runs.py).

MODE (default "plain") exercises more of DDP's paths through the backend: "unused" adds a
head that only even steps use (find_unused_parameters=True: the reducer's own allreduce of
the used-parameter map, a Work it keeps and waits for later), "hook" registers the Python
allreduce comm hook (async_op=True futures chained with ``then``).

Usage: ddp_train.py BACKEND OUT.pt [STEPS] [MODE]
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightpath.torch  # noqa: F401  (registers "lightpath")

backend, out_path = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
mode = sys.argv[4] if len(sys.argv) > 4 else "plain"
assert mode in ("plain", "unused", "hook"), mode
if "OMPI_COMM_WORLD_RANK" in os.environ:  # mpirun: torch's env:// variables from Open MPI's
    os.environ.setdefault("RANK", os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ.setdefault("WORLD_SIZE", os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)



class WithSometimesHead(nn.Module):
    """The plain model plus a head that only some steps use."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_head: bool = True) -> torch.Tensor:
        y = self.body(x)
        return self.head(y) if use_head else y


torch.manual_seed(1234)  # the same initial model everywhere (DDP also broadcasts it)
model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
if mode == "unused":
    model = WithSometimesHead(model)
# small buckets: several allreduces per step
ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=(mode == "unused"))
if mode == "hook":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
teacher = torch.Generator().manual_seed(7)
w_true = torch.randn(32, 4, generator=teacher)
counter = torch.zeros(3, dtype=torch.int64)
for step in range(steps):
    x = torch.randn(16, 32, generator=gen)
    y = x @ w_true + 0.1 * torch.randn(16, 4, generator=gen)
    out = ddp(x, step % 2 == 0) if mode == "unused" else ddp(x)
    loss = nn.functional.mse_loss(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    # integers only (a value derived from the loss could round differently between backends)
    seen = torch.tensor([step, rank + 1, (step * 7919 + rank * 104729) % 1000003], dtype=torch.int64)
    dist.all_reduce(seen)
    counter += seen

state = {k: v.detach().clone() for k, v in model.state_dict().items()}
state["counter"] = counter
# every rank must hold the same parameters (buffers: rank 0's are broadcast at each forward,
# then every rank updates its own)
for k, v in model.named_parameters():
    gathered = [torch.empty_like(v) for _ in range(size)]
    dist.all_gather(gathered, v.detach().contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{k} differs between ranks"
if rank == 0:
    if backend == "lightpath":
        pg = dist.distributed_c10d._get_default_group()
        print(f"lightpath transports: {pg.comm.transports()}", flush=True)
    torch.save(state, out_path)
    print(f"ddp {backend} ({mode}): {steps} steps, final loss {loss.item():.5f}, saved {out_path}", flush=True)
dist.barrier()
dist.destroy_process_group()
