"""Nothing in checkpoint_dir is deleted unless it is this run's (issue 46, points 2-4): pruning
sets another job's checkpoint aside, a planted ``set-aside`` link is not followed, and the
clean-up at start removes only this machine's dead writers' temporary files and this job's
orphan shard files, naming what it leaves. Single-process (the Checkpointer as rank 0 of 1),
except for one two-rank check of the sweep on another machine."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dptrain import checkpoint
from dptrain.runtime import proc as _proc, env
from dptrain.checkpoint import CheckpointError
from dptrain.train import checkpointer as checkpointer_module
from dptrain.train.checkpointer import Checkpointer
from tests._dist import run_ranks


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}}


class _Shard:
    """A stateful part written by every rank into a file of its own (as FSDP's optimizer state)."""

    sharded = True

    def state_dict(self) -> dict:
        return {"m": torch.ones(2)}


def _run(directory, resume=False, restart_count=0, keep_last=3) -> tuple[Checkpointer, str | None]:
    """What the Trainer does at start: prepare the directory, then resume or start fresh."""
    cp = Checkpointer(str(directory), keep_last, rank=0, world_size=1)
    cp.prepare()
    path, _ = cp.read_first_readable(cp.resume_candidates(resume, restart_count), map_location="cpu")
    return cp, path


def _another_job_writes(directory, epoch: int, step: int, value: float, sharded: bool = False) -> str:
    """A save by another job in the same directory (its own Checkpointer, which prunes nothing)."""
    states = {**_state(value), "optimizer": _Shard()} if sharded else _state(value)
    return Checkpointer(str(directory), 0, rank=0, world_size=1).save(states, epoch=epoch, step=step, prune=False)


def _names(directory) -> list[str]:
    return [os.path.basename(p) for p in checkpoint.list_checkpoints(directory)]


@pytest.fixture
def job(monkeypatch):
    """Set what names the job (see job_identity): job(run_id)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return lambda run_id: monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)


# ------------------------------------------ 2. pruning never deletes another job's checkpoint ---


def test_pruning_sets_another_jobs_checkpoint_aside_instead_of_deleting_it(tmp_path, capsys, job):
    cdir = tmp_path / "ck"
    job("aaa")
    cp, _ = _run(cdir, keep_last=1)
    cp.save(_state(1), epoch=1, step=16)
    job("bbb")  # another job, writing into the same directory meanwhile (with a shard file)
    theirs = _another_job_writes(cdir, 1, 20, 9, sharded=True)
    job("aaa")
    capsys.readouterr()
    cp.save(_state(2), epoch=2, step=32)  # keep_last=1: its own step 16 goes, the other job's step 20 stays
    assert _names(cdir) == ["ckpt-e0002-s000000032.pt"]
    aside = cdir / "set-aside"
    assert sorted(os.listdir(aside)) == ["ckpt-e0001-s000000020.pt", "rank0-of-1.ckpt-e0001-s000000020.pt"]
    back = checkpoint.load(aside / "ckpt-e0001-s000000020.pt")
    assert back["job"] == "run:bbb" and back["model"]["w"][0] == 9
    err = capsys.readouterr().err
    assert (f"dptrain: moved {theirs!r} to {str(aside / 'ckpt-e0001-s000000020.pt')!r} (nothing is deleted): it was "
            f"written by another job (run:bbb), not by this one (run:aaa). It is not counted by keep_last") in err, err


def test_a_checkpoint_of_this_runs_name_that_another_job_replaced_is_set_aside_not_deleted(tmp_path, capsys, job):
    # Two jobs that save at the same steps write the same names: the file this run wrote is the other
    # job's by now. It is read again right before it would be deleted.
    cdir = tmp_path / "ck"
    job("aaa")
    cp, _ = _run(cdir, keep_last=1)
    cp.save(_state(1), epoch=1, step=16)
    job("bbb")
    _another_job_writes(cdir, 1, 16, 9)
    job("aaa")
    cp.save(_state(2), epoch=2, step=32)
    assert checkpoint.load(cdir / "set-aside" / "ckpt-e0001-s000000016.pt")["job"] == "run:bbb"
    assert "was written by another job (run:bbb)" in capsys.readouterr().err


def test_a_resumed_run_prunes_its_own_past_and_sets_a_foreign_checkpoint_aside(tmp_path, job):
    cdir = tmp_path / "ck"
    job("aaa")
    cp, _ = _run(cdir, keep_last=3)
    cp.save(_state(1), epoch=1, step=16)
    cp.save(_state(2), epoch=2, step=32)
    job("bbb")
    _another_job_writes(cdir, 1, 24, 9)  # older than the newest: there when the run resumes
    job("aaa")
    cp, path = _run(cdir, resume="auto", keep_last=1)
    assert path == checkpoint.checkpoint_path(cdir, 2, 32)
    cp.save(_state(3), epoch=3, step=48)
    assert _names(cdir) == ["ckpt-e0003-s000000048.pt"]
    assert os.listdir(cdir / "set-aside") == ["ckpt-e0001-s000000024.pt"]
    # Resumed by hand under other run ids (each `dptrain run` draws one): the run's past is still its own.
    job("ccc")
    cp, path = _run(cdir, resume="auto", keep_last=3)
    cp.save(_state(4), epoch=4, step=64)
    job("ddd")
    cp, path = _run(cdir, resume="auto", keep_last=1)
    assert path == checkpoint.checkpoint_path(cdir, 4, 64)
    cp.save(_state(5), epoch=5, step=80)
    assert _names(cdir) == ["ckpt-e0005-s000000080.pt"]  # step 48 (job aaa's) and 64 (ccc's) pruned
    assert os.listdir(cdir / "set-aside") == ["ckpt-e0001-s000000024.pt"]
    assert checkpoint.load(cdir / "ckpt-e0005-s000000080.pt")["lineage"] == ["run:aaa", "run:ccc", "run:ddd"]


def test_a_checkpoint_that_appeared_while_the_run_trained_is_set_aside_when_no_job_is_named(tmp_path, capsys, job):
    # Two plain runs (nothing names either job: torchrun's "none", a plain python, dptrain.spawn) in one
    # directory: the other's checkpoint names no job this run could tell apart, but this run did not write it.
    cdir = tmp_path / "ck"
    job("none")
    cp, _ = _run(cdir, keep_last=1)
    cp.save(_state(1), epoch=1, step=16)
    _another_job_writes(cdir, 1, 20, 9)
    cp.save(_state(2), epoch=2, step=32)
    assert _names(cdir) == ["ckpt-e0002-s000000032.pt"]
    assert os.listdir(cdir / "set-aside") == ["ckpt-e0001-s000000020.pt"]
    err = capsys.readouterr().err
    assert "it was not written by this run: it appeared in checkpoint_dir while this run trained" in err, err


def test_a_checkpoint_is_read_for_its_job_without_running_its_code(tmp_path):
    # What pruning reads of a file it did not write: its plain entries, through no link, importing nothing.
    evil = tmp_path / "ckpt-e0001-s000000016.pt"
    hook = _Evil()
    hook.payload = 1  # so that unpickling it calls __setstate__
    torch.save({"format": "dptrain.trainer/3", "job": "run:x", "hook": hook, "w": torch.ones(3)}, evil)
    entries, why = checkpoint._peek(str(evil))
    assert why is None and entries == {"format": "dptrain.trainer/3", "job": "run:x"}
    assert not _Evil.built
    os.symlink(evil, tmp_path / "link.pt")
    assert checkpoint._peek(str(tmp_path / "link.pt"))[1] == (
        f"is a symbolic link (to {str(evil)!r}), which dptrain does not follow")


class _Evil:
    """Unpickling it would import this module and run __setstate__."""

    built = False

    def __setstate__(self, state):
        type(self).built = True


# ------------------------------------------------------- 3. a planted set-aside link ---


@pytest.mark.parametrize("planted", ["link", "file", "another user's folder"])
def test_a_planted_set_aside_is_passed_over_and_nothing_leaves_checkpoint_dir(tmp_path, capsys, planted):
    outside = tmp_path / "outside"
    outside.mkdir()
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir, keep_last=1)
    for step in (16, 32, 48):
        cp.save(_state(step), epoch=step // 16, step=step, prune=False)
    where = cdir / "set-aside"
    if planted == "link":
        os.symlink(outside, where)
        why = f"{str(where)!r} is a symbolic link (to {str(outside)!r}), which dptrain does not follow"
    elif planted == "file":
        where.write_text("someone's")
        why = f"{str(where)!r} is a file, not a folder"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        where.mkdir()
        os.chown(where, 65534, 65534)
        why = f"{str(where)!r} belongs to another user (uid 65534)"
    capsys.readouterr()
    _run(cdir, resume=checkpoint.checkpoint_path(cdir, 1, 16), keep_last=1)  # sets steps 32 and 48 aside
    assert os.listdir(outside) == [] and _names(cdir) == ["ckpt-e0001-s000000016.pt"]
    used = cdir / "set-aside-2"
    assert not os.path.islink(used)
    assert sorted(os.listdir(used)) == ["ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"]
    assert os.path.lexists(where) and (planted == "file") == os.path.isfile(where)  # not touched
    if planted == "another user's folder":
        assert os.listdir(where) == []
    err = capsys.readouterr().err
    assert f"moved 2 files into {str(used)!r} (nothing is deleted; {why}, so not there): " in err, err
    assert "is newer than ckpt-e0001-s000000016.pt, which this run resumes from" in err


def test_a_previous_run_folder_swapped_for_a_link_once_made_moves_nothing(tmp_path, monkeypatch):
    # The race that a check of the name alone would lose: the folder is replaced by a link between the
    # mkdir and the moves. The files are moved into the folder's descriptor, or not at all.
    outside = tmp_path / "outside"
    outside.mkdir()
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir)
    cp.save(_state(1), epoch=1, step=16)
    real_mkdir = os.mkdir

    def mkdir_then_swap(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if os.path.basename(path).startswith("previous-run-"):
            os.rename(path, f"{path}.moved-away")
            os.symlink(outside, path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(CheckpointError, match=r"moving them aside failed .*is a symbolic link .*nothing was deleted"):
        _run(cdir)
    assert os.listdir(outside) == [] and _names(cdir) == ["ckpt-e0001-s000000016.pt"]


# ------------------------------------- 4. the clean-up at start deletes only its own leftovers ---


def test_the_clean_up_at_start_leaves_a_users_dot_files(tmp_path, capsys):
    cdir = tmp_path / "ck"
    cdir.mkdir()
    mine = {".notes.tmp-keep": "my notes", ".plan.tmp-draft": "draft", ".x.tmp-": "x"}
    for name, text in mine.items():
        (cdir / name).write_text(text)
    Checkpointer(str(cdir), 3, 0, 1).prepare()
    assert {name: (cdir / name).read_text() for name in mine} == mine
    assert ".notes" not in capsys.readouterr().err  # not dptrain's: not even named


_CONCURRENT = textwrap.dedent(
    """
    import os, sys, torch
    from dptrain import checkpoint
    directory = sys.argv[1]
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):  # the checkpoint's bytes reach the temporary file, then wait
        real_save(obj, f, *args, **kwargs)
        f.flush()
        print(f"in-flight {f.name}", flush=True)
        sys.stdin.readline()

    # Another job's FSDP save: its shard file first (complete), then its checkpoint, in flight.
    checkpoint.save({"job": "run:other", "optimizer": {"m": torch.ones(2)}},
                    os.path.join(directory, "rank0-of-1.ckpt-e0001-s000000016.pt"))
    torch.save = slow_save
    checkpoint.save({"job": "run:other", "w": torch.ones(3)}, os.path.join(directory, "ckpt-e0001-s000000016.pt"))
    print("saved", flush=True)
    """
)


def test_the_clean_up_at_start_leaves_a_concurrent_jobs_save_in_flight(tmp_path, capsys, job):
    cdir = tmp_path / "ck"
    cdir.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(_CONCURRENT)
    job("aaa")
    proc = subprocess.Popen([sys.executable, str(script), str(cdir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        event = proc.stdout.readline().split()
        assert event and event[0] == "in-flight", "the other job's writer never reached its save"
        temp = os.path.basename(event[1])
        shard = "rank0-of-1.ckpt-e0001-s000000016.pt"
        assert sorted(os.listdir(cdir)) == sorted([temp, shard])
        capsys.readouterr()
        cp, _ = _run(cdir)  # this job starts meanwhile, in the same directory
        assert sorted(os.listdir(cdir)) == sorted([temp, shard])  # neither is touched
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "saved"  # and the other job's save completes
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert checkpoint.load(cdir / "ckpt-e0001-s000000016.pt")["job"] == "run:other"
    err = capsys.readouterr().err
    assert f"{temp!r} is being written by process {proc.pid}, which is running (a save in progress)" in err, err
    assert f"{shard!r} is a shard file of job run:other without its checkpoint: a save in progress" in err


def test_the_clean_up_at_start_removes_only_its_own_leftovers_and_names_the_rest_in_one_notice(tmp_path, capsys, job):
    cdir = tmp_path / "ck"
    cdir.mkdir()
    job("aaa")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a writer killed mid-save: its pid names no process now
    running = subprocess.Popen(["sleep", "120"])
    try:
        here = checkpoint._machine()
        elsewhere = "0" * 8 if here != "0" * 8 else "1" * 8
        dead = checkpoint._temp_name("ckpt-e0001-s000000016.pt", gone.pid, 4242)
        reused = checkpoint._temp_name("ckpt-e0001-s000000020.pt", running.pid, 1)  # its pid, another start
        alive = checkpoint._temp_name("ckpt-e0001-s000000024.pt", running.pid, _proc.start_time(running.pid))
        other_machine = f".ckpt-e0001-s000000028.pt.tmp-{gone.pid}-4242-{elsewhere}"
        older_dptrain = ".ckpt-e0001-s000000032.pt.tmp-123"
        link = checkpoint._temp_name("ckpt-e0001-s000000036.pt", gone.pid, 4242)
        for name in (dead, reused, alive, other_machine, older_dptrain):
            (cdir / name).write_bytes(b"half a checkpoint")
        os.symlink(tmp_path, cdir / link)
        checkpoint.save({"job": "run:aaa", "optimizer": {}}, cdir / "rank0-of-2.ckpt-e0000-s000000008.pt")  # ours
        checkpoint.save({"job": "run:bbb", "optimizer": {}}, cdir / "rank1-of-2.ckpt-e0000-s000000008.pt")
        checkpoint.save({"optimizer": {}}, cdir / "rank0-of-2.ckpt-e0000-s000000012.pt")  # an older dptrain's
        capsys.readouterr()
        Checkpointer(str(cdir), 3, 0, 1).prepare()
        left = sorted(os.listdir(cdir))
        assert left == sorted([alive, other_machine, older_dptrain, link, "rank1-of-2.ckpt-e0000-s000000008.pt",
                               "rank0-of-2.ckpt-e0000-s000000012.pt"])
    finally:
        running.kill()
        running.wait()
    err = capsys.readouterr().err
    assert err.count("dptrain: ") == 1, err  # one notice
    assert err.startswith(f"dptrain: checkpoint_dir {str(cdir)!r}: removed 3 files that interrupted saves left behind "
                          f"(temporary files whose writer is gone, shard files of this job without their checkpoint): "
                          f"{dead!r}, {reused!r}, 'rank0-of-2.ckpt-e0000-s000000008.pt'; "
                          f"left 6 files where they are"), err
    assert f"{alive!r} is being written by process {running.pid}, which is running" in err
    assert f"{other_machine!r} was written by process {gone.pid} on another machine or container" in err
    assert f"{older_dptrain!r} is named as earlier dptrain versions named their temporary files" in err
    assert f"{link!r} is a symbolic link, not a file that dptrain writes" in err
    assert "'rank1-of-2.ckpt-e0000-s000000008.pt' is a shard file of job run:bbb without its checkpoint" in err
    assert "'rank0-of-2.ckpt-e0000-s000000012.pt' is a shard file that names no job" in err
    assert err.rstrip().endswith("Delete those yourself once no other job writes into this directory")
    assert checkpoint.remove_stale_temporaries(cdir, "run:aaa") == [alive]  # once its writer is gone


def _sweep_on_two_machines(rank, cdir, machine):
    """Rank 1 stands for the first rank of another machine (whose temporaries name ``machine``)."""
    if rank == 1:
        world = env.get_world()
        checkpoint._machine = lambda: machine
        env.get_world = lambda: dataclasses.replace(world, local_rank=0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        Checkpointer(cdir, 3, rank, 2).prepare()
    return err.getvalue(), sorted(os.listdir(cdir))


def test_every_machine_sweeps_its_own_temporaries_and_rank_0_names_them_all(tmp_path):
    cdir = tmp_path / "ck"
    cdir.mkdir()
    here = checkpoint._machine()
    there, nowhere = ("a" * 8, "b" * 8) if here not in ("a" * 8, "b" * 8) else ("c" * 8, "d" * 8)
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "120"])
    try:
        dead = f".ckpt-e0001-s000000016.pt.tmp-{gone.pid}-7-{there}"
        alive = f".ckpt-e0001-s000000020.pt.tmp-{running.pid}-{_proc.start_time(running.pid)}-{there}"
        unseen = f".ckpt-e0001-s000000024.pt.tmp-{gone.pid}-7-{nowhere}"
        for name in (dead, alive, unseen):
            (cdir / name).write_bytes(b"half")
        out = run_ranks(_sweep_on_two_machines, 2, str(cdir), there)
    finally:
        running.kill()
        running.wait()
    err, listed = out[0]
    assert out[1][0] == "" and listed == sorted([alive, unseen])
    assert err.count("dptrain: ") == 1 and f"removed 1 file that interrupted saves left behind" in err, err
    assert f"{dead!r}; left 2 files where they are" in err
    assert f"{alive!r} is being written by process {running.pid}, which is running" in err
    assert f"{unseen!r} was written by process {gone.pid} on another machine or container" in err
