"""torchrun's per-rank log files: ``dptrain run --log-dir D --tee N`` / ``--redirects N``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "both_streams.py")


def _run(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", "--rdzv-id", "job7", *flags, SCRIPT]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _read(path) -> str:
    with open(path, newline="") as fh:  # keep the carriage returns
        return fh.read()


def test_tee_writes_every_stream_to_files_and_still_shows_it(tmp_path):
    done = _run("--log-dir", str(tmp_path), "--tee", "3")
    assert done.returncode == 0, done.stderr
    assert "[rank0] out from 0" in done.stdout and "[rank1] err from 1" in done.stderr
    assert f"rank logs go to {tmp_path / 'job7'}" in done.stderr
    for local in (0, 1):
        folder = tmp_path / "job7" / "attempt_0" / str(local)
        assert _read(folder / "stdout.log") == f"out from {local}\n"
        assert _read(folder / "stderr.log") == f"10%\r50%\r100%\nerr from {local}\n"  # as the rank wrote it


def test_redirects_per_local_rank_take_the_stream_off_the_console(tmp_path):
    done = _run("--log_dir", str(tmp_path), "--redirects", "0:1,1:2")
    assert done.returncode == 0, done.stderr
    assert "out from 0" not in done.stdout and "[rank1] out from 1" in done.stdout
    assert "[rank0] err from 0" in done.stderr and "err from 1" not in done.stderr
    attempt = tmp_path / "job7" / "attempt_0"
    assert sorted(p.relative_to(attempt).as_posix() for p in attempt.rglob("*.log")) == ["0/stdout.log", "1/stderr.log"]
    assert _read(attempt / "0" / "stdout.log") == "out from 0\n"


def test_without_tee_or_redirects_nothing_is_written(tmp_path):
    done = _run("--log-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["4", "x", "0:9", "a:1"])
def test_bad_values_are_refused(value):
    done = _run("--tee", value)
    assert done.returncode == 2 and "argument -t/--tee" in done.stderr


def test_an_unwritable_log_dir_is_an_error_before_any_rank_starts(tmp_path):
    (tmp_path / "file").write_text("")
    done = _run("--log-dir", str(tmp_path / "file" / "logs"), "--tee", "1")
    assert done.returncode == 2
    assert "dptrain run: error: --log-dir: cannot write" in done.stderr and "give a writable folder" in done.stderr
    assert "out from" not in done.stdout
