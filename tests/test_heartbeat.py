"""How an exit is said (dptrain.runtime.heartbeat.describe_exit): a SIGKILL is named as a kill, and as a kill for
want of memory only where the kernel recorded one (see [Note: a rank killed by SIGKILL])."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dptrain.runtime.heartbeat import OomRecord, describe_exit

# A cgroup's count as each version writes it (v2 memory.events, v1 memory.oom_control), with N for the count.
FORMATS = {
    "v2": "low 0\nhigh 0\nmax 3\noom 1\noom_kill N\noom_group_kill 0\n",
    "v1": "oom_kill_disable 0\nunder_oom 0\noom_kill N\n",
}


def _killed() -> tuple[int, int]:
    """A real process ended with SIGKILL (as by ``kill -9``): its pid and exit code."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGKILL)
    return proc.pid, proc.wait(10)


def test_a_process_killed_by_sigkill_is_said_killed_and_not_out_of_memory_when_nothing_recorded_an_oom(tmp_path):
    pid, code = _killed()
    assert code == -signal.SIGKILL
    assert describe_exit(code) == "was killed by SIGKILL"  # a rank reading a peer's exit code knows nothing more
    events = tmp_path / "memory.events"
    events.write_text(FORMATS["v2"].replace("N", "2"))  # OOM kills before the launcher started do not count
    assert describe_exit(code, OomRecord(str(events), ""), pid) == "was killed by SIGKILL"
    said = describe_exit(code, OomRecord(), pid)  # this machine's own cgroup and kernel log, whatever it can read
    assert said == "was killed by SIGKILL", said
    # The other exits are said as before.
    assert describe_exit(1) == "exited with code 1" and describe_exit(None) == "is still running"
    assert describe_exit(-signal.SIGTERM, OomRecord(str(events), ""), pid) == "was killed by SIGTERM"


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_an_oom_kill_that_the_memory_cgroup_counted_since_the_start_is_said_as_out_of_memory(tmp_path, version):
    events = tmp_path / "memory.events"
    events.write_text(FORMATS[version].replace("N", "0"))
    oom = OomRecord(str(events), "")
    pid, code = _killed()
    events.write_text(FORMATS[version].replace("N", "1"))  # the kernel's OOM killer ended a process of the cgroup
    said = describe_exit(code, oom, pid)
    assert said.startswith("was killed by SIGKILL from the kernel's OOM killer, out of memory ("), said
    assert f"counted OOM kills since the launcher started: oom_kill 0 -> 1 in {events})" in said, said
    assert said.endswith("; give each rank less to hold (a smaller batch, fewer DataLoader workers) or the job "
                         "more memory"), said
    assert describe_exit(code, oom, pid) == said  # the same exit, said again (the launcher does), the same way
    # One kill explains one exit: a rank killed by hand afterwards is not blamed on it.
    other, code = _killed()
    assert describe_exit(code, oom, other) == "was killed by SIGKILL"


def test_the_kernel_log_naming_the_process_says_out_of_memory(tmp_path):
    log = tmp_path / "kmsg"  # /dev/kmsg's records, one a line
    pid, code = _killed()
    log.write_text(f"3,1,100,-;Out of memory: Killed process {pid} (python) total-vm:1kB\n")  # before the start
    oom = OomRecord("", str(log))
    with open(log, "a") as fh:
        fh.write(f"3,2,200,-;Out of memory: Killed process {pid + 1} (python) total-vm:1kB\n"  # another process
                 " SUBSYSTEM=memory\n"  # a record's continuation line
                 "6,3,300,-;Starting the job\n")
    assert describe_exit(code, oom, pid) == "was killed by SIGKILL"
    oom = OomRecord("", str(log))
    summary = f"oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/job,task=python,pid={pid},uid=1000"
    record = f"Memory cgroup out of memory: Killed process {pid} (python) total-vm:4194304kB, anon-rss:4190000kB"
    with open(log, "a") as fh:
        fh.write(f"6,4,400,-;{summary}\n3,5,")  # the kernel's summary, and half of the next record
        fh.flush()
        assert oom.evidence(pid + 7) == ""  # (a look in between, for another process, reads that much)
        fh.write(f"500,-;{record}\n")
    said = describe_exit(code, oom, pid)
    assert said.startswith(f'was killed by SIGKILL from the kernel\'s OOM killer, out of memory (the kernel log: '
                           f'"{record[:160]}"); give each rank less to hold'), said


def test_records_that_cannot_be_read_are_no_evidence_and_no_error(tmp_path):
    pid, code = _killed()
    (tmp_path / "garbage").write_text("oom_kill many\n\x00\x01")
    for events in ("", str(tmp_path / "missing"), str(tmp_path), str(tmp_path / "garbage")):
        for log in ("", str(tmp_path / "missing"), str(tmp_path), str(tmp_path / "garbage"), "/dev/null"):
            assert describe_exit(code, OomRecord(events, log), pid) == "was killed by SIGKILL", (events, log)
