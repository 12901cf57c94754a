"""Rank 1 raises while the others wait in an all-reduce; they must all be stopped."""
import os
import sys
import time

import torch

import dptrain
from dptrain import comm

dptrain.init()
print(f"started {dptrain.rank()} pid {os.getpid()}", flush=True)
if dptrain.rank() == 1:
    time.sleep(0.3)
    raise RuntimeError("rank one is broken on purpose")
if len(sys.argv) > 1 and sys.argv[1] == "sleep":
    time.sleep(600)  # a rank that would never notice by itself
comm.all_reduce(torch.ones(2))
