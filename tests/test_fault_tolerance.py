"""Elastic restarts: a rank killed with SIGKILL, the job restarted by the launcher and resumed
by the Trainer from the newest checkpoint completed before the kill, ends with weights bitwise
equal to a run that was never interrupted.

The run is deterministic, so a restart that trained from scratch would reach the same weights:
each test also asserts which checkpoint every rank resumed from.

The kill points are drawn from a fixed seed (DPTRAIN_KILL_SEED, default 24; each test's id
shows its point): one kill on each rank after the first checkpoint, one before any.
"""

import os
import random

import pytest

from benchmarks.soak import BATCHES_PER_RANK, NO_CHECKPOINT, check_trial, digests, expected_resume, resumes, run_job, saves

SEED = int(os.environ.get("DPTRAIN_KILL_SEED", "24"))  # benchmarks/soak.py draws many more
FIRST_SAVE_AFTER = 2  # train_resilient.py's default --every


def _points(seed):
    rng = random.Random(seed)
    after = [(r, rng.randint(FIRST_SAVE_AFTER + 1, BATCHES_PER_RANK)) for r in (0, 1)]
    before = (rng.randrange(2), rng.randint(1, FIRST_SAVE_AFTER))
    return after + [before]


POINTS = _points(SEED)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = run_job(tmp_path_factory.mktemp("reference"))
    assert out.returncode == 0, out.stderr
    d = digests(out.stdout)
    assert len(d) == 1
    s = saves(out.stdout)
    # steps 2, 4, 6, ... within an epoch, and every epoch's end (5 steps an epoch)
    assert sorted(s) == [2, 4, 5, 6, 8, 10, 12, 14, 15], out.stdout
    return d.pop(), s


@pytest.mark.parametrize("kill_rank, kill_at", POINTS)
def test_sigkilled_rank_restarts_resumes_and_finishes_bitwise_equal(tmp_path, reference, kill_rank, kill_at):
    digest, reference_saves = reference
    out = run_job(tmp_path, "--kill-rank", kill_rank, "--kill-at", kill_at, restarts=1)
    context = f"(DPTRAIN_KILL_SEED={SEED}, rank {kill_rank}, batch {kill_at})\n{out.stdout}\n{out.stderr[-3000:]}"
    assert f"rank {kill_rank} kills itself at batch {kill_at}" in out.stdout, context
    assert f"rank {kill_rank} (local rank {kill_rank}" in out.stderr and "was killed by SIGKILL" in out.stderr, context
    assert "restarting all ranks (restart 1 of 1)" in out.stderr, context
    want = expected_resume(reference_saves, kill_at)
    if want is None:
        assert NO_CHECKPOINT in out.stderr and resumes(out.stdout) == {}, context
    else:
        assert resumes(out.stdout) == {0: want, 1: want}, context
    assert check_trial(out, digest, reference_saves, kill_at) == [], context
