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
from tests._dist import run_ranks, set_event, wait_event


HELD_S = 0.03  # how long the straggler holds back each step, once rank 0 waits for it


class _SaysWhenWaited:
    """A work handle that, as its wait begins (inside the profiler's clock), sets an event."""

    def __init__(self, work, event):
        self._work, self._event = work, event

    def wait(self, *args):
        set_event(self._event)
        return self._work.wait(*args)


def _straggler(rank, out_dir, slow_rank):
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    data = torch.utils.data.TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    steps = {"waits": 0, "losses": 0}
    if rank != slow_rank:
        real_wait = dptrain.comm.wait

        def wait(work, name, group=None):
            if name == "DDP gradient all-reduce (bucket 0)":
                steps["waits"] += 1
                work = _SaysWhenWaited(work, os.path.join(out_dir, f"waiting-{steps['waits']}"))
            return real_wait(work, name, group)

        dptrain.comm.wait = wait

    def loss_fn(out, y):
        steps["losses"] += 1
        if rank == slow_rank:
            # This rank's forward is slow, and it starts being slow only once rank 0 waits for
            # this step's gradients: by construction rank 0 waits at least HELD_S every step.
            wait_event(os.path.join(out_dir, f"waiting-{steps['losses']}"))
            time.sleep(HELD_S)
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
    # rank 0 was held in its gradient all-reduce for at least HELD_S a step: the profiler counts it
    assert all(s["comm"] >= HELD_S for s in steps), steps
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
