"""Warm templates shared by jobs (DPTRAIN_TEMPLATE_SERVERS; [Note: a warm template for many jobs] in
dptrain/launcher/served.py): from the third job of an import environment on, a job gets its
template from that environment's server, and its ranks are what a start of their own would make."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from dptrain.launcher import served, template_server
from dptrain.runtime import proc as _proc
from tests._warm import stop_template_servers

# One worker runs them all (tests/conftest.py's GROUPS), so that the module's server (the ``warm``
# fixture) is started once.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the warm template is Linux's")

SCRIPT = """
import json, os, sys
import torch
import dptrain
world = dptrain.init()
t = torch.ones(1)
dptrain.comm.all_reduce(t)

def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\\0", b" ").decode()

def parent(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])

template = os.getppid()
print(json.dumps({"net": os.stat("/proc/self/ns/net").st_ino,"rank": world.rank, "sum": t.item(), "cwd": os.getcwd(), "path0": sys.path[0],
                  "mark": os.environ.get("MARK"), "argv": sys.argv, "template": cmdline(template),
                  "above": cmdline(parent(template)), "pid": os.getpid()}), flush=True)
dptrain.comm.all_reduce(torch.ones(1))  # every rank has printed before rank 1 ends with CODE
if os.environ.get("HOLD"):
    import time
    time.sleep(60)
sys.exit(int(os.environ.get("CODE", "0")) if world.rank == 1 else 0)
"""


def _folder(tmp_path):
    """The folder to name (any), and the private one the servers use inside it."""
    folder = tmp_path / "servers"
    folder.mkdir()
    return str(folder), os.path.join(str(folder), f"dptrain-templates-{os.getuid()}")


def _env(folder, **extra):
    env = {k: v for k, v in os.environ.items() if k != "DPTRAIN_TEMPLATE_SERVERS"}
    return {**env, "DPTRAIN_TEMPLATE_SERVERS": folder, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **extra}


def _run(script, cwd, env, *args):
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", str(script), *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    said = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if "] {" in line]
    return done, sorted(said, key=lambda r: r["rank"])


def _server_listening(folder, wait_s=60.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if any(name.endswith(".sock") for name in os.listdir(folder)):
            return True
        time.sleep(0.1)
    return False


def test_the_import_key_follows_what_an_import_reads_and_nothing_else(tmp_path):
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    key = served.import_key(base)
    assert served.import_key(dict(base, RANK="1", DPTRAIN_DEBUG="1", MY_SETTING="x")) == key
    for name, value in (("OMP_NUM_THREADS", "2"), ("PYTHONPATH", "/opt/lib"), ("LD_PRELOAD", "/x.so"),
                        ("TORCH_LOGS", "+dynamo"), ("CUDA_VISIBLE_DEVICES", ""), ("HOME", "/elsewhere"),
                        # torch writes it into os.environ at its first use, but torch._dynamo also
                        # reads it as it is imported (its disk cache's folder, torch 2.13): in the key.
                        ("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")):
        assert served.import_key(dict(base, **{name: value})) != key, name
    assert served.import_key(base, executable="/other/python") != key
    # A relative entry of PYTHONPATH is found from the working directory: that becomes part of the key.
    relative = dict(base, PYTHONPATH="lib")
    assert served.import_key(relative, cwd="/a") != served.import_key(relative, cwd="/b")
    absolute = dict(base, PYTHONPATH="/opt/lib")
    assert served.import_key(absolute, cwd="/a") == served.import_key(absolute, cwd="/b")


def test_a_module_beside_the_program_that_the_server_imported_is_refused(tmp_path):
    (tmp_path / "torch.py").write_text("")
    (tmp_path / "numpy").mkdir()
    (tmp_path / "torchvision.py").write_text("")
    assert template_server._shadowed(str(tmp_path), {"torch", "json"}) == "torch.py"
    assert template_server._shadowed(str(tmp_path), {"numpy"}) == "numpy"
    assert template_server._shadowed(str(tmp_path), {"json", "torchvision_x"}) == ""


def test_the_servers_live_in_a_private_folder_of_the_users_own(tmp_path):
    mine = served.servers_folder(str(tmp_path))
    assert mine == str(tmp_path / f"dptrain-templates-{os.getuid()}") and os.stat(mine).st_mode & 0o777 == 0o700
    os.chmod(mine, 0o755)  # others may enter: not used
    assert served.servers_folder(str(tmp_path)) is None
    assert served.request(str(tmp_path), dict(os.environ), str(tmp_path), ["x"]) is None
    assert served.servers_folder(str(tmp_path / "missing")) is None


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A folder of servers whose server for this test's import environment listens: the first job of
    that environment noted it, the second started it, and both forked their ranks from a template of
    their own, as a job without the server would. The server ends with its folder, at the end."""
    tmp_path = tmp_path_factory.mktemp("warm")
    named, folder = _folder(tmp_path)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    for mark in ("1", "2"):
        done, ranks = _run(script, str(tmp_path), _env(named, MARK=mark))
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(ranks) == 2 and all("template_server" not in r["above"] for r in ranks), ranks
        assert all("dptrain.launcher.template" in r["template"] for r in ranks), ranks
    assert _server_listening(folder), os.listdir(folder)
    (server,) = [int(open(os.path.join(folder, n)).read()) for n in os.listdir(folder) if n.endswith(".pid")]
    yield SimpleNamespace(named=named, folder=folder, script=script, tmp=tmp_path, server=server)
    shutil.rmtree(named)
    deadline = time.monotonic() + 10
    while _proc.running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _proc.running(server):
        os.kill(server, signal.SIGKILL)
        pytest.fail("the server outlived its folder")


def test_the_third_job_is_served_and_its_ranks_are_what_a_start_of_their_own_makes(warm, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for mark, code in (("3", "0"), ("4", "3")):
        done, ranks = _run(warm.script, str(work), _env(warm.named, MARK=mark, CODE=code), "--flag", mark)
        if code == "3":  # the rank's exit code came back through the served template
            assert done.returncode == 3 and "exited with code 3" in done.stderr, done.stderr[-3000:]
        else:
            assert done.returncode == 0, done.stderr[-3000:]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["sum"] == 2.0 for r in ranks), ranks
        for r in ranks:
            assert "dptrain.launcher.template_server" in r["above"], r  # the template's parent is the server
            assert "dptrain.launcher.template" in r["template"], r  # shown as a template
            assert r["cwd"] == str(work) and r["path0"] == str(warm.tmp) and r["mark"] == mark, r
            assert r["argv"] == [str(warm.script), "--flag", mark], r
    # Another import environment is not that server's.
    other, ranks = _run(warm.script, str(work), _env(warm.named, OMP_NUM_THREADS="2"))
    assert other.returncode == 0 and all("template_server" not in r["above"] for r in ranks), other.stderr[-3000:]
    # A program beside a folder named as a package the server imported: a start of its own looks at
    # that folder first (an empty one, so torch itself is still found), so it gets a template of its own.
    (tmp_path / "beside" / "torch").mkdir(parents=True)
    (tmp_path / "beside" / "job.py").write_text(SCRIPT)
    own, ranks = _run(tmp_path / "beside" / "job.py", str(work), _env(warm.named))
    assert own.returncode == 0 and len(ranks) == 2, own.stderr[-3000:]
    assert all("template_server" not in r["above"] for r in ranks), ranks


def test_a_killed_launcher_stops_its_served_ranks_and_not_the_server(warm):
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", str(warm.script)]
    job = subprocess.Popen(cmd, cwd=str(warm.tmp), env=_env(warm.named, HOLD="1"), stdout=subprocess.PIPE, text=True)
    pids = []
    for line in job.stdout:
        if "] {" in line:
            pids.append(json.loads(line.split("] ", 1)[1]))
            if len(pids) == 2:
                break
    assert all("template_server" in r["above"] for r in pids), pids
    job.kill()
    job.wait(30)
    deadline = time.monotonic() + 20
    while any(_proc.running(r["pid"]) for r in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_proc.running(r["pid"]) for r in pids), "a served rank outlived its killed launcher"
    assert _proc.running(warm.server)  # the server is not the job's: it serves the next one


def test_a_job_inside_a_network_namespace_is_served_with_ranks_inside_it(warm):
    # `ip netns exec NS dptrain run ...`: the template the server forks enters the launcher's network
    # and mount namespaces, so that the ranks rendezvous on the namespace's loopback.
    ns = f"dpt-served-{os.getpid()}"
    _netns_or_skip(ns)
    try:
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2",
               str(warm.script)]
        done = subprocess.run(cmd, cwd=str(warm.tmp), env=_env(warm.named), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if "] {" in line]
        inside = os.stat(f"/run/netns/{ns}").st_ino
        assert len(ranks) == 2 and all(r["net"] == inside for r in ranks), (inside, ranks)
        assert all("dptrain.launcher.template_server" in r["above"] for r in ranks), ranks
    finally:
        _drop_netns(ns)


def _netns_or_skip(name):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2")
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here")
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)


def _drop_netns(name):
    for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_jobs_inside_network_namespaces_start_their_server_outside_them(tmp_path):
    # Every job of a key under `ip netns exec`, none on the host: the second one's launcher starts
    # the server in its parent's namespaces (its own may last one job), and the jobs after it are
    # served, their ranks inside the namespace. The server outlives the namespace.
    ns = f"dpt-outer-{os.getpid()}"
    _netns_or_skip(ns)
    folder, private = _folder(tmp_path)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = _env(folder, MARK="netns-only")
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", str(script)]
    try:
        for _ in range(2):
            done = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
        assert _server_listening(private), os.listdir(private)
        (pid_file,) = [name for name in os.listdir(private) if name.endswith(".pid")]
        with open(os.path.join(private, pid_file)) as fh:
            server = int(fh.read())
        assert os.stat(f"/proc/{server}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino  # not the namespace's
        assert os.stat(f"/proc/{server}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
        done = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if "] {" in line]
        inside = os.stat(f"/run/netns/{ns}").st_ino
        assert len(ranks) == 2 and all(r["net"] == inside for r in ranks), (inside, ranks)
        assert all("dptrain.launcher.template_server" in r["above"] for r in ranks), ranks
        _drop_netns(ns)
        assert _proc.running(server)
    finally:
        _drop_netns(ns)
        stop_template_servers(private)


def test_the_files_of_a_server_that_was_killed_are_cleared_for_the_next_one(tmp_path):
    folder = served.servers_folder(str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, text in (("k.starting", str(dead.pid)), ("k.sock", ""), ("k.seen", "")):
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(text)
    assert served._connect(folder, "k") is None  # nobody listens there any more
    served._note(folder, "k", dict(os.environ))
    assert sorted(os.listdir(folder)) == ["k.seen"]  # the next launcher of the key starts a server
    # A server still starting (its pid alive, no socket yet) is left alone.
    with open(os.path.join(folder, "k.starting"), "w") as fh:
        fh.write(str(os.getpid()))
    served._note(folder, "k", dict(os.environ))
    assert sorted(os.listdir(folder)) == ["k.seen", "k.starting"]
    # A server whose imports loaded the CUDA driver said so: nobody starts another for its key.
    with open(os.path.join(folder, "k.starting"), "w") as fh:
        fh.write(str(dead.pid))
    open(os.path.join(folder, "k.unusable"), "w").close()
    served._note(folder, "k", dict(os.environ))
    assert sorted(os.listdir(folder)) == ["k.seen", "k.starting", "k.unusable"]


def test_a_silent_server_does_not_hold_the_launcher_once_the_template_ended():
    # The server stopped (SIGSTOP) or hung: the launcher's wait for its template's code still ends.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        proc = served.ServedProcess(ours, ended.pid, None)
        began = time.monotonic()
        assert proc.wait(timeout=10) == served.UNKNOWN_CODE
        assert time.monotonic() - began < 5
        # A server that says the code is heard at once.
        ours2, theirs2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs2.send(json.dumps({"code": -9}).encode())
        assert served.ServedProcess(ours2, ended.pid, None).wait(timeout=10) == -9
        theirs2.close()
    finally:
        theirs.close()
