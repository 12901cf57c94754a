"""What the launcher's watch says about ranks that stall or exit early, read from heartbeats in a store."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from dptrain.runtime.heartbeat import keys_prefix
from dptrain.launcher.watch import Watch

GRADS = "DDP gradient all-reduce (bucket 0)"


class _Store:
    """The three calls the watch makes on the launcher's store."""

    def __init__(self, entries: dict[str, dict]) -> None:
        self.data = {f"{keys_prefix(0)}/{k}": json.dumps(v).encode() for k, v in entries.items()}

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, k):
        return self.data[k]

    def set(self, k, v):
        self.data[k] = v


def _beat(op: str, ddp_steps: int, seq: int = 15) -> dict:
    return {"seq": seq, "op": op, "ticks": 0, "ddp_steps": ddp_steps, "failed": False, "t": time.time(), "pid": 1}


def _watch(store: _Store, lines: list[str]) -> Watch:
    return Watch(store, 0, [], SimpleNamespace(received=False, forward=[]), lines.append, stall_s=1.0, nnodes=1)


def test_a_rank_that_exited_0_after_fewer_ddp_steps_is_reported_as_unequal_batches():
    # What NCCL shows (gloo fails at once): rank 0 waits in step 10 for a rank 1 that has ended.
    lines: list[str] = []
    left = {"t": 0, "after_failure": False, "ddp_steps": 9}
    store = _Store({"hb/0": _beat(GRADS, 9), "hb/1": _beat("", 7), "left/1": left})
    watch = _watch(store, lines)
    watch.exits[1] = (0, time.monotonic() - 2.0)
    watch._report_early_exit([SimpleNamespace(rank=0)])
    assert len(lines) == 1, lines
    assert lines[0].startswith("dptrain run: rank 1 exited with code 0 while rank 0 is still running, 2s later "
                               f"(rank 0: waiting in {GRADS} #15, 9 DDP steps). rank 1 exited with code 0 after 9 "
                               "DDP steps, while rank 0 waits in step 10's gradient all-reduce: the ranks ran unequal "
                               "numbers of steps"), lines  # the steps from its note as it left, not its older heartbeat
    assert "dptrain.DistributedSampler" in lines[0] and "`with model.join():`" in lines[0], lines


def test_a_stall_report_says_when_a_rank_waits_in_a_ddp_step_the_other_never_entered():
    lines: list[str] = []
    watch = _watch(_Store({"hb/0": _beat(GRADS, 9), "hb/1": _beat("", 9, seq=14)}), lines)
    running = [SimpleNamespace(rank=0), SimpleNamespace(rank=1)]
    seen: dict[int, list] = {}
    watch._report_stalls(seen, running)  # first look: remembers the states
    for entry in seen.values():
        entry[1] -= 2.0  # ... which have stood still for 2 s
    watch._report_stalls(seen, running)
    assert lines[:2] == [
        f"dptrain run: rank 0 has made no progress for 2s (waiting in {GRADS} #15, 9 DDP steps)",
        "dptrain run: rank 1 has made no progress for 2s (outside any collective after #14, 9 DDP steps)",
    ]
    assert lines[2].startswith("dptrain run: rank 1 is outside any collective after 9 DDP steps, while rank 0 waits "
                               "in step 10's gradient all-reduce: if rank 1 has left the training loop"), lines
    for entry in seen.values():
        entry[1] -= 2.0
        entry[2] -= 2.0
    watch._report_stalls(seen, running)
    assert len(lines) == 5 and "has made no progress for 4s" in lines[4], lines  # the reports go on, the hint once


class _Dying:
    """A rank whose process the kernel is still ending: ``poll`` says so only at its ``polls``-th call."""

    def __init__(self, rank: int, polls: int) -> None:
        self.rank, self.polls, self.calls, self.asked = rank, polls, 0, 0

    def poll(self):
        self.calls += 1
        return -9 if self.calls >= self.polls else None

    def dying(self):
        self.asked += 1
        return -9


def test_an_early_watch_counts_a_rank_the_kernel_is_still_ending_as_exited():
    for early in (True, False):
        store = _Store({})
        ranks = [SimpleNamespace(rank=0, poll=lambda: None, dying=lambda: None), _Dying(1, polls=3)]
        watch = Watch(store, 0, ranks, SimpleNamespace(received=False, forward=[]), [].append, stall_s=1.0, nnodes=1,
                      early=early)
        failed, peer = watch.run()
        assert failed is ranks[1] and peer is None
        assert watch.exits[1][0] == -9
        assert json.loads(store.data[f"{keys_prefix(0)}/exit/1"])["code"] == -9  # published for the other nodes
        # Early: at the first look, from /proc; otherwise only when the process could be waited for.
        assert (ranks[1].calls, ranks[1].asked) == ((1, 1) if early else (3, 0))
