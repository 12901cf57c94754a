"""No rank outlives its launcher, and no temporary directory outlives the job.

[Note: how ranks die with the launcher]
``dptrain run`` stops its ranks itself on every exit it sees coming (a failed rank, Ctrl-C,
SIGTERM, SIGHUP, SIGQUIT). For the exits it cannot see -- SIGKILL, the OOM killer, a crash
of the interpreter -- two things hold:

* each rank is started with a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``): the
  kernel sends it SIGTERM the moment the launcher is gone;
* the janitor, this file run as a small separate program in a session of its own, reads
  the launcher's instructions from a pipe. When the pipe closes without a final ``done``,
  the launcher died: the janitor sends SIGTERM to every rank's process group (the rank and
  its DataLoader workers), SIGKILL after ``GRACE_S`` to what is left, and removes the
  launcher's temporary directories. It also covers platforms without ``prctl``.

Protocol, one command a line: ``group PGID`` (a rank's process group), ``helper PGID`` (the
warm template's or a hot spare's: stopped as well, not counted as a rank), ``forget PGID``
(stopped and reaped by the launcher), ``dir PATH`` (remove when the launcher ends), ``done``.

This file imports only the standard library: it runs as ``python -I -S janitor.py``,
which starts in a few milliseconds, without torch.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

#: Seconds between SIGTERM and SIGKILL when the janitor stops the ranks of a dead launcher.
GRACE_S = 2.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_groups(groups: set[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_groups(groups: set[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process group, then SIGKILL those still alive after ``grace_s``."""
    _signal_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
        time.sleep(0.05)
    _signal_groups({g for g in groups if _group_alive(g)}, signal.SIGKILL)


def main() -> int:
    # A terminal's hang-up or Ctrl-C is for the launcher, which handles it; the janitor
    # must live on to clean up after it.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    launcher = os.getppid()
    groups: set[int] = set()
    helpers: set[int] = set()  # the warm template and hot spares: stopped too, not counted as ranks
    dirs: list[str] = []
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "group":
            groups.add(int(arg))
            helpers.discard(int(arg))  # a spare that became a rank
        elif command == "helper":
            helpers.add(int(arg))
        elif command == "forget":
            groups.discard(int(arg))
            helpers.discard(int(arg))
        elif command == "dir":
            dirs.append(arg)
        elif command == "done":
            groups.clear()
            helpers.clear()
            break
    if groups:
        try:
            sys.stderr.write(f"dptrain run: the launcher (pid {launcher}) died; stopping its "
                             f"{len(groups)} rank(s)\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    if groups or helpers:
        stop_groups(groups | helpers)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    return 0


# ------------------------------------------------------------------------ launcher side --


class Janitor:
    """The launcher's end of the janitor: tell it what to clean up if the launcher dies."""

    def __init__(self) -> None:
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError:  # cannot start a process: the parent-death signal still holds
            self._proc = None

    def tell(self, command: str, arg: object = "") -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(f"{command} {arg}\n".encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the janitor is gone: nothing to tell
            self._proc = None

    def done(self) -> None:
        """The launcher ends in order; the janitor removes the directories and exits."""
        self.tell("done")
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_prctl = None


def prctl_function():
    """libc's ``prctl`` (loaded once), or None where there is none (not Linux)."""
    global _prctl
    if _prctl is None:
        _prctl = _load_prctl() or False
    return _prctl or None


def adopt_orphans() -> bool:
    """Make this process the child subreaper of its descendants (Linux): a process whose parent
    dies is re-parented to this one, not to init, so that this one can still wait for it and
    read its exit code. Whether that holds.

    The launcher does this before it starts the warm template (see [Note: the warm template] in
    ``template``): the ranks forked from the template then outlive it, and their exit codes
    still reach the launcher.
    """
    prctl = prctl_function()
    return prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def parent_death_signal(launcher_pid: int, if_gone: int = signal.SIGKILL):
    """A ``preexec_fn`` that makes the child get SIGTERM when the launcher dies, or None.

    Runs in the child between fork and exec, so it only calls a function loaded before the
    fork. ``launcher_pid`` is the parent's pid as the parent knew it before the fork (the
    child's ``os.getppid()`` is already another process's if the parent died first). If the
    launcher died before the call, the child is already orphaned and no signal will come: it
    sends itself ``if_gone`` (default SIGKILL: between fork and exec a Python handler of the
    parent's for SIGTERM would not run; a child whose SIGTERM is the default may pass SIGTERM).
    """
    prctl = prctl_function()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher_pid:
            os.kill(os.getpid(), if_gone)

    return preexec


if __name__ == "__main__":
    sys.exit(main())
