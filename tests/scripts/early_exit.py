"""Rank 0 returns early; rank 1 then either calls an all-reduce that needs rank 0, or goes
on working (sleeping) without collectives: `early_exit.py all_reduce|work SECONDS`."""
import sys
import time

import torch

import dptrain
from dptrain import comm

world = dptrain.init()
comm.all_reduce(torch.ones(1))  # both ranks are up and connected
if world.rank == 0:
    print("rank 0 returns early", flush=True)
    sys.exit(0)
if sys.argv[1] == "all_reduce":
    time.sleep(0.5)  # rank 0 is gone by now
    comm.all_reduce(torch.ones(1))
else:
    time.sleep(float(sys.argv[2]))
    print("rank 1 done", flush=True)
