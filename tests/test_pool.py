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
        except (FileNotFoundError, ProcessLookupError):  # reaped, also between the open and the read (ESRCH)
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


def _start_method(rank):
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True)


@pytest.mark.skipif(not _pool.enabled(), reason="DPTRAIN_TEST_POOL=0: every call starts fresh ranks")
def test_a_pooled_rank_starts_processes_as_a_launched_rank_does():
    # A fork-server child inherits "forkserver"; a rank under dptrain run has none set (the
    # platform's default), and so its DataLoader's workers start the way a user's do.
    assert run_ranks(_start_method, 2) == [None, None]


def _stall_on_rank_1(rank):
    if rank == 1:
        _a_recognisable_stall()
    return rank


def _a_recognisable_stall():
    time.sleep(600)


@pytest.mark.skipif(not _pool.enabled(), reason="DPTRAIN_TEST_POOL=0: every call starts fresh ranks")
def test_a_rank_past_the_timeout_says_where_its_threads_are():
    with pytest.raises(TimeoutError) as stalled:
        run_ranks(_stall_on_rank_1, 2, timeout=5)
    message = str(stalled.value)
    assert "rank(s) [1] of 2 still running" in message
    assert "threads of rank 1" in message and "_a_recognisable_stall" in message, message
