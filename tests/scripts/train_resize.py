"""A Trainer job that writes down which samples each process trains on, for the in-place resize tests.

    dptrain run --nnodes 2:3 --recovery in-place --max-restarts 2 ... tests/scripts/train_resize.py --seen DIR

Every process appends one line per batch to ``<seen>/p<pid>.txt``: the process group's
generation, the epoch, the number of steps done, the rank and the batch's dataset indices. A
step abandoned by a recovery is done again under a newer generation, so for each step only the
lines of its newest generation count. At the end each rank prints its pid and a digest of its
weights. No checkpoint directory: whatever state a rank recovers comes from a live peer.
"""
import argparse
import hashlib
import os
import time

import torch
from torch import nn

import dptrain
from dptrain import env

p = argparse.ArgumentParser()
p.add_argument("--seen", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=240)
p.add_argument("--sleep", type=float, default=0.1)
args = p.parse_args()

world = dptrain.init()
print(f"started pid {os.getpid()} as rank {world.rank} of {world.world_size}", flush=True)
dptrain.seed_everything(0)
gen = torch.Generator().manual_seed(7)
x = torch.randn(args.samples, 8, generator=gen)
y = x @ torch.randn(8, 1, generator=gen)
data = torch.utils.data.TensorDataset(x, torch.arange(args.samples))  # the target is the sample's index
loader = dptrain.prepare_dataloader(data, batch_size=4, shuffle=True, seed=3)
model = nn.Linear(8, 1)
log = open(os.path.join(args.seen, f"p{os.getpid()}.txt"), "a")


def loss_fn(out, index):
    log.write(f"{env._STATE.generation} {trainer.epoch} {trainer.global_step} {dptrain.rank()} "
              f"{','.join(map(str, index.tolist()))}\n")
    log.flush()
    time.sleep(args.sleep)
    return nn.functional.mse_loss(out, y[index])


config = dptrain.TrainerConfig(verbose=False, progress=False)
trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loader, loss_fn, config)
trainer.fit(args.epochs)
digest = hashlib.sha256(b"".join(v.detach().numpy().tobytes() for v in model.state_dict().values())).hexdigest()
print(f"finished pid {os.getpid()} as rank {dptrain.rank()} of {dptrain.world_size()} at step {trainer.global_step} "
      f"weights {digest[:16]}", flush=True)
dptrain.shutdown()
