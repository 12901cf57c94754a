"""Train a small MLP with compressed gradients; every rank prints a digest of its weights per run.

    dptrain run ... tests/scripts/train_compressed.py auto:1:14              # compression="auto": one run, 14 steps
    dptrain run ... tests/scripts/train_compressed.py auto:1:14 powersgd:3   # then PowerSGD (a bucket per layer), 3 runs
    dptrain run ... tests/scripts/train_compressed.py torchpowersgd:3        # PyTorch's PowerSGD hook instead

Replicas that end with different digests, or a run that aborts, mean the ranks paired their
collectives differently. Run under DPTRAIN_DEBUG=1 to have every collective cross-checked.
"""
import hashlib
import sys

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import dptrain
from dptrain.models import MLP
from dptrain.parallel import comm_hooks

dptrain.init()
run = 0
for spec in sys.argv[1:]:
    mode, runs, steps = (spec + ":8").split(":")[:3]
    for _ in range(int(runs)):
        torch.manual_seed(run)
        net = MLP([256] * 4)
        if mode == "auto":
            model = dptrain.DDP(net, compression="auto")
        else:
            model = dptrain.DDP(net, bucket_cap_mb=0.2)  # one bucket per layer: several jobs in flight
            hooks = torch_powersgd if mode == "torchpowersgd" else comm_hooks  # PyTorch's, for comparison
            state = hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
            model.register_comm_hook(state, hooks.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 * run + dptrain.rank())
        for _ in range(int(steps)):
            x = torch.randn(16, 256, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
            opt.step()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters()))
        print(f"rank {dptrain.rank()} run {run} {mode} choice {model.compression_choice} "
              f"digest {digest.hexdigest()[:16]}", flush=True)
        run += 1
dptrain.shutdown()
