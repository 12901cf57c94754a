"""`dptrain run` never leaves a rank behind: whatever ends the launcher, its ranks and their
DataLoader workers are gone within 5 s and its temporary directories are removed."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dptrain.launcher.inplace import orphaned_directories

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLEEPY = os.path.join(ROOT, "tests", "scripts", "sleepy_workers.py")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


#: How the job's ranks start: forked from the warm template, where the launcher adopts them and
#: they do not die with the template (every job, "restart"; with in-place recovery, "in-place"),
#: or as new interpreters ("fresh": DPTRAIN_WARM_TEMPLATE=0).
MODES = {"restart": [], "in-place": ["--recovery", "in-place", "--max-restarts", "1"], "fresh": []}


def start_job(tmp_path, mode="restart"):
    """A 2-rank job whose ranks each run a DataLoader worker; returns (launcher, pids)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), DPTRAIN_WARM_TEMPLATE="0" if mode == "fresh" else "1")
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", *MODES[mode], SLEEPY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    pids = []
    deadline = time.monotonic() + 120
    while len(pids) < 4 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"the job ended early: {proc.stderr.read()}"
        if " worker " in line:
            words = line.split()
            pids += [int(words[words.index("pid") + 1]), int(words[words.index("worker") + 1])]
    assert len(pids) == 4, "the ranks never came up"
    assert list(tmp_path.glob("dptrain_run_*")), "the launcher's error-file directory is not under TMPDIR"
    return proc, pids


def wait_gone(pids, tmp_path, seconds=5.0) -> list[int]:
    """Ranks still alive, and temporary directories still there, after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids) and not list(tmp_path.glob("dptrain_run_*")):
            break
        time.sleep(0.1)
    return [p for p in pids if alive(p)] + [str(d) for d in tmp_path.glob("dptrain_run_*")]


def _cleanup(pids):
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig,mode", [(signal.SIGHUP, "restart"), (signal.SIGQUIT, "restart"),
                                      (signal.SIGTERM, "restart"), (signal.SIGTERM, "in-place")],
                         ids=["SIGHUP", "SIGQUIT", "SIGTERM", "SIGTERM-in-place"])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, sig, mode):
    proc, pids = start_job(tmp_path, mode)
    try:
        proc.send_signal(sig)
        left = wait_gone(pids, tmp_path)
        _, err = proc.communicate(timeout=30)
    finally:
        _cleanup(pids)
    assert not left, f"still there 5 s after {sig.name}: {left}"
    assert proc.returncode == 128 + sig
    assert f"dptrain run: {sig.name} received; stopping all ranks" in err


@pytest.mark.parametrize("mode", list(MODES))
def test_ranks_die_with_a_sigkilled_launcher(tmp_path, mode):
    proc, pids = start_job(tmp_path, mode)
    try:
        proc.kill()
        left = wait_gone(pids, tmp_path)
        _, err = proc.communicate(timeout=30)
    finally:
        _cleanup(pids)
    assert not left, f"still there 5 s after SIGKILL of the launcher: {left}"
    assert f"dptrain run: the launcher (pid {proc.pid}) died; stopping its 2 rank(s)" in err


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


@pytest.mark.parametrize("mode", list(MODES))
def test_ranks_die_with_the_launcher_even_without_the_janitor(tmp_path, mode):
    # With the janitor gone nobody removes an in-place job's recovery folder (in /dev/shm): this
    # test does, so that it leaves nothing behind.
    proc, pids = start_job(tmp_path, mode)
    ranks = pids[0::2]  # a rank's DataLoader worker stops by itself once its rank is gone
    try:
        janitor = [p for p in children(proc.pid) if b"janitor.py" in _cmdline(p)]
        assert len(janitor) == 1, janitor
        os.kill(janitor[0], signal.SIGKILL)
        proc.kill()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in ranks if alive(p)]
        proc.communicate(timeout=30)
    finally:
        _cleanup(pids)
        for folder in orphaned_directories():  # the killed launcher's; never a running job's
            shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"ranks {left} outlived their launcher"
