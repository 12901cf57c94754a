"""The shared-memory all-reduce: numerics, the DDP hook-up, fallbacks, and failures.

Rank functions check what a user relies on: the sum order (bitwise equal to gloo on two
ranks, rank order on more), that ``DistributedDataParallel`` picks shared memory by itself
on one node and gloo when told or when it cannot, that waiting burns no CPU, that the
segment is private and never left in ``/dev/shm``, and that a rank killed in the middle of
an all-reduce is named by the others instead of hanging them.
"""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import dptrain
from dptrain import _shm
from dptrain._shm import segment as _shm_segment
from dptrain.launcher.rendezvous import RendezvousServer
from dptrain.launcher.workers import rank_environ
from tests import _dist
from tests._dist import run_ranks

# Fresh ranks for every call (tests/_dist.py): peers die, are killed or left unreaped here: what is
# tested is the process, not only the body.
FRESH_RANKS = True

ON = {"DPTRAIN_SHM": "1"}  # these tests are about shared memory, also in a DPTRAIN_SHM=0 run of the suite


def _sum_order(rank):
    n = dist.get_world_size()
    g = _shm.ShmGroup.create(None, 24 * 1024, what="test all-reduce")  # room for 1136 staged floats
    st = os.fstat(g._seg.fd)
    private = (stat.S_IMODE(st.st_mode), st.st_uid == os.getuid(), os.path.exists(g._seg.path))
    # Values where fp32 addition is not associative, so a different order shows.
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(5000, generator=gen) * 10.0 ** (3 * r) for r in range(n)]
    expected = xs[0] + xs[1]
    for x in xs[2:]:
        expected = expected + x
    in_place = g.zeros(5000, torch.float32)
    in_place.copy_(xs[rank])
    g.all_reduce(in_place).wait()
    staged = xs[rank].clone().view(50, 100)[:, :70]  # not in the segment, not contiguous, > free room
    g.all_reduce(staged).wait()
    gloo = xs[rank].clone()
    dist.all_reduce(gloo)
    # Mismatched calls (rank 1 passes a shorter tensor) fail on every rank, naming each call.
    with pytest.raises(dptrain.runtime.diagnostics.CollectiveMismatchError) as info:
        g.all_reduce(in_place[:1000] if rank == 1 else in_place).wait()
    return (
        private,
        torch.equal(in_place, expected),
        torch.equal(staged, expected.view(50, 100)[:, :70]),
        torch.equal(in_place, gloo) if n == 2 else None,
        str(info.value),
    )


@pytest.mark.parametrize("nprocs", [2, 3])
def test_sum_is_in_rank_order_on_every_rank_and_equals_gloo_on_two(nprocs):
    for rank, (private, in_place, staged, same_as_gloo, mismatch) in enumerate(run_ranks(_sum_order, nprocs, env=ON)):
        assert private == (0o600, True, False)  # mode 0600, ours, and the name already unlinked
        assert in_place and staged
        assert same_as_gloo in (True, None)
        assert mismatch.startswith(f"rank {rank}: test all-reduce #3: the ranks called different"), mismatch
        assert "rank 0: all_reduce of 20000 bytes at offset 0; rank 1: all_reduce of 4000 bytes at offset 0" in mismatch


def _ddp_choices(rank):
    from torch import nn

    def make(**kw):
        torch.manual_seed(0)
        return dptrain.DDP(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)), **kw)

    auto, off = make(), make(shm=False)
    seg = auto.reducer.shm._seg
    inside = all(seg.offset_of(b.flat) is not None for b in auto.reducer.buckets)
    os.environ["DPTRAIN_SHM"] = "0"
    by_env, forced = make(), make(shm=True)
    os.environ["DPTRAIN_SHM"] = "1"
    # Another node (as rank 1 reports it): every rank falls back to gloo, or raises if forced.
    real = _shm_segment._node_identity
    _shm_segment._node_identity = (lambda: ("elsewhere",) + real()[1:]) if rank == 1 else real
    other_node = make()
    with pytest.raises(ValueError, match="rank 1 is on another node than rank 0"):
        make(shm=True)
    _shm_segment._node_identity = real
    # A /dev/shm too small for the buckets: gloo, and a warning (from rank 0) that says how to fix it.
    fallocate = os.posix_fallocate
    os.posix_fallocate = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        no_room = make()
    os.posix_fallocate = fallocate
    warned = [str(w.message) for w in caught if "shared memory is off" in str(w.message)]
    # The models train the same either way, bitwise, against PyTorch's DDP too.
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)))
    models = [auto, off, by_env, forced, other_node, no_room, ref]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    params = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    return (
        [m.reducer.shm is not None for m in models[:6]],
        inside,
        [torch.equal(p, params[-1]) for p in params],
        warned,
    )


def test_ddp_uses_shared_memory_on_one_node_unless_told_or_unable():
    results = run_ranks(_ddp_choices, 2, env=ON)
    for used, inside, same, _ in results:
        # auto, shm=False, DPTRAIN_SHM=0, shm=True, another node, /dev/shm full
        assert used == [True, False, False, True, False, False]
        assert inside  # the buckets themselves live in the segment: no copy in or out
        assert all(same)
    warned = results[0][3]
    assert len(warned) == 1 and "cannot reserve" in warned[0] and "--shm-size" in warned[0], warned
    assert results[1][3] == []  # warnings come from rank 0 only


def _thread_states(pid: int) -> str:
    """One letter per thread of process ``pid`` (``R`` running or runnable, ``S`` asleep, ...)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # a thread that ended since the listing
            pass
    return "".join(states)


def _idle_wait(rank, events):
    g = _shm.ShmGroup.create(None, 1 << 12, what="test all-reduce")
    t = g.zeros(16, torch.float32)
    g.all_reduce(t).wait()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        _dist.wait_event(events / "waiting")
        # Rank 0 waits for this rank: look at its threads 50 times. A waiter that spins (or
        # polls without sleeping) is running or runnable -- R -- whenever one looks.
        samples = []
        for _ in range(50):
            samples.append(_thread_states(pids[0]))
            time.sleep(0.005)
        g.all_reduce(t).wait()
        return samples
    _dist.set_event(events / "waiting")
    g.all_reduce(t).wait()
    return None


def test_a_waiting_rank_sleeps_instead_of_spinning(tmp_path):
    samples = run_ranks(_idle_wait, 2, tmp_path, env=ON)[1]
    busy = [s for s in samples if "R" in s]
    # a few looks may catch it on its way into the wait, or a helper thread at work
    assert len(busy) < len(samples) // 2, f"rank 0 had a running thread in {len(busy)} of {len(samples)} looks: {samples}"


# ---------------------------------------------------------------- a rank that dies
def _entry(fn, rank, n, port, conn):
    os.environ.update(rank_environ(
        rank=rank, local_rank=rank, world_size=n, local_world_size=n, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=port, run_id="shm-test",
    ))
    os.environ.update(ON, DPTRAIN_TIMEOUT="30")  # a missed death fails in 30 s, not 10 minutes
    torch.set_num_threads(1)
    dptrain.init(backend="gloo")
    try:
        conn.send(("ok", fn(rank)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _run_with_a_victim(fn, n, timeout=60.0):
    """Like run_ranks, but a rank's death does not stop the others: the survivors report."""
    server = RendezvousServer("127.0.0.1", 0, n, timeout_s=timeout)
    server.serve()
    procs, conns = [], []
    try:
        for rank in range(n):
            parent, child = _dist._ctx.Pipe(duplex=False)
            p = _dist._ctx.Process(target=_entry, args=(fn, rank, n, server.port, child))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + timeout
        out = []
        for p, c in zip(procs, conns):
            try:
                if c.poll(max(0.0, deadline - time.monotonic())):
                    out.append(c.recv())
                    continue
            except EOFError:  # it died without a word
                p.join(5)
            out.append(("no answer", p.exitcode))
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        server.close()


def _die_in_the_middle(rank):
    from torch import nn

    model = dptrain.DDP(nn.Linear(64, 64))
    seg = model.reducer.shm._seg
    model(torch.randn(4, 64)).sum().backward()  # one healthy step
    if rank == 1:
        arrive = seg.barrier

        def arrive_then_die(*args):  # pass the first barrier of the all-reduce, then vanish
            arrive(*args)
            os.kill(os.getpid(), signal.SIGKILL)

        seg.barrier = arrive_then_die
    try:
        model(torch.randn(4, 64)).sum().backward()
    except dptrain.comm.CollectiveError as exc:
        return str(exc), seg.path
    return "no error", seg.path


def test_a_rank_killed_mid_all_reduce_is_named_and_leaves_no_segment():
    (status, (msg, path)), victim = _run_with_a_victim(_die_in_the_middle, 2)
    assert status == "ok" and victim == ("no answer", -signal.SIGKILL)
    assert msg.startswith("rank 0: DDP gradient all-reduce (bucket 0)"), msg
    assert "rank 1 did not arrive: its process exited" in msg, msg
    # "its process exited": noticed through the liveness lock, not by the 30 s timeout
    # ("did not arrive within the 30s timeout (its process is alive)")
    assert os.path.basename(path).startswith(_shm.SEGMENT_PREFIX)
    assert not os.path.exists(path)
    assert not [f for f in os.listdir("/dev/shm") if f in os.path.basename(path)]


def _peer_seen_dying(rank):
    import subprocess
    import sys

    from dptrain.runtime import proc as _proc

    g = _shm.ShmGroup.create(None, 4096, what="test all-reduce")
    pids = [None, None]
    dist.all_gather_object(pids, (os.getpid(), _proc.start_time(os.getpid())))
    seen = g._seg.processes[1 - rank] == pids[1 - rank]  # the peer's process, from the segment's exchange
    # A process of rank 0's that a SIGKILL left unreaped: a zombie, as a killed rank's main thread is
    # while the kernel still ends the rest of it (and still holds its lock).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) if rank == 0 else None
    box = [(child.pid, _proc.start_time(child.pid)) if child else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        child.kill()
        while _proc.dying(child.pid) is None:
            time.sleep(0.001)
    dist.barrier()
    said = None
    if rank == 1:
        g._seg.processes[0] = box[0]  # rank 0 "is" the dying process; its lock is held all along
        started = time.monotonic()
        try:
            g.all_reduce(torch.ones(8)).wait()  # rank 0 never enters it
        except Exception as exc:  # noqa: BLE001 - what the survivor is told
            said = (type(exc).__name__, str(exc), time.monotonic() - started)
    dist.barrier()  # rank 0 waits here until rank 1 was told
    if child is not None:
        child.wait()
    return seen, said


def test_a_peer_whose_process_the_kernel_is_still_ending_counts_as_dead():
    results = run_ranks(_peer_seen_dying, 2, env={**ON, "DPTRAIN_TIMEOUT": "30"})
    assert [seen for seen, _ in results] == [True, True]  # each knows the other's (pid, start time)
    name, text, _ = results[1][1]
    # Told at once that rank 0's process exited, not after the collective timeout (its lock is held)
    assert name == "ShmPeerError" and "rank 0 did not arrive: its process exited" in text, text


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes a while and says (in ``ran``) that it ran."""

    ran: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _SlowBackward.ran.append(time.monotonic())
        time.sleep(1.0)
        return g


def _die_before_backward(rank):
    from torch import nn

    first, middle, last = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.middle, self.last = first, middle, last

        def forward(self, x):  # backward: last, slow (a peer's death is noticed), middle, slow, first
            return self.last(_SlowBackward.apply(self.middle(_SlowBackward.apply(self.first(x)))))

    model = dptrain.DDP(Net(), bucket_cap_mb=0.0001)  # a bucket per parameter: last's go first
    assert model.reducer.shm is not None and len(model.reducer.buckets) > 2
    model(torch.randn(4, 8)).sum().backward()  # one healthy step
    _SlowBackward.ran.clear()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        model(torch.randn(4, 8)).sum().backward()
    except dptrain.comm.CollectiveError as exc:
        return str(exc), len(_SlowBackward.ran), time.monotonic() - started
    return "no error", len(_SlowBackward.ran), time.monotonic() - started


def test_a_peers_death_stops_the_backward_at_the_next_gradient_instead_of_at_its_end():
    # The survivor's first bucket fails while the backward is in its first slow part; the next
    # gradient hook raises, so the second slow part (and the rest of the backward) never runs:
    # in-place recovery starts as soon as the peer is gone, not one whole backward later.
    (status, (msg, slow_parts, took)), victim = _run_with_a_victim(_die_before_backward, 2)
    assert status == "ok" and victim == ("no answer", -signal.SIGKILL)
    assert "rank 1 did not arrive: its process exited" in msg, msg
    assert slow_parts == 1 and took < 1.9, (slow_parts, took)


def _die_while_attaching(rank):
    created = []
    make = _shm_segment._create

    def create_and_remember(path, nbytes):
        created.append(path)
        return make(path, nbytes)

    _shm_segment._create = create_and_remember
    if rank == 1:
        _shm_segment._open_existing = lambda path, nbytes: os.kill(os.getpid(), signal.SIGKILL)
    try:
        _shm.ShmGroup.create(None, 1 << 20, what="test all-reduce")
    except Exception as exc:  # noqa: BLE001 - the peer's death surfaces as gloo's error
        return type(exc).__name__, created[0], os.path.exists(created[0])
    return "no error", created[0], os.path.exists(created[0])


def test_a_rank_killed_during_construction_leaves_no_segment():
    (status, (error, path, exists)), victim = _run_with_a_victim(_die_while_attaching, 2)
    assert status == "ok" and victim[0] == "no answer"
    assert error != "no error" and path.startswith("/dev/shm/" + _shm.SEGMENT_PREFIX)
    assert not exists and not os.path.exists(path)


def _made_ahead(rank, folder):
    n = dist.get_world_size()
    # Rank 1 makes the segment ahead, as the survivor that sends the state does while it waits.
    made = _shm_segment.make_ahead(folder, 64 * 1024, n) if rank == 1 else False
    dist.barrier()
    listed = os.listdir(folder)
    g = _shm.ShmGroup.create(None, 64 * 1024, what="made ahead")
    t = g.zeros(1000, torch.float32)
    t.fill_(rank + 1.0)
    g.all_reduce(t).wait()
    dist.barrier()
    after = os.listdir(folder)
    dist.barrier()  # every rank has looked before rank 0 makes the next one
    # One of another size is not used (the group makes its own) and is removed all the same.
    other = _shm_segment.make_ahead(folder, 8 * 1024, n) if rank == 0 else False
    g2 = _shm.ShmGroup.create(None, 64 * 1024, what="not made ahead")
    t2 = g2.zeros(10, torch.float32)
    t2.fill_(rank + 1.0)
    g2.all_reduce(t2).wait()
    dist.barrier()
    return (made, listed, g._seg.path, torch.equal(t, torch.full((1000,), 3.0)), after, other, g2._seg.path,
            torch.equal(t2, torch.full((10,), 3.0)), os.listdir(folder))


def test_a_segment_made_ahead_is_used_by_the_next_group_of_its_size_and_never_left_behind():
    folder = tempfile.mkdtemp(prefix="dptrain_test_ahead_", dir="/dev/shm")
    try:
        results = run_ranks(_made_ahead, 2, folder, env=ON)
        assert [r[0] for r in results] == [False, True]
        listed = results[0][1]
        assert len(listed) == 1 and listed[0].startswith(_shm.SEGMENT_PREFIX)
        made_path = os.path.join(folder, listed[0])
        for made, _, used, summed, after, _, used2, summed2, left in results:
            assert used == made_path and summed  # both ranks mapped the one rank 1 made
            assert after == [] and left == []  # its name unlinked once mapped; the unused one removed
            assert used2.startswith("/dev/shm/" + _shm.SEGMENT_PREFIX) and used2 != made_path and summed2
        assert results[0][5] is True
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_segment_is_made_ahead_only_in_a_folder_on_dev_shm_and_with_shared_memory_on(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTRAIN_SHM", "1")
    assert not _shm_segment.make_ahead(str(tmp_path), 4096, 2)  # on disk: its pages are not memory
    assert not _shm_segment.make_ahead(None, 4096, 2)
    assert list(tmp_path.iterdir()) == []
    folder = tempfile.mkdtemp(prefix="dptrain_test_ahead_", dir="/dev/shm")
    try:
        monkeypatch.setenv("DPTRAIN_SHM", "0")
        assert not _shm_segment.make_ahead(folder, 4096, 2)
        monkeypatch.setenv("DPTRAIN_SHM", "1")
        assert _shm_segment.make_ahead(folder, 4096, 2)
        (name,) = os.listdir(folder)
        assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o600
        _shm_segment.discard_ahead()
        assert os.listdir(folder) == []
    finally:
        _shm_segment.discard_ahead()
        shutil.rmtree(folder, ignore_errors=True)


def test_group_obstacle_names_the_rank_and_the_reason():
    node = ("host-a", "boot", 1, 0)
    ok = {"wish": None, "obstacle": None, "node": node}
    assert _shm_segment._group_obstacle([ok, ok], [0, 1]) is None
    assert "rank 3 turned it off" in _shm_segment._group_obstacle([ok, dict(ok, wish=False)], [0, 3])
    assert "on rank 1 the tensors are on cuda:0" in _shm_segment._group_obstacle(
        [ok, dict(ok, obstacle="the tensors are on cuda:0, not on the CPU")], [0, 1])
    assert "(host-b vs host-a)" in _shm_segment._group_obstacle([ok, dict(ok, node=("host-b",) + node[1:])], [0, 1])


def _join_uneven(rank):
    from torch import nn

    def make(cls):
        torch.manual_seed(0)
        return cls(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32)), bucket_cap_mb=0.01)

    out = []
    for model in (make(dptrain.DDP), make(nn.parallel.DistributedDataParallel)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(2 if rank == 0 else 5):  # rank 0 joins early and shadows with zeros
                opt.zero_grad()
                model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
                opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return torch.equal(out[0], out[1])


def test_a_rank_that_joined_early_all_reduces_zeros_through_its_buckets():
    assert run_ranks(_join_uneven, 2, env=ON) == [True, True]


def _wait_with_a_timeout(rank, gate):
    g = _shm.ShmGroup.create(None, 1 << 16, what="test all-reduce")
    t = torch.full((8,), float(rank + 1))
    if rank == 1:
        _dist.wait_event(gate)  # arrives only after rank 0's bounded wait has given up
        g.all_reduce(t).wait()
        return t.tolist()
    work = g.all_reduce(t)
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=200))
        early = "done"
    except _shm.ShmPeerError as exc:
        early = str(exc)
    _dist.set_event(gate)
    work.wait()  # the collective went on in the worker: it completes once the peer arrives
    dptrain.shutdown()  # the group's worker thread ends with the job, not at exit
    return early, t.tolist(), [th.name for th in threading.enumerate() if th.name == "dptrain-shm"]


def test_work_wait_honours_its_timeout_and_names_the_operation(tmp_path):
    (early, total, threads), peer = run_ranks(_wait_with_a_timeout, 2, str(tmp_path / "gate"), env=ON)
    assert early == "test all-reduce #1: not done within the 0.2s given to Work.wait(timeout=)", early
    assert total == peer == [3.0] * 8
    assert threads == []


def test_a_works_then_callbacks_run_before_any_wait_returns():
    # What the profiler's event for a shared-memory all-reduce relies on (dptrain.parallel.ddp._profiling):
    # it ends before the caller can go on, never after.
    from dptrain._shm.group import Work

    work, seen = Work("test"), []
    work.then(lambda: seen.append(("first", work.is_completed())))
    finisher = threading.Thread(target=lambda: (time.sleep(0.05), work._finish()))
    finisher.start()
    work.wait()
    assert seen == [("first", False)]  # ran, and before the work counted as done
    work.then(lambda: seen.append(("late", work.is_completed())))  # done already: runs here, at once
    assert seen[-1] == ("late", True)
    work.then(lambda: 1 / 0)  # a failing callback is not the collective's failure
    finisher.join()


def _train_after_shutdown(rank):
    from torch import nn

    lin = nn.Linear(64, 64)
    net = dptrain.DDP(lin, shm=True)
    net(torch.rand(3, 64)).sum().backward()
    dptrain.shutdown()
    try:
        net(torch.rand(3, 64)).sum().backward()  # writes its gradients into the closed group's buckets
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_ddp_model_used_after_shutdown_raises_instead_of_crashing():
    # The segment was unmapped at shutdown while the buckets still viewed it: the backward's copy into
    # a bucket killed the rank with SIGSEGV. The mapping now lives as long as a view of it.
    for said in run_ranks(_train_after_shutdown, 2):
        assert said is not None and "after dptrain.shutdown()" in said, said
