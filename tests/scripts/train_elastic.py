"""A Trainer job that writes down which samples each rank trains on, for the elastic tests.

    dptrain run --nnodes 1:2 --max-restarts 1 ... tests/scripts/train_elastic.py --ckpt DIR --seen DIR
    dptrain run --nnodes 2:3 --recovery in-place ... tests/scripts/train_elastic.py --seen DIR --per-process

Every rank appends one line per batch to ``<seen>/a<restart>-r<rank>.txt``: the epoch, the
global step and the dataset indices of the batch. With ``--per-process`` (in-place recovery,
where a process keeps running while its rank number changes) every process writes
``<seen>/p<pid>.txt`` instead, each line starting with the process group's generation and
ending with the rank: a step abandoned by a recovery is done again under a newer generation,
so for each step only the lines of its newest generation count; each rank also prints its pid
when it starts, and its pid, rank and a digest of its weights when it finishes. Without
``--ckpt`` there is no checkpoint directory: whatever state a rank recovers comes from a live
peer. A short sleep per step leaves the test time to take a node away in the middle of the
first epoch; with ``--sleep-until N`` the steps stop sleeping once the job has been restarted or
re-formed N times (restarts plus in-place generations), where nothing is left to wait for.
``--diloco H`` trains with ``strategy="diloco"`` (every rank a replica, an outer sync every H
steps) instead of DDP.
"""
import argparse
import hashlib
import os
import time

import torch
from torch import nn

import dptrain
from dptrain.runtime import env

p = argparse.ArgumentParser()
p.add_argument("--ckpt")
p.add_argument("--seen", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=240)
p.add_argument("--sleep", type=float, default=0.1)
p.add_argument("--sleep-until", type=int, default=None)
p.add_argument("--per-process", action="store_true")
p.add_argument("--diloco", type=int, default=0, help="train with strategy='diloco', sync_every this (0: DDP)")
args = p.parse_args()

world = dptrain.init()
if args.per_process:
    print(f"started pid {os.getpid()} as rank {world.rank} of {world.world_size}", flush=True)
dptrain.seed_everything(0)
gen = torch.Generator().manual_seed(7)
x = torch.randn(args.samples, 8, generator=gen)
y = x @ torch.randn(8, 1, generator=gen)
data = torch.utils.data.TensorDataset(x, torch.arange(args.samples))  # the target is the sample's index
loader = dptrain.prepare_dataloader(data, batch_size=4, shuffle=True, seed=3)
model = nn.Linear(8, 1)
name = f"p{os.getpid()}.txt" if args.per_process else f"a{world.restart_count}-r{world.rank}.txt"
log = open(os.path.join(args.seen, name), "a")


def loss_fn(out, index):
    indices = ",".join(map(str, index.tolist()))
    if args.per_process:
        log.write(f"{env._STATE.generation} {trainer.epoch} {trainer.global_step} {dptrain.rank()} {indices}\n")
    else:
        log.write(f"{trainer.epoch} {trainer.global_step} {indices}\n")
    log.flush()
    if args.sleep_until is None or world.restart_count + env._STATE.generation < args.sleep_until:
        time.sleep(args.sleep)
    return nn.functional.mse_loss(out, y[index])


diloco = {"strategy": "diloco", "diloco_kwargs": {"sync_every": args.diloco}} if args.diloco else {}
config = dptrain.TrainerConfig(checkpoint_dir=args.ckpt, save_every_steps=4 if args.ckpt else 0, keep_last=3,
                               verbose=False, progress=False, **diloco)
trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loader, loss_fn, config)
if trainer.resumed_from:
    print(f"rank {world.rank} of {world.world_size} resumed from {os.path.basename(trainer.resumed_from)}", flush=True)
trainer.fit(args.epochs)
if args.per_process:
    # The Trainer's weights: DiLoCo's are the replicas' common (outer) ones.
    weights = b"".join(v.detach().numpy().tobytes() for v in trainer.model_state_dict().values())
    print(f"finished pid {os.getpid()} as rank {dptrain.rank()} of {dptrain.world_size()} at step "
          f"{trainer.global_step} weights {hashlib.sha256(weights).hexdigest()[:16]}", flush=True)
else:
    print(f"rank {world.rank} of {world.world_size} finished at step {trainer.global_step}", flush=True)
dptrain.shutdown()
