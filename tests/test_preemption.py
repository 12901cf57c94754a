"""Slurm preemption: SIGUSR1 on one rank -> every rank stops after the same step, a checkpoint
is written there, the job is requeued with scontrol, and the requeued job resumes from it."""

from __future__ import annotations

import os
import signal
import stat

import pytest

import dptrain
from dptrain import checkpoint
from dptrain.train.preemption import Preempted
from tests._dist import run_ranks
from tests.test_trainer import _params, _same, _trainer


def _fake_scontrol(tmp_path, fail=False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n' + ("echo 'Requested operation is not allowed' >&2; exit 1\n" if fail else ""))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def _preempted_rank(rank, cdir, signal_at):
    t = _trainer(cdir, steps=4)
    inner = t.loss_fn

    def loss_fn(out, y):
        if rank == 1 and t.global_step + 1 == signal_at and not getattr(loss_fn, "sent", False):
            loss_fn.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)  # what `#SBATCH --signal=USR1@90` delivers
        return inner(out, y)

    t.loss_fn = loss_fn
    try:
        t.fit(3)
    except Preempted as exc:
        return {"code": exc.code, "step": t.global_step, "newest": checkpoint.latest_checkpoint(cdir)}
    return {"code": None, "step": t.global_step}


def _resumed_rank(rank, cdir):
    t = _trainer(cdir, resume=None, steps=4)  # automatic after a requeue (SLURM_RESTART_COUNT > 0)
    t.fit(3)
    return {"from": t.resumed_from, "params": _params(t)}


def _uninterrupted_rank(rank):
    t = _trainer(None)
    t.fit(3)
    return _params(t)


def test_sigusr1_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path):
    env = _fake_scontrol(tmp_path)
    cdir = str(tmp_path / "ck")
    results = run_ranks(_preempted_rank, 2, cdir, 6, env=env)
    for r in results:
        assert r["code"] == 0 and r["step"] == 6  # stopped after the step in which rank 1 got the signal
        assert r["newest"] == checkpoint.checkpoint_path(cdir, 0, 6)
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # once, from rank 0
    resumed = run_ranks(_resumed_rank, 2, cdir, env={**env, "SLURM_RESTART_COUNT": "1"})
    assert resumed[0]["from"] == checkpoint.checkpoint_path(cdir, 0, 6)
    assert _same(resumed[0]["params"], run_ranks(_uninterrupted_rank, 2)[0])


def test_a_job_that_cannot_be_requeued_exits_non_zero_after_the_checkpoint(tmp_path):
    env = _fake_scontrol(tmp_path, fail=True)
    cdir = str(tmp_path / "ck")
    results = run_ranks(_preempted_rank, 2, cdir, 3, env=env)
    assert [r["code"] for r in results] == [143, 143]
    assert results[0]["newest"] == checkpoint.checkpoint_path(cdir, 0, 3)
