"""The per-rank step report: a straggler is named, exposed communication is measured, and a PNG is written."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch
from torch import nn

import dptrain
from dptrain.data import prepare_dataloader
from dptrain.train import Trainer, TrainerConfig
from dptrain.train.profile import format_table, slowest_rank
from tests._dist import run_ranks


def _straggler(rank, out_dir, slow_rank):
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    data = torch.utils.data.TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))

    def loss_fn(out, y):
        if rank == slow_rank:
            time.sleep(0.03)  # this rank's forward is slow: the others will wait for it
        return nn.functional.cross_entropy(out, y)

    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), prepare_dataloader(data, 8), loss_fn,
                TrainerConfig(profile=True, profile_every_steps=4, profile_dir=out_dir, verbose=False))
    # The report goes to this process's sys.stderr; a rank's fd 2 is the forkserver's, which
    # belongs to whichever test started it, so the text is captured here, in the rank.
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        t.fit(1)
    return (t._profiler.steps, err.getvalue()) if rank == 0 else None


def test_the_report_names_a_straggler_and_the_exposed_communication(tmp_path):
    steps, err = run_ranks(_straggler, 2, str(tmp_path), 1)[0]
    assert len(steps) == 8
    # rank 0 spends most of its step waiting for rank 1's gradients
    assert sum(s["comm"] for s in steps) / sum(s["step"] for s in steps) > 0.5
    assert (tmp_path / "profile.png").stat().st_size > 1000
    assert "profile: whole run, steps 1-8" in err and "slowest rank: 1 (" in err


def test_format_table_names_the_slowest_rank():
    fast = {"data": 0.001, "forward": 0.01, "backward": 0.02, "comm": 0.05, "optimizer": 0.005}
    slow = {"data": 0.001, "forward": 0.06, "backward": 0.02, "comm": 0.001, "optimizer": 0.005}
    for m in (fast, slow):
        m["step"] = sum(m.values())
    assert slowest_rank([fast, slow])[0] == 1
    text = format_table([fast, slow], 1, 4)
    assert "slowest rank: 1" in text and "exposed communication: 58% of rank 0's step" in text
    assert text.splitlines()[1].split() == ["rank", "data", "forward", "backward", "comm", "optimizer", "step"]
