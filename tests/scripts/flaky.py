"""Fails on the first attempt and succeeds after the launcher restarts it; says whether the rank
was forked from the launcher's warm template (its parent is the template) or is a new interpreter."""
import os
import sys

with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
    forked = b"dptrain.launcher.template" in fh.read()

import torch

import dptrain
from dptrain import comm

world = dptrain.init()
t = torch.ones(1)
comm.all_reduce(t)
if world.restart_count == 0 and world.rank == int(sys.argv[1]):
    os._exit(3)
print(f"attempt {world.restart_count} sum {t.item()} forked {forked}", flush=True)
