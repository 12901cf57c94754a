"""Checkpoints are never lost to what else a directory holds (issue 31, points 1-6): an
earlier run, an unreadable file under a checkpoint's name, a planted symlink, a FIFO, an old
torch, a write that fails midway. Single-process (the Checkpointer as rank 0 of 1), except
for one two-rank check that the ranks agree on a fresh start."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import stat
import warnings

import pytest
import torch

from dptrain import checkpoint
from dptrain.runtime import torch_version as _torch_version, env
from dptrain.checkpoint import CheckpointError
from dptrain.train.checkpointer import Checkpointer
from tests._dist import run_ranks


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}}


def _run(directory, resume=False, restart_count=0, keep_last=3) -> tuple[Checkpointer, str | None]:
    """What the Trainer does at start: prepare the directory, then resume or start fresh."""
    cp = Checkpointer(str(directory), keep_last, rank=0, world_size=1)
    cp.prepare()
    path, _ = cp.read_first_readable(cp.resume_candidates(resume, restart_count), map_location="cpu")
    return cp, path


def _names(directory) -> list[str]:
    return [os.path.basename(p) for p in checkpoint.list_checkpoints(directory)]


class _Blocked(BaseException):
    """Raised by a timer into code that blocks; a BaseException, so no ``except Exception`` keeps it."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Fail, instead of hanging the suite, when the body blocks (a read of a FIFO would)."""

    def expire(signum, frame):
        raise _Blocked()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)  # and again each second, should it block once more
    try:
        yield
    except _Blocked:
        pytest.fail(f"blocked for more than {seconds} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------ 1. an earlier run is never deleted ---


def test_three_fresh_runs_in_one_directory_keep_both_earlier_runs(tmp_path, capsys):
    cdir = tmp_path / "ck"
    for run, steps in enumerate([(16, 32, 48), (16,), (16, 32)]):
        cp, _ = _run(cdir)
        for i, step in enumerate(steps):
            cp.save(_state(10 * run + i), epoch=i + 1, step=step)
        cp.save_best(_state(10 * run))
    err = capsys.readouterr().err
    assert err.count("held checkpoints of an earlier run") == 2 and "nothing is deleted" in err
    runs = sorted(d for d in os.listdir(cdir) if d.startswith("previous-run-"))
    assert len(runs) == 2, os.listdir(cdir)
    assert [_names(cdir / d) for d in runs] == [
        ["ckpt-e0001-s000000016.pt", "ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"],
        ["ckpt-e0001-s000000016.pt"]]
    assert checkpoint.load(cdir / runs[0] / "ckpt-e0003-s000000048.pt")["model"]["w"][0] == 2  # run 1, untouched
    assert all(os.path.exists(cdir / d / "best.pt") for d in runs)
    # The line says where the earlier run went and how to continue it instead.
    last = err.strip().splitlines()[-1]
    assert f"resume={str(cdir / runs[1] / 'ckpt-e0001-s000000016.pt')!r}" in last and "2 earlier runs are kept" in last


def test_a_restarted_job_resumes_and_moves_nothing_aside(tmp_path, capsys):
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir)
    cp.save(_state(1), epoch=1, step=16)
    capsys.readouterr()
    _, path = _run(cdir, resume=None, restart_count=1)  # the launcher restarted the job
    assert path == checkpoint.checkpoint_path(cdir, 1, 16)
    assert sorted(os.listdir(cdir)) == ["ckpt-e0001-s000000016.pt"] and "moved" not in capsys.readouterr().err


@pytest.fixture
def job(monkeypatch):
    """Set what names the job (see job_identity): job(run_id, slurm_job_id=None)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def name(run_id, slurm_job_id=None):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        if slurm_job_id is None:
            monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        else:
            monkeypatch.setenv("SLURM_JOB_ID", slurm_job_id)
    return name


def test_a_restart_resumes_only_its_own_jobs_checkpoints(tmp_path, capsys, job):
    # The first run keeps checkpoints; a second run's first attempt died before its Trainer was
    # built (so it moved nothing aside), and the launcher restarted it: that restart must not
    # continue the first run -- it starts fresh, as its first attempt would have.
    cdir = tmp_path / "ck"
    job("aaa")
    cp, _ = _run(cdir)
    cp.save(_state(1), epoch=1, step=16)
    assert checkpoint.load(cdir / "ckpt-e0001-s000000016.pt")["job"] == "run:aaa"
    capsys.readouterr()
    job("bbb")
    cp, path = _run(cdir, resume=None, restart_count=1)
    assert path is None
    err = capsys.readouterr().err
    assert "another job's (run:aaa)" in err and "starts fresh" in err, err
    (aside,) = [d for d in os.listdir(cdir) if d.startswith("previous-run-")]
    assert os.listdir(cdir / aside) == ["ckpt-e0001-s000000016.pt"]
    # Its own checkpoints it resumes when restarted again.
    cp.save(_state(2), epoch=1, step=4)
    _, path = _run(cdir, resume=None, restart_count=2)
    assert path == checkpoint.checkpoint_path(cdir, 1, 4)


def test_a_requeued_slurm_job_resumes_its_checkpoints_under_a_new_launcher(tmp_path, job):
    # sbatch's script runs `dptrain run` again after a requeue (a new run id): Slurm's job id names the job.
    cdir = tmp_path / "ck"
    job("first-launch", slurm_job_id="4242")
    cp, _ = _run(cdir)
    cp.save(_state(1), epoch=1, step=16)
    job("second-launch", slurm_job_id="4242")
    _, path = _run(cdir, resume=None, restart_count=1)
    assert path == checkpoint.checkpoint_path(cdir, 1, 16)


def test_a_restart_resumes_a_checkpoint_that_names_no_job_as_before(tmp_path, job, monkeypatch):
    # Written before checkpoints named their job, or by a job nothing names (torchrun's run id "none"):
    # it may be this job's own, so a restart resumes it as it always did.
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir)
    cp.save(_state(1), epoch=1, step=16)
    older = checkpoint.load(cdir / "ckpt-e0001-s000000016.pt")
    del older["job"]
    torch.save(older, cdir / "ckpt-e0001-s000000016.pt")
    job("bbb")
    _, path = _run(cdir, resume=None, restart_count=1)
    assert path == checkpoint.checkpoint_path(cdir, 1, 16)
    job("none")  # nothing names this job: whatever is there is resumed, as before
    cp.save(_state(2), epoch=1, step=20)
    _, path = _run(cdir, resume=None, restart_count=1)
    assert path == checkpoint.checkpoint_path(cdir, 1, 20)


_JOB = """
import os, sys, torch
from torch import nn
import dptrain
from dptrain import Trainer, TrainerConfig, prepare_dataloader

world = dptrain.init()
if os.environ.get("DIE_EARLY") and world.restart_count == 0:
    sys.exit(7)  # before the Trainer is built: this attempt moves nothing aside
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
model = nn.Linear(4, 2)
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), prepare_dataloader(data, 8),
                  nn.CrossEntropyLoss(), TrainerConfig(checkpoint_dir=sys.argv[1], verbose=False))
print(f"resumed from {trainer.resumed_from}", flush=True)
trainer.fit(int(sys.argv[2]))
dptrain.shutdown()
"""


def test_a_second_run_restarted_before_its_trainer_was_built_does_not_continue_the_first(tmp_path):
    # As a user meets it: `dptrain run --max-restarts 1` twice in one folder; the second run's first
    # attempt dies before its Trainer exists. Its restart trains from scratch, and the first run's
    # checkpoints are moved aside, not continued.
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_JOB)
    cdir = tmp_path / "ck"

    # Each `dptrain run` draws its own run id (unless one is inherited, or Slurm's job id names both).
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}

    def run(epochs, **env):
        return subprocess.run([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "1", "--max-restarts", "1",
                               str(script), str(cdir), str(epochs)], capture_output=True, text=True, timeout=240,
                              cwd=str(tmp_path), env=dict(base, CUDA_VISIBLE_DEVICES="", **env))

    first = run(3)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resumed from None" in first.stdout
    second = run(1, DIE_EARLY="1")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "exited with code 7" in second.stderr or "code 7" in second.stderr, second.stderr[-3000:]
    assert "resumed from None" in second.stdout, second.stdout + second.stderr[-3000:]
    assert "another job's" in second.stderr and "starts fresh" in second.stderr, second.stderr[-3000:]
    (aside,) = [d for d in os.listdir(cdir) if d.startswith("previous-run-")]
    assert _names(cdir / aside)[-1] == "ckpt-e0003-s000000012.pt"  # the first run's newest, moved, not continued
    assert _names(cdir)[-1] == "ckpt-e0001-s000000004.pt"  # the second run's own


def _fresh_start_on_two_ranks(rank, moves, fails):
    import time

    real_replace, real_mkdir = os.replace, os.mkdir

    def slow_replace(src, dst, **kwargs):  # kwargs: the folder moved into (dst_dir_fd)
        time.sleep(0.2)  # rank 1 must wait for the move, not run past it into the directory
        real_replace(src, dst, **kwargs)

    def no_mkdir(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    outcome = []
    for directory, patch in ((moves, ("replace", slow_replace)), (fails, ("mkdir", no_mkdir))):
        if rank == 0:
            setattr(os, *patch)
        try:
            Checkpointer(directory, 3, rank, 2).resume_candidates(False, 0)
            outcome.append(_names(directory))
        except CheckpointError as exc:
            outcome.append(str(exc))
        finally:
            os.replace, os.mkdir = real_replace, real_mkdir
    return outcome


def test_two_ranks_agree_on_moving_an_earlier_run_aside(tmp_path):
    for d in ("moves", "fails"):
        for step in (4, 8):
            checkpoint.save(_state(step), checkpoint.checkpoint_path(tmp_path / d, 1, step))
    out = run_ranks(_fresh_start_on_two_ranks, 2, str(tmp_path / "moves"), str(tmp_path / "fails"))
    assert out[0][0] == out[1][0] == []  # rank 1 returned only once rank 0 had moved the files
    assert out[0][1] == out[1][1] and "moving them aside failed (PermissionError" in out[0][1], out
    assert _names(tmp_path / "fails") == ["ckpt-e0001-s000000004.pt", "ckpt-e0001-s000000008.pt"]


# ------------------------------- 2. an unreadable file never makes pruning eat new ones ---


def test_unreadable_files_under_checkpoint_names_are_set_aside_not_counted(tmp_path, capsys):
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir, keep_last=1)
    cp.save(_state(1), epoch=1, step=16)
    bad = cdir / "ckpt-e0099-s999999999.pt"
    bad.write_bytes(b"not a checkpoint, with the highest step")
    cp, path = _run(cdir, resume="auto", keep_last=1)
    assert path == checkpoint.checkpoint_path(cdir, 1, 16)
    cp.save(_state(2), epoch=2, step=32)
    assert _names(cdir) == ["ckpt-e0002-s000000032.pt"]  # the one just written is kept; keep_last=1
    # One planted while the run goes on, ahead of it, and a truncated one behind it.
    bad.write_bytes(b"planted again")
    behind = checkpoint.checkpoint_path(cdir, 0, 8)
    checkpoint.save(_state(0), behind)
    with open(behind, "r+b") as fh:
        fh.truncate(100)
    cp.keep_last = 2
    cp.save(_state(3), epoch=3, step=48)
    assert _names(cdir) == ["ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"]
    assert sorted(os.listdir(cdir / "set-aside")) == [
        "ckpt-e0000-s000000008.pt", "ckpt-e0099-s999999999.2.pt", "ckpt-e0099-s999999999.pt"]
    err = capsys.readouterr().err
    assert f"moved {str(bad)!r} to {str(cdir / 'set-aside' / bad.name)!r} (nothing is deleted)" in err
    assert "does not begin as a PyTorch checkpoint does" in err and "is truncated" in err
    _, path = _run(cdir, resume="auto")  # and the next resume continues this run
    assert path == checkpoint.checkpoint_path(cdir, 3, 48)


def test_a_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir, keep_last=1)
    for step in (16, 32, 48):
        cp.save(_state(step), epoch=step // 16, step=step, prune=False)
    cp, _ = _run(cdir, resume=checkpoint.checkpoint_path(cdir, 1, 16), keep_last=1)
    cp.save(_state(2), epoch=2, step=32)
    assert _names(cdir) == ["ckpt-e0002-s000000032.pt"]
    assert checkpoint.load(checkpoint.checkpoint_path(cdir, 2, 32))["model"]["w"][0] == 2  # this run's, not the old
    assert sorted(os.listdir(cdir / "set-aside")) == ["ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"]
    assert "is newer than ckpt-e0001-s000000016.pt, which this run resumes from" in capsys.readouterr().err


def test_a_checkpoint_saved_under_a_name_of_ones_own_prunes_as_before(tmp_path, capsys):
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir, keep_last=2)
    for step in (16, 32, 48):
        cp.save(_state(step), epoch=step // 16, step=step)
    cp.save(_state(0), str(cdir / "mine.pt"))  # Trainer.save_checkpoint(path): not ordered, not counted
    assert _names(cdir) == ["ckpt-e0002-s000000032.pt", "ckpt-e0003-s000000048.pt"]
    assert not os.path.exists(cdir / "set-aside") and "moved" not in capsys.readouterr().err


# ----------------------------------------------- 3. a planted symlink is never followed ---


def test_a_symlink_planted_at_the_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir)
    planted = cdir / checkpoint._temp_name("ckpt-e0001-s000000016.pt")  # the name the writer would use
    os.symlink(victim, planted)
    path = cp.save(_state(1), epoch=1, step=16)
    assert victim.read_bytes() == b"someone else's file"
    assert stat.S_ISREG(os.lstat(path).st_mode) and checkpoint.load(path)["model"]["w"][0] == 1
    assert os.readlink(planted) == str(victim)  # not used, not touched
    assert sorted(os.listdir(cdir)) == sorted([planted.name, "ckpt-e0001-s000000016.pt"])
    assert checkpoint.remove_stale_temporaries(cdir) == [] and os.readlink(planted) == str(victim)  # not ours: left


def test_a_checkpoint_dir_that_others_can_write_gets_a_warning(tmp_path, capsys):
    cdir = tmp_path / "shared"
    cdir.mkdir()
    Checkpointer(str(cdir), 3, 0, 1).prepare()
    assert capsys.readouterr().err == ""
    os.chmod(cdir, 0o777)
    Checkpointer(str(cdir), 3, 0, 1).prepare()
    err = capsys.readouterr().err
    assert err.startswith(f"dptrain: checkpoint_dir {str(cdir)!r} can be written by every user (drwxrwxrwx)"), err
    assert "only you can write" in err


# ------------------------------------------------------------ 4. only regular files ---


def test_a_fifo_named_as_the_newest_checkpoint_is_skipped_not_read(tmp_path, capsys):
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir)
    cp.save(_state(1), epoch=1, step=16)
    fifo = checkpoint.checkpoint_path(cdir, 2, 32)
    os.mkfifo(fifo)
    with _deadline(10):
        with pytest.raises(CheckpointError, match=r"is a FIFO \(named pipe\), not a regular file, so it is not read"):
            checkpoint.load(fifo)
        _, path = _run(cdir, resume="auto")
    assert path == checkpoint.checkpoint_path(cdir, 1, 16)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {fifo!r}" in err and "FIFO" in err
    assert stat.S_ISFIFO(os.lstat(cdir / "set-aside" / os.path.basename(fifo)).st_mode)


# ------------------------------------------------------ 5. weights_only on older torch ---


@pytest.mark.parametrize("torch_version, says", [((2, 5), True), ((2, 9), True), ((2, 10), False)])
def test_an_old_torch_says_once_at_load_that_a_checkpoint_can_run_code(tmp_path, monkeypatch, torch_version, says):
    monkeypatch.setattr(_torch_version, "installed", lambda: torch_version)
    monkeypatch.setattr(env, "_WARNED", set())
    path = checkpoint.save(_state(1), tmp_path / "c.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(path)
        checkpoint.load(path)
    texts = [str(w.message) for w in caught]
    if says:
        assert len(texts) == 1 and "weights_only" in texts[0] and "CVE-2025-32434" in texts[0], texts
        assert "CVE-2026-24747" in texts[0] and "pip install 'torch>=2.10'" in texts[0]
    else:
        assert texts == []


# ------------------------------------------------- 6. a write that fails midway, said ---


@pytest.mark.parametrize("code, says", [
    (errno.EACCES, "permission denied (EACCES)"),
    (errno.EIO, "an I/O error"),
    (errno.ENOSPC, "no space left on device"),
])
def test_a_write_failing_midway_says_which_file_why_and_that_the_previous_is_intact(tmp_path, monkeypatch, code, says):
    cdir = tmp_path / "ck"
    cp, _ = _run(cdir)
    kept = cp.save(_state(1), epoch=1, step=16)
    real_write, sent = os.write, []

    def failing(fd, data):  # the OS refuses a checkpoint's bytes once some have gone
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            if sum(sent) > 200:
                raise OSError(code, os.strerror(code))
            sent.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(CheckpointError) as info:
        cp.save({"model": {"w": torch.zeros(10_000)}}, epoch=2, step=32)
    text = str(info.value)
    assert f"saving checkpoint {checkpoint.checkpoint_path(cdir, 2, 32)!r} failed" in text and says in text, text
    assert f"newest complete checkpoint is {kept!r}" in text and "unexpected pos" not in text
    assert isinstance(info.value, OSError) and info.value.errno == code
    assert _names(cdir) == ["ckpt-e0001-s000000016.pt"] and not [n for n in os.listdir(cdir) if ".tmp-" in n]


def test_a_real_short_write_is_named_and_the_file_there_is_intact(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save({"v": 1}, path)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, limits[1]))
    try:
        with pytest.raises(CheckpointError) as info:
            checkpoint.save({"w": torch.zeros(250_000)}, path)  # 1 MB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    text = str(info.value)
    assert text.startswith(f"writing {str(path)!r} failed after 256.0 kB of about 976.6 kB: the file would be "), text
    assert "(EFBIG)" in text and f"the file already at {str(path)!r} is intact" in text
    assert checkpoint.load(path) == {"v": 1} and os.listdir(tmp_path) == ["c.pt"]
