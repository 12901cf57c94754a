"""Two nodes of two ranks: DDP inside each node, DiLoCo between the nodes (hierarchical).

Prints, on every rank: the topology DiLoCo found, whether the replicas are bitwise equal
right after each sync and differ between nodes (but not inside one) between syncs, the
largest difference from a flat DiLoCo over the world whose every rank trains on its whole
node's batch (the same arithmetic without DDP), and the bytes each form sent per sync
(run by tests/parallel/test_diloco_nodes.py).
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain.parallel.diloco import node_group

dptrain.init()
rank, world = dist.get_rank(), dist.get_world_size()
node, local = divmod(rank, 2)
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
H = 3

ddp = dptrain.DDP(copy.deepcopy(base), process_group=node_group())
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
hier = dptrain.DiLoCo(ddp, opt, sync_every=H)
top = hier._topology
print(f"TOPOLOGY rank {rank} replicas {hier.num_replicas} node_size {top.node_size}", flush=True)

flat_model = copy.deepcopy(base)
flat_opt = torch.optim.SGD(flat_model.parameters(), lr=0.1, momentum=0.9)
flat = dptrain.DiLoCo(flat_model, flat_opt, sync_every=H)


def batch(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def gather(model):
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return out


ok_sync, ok_between = True, True
for step in range(1, 2 * H + 2):
    x, y = batch(rank, step)
    opt.zero_grad()
    F.mse_loss(ddp(x), y).backward()
    opt.step()
    hier.step()
    # The flat reference: this rank trains on its whole node's batch (both local ranks' halves).
    xs, ys = zip(*(batch(2 * node + i, step) for i in range(2)))
    flat_opt.zero_grad()
    F.mse_loss(flat_model(torch.cat(xs)), torch.cat(ys)).backward()
    flat_opt.step()
    flat.step()
    every = gather(ddp.module)
    if step % H == 0:
        ok_sync &= all(torch.equal(e, every[0]) for e in every)
    else:
        ok_between &= torch.equal(every[0], every[1]) and torch.equal(every[2], every[3]) \
            and not torch.equal(every[0], every[2])
diff = max((p - q).abs().max().item() for p, q in zip(ddp.module.parameters(), flat_model.parameters()))
print(f"SYNCED rank {rank} at_sync {ok_sync} between {ok_between} maxdiff {diff:.3e}", flush=True)
print(f"BYTES rank {rank} hierarchical {hier.bytes_sent // hier.num_syncs} flat {flat.bytes_sent // flat.num_syncs} "
      f"params {sum(p.numel() for p in base.parameters())}", flush=True)
dptrain.shutdown()
