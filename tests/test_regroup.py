"""Leaving a group that a silent peer broke (see [Note: a peer that goes silent] in dptrain._regroup).

A peer that stops answering without closing its connections (a node that hangs or drops off the
network) would hold a survivor's gloo collective for the whole collective timeout. Under in-place
recovery the heartbeat thread of every rank looks for the launcher's announcement of a generation
without it and cuts the broken group, so the collective fails at once and the rank recovers.
"""

from __future__ import annotations

import json
import time

import pytest

import torch
import torch.distributed as dist

from dptrain import _regroup
from tests._dist import run_ranks, set_event, wait_event

LOST = {"kind": "resize", "why": "node(s) 1 (rank(s) 1) stopped answering", "lost": [1], "rank": [1]}


def _silent_peer(rank, events):
    from dptrain import env

    dist.all_reduce(torch.ones(4))  # the group works
    if rank == 1:  # alive, connections open, but it never issues the next collective
        wait_event(events / "done")
        return None
    env._STATE.store.set(_regroup.generation_key(1), json.dumps(LOST))  # the launcher's announcement
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        failed = (time.monotonic() - began, str(exc)[:200])
    else:
        failed = None
    set_event(events / "done")
    return failed


def test_a_collective_with_a_silent_peer_fails_once_a_failure_is_announced(tmp_path):
    env = {"DPTRAIN_RECOVERY": "in-place", "DPTRAIN_HEARTBEAT_S": "0.2", "DPTRAIN_TIMEOUT": "60"}
    failed, _ = run_ranks(_silent_peer, 2, tmp_path, env=env, timeout=100)
    assert failed is not None, "the all-reduce with a silent peer completed"
    assert failed[0] < 20, f"it failed only after {failed[0]:.0f}s (the collective timeout is 60s): {failed[1]}"


class _Keys(dict):
    """The few store calls the look needs, on a dict."""

    def check(self, names):
        return all(n in self for n in names)

    def get(self, name):
        return self[name].encode()


def test_a_node_let_in_or_a_group_formed_for_the_generation_is_not_cut(monkeypatch):
    cuts, said = [], []
    monkeypatch.setattr(_regroup, "_cut_noted", lambda: cuts.append(1) or 0)
    monkeypatch.setattr(_regroup, "_on_leaving", [said.append])
    monkeypatch.setattr(_regroup, "_group_generation", [0])
    keys = _Keys()
    assert not _regroup.leave_if_broken(keys, 0)  # nothing announced
    keys[_regroup.generation_key(1)] = json.dumps({"kind": "resize", "joining": [2], "why": "node 1 arrived"})
    assert not _regroup.leave_if_broken(keys, 0) and not cuts  # a node let in: the step boundary takes it
    keys[_regroup.generation_key(2)] = json.dumps(LOST)
    _regroup._group_generation[0] = 2  # the main thread formed generation 2's group already
    assert not _regroup.leave_if_broken(keys, 0) and not cuts
    _regroup._group_generation[0] = 1
    assert _regroup.leave_if_broken(keys, 1) and cuts == [1]
    assert "generation 2 (node(s) 1 (rank(s) 1) stopped answering)" in said[0]
    assert not _regroup.leave_if_broken(keys, 1) and cuts == [1]  # once


class _Arrivals(_Keys):
    """The calls ``form``'s wait makes: the others never arrive, and the job ends after ``polls`` looks."""

    def __init__(self, polls: int) -> None:
        super().__init__({_regroup.generation_key(1): json.dumps({"rank": 1, "why": "was killed by SIGKILL"})})
        self.polls = polls

    def add(self, name, amount):
        self[name] = str(int(self.get(name)) + amount if name in self else amount)
        return int(self[name])

    def set(self, name, value):
        self[name] = value

    def wait(self, names, timeout):
        if not self.check(names):
            raise RuntimeError("Wait timeout")  # what torch's store raises when the slice passes

    def check(self, names):
        if names == [_regroup.FINISHED]:
            self.polls -= 1
            return self.polls < 0
        return super().check(names)


def test_a_member_waiting_for_the_others_does_the_registered_work_once(monkeypatch):
    import datetime
    from types import SimpleNamespace

    done = []
    monkeypatch.setattr(_regroup, "_while_waiting", [done.append, lambda world: 1 / 0])  # a failing one is ignored
    world = SimpleNamespace(rank=1, world_size=2, launch_attempt=0)
    try:
        _regroup.form(None, _Arrivals(polls=5), world, "gloo", datetime.timedelta(seconds=60), 1, since=1)
    except _regroup.JobFinished:
        pass
    else:
        raise AssertionError("form returned without the other member")
    assert done == [world]  # once, however many looks the wait took


def test_a_replacement_reads_its_ranks_snapshots_while_it_waits_and_the_trainer_takes_them(monkeypatch, tmp_path):
    from dptrain.train import recovery

    for seq in (4, 5):
        torch.save({"seq": seq, "rng": {}, "loss_sum": torch.zeros(()), "sample_count": 0, "buffers": {}},
                   tmp_path / f"rank1.{seq % 2}")
    monkeypatch.setenv("DPTRAIN_RECOVERY", "in-place")
    monkeypatch.setenv("DPTRAIN_GENERATION", "1")
    monkeypatch.setenv("DPTRAIN_RECOVERY_DIR", str(tmp_path))
    monkeypatch.setattr(recovery, "_READ_AHEAD", {})
    monkeypatch.setattr(recovery, "_READ_AHEAD_ONCE", [False])
    assert recovery._read_ahead in _regroup._while_waiting  # registered as the Trainer's module is imported
    from types import SimpleNamespace

    recovery._read_ahead(SimpleNamespace(rank=1))
    recovery._read_ahead(SimpleNamespace(rank=1))  # a later wait (a second recovery) reads nothing again
    read = recovery._READ_AHEAD[(str(tmp_path), 1)]
    assert sorted(read) == [4, 5]
    for f in tmp_path.iterdir():
        f.unlink()  # the join must not need the files any more
    fake = SimpleNamespace(snapshot=None, prepared=None, seq=-1, directory=str(tmp_path),
                           trainer=SimpleNamespace(rank=1), _newcomer=lambda: False)
    held, newcomer = recovery.InPlaceRecovery._snapshots(fake)
    assert sorted(held) == [4, 5] and not newcomer
    assert recovery._READ_AHEAD == {}  # taken once


def _store_server(kind):
    """A store server of ``kind`` ("dptrain": the launcher's, "torch": torch's TCPStore) and a closer."""
    import datetime
    import socket

    if kind == "torch":
        master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10))
        return master.port, lambda: master  # (holding it until the end: the server goes with it)
    from dptrain.launcher.store import StoreServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = StoreServer(sock)
    return server.port, server.close


@pytest.mark.parametrize("kind", ["dptrain", "torch"])
def test_a_member_waiting_for_the_group_wakes_when_the_last_one_arrives_not_at_its_next_look(kind):
    import datetime
    import threading

    port, close = _store_server(kind)
    try:
        def client():
            base = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
            return dist.PrefixStore("attempt0/", base)

        keys, last = client(), client()
        began = time.monotonic()  # a look every half second: a wake-up must come sooner
        for _ in range(3):  # slices that pass without the key leave the client usable
            _regroup._wait_briefly(keys, "recovery/g1/everyone", 0.5)
        assert time.monotonic() - began >= 1.4
        threading.Timer(0.1, lambda: last.set("recovery/g1/everyone", "1")).start()
        began = time.monotonic()
        _regroup._wait_briefly(keys, "recovery/g1/everyone", 0.5)
        assert 0.05 < time.monotonic() - began < 0.4
        keys.set("other", "x")  # and the client still answers right
        assert keys.get("other") == b"x" and last.get("other") == b"x"
    finally:
        close()
