"""Communication hooks: low-precision all-reduce, PowerSGD, and PyTorch interoperability."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn import functional as F

import dptrain
from dptrain.models import MLP
from dptrain.parallel import comm_hooks
from tests._dist import run_ranks


def _grads(model):
    return [p.grad.clone() for p in model.module.parameters()]


def _one_backward(model, rank):
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
    F.mse_loss(model(x), y).backward()


def _low_precision(rank):
    torch.manual_seed(0)
    base = MLP([12, 24, 4])
    out = {}
    for name, hook in (
        ("none", None),
        ("allreduce", comm_hooks.allreduce_hook),
        ("fp16", comm_hooks.fp16_compress_hook),
        ("bf16", comm_hooks.bf16_compress_hook),
        ("torch_fp16_on_ours", torch_hooks.fp16_compress_hook),
    ):
        model = dptrain.DDP(copy.deepcopy(base), bucket_cap_mb=0.0005)  # several buckets
        if hook is not None:
            model.register_comm_hook(None, hook)
        _one_backward(model, rank)
        out[name] = _grads(model)
    # Misuse: a second hook, and a hook that returns no future.
    model = dptrain.DDP(copy.deepcopy(base))
    model.register_comm_hook(None, comm_hooks.allreduce_hook)
    try:
        model.register_comm_hook(None, comm_hooks.allreduce_hook)
    except RuntimeError as exc:
        out["twice"] = str(exc)
    model = dptrain.DDP(copy.deepcopy(base))
    model.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    try:
        _one_backward(model, rank)
    except TypeError as exc:
        out["not_a_future"] = str(exc)
    # Our hook on PyTorch's DDP.
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005)
    theirs.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    _one_backward(theirs, rank)
    out["ours_fp16_on_torch"] = _grads(theirs)
    return out


def test_low_precision_hooks_close_to_fp32_and_interchangeable_with_torch():
    for out in run_ranks(_low_precision, 2):
        ref = out["none"]
        for a, b in zip(out["allreduce"], ref):
            assert torch.equal(a, b)  # the built-in hook is exactly the default reduction
        for name, tol in (("fp16", 2e-3), ("bf16", 1e-2)):
            for a, b in zip(out[name], ref):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
            assert any(not torch.equal(a, b) for a, b in zip(out[name], ref)), f"{name} did not compress"
        for a, b, c in zip(out["fp16"], out["torch_fp16_on_ours"], out["ours_fp16_on_torch"]):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert "only be called once" in out["twice"]
        assert "returned Tensor" in out["not_a_future"] and "torch.futures.Future" in out["not_a_future"]


# PyTorch's own powerSGD_hook calls torch.cuda.synchronize(device) whenever CUDA exists, which
# fails for CPU tensors: on a GPU machine it cannot run on this CPU test's gradients (ours can;
# tests/gpu/test_gpu_paths.py compares the two on CUDA tensors there).
TORCH_HOOK_RUNS_ON_CPU = not torch.cuda.is_available()


def _train_regressions(rank, steps):
    names = ("none", "powersgd") + (("torch_powersgd",) if TORCH_HOOK_RUNS_ON_CPU else ())
    return {name: _train_regression(rank, name, steps) for name in names}


def _train_regression(rank, hook_name, steps):
    torch.manual_seed(0)
    teacher = nn.Linear(32, 16)
    model = dptrain.DDP(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))
    state = None
    if hook_name == "powersgd":
        state = comm_hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3)
        model.register_comm_hook(state, comm_hooks.powerSGD_hook)
    elif hook_name == "torch_powersgd":
        state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3)
        model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    rate = state.compression_stats()[0] if hook_name == "powersgd" else None
    return losses, [p.detach().clone() for p in model.parameters()], rate


def test_powersgd_converges_on_small_task():
    results = run_ranks(_train_regressions, 2, 50)
    plain, psgd = ([r[name] for r in results] for name in ("none", "powersgd"))
    for losses, _, rate in psgd:
        assert losses[-1] < 0.05 * losses[0], losses[::10]
        assert losses[-1] < 5 * plain[0][0][-1] + 1e-3
        assert rate > 3  # the matrices really went through the low-rank path
    compared = [psgd]
    if TORCH_HOOK_RUNS_ON_CPU:
        torch_psgd = [r["torch_powersgd"] for r in results]
        assert torch_psgd[0][0][-1] < 0.05 * torch_psgd[0][0][0]  # PyTorch's hook drops in
        compared.append(torch_psgd)
    for result in compared:  # both ranks keep identical replicas
        for a, b in zip(result[0][1], result[1][1]):
            assert torch.equal(a, b)


def test_powersgd_state_validates():
    import pytest

    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        comm_hooks.PowerSGDState(None, matrix_approximation_rank=0)
    state = comm_hooks.PowerSGDState(None)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.use_error_feedback, state.warm_start) == (
        1,
        1000,
        True,
        True,
    )
