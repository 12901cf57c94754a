"""The Trainer with ZeRO-1 (strategy="zero" / zero_stage=1): DDP's numbers with 1/N of the
optimizer state per rank, clipping by global norm, checkpoints that resume on any world size."""

from __future__ import annotations

import os

import pytest
import torch

import dptrain
from dptrain import checkpoint
from dptrain.parallel.zero import ZeroRedundancyOptimizer
from dptrain.train import TrainerConfig
from tests._dist import run_ranks
from tests.test_trainer import _params, _same, _trainer


def _zero_vs_ddp(rank, cdir):
    out = {}
    for label, kw in (("ddp", {"strategy": "ddp"}), ("zero", {"zero_stage": 1}), ("zero_named", {"strategy": "zero"})):
        t = _trainer(cdir if label == "zero" else None, max_grad_norm=0.5, steps=5 if label == "zero" else 0, **kw)
        if label != "ddp":
            assert isinstance(t.optimizer, ZeroRedundancyOptimizer) and t.strategy == "zero"
        t.fit(2)
        out[label] = _params(t)
    # resume from the mid-epoch checkpoint of step 10: the same weights at the end
    if rank == 0:  # one rank deletes; the others wait until it is gone
        os.remove(checkpoint.latest_checkpoint(cdir))
    dptrain.comm.barrier()
    again = _trainer(cdir, resume="auto", max_grad_norm=0.5, steps=5, zero_stage=1)
    again.fit(2)
    out["resumed"] = _params(again)
    out["state_bytes"] = sum(v.numel() * v.element_size() for s in again.optimizer.optim.state.values()
                             for v in s.values() if torch.is_tensor(v))
    return out


def test_zero_trains_like_ddp_and_resumes_bitwise(tmp_path):
    results = run_ranks(_zero_vs_ddp, 2, str(tmp_path / "ck"))
    for r in results:
        assert _same(r["zero"], r["ddp"]) and _same(r["zero_named"], r["ddp"]) and _same(r["resumed"], r["ddp"])
    full = sum(p.numel() * 4 for p in results[0]["ddp"].values() if p.dtype == torch.float32 and p.dim() > 0)
    assert sum(r["state_bytes"] for r in results) < full * 1.01  # momentum buffers, split across ranks
    # the saved optimizer state is the unsharded optimizer's, on rank 0's file
    state = checkpoint.load(checkpoint.latest_checkpoint(tmp_path / "ck"))
    assert "optimizer" in state and len(state["optimizer"]["state"]) == 6


def _load_on_three(rank, path, cdir):
    t = _trainer(cdir, resume=path, zero_stage=1)
    t.fit(3)
    return t.epoch


def test_a_zero_checkpoint_resumes_on_another_world_size(tmp_path):
    run_ranks(_zero_vs_ddp, 2, str(tmp_path / "ck"))
    path = checkpoint.latest_checkpoint(tmp_path / "ck")
    assert run_ranks(_load_on_three, 3, path, str(tmp_path / "three")) == [3, 3, 3]


def test_zero_stage_is_validated():
    with pytest.raises(ValueError, match="zero_stage=2"):
        TrainerConfig(zero_stage=2)


def _scheduled(rank, strategy, kind="step"):
    import warnings

    from torch import nn

    from dptrain.data import prepare_dataloader
    from dptrain.train import Trainer
    from tests.test_trainer import _dataset, _model

    dptrain.seed_everything(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made on the optimizer given
    if kind == "sequential":  # the inner schedulers hold the optimizer too
        sched = torch.optim.lr_scheduler.SequentialLR(
            opt, [torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=1), sched], milestones=[1])
    t = Trainer(model, opt, prepare_dataloader(_dataset(96), 6, seed=3), nn.CrossEntropyLoss(),
                TrainerConfig(strategy=strategy, verbose=False), scheduler=sched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(3)
    lrs = [g["lr"] for g in t.optimizer.param_groups]
    return _params(t), lrs, t.scheduler.optimizer is t.optimizer, [str(w.message)[:80] for w in caught]


@pytest.mark.parametrize("kind", ["step", "sequential"])
def test_a_scheduler_made_on_the_given_optimizer_drives_the_sharded_one(kind):
    # "zero" steps a ZeroRedundancyOptimizer built from the given optimizer: the scheduler must
    # follow it, or it decays the learning rate of an optimizer that is never stepped.
    ddp = run_ranks(_scheduled, 2, "ddp", kind)
    zero = run_ranks(_scheduled, 2, "zero", kind)
    for (p_ddp, lr_ddp, _, warned_ddp), (p_zero, lr_zero, moved, warned) in zip(ddp, zero):
        assert lr_zero == lr_ddp != [0.05]
        if kind == "step":
            assert lr_zero == [0.05 * 0.5**3]
        # torch 2.4's SequentialLR warns by itself (it calls step(0) at a milestone): the same with "ddp"
        assert moved and warned == warned_ddp
        assert _same(p_zero, p_ddp)


def test_a_scheduler_on_another_optimizer_is_refused():
    from torch import nn

    from dptrain.train import Trainer
    from tests.test_trainer import _dataset, _model

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stray = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"the scheduler \(StepLR\) adjusts an optimizer the Trainer does not step"):
        Trainer(model, opt, _dataset(12), nn.CrossEntropyLoss(), TrainerConfig(batch_size=4, verbose=False),
                scheduler=torch.optim.lr_scheduler.StepLR(stray, 1))
