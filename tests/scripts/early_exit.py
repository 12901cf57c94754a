"""Rank 0 returns early; rank 1 then either calls an all-reduce that needs rank 0 (once rank 0's
process has exited), or goes on working (sleeping) without collectives:
`early_exit.py all_reduce|work SECONDS`."""
import os
import sys
import time

import torch

import dptrain
from dptrain import comm

world = dptrain.init()
pids = comm.all_gather_object(os.getpid())  # both ranks are up and connected
if world.rank == 0:
    print("rank 0 returns early", flush=True)
    sys.exit(0)
if sys.argv[1] == "all_reduce":
    while True:  # wait for rank 0's exit itself: gone, or a zombie its launcher has yet to reap
        try:
            with open(f"/proc/{pids[0]}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:  # gone (it can vanish between the open and the read: ESRCH)
            break
        time.sleep(0.01)
    comm.all_reduce(torch.ones(1))
else:
    time.sleep(float(sys.argv[2]))
    print("rank 1 done", flush=True)
