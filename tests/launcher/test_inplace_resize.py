"""In-place recovery when nodes come and go (``--nnodes MIN:MAX --recovery in-place``).

Across network-namespace "nodes", three of one rank each: nodes 0 and 2 in one namespace, node 1
in the other. Node 1 goes silent in the middle of the first epoch: every process of it is
stopped (SIGSTOP), so its connections stay open and say nothing, as a node that hangs or drops
off the network does -- the survivors' collective with it would wait the whole collective
timeout (300 s here). Node 0's launcher notices that node 1's launcher stopped answering and
announces a resize; the survivors' heartbeat threads see it and cut the broken group; the two
surviving ranks keep their processes, re-form the process group as ranks 0 and 1 (node
2's rank 2 becomes rank 1) and go on. Then node 1 is started again; node 0 lets it in and its
rank joins at a step boundary with a live rank's state. No restart, no checkpoint (the job has
none), and every sample of each epoch is trained on exactly once, counting for every step only
what its newest generation trained (but for the padding of the epoch that grew, as on a resume).

Then the launchers' side alone, with fake ranks: the resize's entry, and the restart (said
once, with why) where the job cannot go on without the node.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict

from dptrain.launcher.inplace import orphaned_directories
from dptrain.launcher.rendezvous import free_port
from tests.launcher.test_elastic import _kill_namespace
from tests.launcher.test_multinode import ADDR, ROOT, two_nodes  # noqa: F401 - the fixture

SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_elastic.py")
SAMPLES = 240


def _launch(ns, node_rank, port, seen, extra=("--epochs", "2"), timeout=30):
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "dptrain", "run", "--nnodes", "2:3", "--node-rank",
           str(node_rank), "--nproc-per-node", "1", "--master-addr", ADDR[0], "--master-port", str(port),
           "--recovery", "in-place", "--max-restarts", "2", "--join-timeout", "20", "--timeout", str(timeout),
           SCRIPT, "--seen", seen, "--per-process", *extra]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(PYTHONPATH=ROOT, DPTRAIN_HEARTBEAT_S="0.5")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _records(seen):
    """(generation, epoch, steps done, rank, indices) of every batch every process trained on."""
    for path in glob.glob(os.path.join(seen, "p*.txt")):
        with open(path) as fh:
            for line in fh:
                g, epoch, step, rank, idx = line.split()
                yield int(g), int(epoch), int(step), int(rank), [int(i) for i in idx.split(",")]


def _steps(seen):
    return max((r[2] for r in _records(seen)), default=0)


def _generations(seen):
    return {r[0] for r in _records(seen)}


def _trained(records):
    """The records of each step's newest generation: a step abandoned by a recovery was done again."""
    newest = defaultdict(int)
    for g, epoch, step, _, _ in records:
        newest[epoch, step] = max(newest[epoch, step], g)
    return [r for r in records if r[0] == newest[r[1], r[2]]]


def _signal_namespace(ns, sig):
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            pass


def test_a_node_lost_for_good_then_back_the_job_goes_on_in_place_each_sample_once(two_nodes, tmp_path):
    """Node 1 goes silent (lost): the job goes on with nodes 0 and 2, node 2's rank renumbered 2 -> 1. Then node 1
    is started again: node 0 lets it in, and its rank joins at a step boundary with the state of a live
    rank (as rank 2, after node 2's). The two survivors never restart."""
    seen = tmp_path / "seen"
    seen.mkdir()
    port = 29633
    epochs = ("--epochs", "4")
    # A collective timeout far past the deadlines below: only leaving the broken group at the
    # announcement lets the survivors go on in time.
    nodes = [_launch(two_nodes[n % 2], n, port, str(seen), epochs, timeout=300) for n in (0, 1, 2)]
    try:
        deadline = time.monotonic() + 90
        while _steps(str(seen)) < 6:
            assert time.monotonic() < deadline and nodes[0].poll() is None, "the job did not reach step 6"
            time.sleep(0.1)
        _signal_namespace(two_nodes[1], signal.SIGSTOP)
        silent = time.monotonic()
        while 1 not in _generations(str(seen)):
            assert time.monotonic() < silent + 60 and nodes[0].poll() is None, "the job did not go on without node 1"
            time.sleep(0.1)
        _kill_namespace(two_nodes[1])  # the silent node ends for good
        nodes[1].communicate()
        nodes[1] = _launch(two_nodes[1], 1, port, str(seen), epochs, timeout=300)  # a new launcher on the same node
        outs = [p.communicate(timeout=150) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        # The killed node's launcher and janitor died with it, so nothing removed its recovery folder
        # (on a real machine it goes with the machine's /dev/shm). Only a dead launcher's folder goes:
        # another job's on this machine (a test running beside this one) is in use.
        for leftover in orphaned_directories():
            shutil.rmtree(leftover, ignore_errors=True)
    if os.environ.get("SHOW_RESIZE"):
        print(*(o for pair in outs for o in pair))
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    (out0, err0), (out1, err1), (out2, err2) = outs
    assert "node(s) 1 (rank(s) 1) stopped answering" in err0, err0[-3000:]
    assert ("in-place recovery: the job goes on without it, with 2 rank(s) on node(s) 0, 2 (generation 1, restart 1 "
            "of 2); rank(s) 2->1 renumbered" in err0), err0[-3000:]
    assert re.search(r"recovered in place \(generation 1\): .*; the survivors waited \d+\.\d\d s; the job goes on with 2 "
                     r"ranks instead of 3", err0), err0[-3000:]
    assert re.search(r"node\(s\) 1 arrived \(rank\(s\) 2\); in-place recovery lets it in: the job goes on with 3 "
                     r"rank\(s\) on node\(s\) 0, 2, 1", err0), err0[-3000:]
    assert "waiting to join at the next restart, or at a step boundary once node 0 lets it in" in err1, err1
    assert "grew in place (generation 2)" in err0 and "goes on with 3 ranks instead of 2" in err0, err0[-3000:]
    assert "restarting all ranks" not in err0 + err1 + err2
    started = dict(re.findall(r"started pid (\d+) as rank (\d+) of \d", out0 + out1 + out2))
    finished = dict(re.findall(r"finished pid (\d+) as rank (\d+) of 3 at step", out0 + out1 + out2))
    assert sorted(f"{started[pid]}->{finished[pid]}" for pid in finished) == ["0->0", "2->1", "2->2"], (started,
                                                                                                        finished)
    assert len(set(re.findall(r"of 3 at step \d+ weights (\w+)", out0 + out1 + out2))) == 1

    trained = _trained(list(_records(str(seen))))
    grown = min((e, s) for g, e, s, _, _ in trained if g == 2)  # the first step trained with the newcomer
    for epoch in range(4):
        count = Counter(i for _, e, _, _, idx in trained if e == epoch for i in idx)
        assert sorted(count) == list(range(SAMPLES)), epoch
        # The epoch that grew shares its rest out on 3 ranks: up to 2 padding repeats, as a resume would.
        repeats = sum(count.values()) - SAMPLES
        assert repeats == 0 or (epoch == grown[0] and repeats <= 2), (epoch, count.most_common(3))
    assert {r[3] for r in trained if (r[1], r[2]) >= grown} == {0, 1, 2}
    assert {r[3] for r in trained if r[0] == 1} == {0, 1}  # between the loss and the return: 2 ranks


# -- the launchers' side, with fake ranks (no torch) and launchers on one machine ----------------
#: A fake rank: says it can recover in place (and, with ``resizable`` in its plan, on another world
#: size), prints its environment's place in the job, then in attempt 0 waits until the launcher
#: announces generation 1 (it then prints what it says and exits 0) or it is stopped; in a later
#: attempt it exits 0 at once.
FAKE_RANK = r'''
import json, os, sys, time
from dptrain.launcher.store_client import StoreClient

plan = json.loads(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
keys = f"dptrain/attempt{attempt}/dp/"
store = StoreClient(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
print("PLACE", json.dumps({"rank": rank, "world": world, "attempt": attempt, "pid": os.getpid()}), flush=True)
store.set(keys + f"recovery/capable/{rank}", "1")
if plan.get("resizable"):
    store.set(keys + f"recovery/resizable/{rank}", "1")
if attempt > 0:
    sys.exit(0)
while not store.check([keys + "recovery/generation/1"]):
    time.sleep(0.05)
print("GENERATION", store.get(keys + "recovery/generation/1").decode(), flush=True)
'''


def _fake_node(script, node, port, plan, nnodes="1:2", nproc=1, timeout=20):
    cmd = [sys.executable, "-m", "dptrain", "run", "--nnodes", nnodes, "--node-rank", str(node), "--nproc-per-node",
           str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port), "--recovery", "in-place",
           "--max-restarts", "2", "--join-timeout", "2", "--timeout", str(timeout), script, json.dumps(plan)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DPTRAIN_HEARTBEAT_S="0.2", PYTHONPATH=ROOT)
    env.pop("GLOO_SOCKET_IFNAME", None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)


def _lose_node_1(tmp_path, plan, nnodes="1:2"):
    """Nodes 0 and 1 (two ranks each); node 1's launcher is SIGKILLed once every rank runs. Returns node 0's output."""
    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)
    port = free_port()
    # A fixed-size job's restart waits for the lost node until the timeout: short here.
    nodes = [_fake_node(str(script), n, port, plan, nnodes, nproc=2, timeout=20 if ":" in nnodes else 4)
             for n in (0, 1)]
    try:
        deadline = time.monotonic() + 30
        while len(glob.glob(f"/proc/{nodes[1].pid}/task/*")) < 3 or not _ranks_of(nodes[1].pid):
            assert time.monotonic() < deadline, "node 1's ranks did not start"
            time.sleep(0.1)
        time.sleep(1.0)  # its beats have been seen
        os.kill(nodes[1].pid, signal.SIGKILL)  # its ranks follow it (dptrain's janitor)
        return nodes[0].communicate(timeout=60)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def _ranks_of(pid):
    """The children of ``pid`` that run a rank."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


def test_the_launchers_resize_the_job_without_a_lost_node(tmp_path):
    out, err = _lose_node_1(tmp_path, {"resizable": True})
    assert "node(s) 1 (rank(s) 2, 3) stopped answering" in err, err
    assert "the job goes on without it, with 2 rank(s) on node(s) 0 (generation 1, restart 1 of 2)" in err, err
    entries = [json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if " GENERATION " in line]
    assert len(entries) == 2 and all(e["kind"] == "resize" and e["world_size"] == 2 for e in entries), out
    assert entries[0]["renumber"] == [[0, 0], [1, 1]] and entries[0]["rank"] == [2, 3]
    assert "restarting all ranks" not in err


def test_a_lost_node_restarts_the_job_when_a_rank_cannot_resize_and_says_why(tmp_path):
    out, err = _lose_node_1(tmp_path, {"resizable": False})
    assert re.search(r"node\(s\) 1 \(rank\(s\) 2, 3\) stopped answering: no sign of life from its launcher for \d+s; "
                     r"rank\(s\) 0, 1, 2, 3 cannot share an epoch out anew on fewer ranks", err), err
    assert "restarting all ranks (restart 1 of 2)" in err, err
    assert "attempt 1 runs on 1 of at most 2 nodes (node(s) 0), 2 rank(s)" in err, err
    places = [json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if " PLACE " in line]
    assert {(p["attempt"], p["world"]) for p in places} == {(0, 4), (1, 2)}, places
    assert " GENERATION " not in out


def test_a_lost_node_of_a_fixed_size_job_restarts_it_and_says_how_to_go_on_without(tmp_path):
    out, err = _lose_node_1(tmp_path, {"resizable": True}, nnodes="2")
    assert "a job of --nnodes 2 cannot go on without a node (with --nnodes MIN:MAX it goes on in place" in err, err
