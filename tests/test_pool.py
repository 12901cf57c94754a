"""The test harness's pooled worlds (tests/_pool.py): a rank killed from outside while its world waits
between bodies costs a new world, not the next test (a CI run failed test_powersgd_with_error_feedback_
converges_like_fp32 with BrokenPipeError: its body was sent to a pooled rank that was gone)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests import _pool
from tests._dist import run_ranks


def _rank_and_pid(rank):
    return rank, os.getpid()


def _kill_and_reap(pid):
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pooled rank {pid} did not die")


@pytest.mark.skipif(not _pool.enabled(), reason="DPTRAIN_TEST_POOL=0: every call starts fresh ranks")
@pytest.mark.parametrize("checked", [True, False], ids=["found-dead-before", "found-dead-while-sending"])
def test_a_pooled_rank_killed_between_bodies_costs_a_new_world_not_the_next_test(checked, monkeypatch):
    first = dict(run_ranks(_rank_and_pid, 2))
    pool = _pool._POOL
    discarded = pool.discarded
    _kill_and_reap(first[1])
    if not checked:  # the rank dies after the look at the world: its pipe is broken when the body is sent
        monkeypatch.setattr(_pool.World, "gone", lambda self: None)
    second = dict(run_ranks(_rank_and_pid, 2))
    assert sorted(second) == [0, 1] and second[1] != first[1] and second[0] != first[0], (first, second)
    assert pool.discarded == discarded + 1 and "rank 1" in pool.last_discard, pool.last_discard
    assert dict(run_ranks(_rank_and_pid, 2)) == second  # the new world is kept
