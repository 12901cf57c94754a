"""Leaving a group that a silent peer broke (see [Note: a peer that goes silent] in dptrain.runtime.regroup).

A peer that stops answering without closing its connections (a node that hangs or drops off the
network) would hold a survivor's gloo collective for the whole collective timeout. Under in-place
recovery the heartbeat thread of every rank looks for the launcher's announcement of a generation
without it and cuts the broken group, so the collective fails at once and the rank recovers.

And the members' wait for each other in a new generation (see [Note: waiting for the others, quietly]):
it ends the moment the last one arrives, or for a newer generation, the job's end or the deadline, and
no wait of torch's store client ends in a timeout, which c10d would log.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

import torch
import torch.distributed as dist

from dptrain.runtime import regroup as _regroup
from tests._dist import run_ranks, set_event, wait_event

# Fresh ranks for every call (tests/_dist.py): a rank's process is killed and its group re-formed: a
# world of its own.
FRESH_RANKS = True

LOST = {"kind": "resize", "why": "node(s) 1 (rank(s) 1) stopped answering", "lost": [1], "rank": [1]}


def _silent_peer(rank, events):
    from dptrain.runtime import env

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


def _a_failed_init_then_a_group(rank, port):
    # The group dptrain.init made goes first, as _reform destroys the broken one.
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    failed = None
    if rank == 0:  # its peer never comes to this one: the init fails, as when a member dies in it
        try:
            _regroup.init_group("gloo", dist.PrefixStore("lonely", store), 0, 2, datetime.timedelta(seconds=1))
        except Exception as exc:  # noqa: BLE001 - which error gloo raises differs across torch versions
            failed = type(exc).__name__
        store.set("failed", "1")
    else:
        store.wait(["failed"])
    _regroup.init_group("gloo", dist.PrefixStore("together", store), rank, 2, datetime.timedelta(seconds=20))
    t = torch.ones(3)
    dist.all_reduce(t)
    return failed, t.tolist()


def test_a_rank_whose_init_failed_forms_the_next_group_with_its_peers():
    # See [Note: a group that failed to form]: without init_group's care, rank 0's second group
    # was named "1" and rank 1's "0", and both waited in init_process_group until the timeout.
    from dptrain.launcher import free_port

    (failed, summed), (_, summed1) = run_ranks(_a_failed_init_then_a_group, 2, free_port(), timeout=60)
    assert failed is not None
    assert summed == summed1 == [2.0, 2.0, 2.0]


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


class _Members:
    """Members of generation 1 of a job of ``world_size`` ranks calling ``form`` on threads, each with its own
    client of a store server of ``kind``; the group's creation is recorded (rank -> when), not done."""

    def __init__(self, kind, world_size, monkeypatch):
        self.port, self.close = _store_server(kind)
        self.world_size, self.formed, self.failed, self.threads = world_size, {}, {}, []
        monkeypatch.setattr(_regroup, "_while_waiting", [])
        monkeypatch.setattr(_regroup, "_group_sockets", {})  # what forming a group notes, kept from other tests
        monkeypatch.setattr(_regroup, "_group_generation", [0])
        monkeypatch.setattr(_regroup.dist, "init_process_group",
                            lambda *a, rank, **k: self.formed.setdefault(rank, time.monotonic()))
        self.timeout = datetime.timedelta(seconds=30)
        self.keys = self.client()[1]
        self.keys.set(_regroup.generation_key(1), json.dumps({"rank": 1, "why": "was killed by SIGKILL"}))

    def client(self):
        base = dist.TCPStore("127.0.0.1", self.port, None, False, timeout=datetime.timedelta(seconds=10))
        return base, _regroup.prefixed(base, 0, "dp")

    def arrive(self, rank, generation=1, since=0):
        def member():
            base, keys = self.client()
            world = SimpleNamespace(rank=rank, world_size=self.world_size, launch_attempt=0)
            try:
                _regroup.form(base, keys, world, "gloo", self.timeout, generation, since)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                self.failed[rank] = (time.monotonic(), exc)

        thread = threading.Thread(target=member)
        thread.start()
        self.threads.append(thread)

    def join(self):
        for thread in self.threads:
            thread.join(20)
        assert not any(t.is_alive() for t in self.threads), "a member is still in form"


def _waiting_threads():
    return [t for t in threading.enumerate() if t.name == "dptrain-arrivals"]


@pytest.mark.parametrize("kind", ["dptrain", "torch"])
def test_a_member_waiting_for_the_others_wakes_when_the_last_one_arrives_and_logs_no_store_timeouts(
        kind, monkeypatch, capfd):
    # Each slice a member waited used to end in a timeout of torch's store client, which c10d logs twice
    # ("[c10d] waitForInput: socket ... timed out after 50ms"): 35 lines a second on a survivor's output
    # while a replacement started. Its looks between slices are 0.5 s here: the wake-up must not wait for one.
    monkeypatch.setattr(_regroup, "_ARRIVAL_SLICE_S", 0.5)
    members = _Members(kind, 2, monkeypatch)
    try:
        members.arrive(0)
        time.sleep(0.7)  # a slice passes
        assert not members.formed and not members.failed
        members.arrive(1)
        members.join()
        assert not members.failed, members.failed
        assert abs(members.formed[0] - members.formed[1]) < 0.2, members.formed
        members.keys.set("other", "x")  # the store still answers
        assert members.keys.get("other") == b"x"
    finally:
        members.close()
    logged = capfd.readouterr().err
    assert "waitForInput" not in logged and "[c10d]" not in logged, logged[-2000:]
    assert not _waiting_threads()


@pytest.mark.parametrize("why", ["newer", "finished", "deadline"])
def test_a_member_that_stops_waiting_for_another_reason_leaves_no_wait_behind(why, monkeypatch, capfd):
    # A newer generation (the replacement died too), the job's end, the deadline: the member goes on at once,
    # and the thread that waited for the others is gone, not left to time out in the store (and log it).
    monkeypatch.setattr(_regroup, "ARRIVAL_WAIT_S", 1.0)
    members = _Members("dptrain", 2, monkeypatch)
    members.timeout = datetime.timedelta(seconds=0.5 if why == "deadline" else 30)
    try:
        members.arrive(0)
        time.sleep(0.4)
        began = time.monotonic()
        if why == "newer":
            members.keys.set(_regroup.generation_key(2), json.dumps({"rank": 1, "why": "exited with code 1"}))
            members.arrive(1, generation=2, since=2)  # the second replacement
        elif why == "finished":
            members.keys.set(_regroup.FINISHED, "1")
        members.join()
    finally:
        members.close()
    if why == "newer":
        assert not members.failed and sorted(members.formed) == [0, 1], (members.failed, members.formed)
        assert members.formed[0] - began < 0.5
    else:
        ((when, exc),) = members.failed.values()
        assert isinstance(exc, _regroup.JobFinished if why == "finished" else TimeoutError), exc
        assert why != "finished" or exc.newcomer is False  # a replacement: it must not end quietly (env)
        assert when - began < (0.5 if why == "finished" else 1.0)
    logged = capfd.readouterr().err
    assert "waitForInput" not in logged and "[c10d]" not in logged, logged[-2000:]
    assert not _waiting_threads()


def test_a_member_waiting_for_the_others_still_handles_signals(monkeypatch):
    # The long wait runs on a thread: a store call does not return for a signal, and on the main thread
    # it would hold off a script's handlers (Ctrl-C, SIGTERM) until the others came or the deadline passed.
    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    monkeypatch.setattr(_regroup, "ARRIVAL_WAIT_S", 10.0)
    members = _Members("torch", 2, monkeypatch)
    old = signal.signal(signal.SIGUSR1, stop)
    try:
        base, keys = members.client()
        world = SimpleNamespace(rank=0, world_size=2, launch_attempt=0)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        began = time.monotonic()
        with pytest.raises(Stop):
            _regroup.form(base, keys, world, "gloo", members.timeout, 1, 0)
        assert time.monotonic() - began < 2.0
        assert not _waiting_threads()
    finally:
        signal.signal(signal.SIGUSR1, old)
        members.close()


def test_a_signal_while_the_wait_starts_leaves_no_wait_behind(monkeypatch):
    # Seen in CI: the signal's handler raised while ``Thread.start`` waited for the waiting thread to run,
    # before ``form`` held it, and the thread stayed in the store's wait (at the process's exit, a C++
    # "terminate called"). Here the handler's exception is raised right after the thread started.
    class Stop(Exception):
        pass

    real_start = threading.Thread.start

    def start(thread):
        real_start(thread)
        if thread.name == "dptrain-arrivals":
            raise Stop

    monkeypatch.setattr(_regroup, "ARRIVAL_WAIT_S", 10.0)
    members = _Members("torch", 2, monkeypatch)
    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        base, keys = members.client()
        world = SimpleNamespace(rank=0, world_size=2, launch_attempt=0)
        with pytest.raises(Stop):
            _regroup.form(base, keys, world, "gloo", members.timeout, 1, 0)
        assert not _waiting_threads()
    finally:
        members.close()


def test_a_survivor_waiting_for_a_slow_replacement_prints_no_store_timeouts(tmp_path):
    # A real in-place recovery (tests/scripts/slow_replacement.py): rank 1 kills itself with SIGKILL and its
    # replacement takes 1.5 s to reach dptrain.init, which rank 0 spends waiting for it in the new generation.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", "--recovery", "in-place",
           "--max-restarts", "1", os.path.join(root, "tests", "scripts", "slow_replacement.py")]
    env = dict(os.environ, START_S="1.5", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    recovered = [line for line in out.splitlines() if "dptrain: recovered in place (generation 1)" in line]
    assert len(recovered) == 1 and "rank 0 done at step 4" in out, out[-4000:]
    waited = float(recovered[0].split("the survivors waited ")[1].split(" s")[0])
    assert waited >= 1.0, recovered[0]  # it did wait for the replacement's start
    noise = [line for line in out.splitlines() if "waitForInput" in line or "[c10d]" in line]
    assert not noise, f"{len(noise)} lines of torch's store client, e.g. {noise[:2]}"
    # The rank was killed by a signal, not for want of memory, and nothing says otherwise.
    assert "rank 1 (local rank 1, pid" in out and "was killed by SIGKILL;" in out, out[-4000:]
    assert "out of memory" not in out and "OOM" not in out, out[-4000:]
