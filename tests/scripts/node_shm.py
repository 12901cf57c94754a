"""Two nodes of two ranks: DDP sums in shared memory inside each node and across nodes on rails.

Prints, on every rank: whether DDP chose the node groups, whether one all-reduce of the node
group is bitwise ``(x0 + x1) + (x2 + x3)``, and after training steps the largest difference
of the parameters from PyTorch's DDP trained on the same batches (run by tests/test_shm_nodes.py).
"""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain._shm import nodes as _shm_nodes

dptrain.init()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

# The primitive: one all-reduce in the documented order.
g = _shm_nodes.node_groups(None, 1 << 20, what="node test", want=None, devices=[torch.device("cpu")])
if g is not None:
    n = 100_003
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    slot = g.zeros(n, torch.float32)
    slot.copy_(xs[rank])
    g.all_reduce(slot).wait()
    expected = (xs[0] + xs[1]) + (xs[2] + xs[3])
    print(f"PRIMITIVE rank {rank} bitwise {torch.equal(slot, expected)}", flush=True)
    g.close()

base = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
ours = dptrain.DDP(copy.deepcopy(base), bucket_cap_mb=0.1)
theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
node_sums = ours._shm is not None and ours._shm.between is not None
print(f"CHOICE rank {rank} node_groups {node_sums}", flush=True)
if node_sums:  # a second DDP reuses the node and rail groups of the first
    again = dptrain.DDP(copy.deepcopy(base))
    print(f"REUSE rank {rank} {again._shm.between is not None and len(_shm_nodes._MADE) == 1}", flush=True)
    required = dptrain.DDP(copy.deepcopy(base), shm=True)  # one segment per node satisfies shm=True
    print(f"REQUIRED rank {rank} {required._shm is not None and required._shm.between is not None}", flush=True)
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
for step in range(int(os.environ.get("STEPS", "4"))):
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
    for m, opt in zip((ours, theirs), opts):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
diff = max((p - q).abs().max().item() for p, q in zip(ours.module.parameters(), theirs.module.parameters()))
same = [torch.zeros(1) for _ in range(world)]
dist.all_gather(same, torch.tensor([sum(p.double().sum().item() for p in ours.module.parameters())]))
print(f"TRAINED rank {rank} maxdiff {diff:.3e} replicas_identical {all(torch.equal(s, same[0]) for s in same)}",
      flush=True)
dptrain.shutdown()
