"""A Trainer job that checkpoints every few steps and can SIGKILL one of its ranks on purpose.

    dptrain run --nproc-per-node 2 --max-restarts 1 tests/scripts/train_resilient.py \
        --ckpt DIR --kill-rank 1 --kill-at 7

On the first attempt, rank --kill-rank kills itself with SIGKILL when it computes the loss of
its --kill-at-th batch; the launcher restarts the job, the Trainer resumes from the newest
complete checkpoint, and rank 0 prints a digest of the final weights, which must equal the
digest of a run that was never killed.

Rank 0 prints "saved <name> after step <n>" for every checkpoint it writes and each rank
prints "resumed from <name>" when it resumed: a restart that silently trained from scratch
would reach the same digest (the run is deterministic), so the callers check the resume too.
"""
import argparse
import hashlib
import os
import signal

import torch
from torch import nn

import dptrain
from dptrain.train import Callback

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-at", type=int, default=-1)
args = p.parse_args()

world = dptrain.init()
dptrain.seed_everything(0)
gen = torch.Generator().manual_seed(7)
data = torch.utils.data.TensorDataset(torch.randn(80, 10, generator=gen), torch.randn(80, 5, generator=gen))
loader = dptrain.prepare_dataloader(data, batch_size=8, shuffle=True, seed=3)
# Dropout makes the result depend on the torch RNG, which a resume must restore exactly.
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 5))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
calls = {"n": 0}


def loss_fn(out, target):
    calls["n"] += 1
    if world.restart_count == 0 and world.rank == args.kill_rank and calls["n"] == args.kill_at:
        print(f"rank {world.rank} kills itself at batch {calls['n']}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.mse_loss(out, target)




class PrintSaves(Callback):
    def on_checkpoint(self, trainer, path):
        if trainer.rank == 0:
            print(f"saved {os.path.basename(path)} after step {trainer.global_step}", flush=True)


config = dptrain.TrainerConfig(checkpoint_dir=args.ckpt, save_every_steps=args.every, keep_last=2,
                               verbose=False, progress=False)
trainer = dptrain.Trainer(model, opt, loader, loss_fn, config, callbacks=[PrintSaves()])
if trainer.resumed_from:
    print(f"rank {world.rank} resumed from {os.path.basename(trainer.resumed_from)}", flush=True)
trainer.fit(args.epochs)
weights = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in weights.state_dict().values())).hexdigest()
print(f"rank {world.rank} digest {digest[:16]}", flush=True)
dptrain.shutdown()
