"""A training script that forgets ``dptrain.init()``: issue 30's report, run under ``dptrain run``.

    dptrain run --nproc-per-node 2 tests/scripts/forgot_init.py

Without a process group each rank trained alone on its shard and the job exited 0 with
different weights on its ranks; now DDP refuses, naming ``dptrain.init()``.
"""

import torch

import dptrain

torch.manual_seed(0)
model = dptrain.DDP(torch.nn.Linear(4, 1))
sampler = dptrain.DistributedSampler(list(range(8)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
for i in sampler:
    opt.zero_grad()
    (model(torch.full((1, 4), i / 8)) - 1).pow(2).sum().backward()
    opt.step()
    seen.append(i)
print(f"rank {dptrain.rank()}: trained on samples {seen}, weight sum {model.module.weight.sum().item():.4f}")
