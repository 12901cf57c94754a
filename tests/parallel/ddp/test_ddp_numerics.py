"""PyTorch's averaging numerics, pinned where a power-of-two world cannot tell them apart.

On two ranks, multiplying by 1/2 and dividing by 2 give the same bits, so the bitwise
comparisons elsewhere cannot see which one the reducer does. Here three ranks run, and only
rank 0 has a non-zero gradient: whatever order gloo sums in, the result is exactly rank 0's
scaled gradient. PyTorch multiplies a copied gradient by 1/3 (``mul_out``) and divides one
that already is its bucket view by 3; ours must give the same bits as PyTorch's DDP in the
same processes, with one or several buckets, with bucket views (aliased gradients), with a
bucket that mixes both, and with PyTorch's ``batched_grad_copy``; small gradients are scaled
with their bucket, a large one on arrival.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dptrain
from dptrain.parallel.ddp._reducer import ONE_PASS_MIN_NUMEL
from tests._dist import run_ranks
from tests.parallel.ddp._torch_args import torch_accepts

OFF = {"DPTRAIN_SHM": "0"}  # gloo on both sides: the same collective, only the scaling differs


def _model() -> nn.Module:
    # One weight large enough to be scaled on arrival in one pass, the others small enough to
    # wait for their bucket's copy (see the reducer's [Note: a bucket at a time]).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 2000), nn.Tanh(), nn.Linear(2000, 3))


def _grads(model: nn.Module) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _run(rank, kwargs):
    base = _model()
    runs = {}
    for name, cls in (("ours", dptrain.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        ddp = cls(copy.deepcopy(base), **kwargs)
        seen = []
        for step in range(3):
            torch.manual_seed(100 + step)
            x = torch.randn(9, 7) * 3
            loss = ddp(x).pow(2).sum() * (1.0 if rank == 0 else 0.0)  # only rank 0 contributes
            # Zeroed every step, so that the other ranks contribute exact zeros: step 0 frees
            # the gradients (they arrive as new tensors and are copied in), step 1 keeps them
            # (with gradient_as_bucket_view they are the bucket's views), step 2 mixes both
            # kinds in one bucket.
            ddp.zero_grad(set_to_none=step == 0)
            if step == 2:
                next(ddp.parameters()).grad = None
            loss.backward()
            seen.append(_grads(ddp.module))
        runs[name] = seen
    plain = copy.deepcopy(base)  # rank 0's own first gradients, not averaged
    torch.manual_seed(100)
    plain(torch.randn(9, 7) * 3).pow(2).sum().backward()
    runs["plain"] = _grads(plain)
    return runs


@pytest.mark.parametrize("kwargs", [
    {},
    {"bucket_cap_mb": 0.0005},
    {"gradient_as_bucket_view": True},
    {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005},
    {"batched_grad_copy": True},
    {"batched_grad_copy": True, "gradient_as_bucket_view": True},
], ids=["default", "buckets", "views", "views-buckets", "batched", "batched-views"])
def test_three_ranks_scale_each_gradient_as_pytorch_does(kwargs):
    sizes = [p.numel() for p in _model().parameters()]
    assert max(sizes) >= ONE_PASS_MIN_NUMEL["cpu"] > min(sizes)  # both paths of the copy-in run
    if "batched_grad_copy" in kwargs and not torch_accepts({"batched_grad_copy": True}):
        pytest.skip("this torch's DDP has no batched_grad_copy to compare with")
    out = run_ranks(_run, 3, kwargs, env=OFF)
    for rank, runs in enumerate(out):
        for step, (ours, theirs) in enumerate(zip(runs["ours"], runs["torch"])):
            for k, (a, b) in enumerate(zip(ours, theirs)):
                assert (a is None) == (b is None), (rank, step, k)
                if a is not None:
                    assert torch.equal(a, b), (
                        f"rank {rank}, step {step}, parameter {k}: differs from PyTorch's DDP by "
                        f"{(a - b).abs().max().item():.3g}")
    # The case matters: for these gradients 1/3 and /3 give other bits, and the first
    # (copied) gradients are exactly rank 0's multiplied by 1/3 (else the test could not fail).
    raw, first = out[0]["plain"], out[0]["torch"][0]
    assert any(not torch.equal(g.mul(1 / 3), g.div(3)) for g in raw)
    if not kwargs.get("batched_grad_copy"):
        assert all(torch.equal(a, g.mul(1 / 3)) for a, g in zip(first, raw))
