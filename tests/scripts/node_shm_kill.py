"""Two nodes of two ranks summing through node groups; rank 3 exits in step 5 (tests/test_shm_nodes.py)."""

import os

import torch
import torch.distributed as dist
from torch import nn

import dptrain

dptrain.init()
rank = dist.get_rank()
model = dptrain.DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8)), bucket_cap_mb=0.5)
print(f"CHOICE rank {rank} node_groups {model._shm is not None and model._shm.between is not None}", flush=True)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(500):
    if rank == 3 and step == 5:
        os._exit(7)
    opt.zero_grad()
    model(torch.randn(16, 64)).sum().backward()
    opt.step()
print(f"rank {rank} trained past the death of rank 3", flush=True)
