"""A job that waits, every rank joined, until the test has probed it from outside.

Each rank says where it reaches the store and whether the job's secret is in its environment,
writes ``<AUTH_DIR>/joined<rank>``, waits for ``<AUTH_DIR>/go``, then all-reduces once more: a
job that a probe stopped or broke never prints "finished".
"""

import os
import time

import torch

import dptrain

dptrain.init()
rank = dptrain.rank()
total = torch.ones(1)
dptrain.comm.all_reduce(total)
secret_seen = any(name.startswith("DPTRAIN_SECRET") for name in os.environ)
print(f"rank {rank} joined at {os.environ['MASTER_ADDR']}, secret in its environment: {secret_seen}", flush=True)
folder = os.environ["AUTH_DIR"]
open(os.path.join(folder, f"joined{rank}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
dptrain.comm.all_reduce(total)
print(f"rank {rank} finished, sum {int(total.item())}", flush=True)
dptrain.shutdown()
