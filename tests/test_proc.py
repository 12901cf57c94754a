"""``dptrain.runtime.proc``: a process that the kernel is still ending counts as dead, and only such a one.

These run real child processes (no torch) and read their ``/proc`` entries; Linux only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dptrain.runtime import proc as _proc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")

SLEEPER = [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)"]


def _started(cmd=SLEEPER) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\n"
    return p


def _until(pid: int) -> int | None:
    """What ``dying`` says once it says anything, waiting up to 10 s for the child to end (unreaped)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        code = _proc.dying(pid)
        if code is not None:
            return code
        time.sleep(0.001)
    return None


def test_a_running_process_is_neither_dying_nor_a_zombie():
    p = _started()
    try:
        assert _proc.running(p.pid) and _proc.dying(p.pid) is None
        assert _proc.start_time(p.pid) == _proc.start_time(p.pid) is not None
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM])
def test_a_process_killed_by_a_signal_is_dying_with_that_signal_until_reaped(sig):
    p = _started()
    started = _proc.start_time(p.pid)
    os.kill(p.pid, sig)
    try:
        assert _until(p.pid) == -sig  # as subprocess will give it (perhaps while its memory is still freed)
        while _proc.running(p.pid):
            time.sleep(0.001)
        assert _proc.dying(p.pid, started) == -sig  # and as a zombie, until reaped
        assert _proc.dying(p.pid, started + 1) is None  # another process under a reused number is not
    finally:
        p.wait()
    assert p.returncode == -sig
    assert _proc.dying(p.pid) is None and _proc.start_time(p.pid) is None  # reaped: no such process


def test_an_exit_with_a_code_is_dying_with_it_and_an_exit_0_waits_for_the_kernel():
    failed = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert _until(failed.pid) == 3
        while _proc.running(done.pid):  # ended, unreaped: still not taken for a death
            time.sleep(0.001)
        assert _proc.dying(done.pid) is None
    finally:
        failed.wait()
        done.wait()
    assert failed.returncode == 3 and done.returncode == 0


def test_a_large_process_is_dying_long_before_the_kernel_has_ended_it():
    # One thread, 1 GiB written: the main thread frees it all itself, in state R, before it is a zombie.
    p = _started([sys.executable, "-c", "b = b'x' * (1 << 30); print('up', flush=True); import time; time.sleep(60)"])
    os.kill(p.pid, signal.SIGKILL)
    # Read once its main thread is surely freeing its memory (the first microseconds of its exit, where a
    # read may end up freeing it itself, are covered by the Note), which takes the kernel ~0.1 s.
    time.sleep(0.02)
    try:
        assert _proc.dying(p.pid) == -signal.SIGKILL
        reapable = os.waitpid(p.pid, os.WNOHANG)
    finally:
        p.wait()
    assert reapable == (0, 0)  # said while the kernel was still ending it (a zombie could be waited for)
    assert p.returncode == -signal.SIGKILL


def test_a_main_thread_that_ends_alone_is_not_a_death():
    # pthread_exit in the main thread: a zombie main thread (status 0) while the process goes on.
    code = ("import ctypes, threading, time, sys\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('alive', flush=True), time.sleep(60)),"
            " daemon=False).start()\n"
            "print('up', flush=True)\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")
    p = _started([sys.executable, "-c", code])
    try:
        assert p.stdout.readline() == b"alive\n"  # the process went on after its main thread ended
        assert not _proc.running(p.pid)  # ... which shows as a zombie
        assert _proc.dying(p.pid) is None  # but it is not dying
    finally:
        p.kill()
        p.wait()


def test_no_such_process():
    assert _proc.dying(2**22 + 12345) is None
    assert not _proc.running(2**22 + 12345)
    assert _proc.start_time(2**22 + 12345) is None


def test_identity_names_this_process_and_its_pid_namespace():
    pidns, pid, started = _proc.identity()
    assert pid == os.getpid() and started == _proc.start_time(os.getpid()) is not None
    assert pidns == os.stat("/proc/self/ns/pid").st_ino
