"""Every rank takes part in one all-reduce; then the ranks of nodes other than 0 take a few
more seconds to finish (writing results, say) while node 0's ranks have already exited."""

import os
import time

import torch

import dptrain

dptrain.init()
total = torch.ones(1)
dptrain.comm.all_reduce(total)
dptrain.shutdown()
if int(os.environ["GROUP_RANK"]) != 0:
    time.sleep(float(os.environ.get("LATE_S", "3")))
print(f"rank {os.environ['RANK']} finished, sum {int(total.item())}, run {os.environ['TORCHELASTIC_RUN_ID']}",
      flush=True)
