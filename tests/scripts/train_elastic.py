"""A Trainer job that writes down which samples each rank trains on, for the elastic test.

    dptrain run --nnodes 1:2 --max-restarts 1 ... tests/scripts/train_elastic.py --ckpt DIR --seen DIR

Every rank appends one line per batch to ``<seen>/a<restart>-r<rank>.txt``: the epoch, the
global step and the dataset indices of the batch. A short sleep per step leaves the test time
to take a node away in the middle of the first epoch.
"""
import argparse
import os
import time

import torch
from torch import nn

import dptrain

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--seen", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=240)
p.add_argument("--sleep", type=float, default=0.1)
args = p.parse_args()

world = dptrain.init()
dptrain.seed_everything(0)
gen = torch.Generator().manual_seed(7)
x = torch.randn(args.samples, 8, generator=gen)
y = x @ torch.randn(8, 1, generator=gen)
data = torch.utils.data.TensorDataset(x, torch.arange(args.samples))  # the target is the sample's index
loader = dptrain.prepare_dataloader(data, batch_size=4, shuffle=True, seed=3)
model = nn.Linear(8, 1)
log = open(os.path.join(args.seen, f"a{world.restart_count}-r{world.rank}.txt"), "a")


def loss_fn(out, index):
    log.write(f"{trainer.epoch} {trainer.global_step} {','.join(map(str, index.tolist()))}\n")
    log.flush()
    time.sleep(args.sleep)
    return nn.functional.mse_loss(out, y[index])


config = dptrain.TrainerConfig(checkpoint_dir=args.ckpt, save_every_steps=4, keep_last=3, verbose=False,
                               progress=False)
trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loader, loss_fn, config)
if trainer.resumed_from:
    print(f"rank {world.rank} of {world.world_size} resumed from {os.path.basename(trainer.resumed_from)}", flush=True)
trainer.fit(args.epochs)
print(f"rank {world.rank} of {world.world_size} finished at step {trainer.global_step}", flush=True)
dptrain.shutdown()
