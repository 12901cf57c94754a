"""Bucket rebuild in gradient-ready order, against PyTorch's reducer.

The model's layers are defined in the reverse of the order forward uses them, so its
gradients arrive in registration order instead of the reverse that the first buckets
assume. PyTorch's rebuilt buckets are read from its reducer
(``_get_zeros_like_grad_buckets``) and compared with ours, layout and trained values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import dptrain
from tests._dist import run_ranks
from tests.parallel.ddp._torch_args import torch_accepts
from tests.parallel.ddp._ddp_models import make_optimizer, snapshot

TorchDDP = nn.parallel.DistributedDataParallel


class Reordered(nn.Module):
    """Defined head, mid, stem; used stem -> mid -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(128, 10)
        self.mid = nn.Linear(256, 128)
        self.stem = nn.Linear(32, 256)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.stem(x)))))


def _torch_layout(ddp) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def _train(ddp, rank: int, steps: int, set_to_none: bool = True) -> list:
    opt = make_optimizer("sgd", ddp.parameters())
    layouts = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = _batch(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        layouts.append(ddp.reducer.assignment if isinstance(ddp, dptrain.DDP) else _torch_layout(ddp))
    return layouts


CONFIGS = [
    ({}, 3, True),
    ({"bucket_cap_mb": 0.05}, 3, True),
    ({"bucket_cap_mb_list": [0.02, 0.1]}, 3, True),
    ({"static_graph": True}, 4, True),  # recorded in the second backward, rebuilt at the third forward
    ({"find_unused_parameters": True, "bucket_cap_mb": 0.05}, 3, True),  # never rebuilt
    ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.05}, 3, False),  # grads move into the new buckets
]
CONFIGS = [c for c in CONFIGS if torch_accepts(c[0])]  # bucket_cap_mb_list: torch >= 2.13


def _rebuild(rank, configs):
    out = []
    for kw, steps, set_to_none in configs:
        res = []
        for cls in (dptrain.DDP, TorchDDP):
            torch.manual_seed(1 + rank)
            ddp = cls(Reordered(), **kw)
            layouts = _train(ddp, rank, steps, set_to_none)
            res.append((layouts, snapshot(ddp)))
        out.append(res)
    return out


def test_buckets_rebuilt_in_gradient_order_like_torch():
    for rank_out in run_ranks(_rebuild, 2, CONFIGS):
        for (kw, steps, _), ((ours_layouts, ours), (torch_layouts, theirs)) in zip(CONFIGS, rank_out):
            assert ours_layouts[-1] == torch_layouts[-1], kw
            for k in ours:
                assert (ours[k] is None and theirs[k] is None) or torch.equal(ours[k], theirs[k]), (kw, k)
            if "find_unused_parameters" not in kw:
                # Gradient order: head (0, 1), mid (2, 3), stem (4, 5); biases first.
                assert [i for b in ours_layouts[-1] for i in b] == [1, 0, 3, 2, 5, 4], kw
                assert ours_layouts[0] != ours_layouts[-1], kw


def _join_rebuild(rank):
    """The rebuild's broadcast happens while rank 0 has joined (it shadows the others)."""
    out = []
    for cls in (dptrain.DDP, TorchDDP):
        torch.manual_seed(1 + rank)
        ddp = cls(Reordered(), bucket_cap_mb=0.05)
        opt = make_optimizer("sgd", ddp.parameters())
        with ddp.join():
            for step in range(1 if rank == 0 else 3):
                opt.zero_grad()
                x, y = _batch(rank, step)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
        layout = ddp.reducer.assignment if cls is dptrain.DDP else _torch_layout(ddp)
        out.append((layout, {k: v.clone() for k, v in ddp.module.state_dict().items()}))
    return out


def test_rebuild_while_a_rank_has_joined_matches_torch():
    results = run_ranks(_join_rebuild, 2)
    for (ours_layout, ours), (torch_layout, theirs) in results:
        assert ours_layout == torch_layout
        for k in ours:
            assert torch.equal(ours[k], theirs[k]), k
    assert torch.equal(results[0][0][1]["head.weight"], results[1][0][1]["head.weight"])


def _order_matches(rank):
    import torch.distributed as dist

    torch.manual_seed(0)
    ddp = dptrain.DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), bucket_cap_mb=0.005)
    before = ddp.reducer.assignment
    broadcasts = []
    real_broadcast = dist.broadcast
    dist.broadcast = lambda *a, **k: broadcasts.append(a) or real_broadcast(*a, **k)
    try:
        for step in range(3):
            x, y = _batch(rank, step)
            F.cross_entropy(ddp(x), y).backward()
    finally:
        dist.broadcast = real_broadcast
    return before == ddp.reducer.assignment, ddp.reducer.has_rebuilt_buckets, len(broadcasts)


def test_no_rebuild_and_no_broadcast_when_the_order_matches():
    """A model used in definition order keeps its first buckets; the ranks agree without a broadcast."""
    for same, decided, broadcasts in run_ranks(_order_matches, 2):
        assert same and decided and broadcasts == 0


def _rebuild_with_hooks(rank):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from dptrain.parallel import comm_hooks

    out = {}
    for name, cls in (("ours", dptrain.DDP), ("torch", TorchDDP)):  # with a hook: always broadcast
        torch.manual_seed(1 + rank)
        ddp = cls(Reordered(), bucket_cap_mb=0.05)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        out[name] = (_train(ddp, rank, 3)[-1], snapshot(ddp))
    # PowerSGD compressing from the first step: its per-bucket state survives the rebuild.
    torch.manual_seed(1 + rank)
    ddp = dptrain.DDP(Reordered(), bucket_cap_mb=0.05)
    ddp.register_comm_hook(comm_hooks.PowerSGDState(None, start_powerSGD_iter=0), comm_hooks.powerSGD_hook)
    layouts = _train(ddp, rank, 3)
    out["powersgd"] = (layouts[0] != layouts[-1], all(torch.isfinite(p.grad).all() for p in ddp.parameters()))
    return out


def test_rebuild_with_communication_hooks():
    for out in run_ranks(_rebuild_with_hooks, 2):
        (ours_layout, ours), (torch_layout, theirs) = out["ours"], out["torch"]
        assert ours_layout == torch_layout
        for k in ours:
            assert torch.equal(ours[k], theirs[k]), k
        assert out["powersgd"] == (True, True)
