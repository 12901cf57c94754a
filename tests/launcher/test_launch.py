"""The launchers: `dptrain run` (env parity with torchrun, failure handling, restarts) and spawn()."""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import dptrain
import dptrain.comm
import dptrain.launcher
from dptrain.launcher import LaunchConfig, RankFailedError
from tests._dist import left_in_tmpdir, run_ranks, wait_event

# Fresh ranks for every call (tests/_dist.py): these tests are about dptrain.spawn itself (how it
# starts, stops and reports ranks), and one waits for a rank's process to exit.
FRESH_RANKS = True

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def dptrain_run(*args, timeout=60, env=None, **kw):
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("OMP_NUM_THREADS", None) if env is None or "OMP_NUM_THREADS" not in env else None
    return subprocess.run([sys.executable, "-m", "dptrain", "run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=full_env, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def _envs(stdout: str, prefix: str = "ENV ") -> dict[int, dict]:
    rows = [json.loads(line.split(prefix, 1)[1]) for line in stdout.splitlines() if prefix in line]
    return {int(r["RANK"]): r for r in rows}


def test_dptrain_run_gives_each_rank_torchruns_environment():
    # OMP_NUM_THREADS given: left unset, torchrun sets 1 and dptrain run the cores per rank (its
    # own documented choice, tested below), which agree only on a machine of 2 or 3 cores.
    ours = dptrain_run("--nproc-per-node", "3", os.path.join(SCRIPTS, "dump_env.py"), env={"OMP_NUM_THREADS": "1"})
    assert ours.returncode == 0, ours.stderr
    theirs = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         os.path.join(SCRIPTS, "dump_env.py")],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert theirs.returncode == 0, theirs.stderr
    a, b = _envs(ours.stdout), _envs(theirs.stdout)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    varying = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
    if b[0].get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        # An older torchrun (2.4) hosts no agent store for --standalone; dptrain run always hosts
        # the store its ranks connect to, and says so.
        assert a[0]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        varying.add("TORCHELASTIC_USE_AGENT_STORE")
    for r in range(3):
        assert set(a[r]) == set(b[r])
        assert {k: v for k, v in a[r].items() if k not in varying} == {k: v for k, v in b[r].items() if k not in varying}
        assert a[r]["MASTER_ADDR"] == "127.0.0.1"


def test_every_line_is_prefixed_with_its_rank_and_log_ranks_filters():
    out = dptrain_run("--nproc_per_node", "2", "--log-ranks", "1", "-m", "tests.scripts.hello_module", "a", "--b")
    assert out.returncode == 0, out.stderr
    assert "[rank1] module rank 1 args ['a', '--b']" in out.stdout
    assert "rank 0" not in out.stdout


def test_omp_num_threads_defaults_to_cores_per_rank_with_a_notice():
    out = dptrain_run("--nproc-per-node", "2", os.path.join(SCRIPTS, "dump_env.py"))
    cores = len(os.sched_getaffinity(0))
    assert f"OMP_NUM_THREADS={max(1, cores // 2)} for each of 2 ranks" in out.stderr
    assert all(e["OMP_NUM_THREADS"] == str(max(1, cores // 2)) for e in _envs(out.stdout).values())
    kept = dptrain_run("--nproc-per-node", "2", os.path.join(SCRIPTS, "dump_env.py"), env={"OMP_NUM_THREADS": "7"})
    assert all(e["OMP_NUM_THREADS"] == "7" for e in _envs(kept.stdout).values())
    assert "OMP_NUM_THREADS=" not in kept.stderr


def test_single_node_rendezvous_listens_on_loopback_only():
    out = dptrain_run("--nproc-per-node", "2", os.path.join(SCRIPTS, "listen_addr.py"))
    assert out.returncode == 0, out.stderr
    assert "[rank0] LISTEN 127.0.0.1" in out.stdout


def test_a_failing_rank_stops_the_job_and_is_named(tmp_path):
    # Ranks 0 and 2 would sleep 600 s: the job ends within dptrain_run's 60 s only if they were stopped.
    out = dptrain_run("--nproc-per-node", "3", os.path.join(SCRIPTS, "fail_one_rank.py"), "sleep",
                      env={"TMPDIR": str(tmp_path)})
    assert not left_in_tmpdir(tmp_path)  # the launcher's error-file directory is gone
    assert out.returncode == 1
    assert "dptrain run: rank 1 (local rank 1" in out.stderr and "exited with code 1" in out.stderr
    assert "--- last lines of rank 1 ---" in out.stderr and "rank one is broken on purpose" in out.stderr
    pids = [int(line.rsplit("pid ", 1)[1]) for line in out.stdout.splitlines() if "started" in line]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_ctrl_c_stops_every_rank():
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2",
                             os.path.join(SCRIPTS, "sleepy.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    pids = []
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "sleeping" in line:
            pids.append(int(line.rsplit("pid ", 1)[1]))
    assert len(pids) == 2 and all(_alive(p) for p in pids), pids  # else "none left" below proves nothing
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "SIGINT received; stopping all ranks" in err
    assert not any(_alive(p) for p in pids)


def test_stall_report_names_the_rank_without_progress():
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2",
                             os.path.join(SCRIPTS, "sleepy.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, DPTRAIN_STALL_REPORT_S="1", DPTRAIN_HEARTBEAT_S="0.2"))
    deadline = time.monotonic() + 120
    seen = ""
    while time.monotonic() < deadline and "has made no progress" not in seen:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            seen += proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert "has made no progress for" in seen and "outside any collective after #0, 0 steps" in seen


def test_a_rank_that_exits_0_early_is_reported_once_not_as_a_stall():
    # A 3 s stall threshold: on a loaded machine a rank can legitimately sit for a second
    # between init and its first collective, which a shorter one would report.
    out = dptrain_run("--nproc-per-node", "2", os.path.join(SCRIPTS, "early_exit.py"), "work", "7",
                      env={"DPTRAIN_STALL_REPORT_S": "3", "DPTRAIN_HEARTBEAT_S": "0.2"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[rank1] rank 1 done" in out.stdout
    reports = [line for line in out.stderr.splitlines() if "still running" in line]
    assert len(reports) == 1, out.stderr
    assert reports[0].startswith("dptrain run: rank 0 exited with code 0 while rank 1 is still running, ")
    assert "(rank 1: outside any collective after #1" in reports[0]
    assert "has made no progress" not in out.stderr


def test_a_collective_that_fails_because_a_peer_exited_says_so():
    out = dptrain_run("--nproc-per-node", "2", os.path.join(SCRIPTS, "early_exit.py"), "all_reduce", timeout=120)
    assert out.returncode == 1
    assert "rank 1: all_reduce #2 failed: rank 0 exited with code 0 " in out.stderr, out.stderr
    assert "dptrain run: rank 1 (local rank 1" in out.stderr and "(after rank(s) 0 had exited with code 0)" in out.stderr


def _return_early(rank, pid_file):
    if rank == 0:
        set_event_with(pid_file, os.getpid())
        return
    wait_event(pid_file)
    with open(pid_file) as fh:
        pid = int(fh.read())
    while _alive(pid):  # wait for rank 0's shutdown and exit themselves
        time.sleep(0.01)
    dptrain.comm.all_reduce(torch.ones(1))


def set_event_with(path, value) -> None:
    with open(f"{path}.part", "w") as fh:
        fh.write(str(value))
    os.replace(f"{path}.part", path)


def test_without_dptrain_run_a_failed_collective_still_names_the_peer_that_left(tmp_path):
    with pytest.raises(RankFailedError, match=r"rank 1: all_reduce #1 failed: rank 0 shut down \d+s ago"):
        run_ranks(_return_early, 2, str(tmp_path / "pid0"))


def test_max_restarts_restarts_the_whole_job():
    out = dptrain_run("--nproc-per-node", "2", "--max-restarts", "2", os.path.join(SCRIPTS, "flaky.py"), "1")
    assert out.returncode == 0, out.stderr
    assert "rank 1 (local rank 1" in out.stderr and "exited with code 3" in out.stderr
    assert "restarting all ranks (restart 1 of 2)" in out.stderr
    # The restarted ranks too are forked from the node's warm template (one import of torch for the node).
    assert "[rank0] attempt 1 sum 2.0 forked True" in out.stdout and "[rank1] attempt 1 sum 2.0 forked True" in out.stdout
    gave_up = dptrain_run("--nproc-per-node", "2", os.path.join(SCRIPTS, "flaky.py"), "0")
    assert gave_up.returncode == 3 and "restarting" not in gave_up.stderr


def test_without_the_warm_template_ranks_are_new_interpreters():
    out = dptrain_run("--nproc-per-node", "2", "--max-restarts", "1", os.path.join(SCRIPTS, "flaky.py"), "1",
                      env={"DPTRAIN_WARM_TEMPLATE": "0"})
    assert out.returncode == 0, out.stderr
    assert "[rank0] attempt 1 sum 2.0 forked False" in out.stdout and "[rank1] attempt 1 sum 2.0 forked False" in out.stdout


def test_a_script_of_the_standard_library_alone_starts_without_importing_torch_ahead(tmp_path):
    # Nothing for the template to import ahead: it would only delay the ranks by its imports.
    script = tmp_path / "hosts.py"
    script.write_text("import os, sys\n"
                      "with open(f'/proc/{os.getppid()}/cmdline', 'rb') as fh:\n"
                      "    forked = b'dptrain.launcher.template' in fh.read()\n"
                      "print('rank', os.environ['RANK'], 'forked', forked, 'torch', 'torch' in sys.modules)\n")
    out = dptrain_run("--nproc-per-node", "2", str(script))
    assert out.returncode == 0, out.stderr
    assert "[rank0] rank 0 forked False torch False" in out.stdout, out.stdout
    assert "[rank1] rank 1 forked False torch False" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc-per-node", "0", "x.py"], "must be >= 1, got 0"),
        (["--nproc-per-node", "2", "--bogus", "x.py"], "unrecognized arguments: --bogus"),
        (["missing_script.py"], "script 'missing_script.py' not found"),
        (["--nnodes", "2", "tests/scripts/dump_env.py"], "needs an explicit rendezvous address"),
        (["--node-rank", "3", "tests/scripts/dump_env.py"], "--node-rank 3 is outside 0..0"),
        (["--log-ranks", "5", "tests/scripts/dump_env.py"], "--log-ranks [5] outside the 1 ranks"),
    ],
)
def test_bad_input_gets_a_one_line_error(args, message):
    out = dptrain_run(*args)
    assert out.returncode == 2
    assert message in out.stderr


def test_port_in_use_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = dptrain_run("--master-port", str(port), os.path.join(SCRIPTS, "dump_env.py"),
                          env={"TMPDIR": str(tmp_path)})
    assert out.returncode == 2
    assert not left_in_tmpdir(tmp_path)
    assert f"port {port} on 127.0.0.1 is not available" in out.stderr and "--master-port" in out.stderr


def test_a_node_that_cannot_reach_node_0_says_what_it_waits_for(tmp_path):
    port = dptrain.launcher.free_port()
    out = dptrain_run("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                      "--timeout", "3", os.path.join(SCRIPTS, "dump_env.py"),
                      env={"DPTRAIN_WAIT_REPORT_S": "1", "TMPDIR": str(tmp_path)})
    where = f"node 0's rendezvous at 127.0.0.1:{port}"
    assert re.search(rf"dptrain run: node 1 has waited \d+s for {re.escape(where)}: nothing listens there yet "
                     r"\(connection refused\)", out.stderr), out.stderr
    assert out.stderr.count("dptrain run: node 1 has waited") >= 2
    assert f"dptrain run: error: node 1 could not reach {where} within 3s" in out.stderr
    assert out.returncode == 2 and not list(tmp_path.iterdir())


def test_launch_config_validates():
    with pytest.raises(ValueError, match="--max-restarts must be >= 0"):
        LaunchConfig(program=os.path.join(SCRIPTS, "dump_env.py"), max_restarts=-1)


def _rank_square(rank, offset):
    return rank * rank + offset, dptrain.world_size()


def test_spawn_returns_values_in_rank_order():
    assert run_ranks(_rank_square, 3, 10) == [(10, 3), (11, 3), (14, 3)]


def _raise_on_two(rank, events):
    set_event_with(events / f"pid{rank}", os.getpid())
    if rank == 2:
        wait_event(events / "pid0")
        wait_event(events / "pid1")
        raise KeyError("missing thing")
    signal.pause()  # forever: must be stopped by spawn (waiting for it would end in TimeoutError)


def test_spawn_reraises_a_rank_error_naming_the_rank_and_stops_the_others(tmp_path):
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_on_two, 3, tmp_path, timeout=60)
    others = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert not any(_alive(p) for p in others), others
    assert info.value.rank == 2
    assert "rank 2 of 3 failed: KeyError: 'missing thing'" in str(info.value)
    assert "in _raise_on_two" in info.value.traceback_text


def _hang(rank):
    time.sleep(60)


def test_spawn_timeout_kills_and_names_ranks():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] of 2 still running after the 2s timeout"):
        run_ranks(_hang, 2, timeout=2)


def _die_hard(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_spawn_reports_a_rank_killed_by_a_signal():
    with pytest.raises(RankFailedError, match="rank 1 of 2 was killed by SIGKILL") as info:
        run_ranks(_die_hard, 2)
    # A kill by hand, not the OOM killer: nothing the kernel recorded says otherwise.
    assert "memory" not in str(info.value) and "OOM" not in str(info.value), str(info.value)


def test_spawn_rejects_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs >= 1"):
        dptrain.spawn(_rank_square, 0)


# -- files dptrain run opens: never waited on, refused unless regular (issue 46, point 5) ------------------
def _at_once(fifo, fn):
    """fn() (its exception too) within 10 s; a wait on ``fifo`` is ended (a reader and a writer
    arrive: O_RDWR) and fails the test."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn()
        except Exception as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_RDWR))
        thread.join(10)
        pytest.fail(f"the open waited on the FIFO {fifo}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_files_dptrain_did_not_make_are_opened_without_waiting_and_only_when_regular(tmp_path):
    from dptrain.runtime.settings import NotRegularFile, open_regular

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to-fifo").symlink_to(fifo)
    regular = tmp_path / "file"
    regular.write_text("text")
    (tmp_path / "to-file").symlink_to(regular)
    fifo_is, write = "a FIFO (named pipe)", os.O_WRONLY | os.O_APPEND | os.O_CREAT
    for path, flags, follow, kind in ((fifo, os.O_RDONLY, True, fifo_is),
                                      (fifo, write, False, fifo_is),
                                      (tmp_path / "to-fifo", os.O_RDONLY, True, f"a symbolic link to {fifo_is}"),
                                      (tmp_path / "to-fifo", os.O_WRONLY, False, "a symbolic link"),
                                      (tmp_path / "to-file", write, False, "a symbolic link"),
                                      (tmp_path, os.O_RDONLY, True, "a directory"),
                                      (tmp_path, os.O_WRONLY, True, "a directory"),
                                      ("/dev/null", os.O_RDONLY, True, "a character device")):
        with pytest.raises(NotRegularFile) as info:
            _at_once(fifo, lambda: open_regular(str(path), flags, follow=follow))
        assert (info.value.kind, str(info.value)) == (kind, f"{path} is {kind}, not a regular file"), (path, flags)
    fd = open_regular(str(tmp_path / "to-file"))  # followed where the user names the file
    try:
        assert os.read(fd, 10) == b"text"
        assert os.get_blocking(fd)  # O_NONBLOCK is cleared once the file is known to be regular
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / "missing"))


def test_a_fifo_or_a_link_where_a_rank_log_goes_is_refused_at_once(tmp_path):
    # A FIFO there held dptrain run for good (its open to append waited for a reader); a link
    # sent the rank's output to the file it pointed to.
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    folder = tmp_path / "logs" / "job7" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    log = folder / "stdout.log"
    elsewhere = tmp_path / "elsewhere.txt"
    for plant, kind in ((lambda: os.mkfifo(log), "a FIFO (named pipe)"),
                        (lambda: log.symlink_to(elsewhere), "a symbolic link")):
        plant()
        try:
            done = dptrain_run("--rdzv-id", "job7", "--log-dir", str(tmp_path / "logs"), "--redirects", "1",
                               str(script))
        except subprocess.TimeoutExpired:
            pytest.fail(f"dptrain run still waits on {kind} at {log} after 60 s")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stderr and lines[-1] == (
            f"dptrain run: error: --log-dir: {log} is {kind}, not a regular file; dptrain appends a rank's output "
            f"only to a file of its own there: remove it, or give another --log-dir"), done.stderr
        log.unlink()
    assert not (tmp_path / "ran").exists() and not elsewhere.exists()


def test_an_error_file_that_is_a_fifo_is_read_as_empty_at_once(tmp_path):
    from dptrain.launcher.workers import read_error_file

    fifo = tmp_path / "error.json"
    os.mkfifo(fifo)
    assert _at_once(fifo, lambda: read_error_file(str(fifo))) == ""
    fifo.unlink()
    fifo.write_text(json.dumps({"message": {"message": "boom", "extraInfo": {"py_callstack": "Traceback: boom"}}}))
    assert read_error_file(str(fifo)) == "Traceback: boom"
