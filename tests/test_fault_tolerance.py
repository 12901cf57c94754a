"""Elastic restarts: a rank killed with SIGKILL at a random step, the job restarted by the
launcher and resumed by the Trainer from its newest complete checkpoint, ends with weights
bitwise equal to a run that was never interrupted."""

import os
import random
import time

import pytest

from benchmarks.soak import BATCHES_PER_RANK, digests, run_job


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = run_job(tmp_path_factory.mktemp("reference"))
    assert out.returncode == 0, out.stderr
    d = digests(out.stdout)
    assert len(d) == 1
    return d.pop()


TRIALS = int(os.environ.get("DPTRAIN_KILL_TRIALS", "3"))  # benchmarks/soak.py runs many more
_seed = int(os.environ.get("DPTRAIN_KILL_SEED", str(int(time.time()))))
_rng = random.Random(_seed)
POINTS = _rng.sample([(r, b) for r in range(2) for b in range(1, BATCHES_PER_RANK + 1)], TRIALS)  # distinct points


@pytest.mark.parametrize("kill_rank, kill_at", POINTS)
def test_sigkilled_rank_restarts_and_finishes_bitwise_equal(tmp_path, reference, kill_rank, kill_at):
    out = run_job(tmp_path, "--kill-rank", kill_rank, "--kill-at", kill_at, restarts=1)
    context = f"(DPTRAIN_KILL_SEED={_seed}, rank {kill_rank}, batch {kill_at})\n{out.stderr[-3000:]}"
    assert out.returncode == 0, context
    assert f"rank {kill_rank} kills itself at batch {kill_at}" in out.stdout, context
    assert f"rank {kill_rank} (local rank {kill_rank}" in out.stderr and "was killed by SIGKILL" in out.stderr
    assert "restarting all ranks (restart 1 of 1)" in out.stderr
    assert digests(out.stdout) == {reference}, context
