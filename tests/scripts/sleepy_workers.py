"""Each rank starts a DataLoader worker, prints its own pid and the worker's, then sleeps."""
import os
import time

import torch

import dptrain

dptrain.init()
loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=1)
batches = iter(loader)
next(batches)  # the worker process is up
print(f"rank {dptrain.rank()} pid {os.getpid()} worker {batches._workers[0].pid}", flush=True)
time.sleep(600)
