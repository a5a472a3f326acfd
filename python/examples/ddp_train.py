"""DistributedDataParallel over the "lightpath" backend (CPU tensors).

    python3 -m torch.distributed.run --nproc_per_node 2 --redirects 1 --tee 1 --standalone examples/ddp_train.py
    mpirun -n 2 -x MASTER_PORT=29500 python3 examples/ddp_train.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightpath.torch  # noqa: F401  (registers the "lightpath" backend)

if "OMPI_COMM_WORLD_RANK" in os.environ:  # under mpirun, torch's env:// from Open MPI's variables
    os.environ.setdefault("RANK", os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ.setdefault("WORLD_SIZE", os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
dist.init_process_group("lightpath")
rank = dist.get_rank()

torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(rank)
for step in range(200):
    x = torch.randn(32, 16, generator=data)
    y = x.sum(dim=1, keepdim=True)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # gradients are averaged over the ranks by lightpath allreduces
    opt.step()
    if step % 50 == 0 and rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
print(f"rank {rank}: final loss {loss.item():.4f}")
dist.destroy_process_group()
