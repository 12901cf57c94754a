"""Fails on the first attempt and succeeds after the launcher restarts it."""
import os
import sys

import torch

import dptrain
from dptrain import comm

world = dptrain.init()
t = torch.ones(1)
comm.all_reduce(t)
if world.restart_count == 0 and world.rank == int(sys.argv[1]):
    os._exit(3)
print(f"attempt {world.restart_count} sum {t.item()}", flush=True)
