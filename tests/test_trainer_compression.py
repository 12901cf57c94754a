"""TrainerConfig(compression=..., overlap_optimizer=...): DDP's extensions set from the Trainer.

The overlap steps each bucket during backward and must give the Trainer bitwise the weights
of an ordinary step (an LR scheduler and momentum included); compression reaches the DDP it
builds; combinations that cannot work are refused when the config is built, with the fix.
"""

from __future__ import annotations

import pytest
import torch

from dptrain import checkpoint
from dptrain.train import NonFiniteError, TrainerConfig
from tests._dist import run_ranks
from tests.test_trainer import _params, _same, _trainer, _weights
from tests.test_trainer_edges import _PoisonAt


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compression": "int8"}, r"compression='int8'.*'auto', 'bf16', 'fp16', 'powersgd'"),
        ({"overlap_optimizer": "yes"}, r"overlap_optimizer='yes'\) must be True or False"),
        ({"compression": "bf16", "strategy": "fsdp"}, r"compression=.*strategy='fsdp'; use strategy='ddp'"),
        ({"compression": "auto", "strategy": "torch-ddp"}, r"strategy='torch-ddp'"),
        ({"overlap_optimizer": True, "strategy": "zero"}, r"overlap_optimizer=.*strategy='zero'; use strategy='ddp'"),
        ({"overlap_optimizer": True, "strategy": "none"}, r"strategy='none'"),
        ({"overlap_optimizer": True, "zero_stage": 1}, r"zero_stage=1"),
        ({"overlap_optimizer": True, "max_grad_norm": 1.0}, r"max_grad_norm=1.0 \(clipping needs the global norm"),
        ({"overlap_optimizer": True, "amp": True}, r"amp=True with amp_dtype='float16'"),
        ({"overlap_optimizer": True, "nan_policy": "skip"}, r"nan_policy='skip'"),
        ({"ddp_kwargs": {"compression": "bf16"}}, r"set TrainerConfig\(compression=...\) instead"),
        ({"ddp_kwargs": {"overlap_optimizer": None}}, r"set TrainerConfig\(overlap_optimizer=...\) instead"),
    ],
)
def test_config_refuses_what_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kwargs)


def test_what_can_work_is_accepted():
    a = TrainerConfig(compression="powersgd", zero_stage=1)
    assert (a.compression, a.zero_stage) == ("powersgd", 1)
    b = TrainerConfig(overlap_optimizer=True, amp=True, amp_dtype="bfloat16", gradient_accumulation_steps=2)
    assert (b.overlap_optimizer, b.amp, b.amp_dtype, b.gradient_accumulation_steps) == (True, True, "bfloat16", 2)
    c = TrainerConfig(compression="bf16", overlap_optimizer=True, strategy="ddp")
    assert (c.compression, c.overlap_optimizer, c.strategy) == ("bf16", True, "ddp")


def test_one_process_ignores_both():
    t = _trainer(None, compression="bf16", overlap_optimizer=True)
    assert t.strategy == "none" and not isinstance(t.model, torch.nn.parallel.DistributedDataParallel)
    t.fit(1)
    plain = _trainer(None)
    plain.fit(1)
    assert _same(_params(t), _params(plain))  # ignored: the very weights of a run without them


def _overlap_vs_plain(rank, accum):
    out = {}
    for overlap in (False, True):
        t = _trainer(None, overlap_optimizer=overlap, accum=accum)
        assert (t.model._overlap is not None) == overlap  # the scheduler was built before the DDP
        t.fit(2)
        out[overlap] = _params(t)
        out[f"lr{overlap}"] = t.optimizer.param_groups[0]["lr"]
    return out


@pytest.mark.parametrize("accum", [1, 2])
def test_overlap_optimizer_trains_bitwise_like_the_ordinary_step(accum):
    for r in run_ranks(_overlap_vs_plain, 2, accum):
        assert _same(r[True], r[False])
        assert r["lrTrue"] == r["lrFalse"] == 0.05 * 0.5


def _compressed(rank, name):
    t = _trainer(None, compression=name)
    assert t.model.compression == name
    t.fit(1)
    full = _trainer(None)
    full.fit(1)
    return t.history[-1]["train_loss"], _params(t), _params(full)


def test_compression_reaches_the_ddp_the_trainer_builds():
    (loss0, p0, full0), (loss1, p1, _) = run_ranks(_compressed, 2, "bf16")
    assert torch.isfinite(torch.tensor(loss0)) and _same(_weights(p0), _weights(p1))  # the replicas stay equal
    # It acted: bf16 gradients give other weights than fp32 ones, but only by bf16's rounding
    # (8 bits of mantissa over one epoch's steps).
    assert not _same(_weights(p0), _weights(full0))
    for k, v in _weights(full0).items():
        torch.testing.assert_close(p0[k], v, rtol=2e-2, atol=2e-3)


def _nan_with_overlap(rank, cdir):
    t = _trainer(cdir, overlap_optimizer=True)
    t.loss_fn = _PoisonAt(t, 12, ranks=(1,))  # epoch 2 (8 steps per epoch on two ranks)
    try:
        t.fit(3)
    except NonFiniteError as exc:
        return str(exc)
    return None


def test_nan_with_the_overlap_says_the_update_was_applied_and_keeps_the_checkpoint(tmp_path):
    cdir = str(tmp_path / "ck")
    for text in run_ranks(_nan_with_overlap, 2, cdir):
        assert text is not None and "non-finite loss at step 12" in text
        assert "overlap_optimizer applied this step's update during backward" in text
        assert "still finite" not in text  # the weights in memory are not
    kept = checkpoint.list_checkpoints(cdir)
    assert kept == [checkpoint.checkpoint_path(cdir, 1, 8)]
    assert repr(kept[0]) in text
    assert all(torch.isfinite(v).all() for v in checkpoint.load(kept[0])["model"].values() if v.is_floating_point())


def _resume(rank, cdir, settings):
    import os

    import dptrain

    full = _trainer(cdir, steps=5, **settings)
    full.fit(2)
    if rank == 0:  # resume from the mid-epoch checkpoint of step 5 (8 steps per epoch): one rank
        for path in checkpoint.list_checkpoints(cdir)[1:]:  # deletes the later ones
            os.remove(path)
    dptrain.comm.barrier()
    again = _trainer(cdir, resume="auto", steps=5, **settings)
    assert again.global_step == 5
    again.fit(2)
    return _params(full), _params(again)


@pytest.mark.parametrize("settings", [{"overlap_optimizer": True}, {"compression": "bf16"}], ids=["overlap", "bf16"])
def test_overlap_and_bf16_resume_bit_for_bit(tmp_path, settings):
    # Loading a checkpoint replaces the optimizer's state dict; the per-bucket steps must use
    # the loaded state, not the fresh one they were built with. bf16 compression has no state.
    for full, again in run_ranks(_resume, 2, str(tmp_path / "ck"), settings):
        assert _same(full, again)
