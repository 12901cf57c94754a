"""A rank that has finished exits with code 0 -- never "terminate called without an active
exception" and SIGABRT from a thread still inside a C++ call when the interpreter ends."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def test_shutdown_waits_for_a_heartbeat_caught_in_a_slow_store_write():
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "slow_heartbeat.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert "terminate called" not in out.stderr
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "stopped\n"


def test_every_exit_path_of_many_short_jobs_ends_without_an_abort():
    # 42 jobs of 2 ranks, 3 jobs at a time on a machine with few cores: every way a process
    # ends (shutdown(), nothing, destroy_process_group() only, sys.exit, an exception,
    # os._exit, SIGTERM) with groups made by dptrain.init and by the user's own
    # init_process_group, several DDPs in shared memory alive at the end (see exit_stress.py).
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "exit_stress.py"), "42", "3"],
                         capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert "terminate called" not in out.stderr, out.stdout + out.stderr[-3000:]
    assert out.returncode == 0 and out.stdout.strip() == "ok 42", out.stdout + out.stderr[-3000:]
