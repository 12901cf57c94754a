"""``torch.distributed.optim._apply_optimizer_in_backward`` under our DDP trains as under
PyTorch's (found by PyTorch's ``test_ddp_apply_optim_in_backward`` in the torch-suite tier):
each parameter's optimizer steps on the averaged gradient, not the local one, and ``.grad``
is None afterwards. PyTorch's DDP runs this through a CUDA stream (it fails on a CPU-only
torch), so the reference is what its test compares with: PyTorch's DDP and the same
per-parameter optimizers stepped after backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward

import dptrain
from tests._dist import run_ranks

TorchDDP = nn.parallel.DistributedDataParallel


def _train(rank, view, before):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3))
    kwargs = {"lr": 0.1, "momentum": 0.9}
    out = {}
    for name in ("ours", "torch"):
        model = copy.deepcopy(base)
        if name == "ours":
            if before:
                _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), kwargs)
            ddp = dptrain.DDP(model, gradient_as_bucket_view=view)
            if not before:
                _apply_optimizer_in_backward(torch.optim.SGD, ddp.parameters(), kwargs)
            optimizers = []
        else:
            ddp = TorchDDP(model, gradient_as_bucket_view=view)
            optimizers = [torch.optim.SGD([p], **kwargs) for p in ddp.parameters()]
        torch.manual_seed(10 + rank)
        for _ in range(4):
            ddp(torch.randn(5, 3)).sum().backward()  # ours: steps the optimizers in backward
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[name] = ([p.detach().clone() for p in ddp.parameters()], [p.grad is None for p in ddp.parameters()])
    return out


@pytest.mark.parametrize("view, before", [(True, True), (False, False)])
def test_optimizer_in_backward_steps_on_averaged_gradients_like_torch(view, before):
    r0, r1 = run_ranks(_train, 2, view, before)
    for out in (r0, r1):
        for a, b in zip(out["ours"][0], out["torch"][0]):
            assert torch.equal(a, b)
        assert out["ours"][1] == out["torch"][1] == [True] * 4
    for a, b in zip(r0["ours"][0], r1["ours"][0]):
        assert torch.equal(a, b)  # the ranks agree: each stepped on the average
