"""Three init()/shutdown() cycles in one process, rank 1 late into the second and third (tests/test_env.py).

Each cycle all-reduces the ranks' numbers, takes a DDP step on them (tensors of another shape
in each cycle: debug mode's cross-check must not compare them with an earlier cycle's) and
prints what it got; under a launcher the store outlives every cycle.
"""
import os
import time

import torch

import dptrain
from dptrain import comm

for cycle in range(3):
    if cycle and os.environ["RANK"] == "1":
        time.sleep(1.0)  # rank 0 comes first to each init after the first
    world = dptrain.init()
    if cycle and world.rank == 1:
        time.sleep(0.5)  # and to the first collective
    t = torch.full((2 + cycle,), float(world.rank + 1 + 10 * cycle))  # each cycle's collectives differ
    comm.all_reduce(t)
    model = dptrain.DDP(torch.nn.Linear(2 + cycle, 1, bias=False))
    model(t.unsqueeze(0)).sum().backward()
    grad = model.module.weight.grad.tolist()
    print(f"cycle {cycle} rank {world.rank} of {world.world_size}: {t.tolist()} grad {grad}", flush=True)
    dptrain.shutdown()
