"""In-place recovery with the Trainer (issue 32): a rank dies, the others keep their processes,
a replacement gets the state from a live rank, and the run ends bit for bit where an
uninterrupted one ends.

Each job is ``tests/scripts/train_inplace.py`` under ``dptrain run --recovery in-place``
(gloo, CPU: the default shared-memory all-reduce among the ranks of the node). The victims
kill themselves from inside (a patched function of that process only) at the moments named by
the issue -- forward, backward in the middle of the gradient all-reduce, inside the optimizer
step, half-way through a checkpoint write, during the dev evaluation -- one after the other in
one job (so every kill after the first is also a kill of a job that recovered already), and
each writes where it landed. Every test asserts:

* the processes that were not killed are the ones that started (a rank has one start per
  process: 1 + the kills it suffered), and one recovery line per kill names the rank and why;
* no file of the checkpoint directory was read, by any process;
* every rank's final weights, buffers and history equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_inplace.py")
LOOP = os.path.join(ROOT, "tests", "scripts", "loop_inplace.py")



def _run(out, nproc, kills="", ckpt=None, *extra, restarts=6, timeout=200, script=SCRIPT, **env_vars):
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OUT=str(out), KILLS=kills, CKPT=str(ckpt) if ckpt else "", CUDA_VISIBLE_DEVICES="",
               **env_vars)
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", str(nproc), "--recovery", "in-place",
           "--max-restarts", str(restarts), *extra, script]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(out), env=env)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Where is each rank? The scripts dump every thread's stack on SIGUSR2 (faulthandler), into
        # their stderr, which the launcher relays; then the launcher stops the job.
        for start in glob.glob(os.path.join(out, "start-rank*-pid*.json")):
            with contextlib.suppress(OSError, ValueError):
                pid = int(start.rsplit("-pid", 1)[1][:-len(".json")])
                with open(f"/proc/{pid}/cmdline", "rb") as fh:  # still a rank of this job (a dead one's pid is reused)
                    cmdline = fh.read()
                if os.path.basename(script).encode() in cmdline or b"dptrain.launcher.template" in cmdline:
                    os.kill(pid, signal.SIGUSR2)
        time.sleep(2)
        job.send_signal(signal.SIGINT)
        try:
            stdout, stderr = job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            stdout, stderr = job.communicate()
        pytest.fail(f"the job did not end in {timeout} s; its last output:\n{(stderr + stdout)[-12000:]}")
    assert job.returncode == 0, stderr[-4000:] + stdout[-2000:]
    return stdout + stderr


def _finals(out):
    return {int(os.path.basename(p)[len("final-rank"):-3]): torch.load(p, weights_only=False)
            for p in glob.glob(os.path.join(out, "final-rank*.pt"))}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same jobs without a failure: 2 ranks with checkpoints, 3 ranks without."""
    base = tmp_path_factory.mktemp("uninterrupted")
    _run(base / "two", 2, "", base / "two-ckpt")
    _run(base / "three", 3, "")
    return {2: _finals(base / "two"), 3: _finals(base / "three")}


def _check(out, log, reference, kills, ckpt=None):
    finals = _finals(out)
    assert sorted(finals) == sorted(reference)
    for rank, ref in reference.items():
        assert _same(finals[rank]["state"], ref["state"]), f"rank {rank}'s weights differ from the uninterrupted run's"
        assert finals[rank]["history"] == ref["history"]
        assert finals[rank]["step"] == ref["step"]
    # Where each kill landed (written by the victim just before it died).
    landed = []
    for spec in kills:
        rank, gen, where, _ = spec.split(":")
        with open(os.path.join(out, f"killed-rank{rank}-gen{gen}.json")) as fh:
            marker = json.load(fh)
        assert marker["where"] == where
        landed.append(marker)
    # Survivors were never restarted: one process per rank, plus one per kill of that rank.
    for rank in reference:
        starts = glob.glob(os.path.join(out, f"start-rank{rank}-pid*.json"))
        killed = [m for m in landed if m["rank"] == rank]
        assert len(starts) == 1 + len(killed), (rank, starts, killed)
        pids = {json.load(open(p))["pid"] for p in starts}
        assert finals[rank]["pid"] in pids and finals[rank]["pid"] not in {m["pid"] for m in killed}
    # One line per recovery (a dead rank's last lines repeat earlier ones); a replacement that dies
    # while it joins makes its recovery start over, in one line with the next.
    said = [line for line in log.splitlines() if line.startswith("[rank") and "dptrain: recovered in place" in line]
    assert len(said) == len([k for k in kills if ":init:" not in k]), log
    for m in landed:
        assert f"pid {m['pid']}" in log
    assert "restarting all ranks" not in log
    # No checkpoint file was read by any process: the state came from a live rank (through /dev/shm here).
    assert glob.glob(os.path.join(out, "reads-*")) == []
    return landed


def test_a_rank_killed_at_each_moment_recovers_in_place_bitwise_on_two_ranks(tmp_path, uninterrupted):
    # Generations count recoveries: rank 0 dies first at the third, so its replacement is generation 3.
    kills = ["1:0:forward:3", "1:1:all_reduce:6", "0:0:optimizer:9", "0:3:checkpoint:10", "1:2:eval:2"]
    log = _run(tmp_path / "out", 2, ";".join(kills), tmp_path / "ckpt")
    landed = _check(tmp_path / "out", log, uninterrupted[2], kills, tmp_path / "ckpt")
    assert "backward" in landed[1]["stack"] and "bucket" in landed[1]
    assert "_optimizer_step" in landed[2]["stack"] and "save_checkpoint" in landed[3]["stack"]
    assert "evaluate" in landed[4]["stack"]
    # The checkpoint that rank 0 died writing was written again; every due checkpoint is there.
    names = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "ckpt" / "ckpt-*.pt")))
    assert "ckpt-e0000-s000000010.pt" in names and len(names) == 12, names
    assert not [n for n in os.listdir(tmp_path / "ckpt") if ".tmp" in n and "ckpt-e0000-s000000010" not in n]


def test_a_rank_that_dies_after_fit_returned_restarts_the_job_instead_of_waiting_for_it(tmp_path, uninterrupted):
    # Rank 0 may have finished and exited: a replacement in place would wait for ranks that are gone
    # (until the collective timeout). The launcher restarts the job instead, which resumes from its
    # last checkpoint and ends with the same weights.
    log = _run(tmp_path / "out", 2, "1:0:after:0", tmp_path / "ckpt", timeout=150)
    assert "dptrain run: a rank failed after rank 0's Trainer.fit had returned" in log, log
    assert "restarting all ranks (restart 1 of 6)" in log and "in-place recovery: replacement" not in log, log
    finals = _finals(tmp_path / "out")
    for rank, ref in uninterrupted[2].items():
        assert _same(finals[rank]["state"], ref["state"]), f"rank {rank}'s weights differ from the uninterrupted run's"


def test_a_rank_that_dies_after_its_fit_but_before_rank_0s_ends_restarts_the_job_not_quietly(tmp_path, uninterrupted):
    # The race of the two ranks' ends: rank 1 dies once its own fit has returned, while rank 0 is still
    # in its fit's end (SLOW_FINISH) and has not said the training is over; the launcher replaces rank 1
    # in place, and the replacement meets a finished job. It once exited 0: rank 1's code after fit
    # (its final save) never ran and the job ended "complete". Now it asks for a restart of the job.
    log = _run(tmp_path / "out", 2, "1:0:early:0", tmp_path / "ckpt", timeout=150, SLOW_FINISH="0:4")
    assert "in-place recovery: replacement" in log, log  # the case under test: replaced before rank 0's end
    assert "its training ended while this rank was replaced" in log, log
    assert "restarting all ranks (restart" in log, log
    finals = _finals(tmp_path / "out")
    assert sorted(finals) == [0, 1], sorted(finals)  # rank 1's code after fit ran (in the restarted job)
    for rank, ref in uninterrupted[2].items():
        assert _same(finals[rank]["state"], ref["state"]), f"rank {rank}'s weights differ from the uninterrupted run's"


def test_a_rank_killed_in_a_second_fit_is_still_replaced_in_place(tmp_path):
    # The end of the first fit is said in the store (see the test above); the second fit's start
    # takes it back, so a failure in the second one is recovered in place, not by a restart.
    reference = _run(tmp_path / "ref", 2, "", None, FITS="1,2")
    kills = ["1:0:optimizer:17"]  # 12 steps per epoch: in the second fit's epoch
    log = _run(tmp_path / "out", 2, ";".join(kills), None, FITS="1,2")
    assert "rank 1 done at step 24" in reference
    _check(tmp_path / "out", log, _finals(tmp_path / "ref"), kills)
    assert "after rank 0's Trainer.fit had returned" not in log, log


def test_three_ranks_without_checkpoints_recover_in_place_bitwise_also_when_a_replacement_dies_joining(
        tmp_path, uninterrupted):
    # Rank 2's first replacement dies while it joins (generation 1), its second one (2) dies in an evaluation.
    kills = ["2:0:all_reduce:3", "2:1:init:0", "0:0:forward:5", "1:0:optimizer:9", "2:2:eval:2"]
    log = _run(tmp_path / "out", 3, ";".join(kills))
    _check(tmp_path / "out", log, uninterrupted[3], kills)
    assert "no checkpoint was read" in log


def test_a_stalled_rank_is_ended_and_replaced_once_the_collective_timeout_passes(tmp_path, uninterrupted):
    kills = ["1:0:stall:5"]
    log = _run(tmp_path / "out", 2, ";".join(kills), tmp_path / "ckpt", "--timeout", "4")
    _check(tmp_path / "out", log, uninterrupted[2], kills)
    assert "stalled" in log and "ending it" in log


def test_a_hot_spare_replaces_the_dead_rank(tmp_path, uninterrupted):
    kills = ["0:0:forward:4"]
    log = _run(tmp_path / "out", 2, ";".join(kills), tmp_path / "ckpt", "--spares", "1")
    _check(tmp_path / "out", log, uninterrupted[2], kills)
    assert "(a hot spare)" in log


def test_a_trainer_that_cannot_recover_in_place_falls_back_to_restarting_the_job(tmp_path, uninterrupted):
    # torch's DDP cannot follow a re-formed group: the job says so once and restarts whole on a
    # failure, resuming from the newest checkpoint (torch's DDP and ours agree bit for bit on 2 ranks).
    log = _run(tmp_path / "out", 2, "1:0:forward:5", tmp_path / "ckpt", STRATEGY="torch-ddp")
    assert log.count("--recovery in-place is not available to this job: strategy 'torch-ddp'") == 1, log
    assert "restarting all ranks" in log and "recovered in place" not in log
    finals = _finals(tmp_path / "out")
    for rank, ref in uninterrupted[2].items():
        assert _same(finals[rank]["state"], ref["state"])
    assert len(glob.glob(str(tmp_path / "out" / "start-rank0-pid*.json"))) == 2  # rank 0 was restarted too


def test_a_replacement_without_its_ranks_snapshot_falls_back_to_restarting_the_job_bitwise(tmp_path, uninterrupted):
    # The victim deletes its step snapshots before it dies: its replacement cannot know the dead rank's
    # RNG streams, so the members agree (in the exchange that starts a recovery) that the run cannot go
    # on bit for bit in place, and the launcher restarts the whole job from its newest checkpoint.
    log = _run(tmp_path / "out", 2, "1:0:forget:5", tmp_path / "ckpt")
    assert "rank(s) [1] have no record of their RNG streams and buffers at commit" in log, log
    assert "restarting all ranks" in log and "recovered in place" not in log
    finals = _finals(tmp_path / "out")
    for rank, ref in uninterrupted[2].items():
        assert _same(finals[rank]["state"], ref["state"]), f"rank {rank}'s weights differ from the uninterrupted run's"
        assert finals[rank]["history"] == ref["history"]
    assert len(glob.glob(str(tmp_path / "out" / "start-rank0-pid*.json"))) == 2  # the survivor was restarted too


def test_a_plain_loop_with_recoverable_loop_recovers_in_place_bitwise(tmp_path):
    # tests/scripts/loop_inplace.py: its own loop over dptrain.RecoverableLoop's epochs(), batches() and step().
    _run(tmp_path / "whole", 2, script=LOOP)
    kills = ["1:0:forward:5", "1:1:all_reduce:9", "0:0:optimizer:14"]
    log = _run(tmp_path / "out", 2, ";".join(kills), script=LOOP)
    _check(tmp_path / "out", log, _finals(tmp_path / "whole"), kills)


def test_a_survivor_in_a_slow_forward_stops_it_at_once_when_its_launcher_signals_the_death(tmp_path, uninterrupted):
    # Rank 1 dies as step 3 starts while rank 0 computes that step's forward, 0.5 s per module (8 modules).
    # dptrain run's signal stops rank 0 before its next module (see [Note: stopping a step at once] in
    # dptrain.runtime.interrupt), not after the forward and into the backward, where its first all-reduce would fail.
    kills = ["1:0:forward:3"]
    log = _run(tmp_path / "out", 2, ";".join(kills), tmp_path / "ckpt", SLOW="0:3:0.5")
    _check(tmp_path / "out", log, uninterrupted[2], kills, tmp_path / "ckpt")
    with open(tmp_path / "out" / "slow-rank0.json") as fh:
        sleeps = json.load(fh)["sleeps"]
    assert 1 <= sleeps <= 2, sleeps  # 8 without the signal


def test_stray_stop_signals_change_nothing_and_a_real_death_is_still_recovered_bitwise(tmp_path, uninterrupted):
    # Rank 0 gets SIGURG every millisecond all along: no step of it stops unless a generation was announced.
    kills = ["1:0:all_reduce:5"]
    log = _run(tmp_path / "out", 2, ";".join(kills), tmp_path / "ckpt", STORM="0")
    _check(tmp_path / "out", log, uninterrupted[2], kills, tmp_path / "ckpt")


def test_a_survivor_that_does_not_take_the_signal_recovers_in_place_from_a_step_longer_than_a_heartbeat(
        tmp_path, uninterrupted):
    # The script handles SIGURG itself, so rank 0 learns of rank 1's death only from its heartbeat thread
    # (every 2 s), which aborts the group while the 4 s forward goes on. The backward's first all-reduce
    # then failed with an error that in-place recovery did not count as a peer's failure: rank 0 exited,
    # and the whole job restarted from its checkpoint.
    kills = ["1:0:forward:3"]
    log = _run(tmp_path / "out", 2, ";".join(kills), tmp_path / "ckpt", SLOW="0:3:0.5", OWN_URG="1")
    _check(tmp_path / "out", log, uninterrupted[2], kills, tmp_path / "ckpt")
    with open(tmp_path / "out" / "slow-rank0.json") as fh:
        assert json.load(fh)["sleeps"] == 8  # the whole forward: no signal stopped it


def test_a_survivor_stopped_in_an_accumulation_micro_batch_under_autocast_recovers_bitwise(tmp_path):
    # Two micro-batches per step, bf16 autocast: rank 0 is stopped by the signal inside the first,
    # no_sync micro-batch of step 3 and inside autocast; the whole step is redone from its commit.
    settings = {"ACCUM": "2", "AMP": "1"}
    _run(tmp_path / "reference", 2, "", **settings)
    kills = ["1:0:forward:3"]
    log = _run(tmp_path / "out", 2, ";".join(kills), None, SLOW="0:3:0.5", **settings)
    _check(tmp_path / "out", log, _finals(tmp_path / "reference"), kills)
    with open(tmp_path / "out" / "slow-rank0.json") as fh:
        assert 1 <= json.load(fh)["sleeps"] <= 2
