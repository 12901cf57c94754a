"""DDP(overlap_optimizer=...): bucket-by-bucket optimizer steps, bitwise PyTorch's DDP + optimizer.step()."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain.parallel.ddp import _overlap
from tests._dist import run_ranks

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 6))


def _loop(model, opt, sched, rank, steps, accumulate):
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        for micro in range(accumulate):
            x, y = torch.randn(8, 20, generator=g), torch.randn(8, 6, generator=g)
            if micro + 1 < accumulate:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _pairs(rank):
    out = {}
    for name, make in OPTIMIZERS.items():
        for accumulate in (1, 3):
            base = _model()
            theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
            plain = make(theirs.parameters())
            net = copy.deepcopy(base)
            opt = make(net.parameters())
            ours = dptrain.DDP(net, bucket_cap_mb=0.001, overlap_optimizer=opt)
            assert len(ours.reducer.buckets) > 2
            for model, o in ((theirs, plain), (ours, opt)):
                sched = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                _loop(model, o, sched, rank, 5, accumulate)
            same = all(torch.equal(a, b) for a, b in zip(theirs.parameters(), ours.parameters()))
            a, b = plain.state_dict()["state"], opt.state_dict()["state"]
            same_state = a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
            out[(name, accumulate)] = (same, same_state)
    return out


def test_overlapped_steps_are_bitwise_pytorchs():
    """SGD (momentum, Nesterov, weight decay), Adam, AdamW (amsgrad); with an LR schedule, with and
    without no_sync accumulation: parameters and optimizer state equal PyTorch DDP + step()."""
    for out in run_ranks(_pairs, 2):
        for key, (same, same_state) in out.items():
            assert same and same_state, key


def _clipping(rank):
    net = _model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model = dptrain.DDP(net, overlap_optimizer=opt)
    F.mse_loss(model(torch.randn(4, 20)), torch.zeros(4, 6)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_clipping_after_an_overlapped_step_raises():
    for message in run_ranks(_clipping, 2):
        assert message is not None
        assert "overlap_optimizer" in message and "clip_grad_norm_" in message
        assert "stepped '0.weight' during backward" in message


def _rest_and_closure(rank):
    # A parameter DDP ignores is in no bucket: the user's step() still updates it.
    net = _model()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["4.bias"])
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = dptrain.DDP(net, overlap_optimizer=opt)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.full((4, 20), float(rank))
    F.mse_loss(model(x), torch.zeros(4, 6)).backward()
    opt.step()
    F.mse_loss(reference(x), torch.zeros(4, 6)).backward()
    ref_opt.step()
    rest_stepped = torch.equal(net[4].bias, reference[4].bias) and not torch.equal(net[4].bias, _model()[4].bias)
    F.mse_loss(model(x), torch.zeros(4, 6)).backward()
    try:
        opt.step(lambda: 0.0)
    except ValueError as exc:
        return rest_stepped, str(exc)
    return rest_stepped, None


def test_step_updates_what_no_bucket_holds_and_refuses_closures():
    for rest_stepped, message in run_ranks(_rest_and_closure, 2):
        assert rest_stepped
        assert message is not None and "closure" in message


def test_unsupported_optimizers_are_refused():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="LBFGS cannot be stepped one bucket at a time"):
        _overlap.check_optimizer(torch.optim.LBFGS(params))
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        _overlap.check_optimizer("adam")


def _scheduler_first(rank):
    import warnings

    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps opt.step before DDP does
    model = dptrain.DDP(net, overlap_optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            F.mse_loss(model(torch.randn(4, 20)), torch.zeros(4, 6)).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    return [str(w.message) for w in caught], opt.param_groups[0]["lr"]


def test_a_scheduler_built_before_ddp_does_not_warn():
    # torch's LR scheduler marks the optimizer's step it wrapped and warns "optimizer.step() has
    # been overridden" on every scheduler.step() once the mark is gone.
    for messages, lr in run_ranks(_scheduler_first, 2):
        assert messages == []
        assert lr == 0.1 * 0.5**3
