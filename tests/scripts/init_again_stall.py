"""Two init()/shutdown() cycles in one process; in the second, rank 1 stalls before a collective
that rank 0 waits in (tests/test_env.py). Rank 0 prints what its failure says of rank 1."""
import os
import time

import torch

import dptrain
from dptrain import comm

world = dptrain.init()
comm.all_reduce(torch.ones(2))
dptrain.shutdown()  # writes left/<rank>: this rank left the first job
world = dptrain.init()
if world.rank == 1:
    time.sleep(float(os.environ.get("STALL_S", "20")))
try:
    comm.all_reduce(torch.ones(3))
except Exception as exc:  # noqa: BLE001 - what rank 0 is told
    print(f"rank {world.rank} was told: {exc}", flush=True)
    os._exit(3)
