"""In-place recovery of the Trainer's DiLoCo (issue 48): a rank dies mid-round, every rank rolls
back to the newest round snapshot all of them hold, a replacement takes the dead rank's replica
from the files it left, and the run ends bit for bit where an uninterrupted one ends.

The jobs are ``tests/scripts/train_inplace.py`` with ``STRATEGY=diloco`` under ``dptrain run
--recovery in-place`` on 2 ranks (gloo, CPU), checked by ``tests.test_inplace_recovery._check``:
no survivor restarted, one recovery line per kill, no checkpoint read, every rank's final
replica (weights and buffers) and history equal to the uninterrupted run's; here also the
replicas' common (outer) weights.

With ``replica="node"`` (DDP inside each of two network-namespace nodes of 2 ranks, DiLoCo between
them): a rank killed mid-round is replaced in place, every rank rebuilds the node groups and rails
and rejoins its node's DDP, and the run ends bit for bit where an uninterrupted one ends.

And a node lost for good (``--nnodes MIN:MAX``, network-namespace nodes): the survivors roll back
to their own round snapshots under their new rank numbers and go on with fewer replicas, each
sample of each epoch trained on once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import types
from collections import Counter

import pytest
import torch

from benchmarks import netlink
from dptrain.launcher.inplace import orphaned_directories
from dptrain.train import resize, rollback
from tests.launcher.test_elastic import _kill_namespace
from tests.launcher.test_inplace_resize import SAMPLES, _generations, _launch, _records, _signal_namespace, _steps, \
    _trained
from tests.launcher.test_multinode import two_nodes  # noqa: F401 - the fixture
from tests.test_inplace_recovery import ROOT, _check, _finals, _run, _same

PLAIN = {"sync_every": 4}
# Streaming: 2 fragments (fragment 0 starts its exchange at steps 2, 6, ..., fragment 1 at 4, 8, ...),
# each applied one step later, in int8: an exchange is in flight at most steps.
STREAMING = {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1, "compression": "int8"}


def _diloco(tmp_path, name, kills, settings, ckpt=False, **extra):
    out = tmp_path / name
    log = _run(out, 2, ";".join(kills), tmp_path / f"{name}-ckpt" if ckpt else None, STRATEGY="diloco",
               DILOCO=json.dumps(settings), **extra)
    return out, log


def _same_common(out, reference_out):
    finals, reference = _finals(out), _finals(reference_out)
    for rank, ref in reference.items():
        assert _same(finals[rank]["common"], ref["common"]), f"rank {rank}'s outer weights differ"


def test_diloco_recovers_in_place_bitwise_from_kills_mid_round_in_a_step_and_in_an_outer_exchange(tmp_path):
    ref, _ = _diloco(tmp_path, "ref", [], PLAIN, ckpt=True)
    # Rounds end at steps 4, 8, 12 (the epoch's last), ...: rank 1 dies mid-round (step 6's forward),
    # rank 0 inside step 11's optimizer step, rank 1's replacement inside step 16's outer exchange.
    kills = ["1:0:forward:6", "0:0:optimizer:11", "1:1:sync:16"]
    out, log = _diloco(tmp_path, "out", kills, PLAIN, ckpt=True)
    reference = _finals(ref)
    _check(out, log, reference, kills)
    _same_common(out, ref)
    said = [line for line in log.splitlines() if line.startswith("[rank0] dptrain: recovered in place")]
    assert ["round snapshot at step 4 " in said[0], "at step 8 " in said[1], "at step 12 " in said[2]] == [True] * 3, said
    assert all("took the dead rank's replica, inner optimizer and DiLoCo state" in line for line in said)
    landed = json.loads((out / "killed-rank1-gen1.json").read_text())
    assert "step" in landed["stack"] and landed["fragment"] == 0  # inside DiLoCo's step, its exchange started
    # Every round point wrote a snapshot (24 steps / 4, the fit's start, 2 epoch ends) in the reference.
    assert reference[0]["rounds"]["written"] == 9 and reference[0]["rounds"]["bytes"] > 0


def test_streaming_diloco_recovers_in_place_bitwise_with_exchanges_in_flight(tmp_path):
    ref, _ = _diloco(tmp_path, "ref", [], STREAMING)
    # Round points at inner steps 1, 5, 9, ... (the last fragment's exchange applied). Rank 1 dies right
    # after starting fragment 0's exchange at step 6 (in flight until 7), rank 0 in step 9's forward and
    # its replacement inside step 13's optimizer step.
    kills = ["1:0:sync:6", "0:0:forward:9", "0:2:optimizer:13"]
    out, log = _diloco(tmp_path, "out", kills, STREAMING)
    _check(out, log, _finals(ref), kills)
    _same_common(out, ref)
    said = [line for line in log.splitlines() if line.startswith("[rank0] dptrain: recovered in place")]
    assert ["at step 5 " in said[0], "at step 5 " in said[1], "at step 9 " in said[2]] == [True] * 3, said


def test_a_diloco_replacement_without_its_round_snapshots_falls_back_to_restarting_the_job(tmp_path):
    ref, _ = _diloco(tmp_path, "ref", [], PLAIN, ckpt=True)
    out, log = _diloco(tmp_path, "out", ["1:0:forget:6"], PLAIN, ckpt=True)
    assert "the ranks hold no DiLoCo round snapshot of one and the same commit" in log, log
    assert "restarting all ranks" in log and "recovered in place" not in log
    finals = _finals(out)
    for rank, ref_final in _finals(ref).items():  # resumed from the newest checkpoint, bit for bit too
        assert _same(finals[rank]["state"], ref_final["state"])


def _two_nodes(tmp_path, name, kills, settings):
    """train_inplace.py on two namespace nodes of 2 ranks each under --recovery in-place: (OUT, both logs)."""
    out = tmp_path / name
    out.mkdir()
    env = dict(os.environ, OUT=str(out), KILLS=";".join(kills), CKPT="", CUDA_VISIBLE_DEVICES="", STRATEGY="diloco",
               DILOCO=json.dumps(settings))
    with netlink.TwoNodeLink("10gbit") as link:
        try:
            results = link.run([os.path.join(ROOT, "tests", "scripts", "train_inplace.py")], nproc_per_node=2,
                               timeout_s=150, env=env, run_args=("--recovery", "in-place", "--max-restarts", "4"))
        except TimeoutError as stuck:
            pytest.fail(f"the two-node job did not end; each node's last output: "
                        f"{[(o + e)[-6000:] for o, e in zip(stuck.outputs, stuck.errors)]}")
    log = "".join(r.stdout + r.stderr for r in results)
    assert all(r.returncode == 0 for r in results), log[-6000:]
    return out, log


def test_diloco_with_node_replicas_recovers_in_place_bitwise_from_a_rank_killed_mid_round(tmp_path):
    """replica='node' on two nodes of 2 ranks (DDP inside each node): rank 3 (node 1) dies in step 6's
    forward and rank 0 (node 0) inside step 10's optimizer step; each time the job goes on in place from
    the newest round snapshot (steps 4 and 8), the replacement taking the dead rank's files, and ends with
    every rank's replica, outer weights and history equal to the uninterrupted run's."""
    reason = netlink.unavailable()
    if reason:
        pytest.skip(f"two-namespace link not available: {reason}")
    settings = {"replica": "node", "sync_every": 4}
    ref, _ = _two_nodes(tmp_path, "ref", [], settings)
    kills = ["3:0:forward:6", "0:0:optimizer:10"]
    out, log = _two_nodes(tmp_path, "out", kills, settings)
    reference = _finals(ref)
    assert sorted(reference) == [0, 1, 2, 3]
    _check(out, log, reference, kills)
    _same_common(out, ref)
    said = [line for line in log.splitlines() if line.startswith("[rank0] dptrain: recovered in place")]
    assert ["round snapshot at step 4 " in said[0], "at step 8 " in said[1]] == [True] * 2, said
    assert "in-place recovery is not possible" not in log
    # The two nodes' replicas are one model after the last outer sync (step 12, the last).
    assert _same(reference[0]["state"], reference[2]["state"])


def test_diloco_goes_on_in_place_without_a_lost_node_each_sample_once(two_nodes, tmp_path):
    """Three nodes of one rank (nodes 0 and 2 in one namespace, node 1 in the other), DiLoCo with an outer
    sync every 4 steps. Node 1 goes silent mid-epoch (SIGSTOP) and is then killed: the survivors re-form as
    ranks 0 and 1 (node 2's rank 2 -> 1), each rolls back to its own round snapshot (rank 1 reads the files
    it wrote as rank 2), and they finish with one common outer model, every sample of every epoch trained
    on once (counting, for each step, only the newest generation that trained it)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    extra = ("--epochs", "2", "--diloco", "4")
    nodes = [_launch(two_nodes[n % 2], n, 29641, str(seen), extra, timeout=300) for n in (0, 1, 2)]
    try:
        deadline = time.monotonic() + 60
        while _steps(str(seen)) < 6:
            assert time.monotonic() < deadline and nodes[0].poll() is None, "the job did not reach step 6"
            time.sleep(0.1)
        _signal_namespace(two_nodes[1], signal.SIGSTOP)
        silent = time.monotonic()
        while 1 not in _generations(str(seen)):
            assert time.monotonic() < silent + 60 and nodes[0].poll() is None, "the job did not go on without node 1"
            time.sleep(0.1)
        _kill_namespace(two_nodes[1])  # the silent node ends for good
        outs = [p.communicate(timeout=90) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        for leftover in orphaned_directories():  # the killed node's; never a running job's
            shutil.rmtree(leftover, ignore_errors=True)
    if os.environ.get("SHOW_RESIZE"):
        print(*(o for pair in outs for o in pair))
    (out0, err0), _, (out2, err2) = outs
    for p, (out, err) in zip(nodes[::2], outs[::2]):
        assert p.returncode == 0, err[-3000:]
    assert ("in-place recovery: the job goes on without it, with 2 rank(s) on node(s) 0, 2 (generation 1, restart 1 "
            "of 2); rank(s) 2->1 renumbered" in err0), err0[-3000:]
    said = re.search(r"recovered in place \(generation 1\): .*DiLoCo: the 2 rank\(s\) left rolled back to their "
                     r"round snapshots at step (\d+) .*the job goes on with 2 ranks instead of 3: the outer mean is "
                     r"over the 2 replicas left", err0)
    assert said and int(said.group(1)) % 4 == 0, err0[-3000:]  # a round point
    assert "restarting all ranks" not in err0 + err2 and "in-place recovery is not possible" not in err0 + err2
    started = dict(re.findall(r"started pid (\d+) as rank (\d+) of 3", out0 + out2))
    finished = dict(re.findall(r"finished pid (\d+) as rank (\d+) of 2 at step", out0 + out2))
    assert sorted(f"{started[pid]}->{finished[pid]}" for pid in finished) == ["0->0", "2->1"], (started, finished)
    assert len(set(re.findall(r"of 2 at step \d+ weights (\w+)", out0 + out2))) == 1  # one outer model

    trained = _trained(list(_records(str(seen))))
    for epoch in range(2):
        count = Counter(i for _, e, _, _, idx in trained if e == epoch for i in idx)
        assert sorted(count) == list(range(SAMPLES)) and set(count.values()) == {1}, (epoch, count.most_common(3))
    assert {r[3] for r in trained if r[0] == 1} == {0, 1}
    # The steps after the round point rolled back to were trained again by the survivors alone.
    assert all(g == 1 for g, _, step, _, _ in trained if step >= int(said.group(1))), "a lost step counted"


def test_diloco_says_what_it_cannot_recover_in_place():
    from dptrain.train.strategy import _DiLoCoStrategy

    node = _DiLoCoStrategy(torch.device("cpu"), {"replica": "node"})
    plain = _DiLoCoStrategy(torch.device("cpu"), {"replica": "rank"})
    assert rollback.obstacle(types.SimpleNamespace(strategy=node)) is None  # (one process: no DDP)
    assert rollback.obstacle(types.SimpleNamespace(strategy=plain)) is None
    # replica='node' replaces a rank in place, but a lost node restarts the job.
    why = resize.obstacle(types.SimpleNamespace(strategy=node, train_loader=None))
    assert why is not None and "replica='node'" in why and "diloco_kwargs={'replica': 'rank'}" in why
    # A lost node (--nnodes MIN:MAX): DiLoCo goes on in place, when its loaders can share an epoch out anew.
    assert resize.obstacle(types.SimpleNamespace(strategy=plain, train_loader=None)) is None
    why = resize.obstacle(types.SimpleNamespace(strategy=plain, train_loader=types.SimpleNamespace(sampler=[0, 1])))
    assert why is not None and "DistributedSampler" in why


def test_round_points_and_the_target_all_members_hold():
    def rounds(step, every, delay):
        snaps = rollback.RoundSnapshots.__new__(rollback.RoundSnapshots)
        snaps.diloco = types.SimpleNamespace(inner_step=step, sync_every=every, fragment_sync_delay=delay)
        return snaps

    assert [s for s in range(1, 13) if rounds(s, 4, 0).due(True)] == [4, 8, 12]
    assert [s for s in range(1, 13) if rounds(s, 4, 1).due(True)] == [1, 5, 9]
    assert rounds(3, 4, 0).due(False)  # fit's start is always one
    pick = rollback.RoundSnapshots.pick
    assert pick(None, [{"has": [4, 8]}, {"has": [8, 13]}, {"has": [4, 8]}]) == 8
    assert pick(None, [{"has": [4, 8]}, {"has": []}]) is None


def test_a_renumbered_rank_s_round_snapshot_takes_its_new_number(tmp_path):
    """After a resize rank 2 became rank 1: its snapshot of the target is found under 1, the others go."""
    for seq, text in ((0, "old"), (4, "target")):
        (tmp_path / f"round2-{seq:09d}.pt").write_text(text)
    snaps = rollback.RoundSnapshots.__new__(rollback.RoundSnapshots)
    snaps.directory, snaps.trainer = str(tmp_path), types.SimpleNamespace(rank=1)
    snaps._rename(2, 4)
    assert rollback.held(str(tmp_path), 2) == {}
    assert list(rollback.held(str(tmp_path), 1)) == [4]
    assert (tmp_path / "round1-000000004.pt").read_text() == "target"
    snaps._rename(1, 4)  # a rank that kept its number keeps its files
    assert list(rollback.held(str(tmp_path), 1)) == [4]


class _Store:
    """The launcher's store as ``InPlaceRecovery._blocker`` reads it."""

    def __init__(self, values):
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def test_the_launcher_lets_no_node_into_a_diloco_job_in_place_but_goes_on_without_one():
    from dptrain.runtime.heartbeat import recovery_key
    from dptrain.launcher.inplace import InPlaceRecovery

    def blocker(value, growing):
        keys = {recovery_key(0, f"{what}/{r}"): (value if what == "resizable" else b"1")
                for r in range(2) for what in ("capable", "resizable")}
        launcher = InPlaceRecovery.__new__(InPlaceRecovery)
        launcher.job = types.SimpleNamespace(store=_Store(keys), warnings=None, layout=types.SimpleNamespace(
            world_size=2))
        return launcher._blocker(0, resizing=True, growing=growing)

    assert blocker(b"shrink", growing=False) is None  # a lost node: DiLoCo goes on without it
    kind, why = blocker(b"shrink", growing=True)  # a node let in: not in place
    assert kind == "resizable" and "DiLoCo" in why and "rank(s) 0, 1" in why, why
    assert blocker(b"1", growing=True) is None  # DDP takes it in
