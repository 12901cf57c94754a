"""Train the ToyModel with dptrain's DDP for a few steps; rank 0 prints a digest of the weights.

Used to check that a job gives the same weights however it is launched (one node, two
network namespaces, restarts).
"""
import hashlib
import sys

import torch

import dptrain
from dptrain.models import ToyModel

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
dptrain.init()
torch.manual_seed(0)
model = dptrain.DistributedDataParallel(ToyModel())
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
gen = torch.Generator().manual_seed(1000 + dptrain.rank())
for _ in range(steps):
    x, y = torch.randn(8, 10, generator=gen), torch.randn(8, 5, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters())).hexdigest()
print(f"rank {dptrain.rank()} world {dptrain.world_size()} digest {digest[:16]}", flush=True)
dptrain.shutdown()
