"""ZeroRedundancyOptimizer against PyTorch's: DDP + the unsharded optimizer, torch's ZeRO,
the state each rank keeps, and checkpoints that resume bit for bit on any world size."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain._shm import shm_disabled_by_env
from dptrain.models import MLP
from tests._dist import run_ranks

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}


def _model(sizes=(16, 32, 32, 32, 32, 16)):
    torch.manual_seed(0)
    return MLP(list(sizes))  # 5 linear layers; by default weights of unequal and equal sizes


EVEN = (16,) * 5  # 4 equal layers: two ranks own exactly half of the parameters each


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _train(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _against_ddp(rank, ckpt):
    """Ours (DDP + ZeRO) against torch's DDP + the unsharded optimizer, for several settings."""
    out = {}
    settings = [(name, {}) for name in OPTIMIZERS] + [
        ("adam", {"parameters_as_bucket_view": True}),
        ("sgd", {"shm": False}),  # shared back by broadcasts instead of shared memory
    ]
    for name, kw in settings:
        cls, hp = OPTIMIZERS[name]
        ours = dptrain.DDP(_model(EVEN))
        theirs = nn.parallel.DistributedDataParallel(_model(EVEN))
        zero = dptrain.ZeroRedundancyOptimizer(ours.parameters(), cls, **kw, **hp)
        plain = cls(theirs.parameters(), **hp)
        _train(ours, zero, rank, 3)
        _train(theirs, plain, rank, 3)
        key = f"{name} {kw}"
        out[key] = (torch.equal(_flat(ours), _flat(theirs)), zero._shm is not None, _state_bytes(zero.optim),
                    _state_bytes(plain))
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            full = zero.state_dict()
            ref = plain.state_dict()
            same = full["param_groups"] == ref["param_groups"] and full["state"].keys() == ref["state"].keys()
            same = same and all(torch.equal(full["state"][i][k], v) for i, s in ref["state"].items() for k, v in s.items())
            out[key] += (same,)
    # Checkpoint after 2 steps, resume in fresh objects, and compare with 4 uninterrupted steps.
    cls, hp = OPTIMIZERS["adam"]
    model = dptrain.DDP(_model())
    zero = dptrain.ZeroRedundancyOptimizer(model.parameters(), cls, **hp)
    _train(model, zero, rank, 2)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": zero.state_dict()}, ckpt)
    _train(model, zero, rank, 2, start=2)
    dist.barrier()
    saved = torch.load(ckpt)
    resumed_model = _model()
    resumed_model.load_state_dict(saved["model"])
    resumed_model = dptrain.DDP(resumed_model)
    resumed = dptrain.ZeroRedundancyOptimizer(resumed_model.parameters(), cls, **hp)
    resumed.load_state_dict(saved["opt"])
    _train(resumed_model, resumed, rank, 2, start=2)
    out["resume"] = torch.equal(_flat(resumed_model), _flat(model))
    return out


def test_bitwise_equal_to_ddp_with_the_unsharded_optimizer_and_half_the_state(tmp_path):
    results = run_ranks(_against_ddp, 2, str(tmp_path / "ckpt.pt"))
    for rank, res in enumerate(results):
        assert res.pop("resume"), f"rank {rank}: resumed run differs from the uninterrupted one"
        for key, (equal, used_shm, mine, full, *same_state) in res.items():
            assert equal, f"rank {rank} {key}: parameters differ from torch DDP + unsharded optimizer"
            assert used_shm == ("'shm': False" not in key and not shm_disabled_by_env()), key
            assert mine * 2 == full, f"{key}: rank {rank} keeps {mine} of {full} bytes of optimizer state"
            if rank == 0:
                assert same_state == [True], f"{key}: consolidated state differs from the unsharded optimizer's"


def _against_torch_zero(rank):
    """Same partition, parameters and state dict as torch's ZeroRedundancyOptimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # imports TorchScript: slow

    ours_model, theirs_model = _model(), _model()
    def groups(m):
        lin = [layer for layer in m if isinstance(layer, nn.Linear)]
        return [
            {"params": [lin[0].weight, lin[1].weight, lin[4].bias]},
            {"params": [lin[2].weight, lin[3].weight], "lr": 2e-3},
        ]

    ours = dptrain.ZeroRedundancyOptimizer(groups(ours_model), torch.optim.Adam, lr=1e-3)
    theirs = TorchZero(groups(theirs_model), torch.optim.Adam, lr=1e-3)
    names = {p: n for n, p in ours_model.named_parameters()} | {p: n for n, p in theirs_model.named_parameters()}

    def owners(zero):
        return [[[names[p] for p in g["params"]] for g in groups] for groups in zero._partition_parameters()]

    def step(model, zero, s):
        zero.zero_grad()
        x, y = _batch(0, s)  # the same data on every rank: no DDP needed
        F.mse_loss(model(x), y).backward()
        zero.step()

    for s in range(2):
        step(ours_model, ours, s)
        step(theirs_model, theirs, s)
    rest = lambda m: [p for p in m.parameters() if all(p is not q for g in groups(m) for q in g["params"])]  # noqa: E731
    ours.add_param_group({"params": rest(ours_model), "lr": 5e-4})
    theirs.add_param_group({"params": rest(theirs_model), "lr": 5e-4})
    for s in range(2, 4):
        step(ours_model, ours, s)
        step(theirs_model, theirs, s)
    ours.consolidate_state_dict(to=1)
    theirs.consolidate_state_dict(to=1)
    same_state = None
    if rank == 1:
        a, b = ours.state_dict(), theirs.state_dict()
        same_state = a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and all(
            torch.equal(a["state"][i][k], v) for i, s in b["state"].items() for k, v in s.items())
    if rank == 0:  # consolidated on rank 1 only
        with pytest.raises(RuntimeError, match=r"call `consolidate_state_dict\(to=0\)`"):
            ours.state_dict()
    return owners(ours) == owners(theirs), torch.equal(_flat(ours_model), _flat(theirs_model)), same_state


def test_same_partition_parameters_and_state_as_torch_zero():
    (p0, e0, _), (p1, e1, s1) = run_ranks(_against_torch_zero, 2)
    assert p0 and p1, "partition differs from torch's sorted-greedy rule"
    assert e0 and e1, "parameters differ from torch's ZeroRedundancyOptimizer"
    assert s1, "consolidated state dict differs from torch's"


def _resume_elsewhere(rank, ckpt):
    """A checkpoint of 2 ranks, loaded on 3: the same state, and the same next step as the plain optimizer."""
    saved = torch.load(ckpt)
    model = _model()
    model.load_state_dict(saved["model"])
    zero = dptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    zero.load_state_dict(saved["opt"])
    zero.consolidate_state_dict(to=0)
    round_trip = None
    if rank == 0:
        again = zero.state_dict()
        round_trip = again["param_groups"] == saved["opt"]["param_groups"] and all(
            torch.equal(again["state"][i][k], v) for i, s in saved["opt"]["state"].items() for k, v in s.items())
    plain_model = copy.deepcopy(model)
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
    plain.load_state_dict(torch.load(ckpt)["opt"])  # its own copy: optimizers adopt loaded tensors
    _train(model, zero, 0, 1, start=2)  # the same batch on every rank
    _train(plain_model, plain, 0, 1, start=2)
    return round_trip, torch.equal(_flat(model), _flat(plain_model)), len(zero.optim.state)


def _save_two_rank_checkpoint(rank, ckpt):
    model = _model()
    zero = dptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _train(model, zero, 0, 2)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": zero.state_dict()}, ckpt)


def test_checkpoint_of_two_ranks_resumes_on_three_and_on_one(tmp_path):
    ckpt = str(tmp_path / "two.pt")
    run_ranks(_save_two_rank_checkpoint, 2, ckpt)
    results = run_ranks(_resume_elsewhere, 3, ckpt)
    assert results[0][0], "state dict changed on its way through 3 ranks"
    assert all(same for _, same, _ in results), "step after resuming on 3 ranks differs from the plain optimizer"
    assert sum(n for _, _, n in results) == 10  # the 10 parameters' states, split over the 3 ranks
    # A world of one (no process group): the whole state on this process.
    saved = torch.load(ckpt)
    model = _model()
    zero = dptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    zero.load_state_dict(saved["opt"])
    zero.consolidate_state_dict()
    assert len(zero.optim.state) == 10 and zero.state_dict()["state"].keys() == saved["opt"]["state"].keys()


def test_bad_arguments_are_named():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="empty parameter list"):
        dptrain.ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="single"):
        dptrain.ZeroRedundancyOptimizer(params[0], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        dptrain.ZeroRedundancyOptimizer(params, "adam", lr=0.1)
    with pytest.raises(ValueError, match="overlap_with_ddp=False"):
        dptrain.ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(ValueError, match="one dense type"):
        dptrain.ZeroRedundancyOptimizer([params[0], torch.zeros(2, dtype=torch.float64)], torch.optim.SGD, lr=0.1)
    zero = dptrain.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r"call `consolidate_state_dict\(to=0\)` on all ranks"):
        zero.state_dict()
    with pytest.raises(ValueError, match="ranks 0..0"):
        zero.consolidate_state_dict(to=1)
    other = torch.optim.SGD(params[:3], lr=0.1).state_dict()
    with pytest.raises(ValueError, match=r"sizes \[3\] but this optimizer has \[10\]"):
        zero.load_state_dict(other)
