"""The Trainer with strategy="diloco": replicas apart between syncs, checkpoints that carry every
rank's replica and DiLoCo's outer state and resume bit for bit mid-round, evaluation of the
replicas' common weights, and settings refused with the fix."""

from __future__ import annotations

import os

import pytest
import torch

import dptrain
from dptrain import checkpoint
from dptrain.train import TrainerConfig
from tests._dist import run_ranks
from tests.test_trainer import _trainer

DILOCO = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "num_fragments": 2, "fragment_sync_delay": 1,
          "compression": "int8"}


def _local(trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()])


def _run_and_resume(rank, cdir):
    out = {}
    whole = _trainer(cdir, strategy="diloco", steps=4, diloco_kwargs=DILOCO)
    assert whole.strategy == "diloco" and whole.strategy.diloco.num_replicas == 2
    whole.fit(2)  # 96 samples / 2 ranks / 6 per batch = 8 steps an epoch: checkpoints at steps 4, 8, 12, 16
    out["local"], out["common"] = _local(whole), whole.model_state_dict()
    out["syncs"] = whole.strategy.diloco.num_syncs
    # Resume from step 12's checkpoint (12 % 3 == 0: fragment 1's exchange starts at 12 and applies
    # at 13 -- an exchange in flight is part of the state), then from step 4's (mid-round: fragment
    # 0's exchange in flight, fragment 1 not synced yet).
    for drop in (1, 3):
        if rank == 0:
            for path in sorted(checkpoint.list_checkpoints(cdir), key=os.path.getmtime)[-drop:]:
                os.remove(path)
        dptrain.comm.barrier()
        again = _trainer(cdir, resume="auto", strategy="diloco", steps=4, diloco_kwargs=DILOCO)
        out[f"from_{drop}"] = again.global_step
        again.fit(2)
        out[f"local_{drop}"], out[f"common_{drop}"] = _local(again), again.model_state_dict()
    return out


def test_diloco_checkpoints_resume_bitwise_mid_round_with_the_outer_state(tmp_path):
    results = run_ranks(_run_and_resume, 2, str(tmp_path / "ck"), timeout=240)
    a, b = results
    assert a["syncs"] > 0
    # Each rank trained its own replica: the local weights differ, the common (outer) ones agree.
    assert not torch.equal(a["local"], b["local"])
    assert all(torch.equal(a["common"][k], b["common"][k]) for k in a["common"])
    assert [a["from_1"], a["from_3"]] == [12, 4], "the resumes start elsewhere than this test means"
    for r in results:
        for drop in (1, 3):
            assert torch.equal(r[f"local_{drop}"], r["local"]), f"resume after dropping {drop} checkpoint(s) differs"
            assert all(torch.equal(r[f"common_{drop}"][k], r["common"][k]) for k in r["common"])
    # The checkpoint's model is the replicas' common weights; each rank's replica is in its own file.
    path = checkpoint.latest_checkpoint(tmp_path / "ck")
    saved = checkpoint.load(path)
    assert "diloco" in saved["sharded"] and "optimizer" in saved["sharded"]
    assert all(torch.equal(saved["model"][k], a["common"][k]) for k in a["common"])


def test_diloco_settings_are_checked_by_the_config():
    with pytest.raises(ValueError, match="strategy='diloco'"):
        TrainerConfig(strategy="ddp", diloco_kwargs={"sync_every": 10})
    with pytest.raises(ValueError, match=r"does not know \['sync_evry'\]"):
        TrainerConfig(strategy="diloco", diloco_kwargs={"sync_evry": 10})
    with pytest.raises(ValueError, match="sync_every=0"):
        TrainerConfig(strategy="diloco", diloco_kwargs={"sync_every": 0})
    with pytest.raises(ValueError, match="'rank'.*'node'"):
        TrainerConfig(strategy="diloco", diloco_kwargs={"replica": "site"})
    TrainerConfig(strategy="diloco", diloco_kwargs={"sync_every": 10, "compression": "int4", "replica": "node"})


def test_diloco_alone_trains_and_evaluates():
    trainer = _trainer(None, strategy="diloco", diloco_kwargs={"sync_every": 4})
    trainer.fit(1)
    assert trainer.strategy.diloco.num_syncs == 96 // 6 // 4
    assert "accuracy" in trainer.evaluate()
