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


def test_many_short_jobs_under_load_all_exit_cleanly():
    # 24 jobs of 2 ranks, 3 jobs at a time on a machine with few cores: half leave without
    # dptrain.shutdown(), half leave right after init.
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "exit_stress.py"), "24", "3"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0 and out.stdout.strip() == "ok 24", out.stdout + out.stderr[-3000:]
