"""A process as Linux's ``/proc`` shows it: whether it runs, and whether it is already dying.

[Note: a process that is dying]
A process killed by a signal (SIGKILL, a crash, the OOM killer) runs no more of its own code
from the moment the signal is delivered, but the kernel takes a while to end it: the last of
its threads unmaps its memory before its files (sockets, locks) are closed and its parent
can wait for it. For a process that has imported torch that is 25-45 ms on a 2-core machine,
and half a second for one holding 4 GiB. Its main thread, though, says within a millisecond
that it is exiting (the flag ``PF_EXITING`` in field 9 of ``/proc/<pid>/stat``) and with which
status (field 52), whether it frees the memory itself or another thread does and it is a
zombie already. So in-place recovery reads that to learn of a death at once -- the launcher
to start the replacement, a survivor waiting in a shared-memory collective to stop waiting --
instead of when the kernel is done.

Only a status that cannot belong to a main thread ending alone counts: a fatal signal, or an
``exit_group`` with a code other than 0, end every thread of the process (a main thread that
leaves by ``pthread_exit`` ends with status 0 and its process may go on: that is not taken
for a death, and neither is an exit 0, which waits for the kernel as before). The status is
shown only to whoever may trace the process (its user); to others it reads 0, and they wait.

A read holds the process's memory for a moment. One that comes in the very instant the dying
process lets go of its memory is left to free it itself (a fraction of a millisecond after the
signal; a poll every few ms rarely meets it): it then returns when that is done, about when the
kernel would have said the process ended anyway -- never later than without this module.
"""

from __future__ import annotations

import os

__all__ = ["dying", "running", "start_time", "identity", "ended_children", "wait_polled"]

_PF_EXITING = 0x4  # the task's flag (field 9): set as it starts to exit, before its memory is freed


def _fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the 3rd field, the state, first),
    or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            line = fh.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold any byte, ")" too: split after the last one.
    return line.rsplit(b")", 1)[-1].decode("ascii", "replace").split()


def running(pid: int) -> bool:
    """Whether ``pid`` is a process whose main thread has not ended (a zombie's has)."""
    fields = _fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (field 22): with the pid, it names one process
    even after the number is reused. None when there is no such process."""
    fields = _fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def identity() -> tuple[int | None, int, int | None]:
    """(PID namespace, pid, :func:`start_time`) of this process: what a peer on the same node needs to
    read its ``/proc`` entry -- only a peer in the same PID namespace sees it under that pid."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return pidns, os.getpid(), start_time(os.getpid())


def dying(pid: int, started: int | None = None) -> int | None:
    """The exit status of process ``pid`` when its main thread has ended in a way that ends the whole
    process (see [Note: a process that is dying]), as ``subprocess`` gives it: ``-signal``, or the
    nonzero exit code. None while it runs, when it ended with 0, or when that cannot be read (no
    such process, a kernel before 3.5); ``started``: its :func:`start_time`, for a number that may
    have been reused (another process under that number is not dying).
    """
    fields = _fields(pid)
    try:
        if not fields or not int(fields[6]) & _PF_EXITING or (started is not None and int(fields[19]) != started):
            return None
        status = int(fields[49])
    except (IndexError, ValueError):
        return None
    if status & 0x7F:
        return -(status & 0x7F)
    return (status >> 8) & 0xFF or None


def ended_children():
    """Reap every child of this process that has ended: ``(pid, code)`` for each, ``code`` as
    ``Popen.returncode`` says it (negative for a signal)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def wait_polled(proc, pause, timeout: float | None = None) -> int:
    """``Popen.wait`` for a process known through ``proc.poll()`` only (not our child): calls
    ``pause(seconds)`` between polls (a sleep, or a wait for news of it); raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    import subprocess
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.poll() is None:
        left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        pause(left)
    return proc.returncode
