"""Elastic scale-down (``dptrain run --nnodes MIN:MAX``) across two network-namespace "nodes".

One rank per node. Node 1 is killed for good in the middle of the first epoch; node 0's rank
fails on the lost connection, the job restarts, node 1 does not come back within the join
timeout, and the run finishes on node 0 alone: the Trainer resumes from the newest checkpoint
on a world of one, and every sample of each epoch is trained on exactly once (counting what
the resumed checkpoint holds, and what came after it).
"""

import glob
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

from tests.launcher.test_multinode import ADDR, ROOT, _sh, two_nodes  # noqa: F401 - the fixture

SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_elastic.py")
SAMPLES = 240


def _launch(ns, node_rank, port, ckpt, seen):
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "dptrain", "run", "--nnodes", "1:2", "--node-rank",
           str(node_rank), "--nproc-per-node", "1", "--master-addr", ADDR[0], "--master-port", str(port),
           "--max-restarts", "1", "--join-timeout", "3", "--timeout", "30", SCRIPT, "--ckpt", ckpt, "--seen", seen,
           "--sleep-until", "1"]  # the restart on node 0 alone needs no time to be interrupted in
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = ROOT
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _kill_namespace(ns):
    for pid in _sh("ip", "netns", "pids", ns).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(path):
    with open(path) as fh:
        for line in fh:
            epoch, step, idx = line.split()
            yield int(epoch), int(step), [int(i) for i in idx.split(",")]


def test_a_node_lost_for_good_the_job_finishes_on_the_others_exactly_once(two_nodes, tmp_path):
    ckpt, seen = tmp_path / "ck", tmp_path / "seen"
    ckpt.mkdir()
    seen.mkdir()
    nodes = [_launch(two_nodes[i], i, 29617, str(ckpt), str(seen)) for i in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        while not any(int(re.search(r"-s(\d+)", f).group(1)) >= 8 for f in glob.glob(str(ckpt / "ckpt-*.pt"))):
            assert time.monotonic() < deadline and nodes[0].poll() is None, "no checkpoint of step 8 appeared"
            time.sleep(0.1)
        _kill_namespace(two_nodes[1])  # node 1 is gone for good: its launcher and its rank
        out, err = nodes[0].communicate(timeout=120)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        nodes[1].communicate()
    assert nodes[0].returncode == 0, err[-3000:]
    assert "attempt 1 runs on 1 of at most 2 nodes (node(s) 0), 1 rank(s); node(s) 1 did not rejoin within 3s" in err
    assert re.search(r"\[rank0\] rank 0 of 1 resumed from ckpt-e0000-s0000000(0[89]|1\d)\.pt", out), out
    assert "rank 0 of 1 finished at step" in out

    before = [r for f in ("a0-r0.txt", "a0-r1.txt") for r in _records(seen / f)]
    after = list(_records(seen / "a1-r0.txt"))
    resumed_at = after[0][1]  # the global step of the checkpoint the restart resumed from
    assert 8 <= resumed_at < SAMPLES // 8, resumed_at  # the middle of the first epoch
    kept = [r for r in before if r[1] < resumed_at]
    for epoch in (0, 1):
        count = Counter(i for e, _, idx in kept + after if e == epoch for i in idx)
        assert sorted(count) == list(range(SAMPLES)) and set(count.values()) == {1}, (epoch, count.most_common(3))
