"""A survivor's wait for an asynchronous collective ends once in-place recovery is announced (issue 48;
see [Note: a wait that gloo never ends] in dptrain.runtime.abandon).

Two ranks on gloo under the in-place settings, no launcher: rank 1 stays alive and never joins the
all-reduce that rank 0 waits for, and rank 0's noted sockets are forgotten, so the heartbeat thread has
nothing to cut -- the state a CI run hung in (DiLoCo's outer exchange in flight, its peer dead, gloo's
socket already closed, the wait not ended). A test stands in for the launcher by writing the
generation's entry into the store. Fresh rank processes: an abandoned group stays in its process.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.runtime import abandon as _abandon, env, interrupt as _interrupt, regroup as _regroup
from tests._dist import run_ranks

FRESH_RANKS = True
TIMEOUT_S = 60  # the collective timeout: a wait that only it ends fails the test's bound below
IN_PLACE = {"DPTRAIN_RECOVERY": "in-place", "DPTRAIN_TIMEOUT": str(TIMEOUT_S)}


def _left_hanging(rank):
    store = env._STATE.store
    t = torch.full((867,), float(rank + 1))
    comm.all_reduce(t)  # the pairs are connected and used once
    if rank == 1:
        # Alive and silent until rank 0 has left the collective and the group.
        store.wait(["test/rank0-done"], datetime.timedelta(seconds=TIMEOUT_S))
        return None
    _regroup._group_sockets.clear()  # nothing left for the heartbeat thread to cut (as in the CI run)
    announce = threading.Timer(1.0, lambda: store.set(_regroup.generation_key(1), json.dumps(
        {"rank": 1, "why": "was killed by SIGKILL", "pid": 4242})))
    announce.start()
    started = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    try:
        comm.wait(work, "DiLoCo outer exchange of fragment 0 at inner step 16")
        outcome = "completed"
    except _interrupt.PeerLost as exc:
        outcome = str(exc)
    waited = time.monotonic() - started
    started = time.monotonic()
    dist.destroy_process_group()  # as the next generation's re-form does: it must not wait for the work
    destroyed = time.monotonic() - started
    abandoned = len(_abandon.ABANDONED)
    store.set("test/rank0-done", "1")
    return outcome, waited, destroyed, abandoned


def test_a_wait_that_the_backend_never_ends_is_abandoned_once_a_failure_is_announced():
    results = run_ranks(_left_hanging, 2, env=IN_PLACE, timeout=TIMEOUT_S + 30)
    outcome, waited, destroyed, abandoned = results[0]
    assert outcome.startswith("rank 0: rank 1 was killed by SIGKILL: dptrain run announced generation 1"), outcome
    assert "DiLoCo outer exchange of fragment 0 at inner step 16" in outcome and "abandoned" in outcome, outcome
    # Within a slice or two of the announcement (at 1 s), not at the collective timeout; and the group goes at once.
    assert waited < TIMEOUT_S / 3 and destroyed < TIMEOUT_S / 3, (waited, destroyed)
    assert abandoned == 1


def _late_peer(rank, announce_joining):
    store = env._STATE.store
    t = torch.full((867,), float(rank + 1))
    comm.all_reduce(t)
    if announce_joining and rank == 0:  # a node let in breaks nothing: the wait goes on
        store.set(_regroup.generation_key(1), json.dumps({"kind": "resize", "joining": [2]}))
    if rank == 1:
        time.sleep(3 * _abandon.SLICE_S)  # several slices late
    work = dist.all_reduce(t, async_op=True)
    comm.wait(work, "a late peer's all-reduce")
    return t[:2].tolist(), len(_abandon.ABANDONED)


@pytest.mark.parametrize("announce_joining", [False, True])
def test_a_collective_that_ends_after_several_slices_returns_its_result(announce_joining):
    for total, abandoned in run_ranks(_late_peer, 2, announce_joining, env=IN_PLACE, timeout=TIMEOUT_S):
        assert total == [6.0, 6.0] and abandoned == 0


class _SliceRunsOut(dist.Work):
    """A gloo handle whose first slice ends ("Operation timed out!") just before the collective does:
    by the time the wait asks, the handle is completed -- with ``failure``, or without one."""

    def __init__(self, failure=None):
        super().__init__()
        self.failure, self.waits = failure, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) == 1:
            raise RuntimeError("Operation timed out!")
        if self.failure is not None:
            raise RuntimeError(self.failure)
        return True

    def is_completed(self):
        return len(self.waits) > 0


@pytest.mark.parametrize("failure", [None, "Connection closed by peer"])
def test_a_collective_completed_just_after_its_slice_ran_out_gives_its_own_outcome(monkeypatch, failure):
    # The race a CI-like run met (rank 0 failed with the slice's "Operation timed out!" although its
    # late peer's all-reduce had completed): the outcome is the collective's, never the slice's.
    monkeypatch.setattr(_abandon, "_watched", lambda group: (object(), 0))
    work = _SliceRunsOut(failure)
    if failure is None:
        assert _abandon.wait(work, "an all-reduce") is True
    else:
        with pytest.raises(RuntimeError, match=failure):
            _abandon.wait(work, "an all-reduce")
    assert work.waits[0] == _abandon._SLICE and len(work.waits) == 2
