"""PyTorch's DDP keeps scatter / to_kwargs / gather for old code; ours answers them too.

``to_kwargs`` is compared with PyTorch's on CPU. PyTorch's ``scatter`` and ``gather`` refuse
CPU devices; ours work there, and split / concatenate along ``dim`` as they do on GPUs.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

import dptrain
from tests._dist import run_ranks

Pair = collections.namedtuple("Pair", "a b")


def _legacy(rank):
    out = {}
    x, y = torch.arange(8.0).reshape(4, 2), Pair(torch.ones(4, 1), 3)
    for name, cls in (("ours", dptrain.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        ddp = cls(nn.Linear(4, 2))
        out[name] = ddp.to_kwargs((x, y), {"scale": torch.full((4,), 2.0)}, 0)
    ours = dptrain.DDP(nn.Linear(4, 2))
    out["scatter"] = ours.scatter((x,), {"scale": torch.arange(4.0)}, ["cpu", "cpu"])
    out["gather"] = ours.gather([torch.ones(2, 3), torch.zeros(1, 3)], "cpu")
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_legacy_helpers_answer_like_torch():
    res = run_ranks(_legacy, 2)[0]
    assert _same(res["ours"], res["torch"]), (res["ours"], res["torch"])
    (in0, in1), (kw0, kw1) = res["scatter"]
    assert torch.equal(in0[0], torch.arange(4.0).reshape(2, 2)) and torch.equal(in1[0], torch.arange(4.0, 8).reshape(2, 2))
    assert torch.equal(kw0["scale"], torch.tensor([0.0, 1.0])) and torch.equal(kw1["scale"], torch.tensor([2.0, 3.0]))
    assert torch.equal(res["gather"], torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
