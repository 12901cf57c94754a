"""A plain loop under ``--recovery in-place`` whose replacement starts slowly (tests/test_regroup.py).

Rank 1 kills itself with SIGKILL in its third step. Its replacement sleeps ``START_S`` seconds (default
1.5) before ``dptrain.init()``, as a fresh interpreter on a loaded machine takes to import torch, so the
survivor waits that long for it in the new generation's rendezvous.
"""

import os
import signal
import time

import torch

import dptrain

GEN = int(os.environ.get("DPTRAIN_GENERATION") or 0)
if GEN:
    time.sleep(float(os.environ.get("START_S", "1.5")))
dptrain.init()
torch.manual_seed(0)
model = dptrain.DDP(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
loop = dptrain.RecoverableLoop(model, optimizer, dptrain.prepare_dataloader(data, batch_size=4))
for epoch in loop.epochs(1):
    for inputs, targets in loop.batches():
        with loop.step():
            if dptrain.rank() == 1 and GEN == 0 and loop.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
print(f"rank {dptrain.rank()} done at step {loop.global_step}", flush=True)
dptrain.shutdown()
