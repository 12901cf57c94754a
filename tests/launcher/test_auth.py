"""Only the job gets in (issue 31, point 12): the secret, the handshake, node 0's gate and the
other nodes' forwarders (dptrain.launcher.auth, dptrain.launcher.tunnel).

The probes are an outsider's: a raw socket speaking TCPStore's protocol, torch's own
``TCPStore`` client, a node with another secret or none, from this process or from another
network namespace. With a secret nothing of theirs reaches the store; a single node is not
reachable from the network at all.
"""

import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from dptrain.runtime import settings as _settings
from dptrain.cli import main
from dptrain.launcher import auth
from dptrain.launcher.job import LaunchConfig
from dptrain.launcher.rendezvous import RendezvousServer, listen_on
from dptrain.launcher.store import StoreClient, StoreError, StoreRefused, StoreServer
from dptrain.launcher.store_client import GET, MAGIC, SET, VALIDATE, _blob
from dptrain.launcher.tunnel import Forwarder, Gate
from tests.launcher.test_multinode import ADDR, ROOT, _sh, two_nodes  # noqa: F401 - the fixture

SECRET = b"0123456789abcdef" * 4
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
OUTSIDER = "10.213.9.2"  # the third namespace, joined to node 0's by a veth of its own


@pytest.fixture
def job():
    """Node 0's side in this process: the store on 127.0.0.1, its gate in front; the log lines."""
    lines = []
    store = StoreServer(listen_on("127.0.0.1", 0))
    gate = Gate(listen_on("127.0.0.1", 0), store.port, SECRET, log=lines.append)
    yield store, gate, lines
    gate.close()
    store.close()


def _until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _raw(port: int, payload: bytes, timeout_s: float = 3.0) -> tuple[bytes, bool]:
    """Send ``payload`` to 127.0.0.1:port; every byte that came back, and whether the gate closed."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
        except socket.timeout:
            return got, False
    return got, True


def _stop_request() -> bytes:
    """TCPStore's handshake, then: stop the job (a well-formed failure report), then read it back."""
    return (struct.pack("<BI", VALIDATE, MAGIC) + bytes([SET]) + _blob(b"/launcher/failed/0")
            + _blob(b"on node 1: rank 1 (local rank 0) exited with code 1 (written from outside the job)")
            + bytes([GET]) + _blob(b"/launcher/failed/0"))


# -- (a) the handshake -----------------------------------------------------------------------------
def test_the_same_secret_passes_both_ways(job):
    store, gate, lines = job
    client = StoreClient("127.0.0.1", gate.port, timeout=5, secret=SECRET)
    client.set("launcher/x", "1")
    assert client.get("launcher/x") == b"1" and store.data[b"/launcher/x"] == b"1"
    client.close()
    assert lines == []
    # The two sides as generators: each one's bytes are what the other needs.
    server, mine = auth.server(SECRET), auth.client(SECRET)
    to_client, need = server.send(None)
    send, want = mine.send(None)
    assert (send, want, need) == (b"", auth.HEAD, auth.HEAD)
    send, want = mine.send(to_client[:auth.HEAD])
    answer, want = mine.send(to_client[auth.HEAD:])
    assert server.send(answer[:auth.HEAD]) == (b"", auth.NONCE + auth.PROOF)
    proof, _ = server.send(answer[auth.HEAD:])
    with pytest.raises(StopIteration):
        mine.send(proof)


def test_another_secret_reads_and_writes_nothing_and_a_fake_node_0_is_refused(job):
    store, gate, lines = job
    store.data[b"/launcher/x"] = b"1"
    with pytest.raises(StoreRefused, match=r"did not let this node in: .*Give every node the same secret"):
        StoreClient("127.0.0.1", gate.port, timeout=5, secret=b"another secret, sixteen or more")
    _until(lambda: lines)
    assert "refused a connection from 127.0.0.1:" in lines[0] and "does not know the job's secret" in lines[0]
    assert list(store.data) == [b"/launcher/x"]
    # A node without a secret is told what it lacks, instead of reading the challenge as answers.
    with pytest.raises(StoreRefused, match="asks for the job's secret, and this node has none"):
        StoreClient("127.0.0.1", gate.port, timeout=5)
    # Mutual: a listener that does not know the secret cannot pass for node 0.
    mine = auth.client(SECRET)
    mine.send(None)
    mine.send(auth.MAGIC + bytes([auth.VERSION]))
    mine.send(os.urandom(auth.NONCE))
    with pytest.raises(auth.AuthError, match="the rendezvous does not know the job's secret"):
        mine.send(os.urandom(auth.PROOF))


def test_a_raw_socket_without_the_handshake_gets_the_challenge_only(job):
    store, gate, lines = job
    got, closed = _raw(gate.port, _stop_request())
    assert closed and len(got) == auth.HEAD + auth.NONCE and got.startswith(auth.MAGIC)
    assert store.data == {}
    _until(lambda: lines)
    assert "does not speak dptrain's authentication" in lines[0]
    # A port probe (connect, then close) is not worth a line.
    socket.create_connection(("127.0.0.1", gate.port)).close()
    time.sleep(0.1)
    assert len(lines) == 1


def test_a_replayed_answer_is_refused(job):
    store, gate, _ = job
    with socket.create_connection(("127.0.0.1", gate.port), timeout=3) as sock:  # the job's own node
        challenge = sock.recv(auth.HEAD + auth.NONCE, socket.MSG_WAITALL)
        mine = auth.client(SECRET)
        mine.send(None)
        mine.send(challenge[:auth.HEAD])
        answer, _ = mine.send(challenge[auth.HEAD:])
        sock.sendall(answer)  # recorded on the wire by an onlooker
        assert len(sock.recv(auth.PROOF, socket.MSG_WAITALL)) == auth.PROOF
    with socket.create_connection(("127.0.0.1", gate.port), timeout=3) as sock:  # the onlooker
        fresh = sock.recv(auth.HEAD + auth.NONCE, socket.MSG_WAITALL)
        assert fresh[auth.HEAD:] != challenge[auth.HEAD:]
        sock.sendall(answer + _stop_request())
        got = b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
        assert got in (auth.REFUSED, b"")  # the refusal, then the end (a reset may take the refusal with it)
    assert store.data == {}


def test_torchs_client_straight_to_the_gate_gets_nothing(job):
    store, gate, _ = job
    store.data[b"/launcher/x"] = b"1"
    with pytest.raises(Exception):  # noqa: B017 - torch says it its own way (a failed ping)
        dist.TCPStore("127.0.0.1", gate.port, None, False, timeout=datetime.timedelta(seconds=1)).get("launcher/x")
    assert list(store.data) == [b"/launcher/x"]


def test_torchs_client_through_a_forwarder_works_unchanged(job):
    store, gate, _ = job
    forwarder = Forwarder("127.0.0.1", gate.port, SECRET)
    try:
        ours = StoreClient("127.0.0.1", gate.port, timeout=5, secret=SECRET)
        theirs = dist.TCPStore("127.0.0.1", forwarder.port, None, False, timeout=datetime.timedelta(seconds=5))
        theirs.set("k", "v")
        assert ours.get("k") == b"v" and theirs.add("n", 2) == 2 and ours.add("n", 1) == 3
        ours.set("later", "x")
        theirs.wait(["later"])
        assert theirs.get("later") == b"x" and theirs.check(["k", "n"])
        big = os.urandom(6 << 20)  # more than the bytes a pipe holds before it stops reading
        theirs.set("big", big)
        assert ours.get("big") == big
        ours.close()
    finally:
        forwarder.close()


def test_the_gate_works_in_front_of_torchs_own_server_too(monkeypatch):
    # DPTRAIN_STORE=torch (or a torch newer than dptrain's server was tested with): the gate does not care.
    monkeypatch.setenv("DPTRAIN_STORE", "torch")
    server = RendezvousServer("127.0.0.1", 0, 2, timeout_s=10)
    server.serve()
    gate = Gate(listen_on("127.0.0.1", 0), server.port, SECRET)
    try:
        client = StoreClient("127.0.0.1", gate.port, timeout=5, secret=SECRET)
        client.set("k", "v")
        assert server.store.get("k") == b"v"
        client.close()
    finally:
        gate.close()
        server.close()


def test_the_secret_from_a_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "job.secret"
    path.write_text(SECRET.decode() + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"can be read or written by other users \(mode 0644\).*chmod 600"):
        auth.load_secret(str(path), {})
    path.chmod(0o600)
    assert auth.load_secret(str(path), {}) == SECRET
    assert auth.load_secret(None, {"DPTRAIN_SECRET_FILE": str(path)}) == SECRET
    assert auth.load_secret(None, {"DPTRAIN_SECRET": " " + SECRET.decode()}) == SECRET
    assert auth.load_secret(None, {}) is None
    path.write_text("short")
    with pytest.raises(ValueError, match="holds 5 characters; a secret needs at least 16"):
        auth.load_secret(str(path), {})
    with pytest.raises(ValueError, match=r"--secret-file .*missing: cannot read it"):
        auth.load_secret(str(tmp_path / "missing"), {})
    # Never shown: not in the config's repr, not in a rank's environment, not by `dptrain env`.
    config = LaunchConfig(program=os.path.join(SCRIPTS, "dump_env.py"), secret=SECRET)
    assert SECRET.decode() not in repr(config)
    from dptrain.envreport import _variables
    from dptrain.launcher.job import base_environ

    monkeypatch.setenv("DPTRAIN_SECRET", SECRET.decode())
    assert _variables()["DPTRAIN_SECRET"] == f"({len(SECRET)} characters, not shown)"
    assert not [n for n in base_environ(config, "127.0.0.1", print) if n.startswith("DPTRAIN_SECRET")]
    assert _settings.LAUNCHER_ONLY == ("DPTRAIN_SECRET_FILE", "DPTRAIN_SECRET")


def _dptrain_run(*args: str, env: dict) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "dptrain", "run", *args], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=dict(os.environ, **env))
    except subprocess.TimeoutExpired:
        pytest.fail(f"dptrain run {' '.join(args)} {env} still waits after 60 s")


def test_a_secret_file_that_is_a_fifo_a_directory_or_a_link_to_one_is_refused_at_once(tmp_path):
    # Issue 46, point 5: a FIFO was opened blocking before its type was checked, and dptrain run
    # waited for a writer for good.
    fifo = tmp_path / "job.secret"
    os.mkfifo(fifo, 0o600)
    link = tmp_path / "link.secret"
    link.symlink_to(fifo)
    folder = tmp_path / "secrets"
    folder.mkdir(mode=0o700)
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    given = "give the file that holds the job's secret, e.g. one made with (umask 077;"
    setting = "unset it (default: none) or set e.g. DPTRAIN_SECRET_FILE=~/.dptrain/job.secret"
    fifo_says = "is a FIFO (named pipe), not a regular file"
    link_says = "is a symbolic link to a FIFO (named pipe), not a regular file"
    for flags, env, says in (
            ([f"--secret-file={fifo}"], {}, f"--secret-file {fifo} {fifo_says}; {given}"),
            ([f"--secret-file={link}"], {}, f"--secret-file {link} {link_says}; {given}"),
            ([f"--secret-file={folder}"], {}, f"--secret-file {folder} is a directory, not a regular file; {given}"),
            ([], {"DPTRAIN_SECRET_FILE": str(fifo)}, f"DPTRAIN_SECRET_FILE={str(fifo)!r} {fifo_says}; {setting}"),
            ([], {"DPTRAIN_SECRET_FILE": str(link)}, f"DPTRAIN_SECRET_FILE={str(link)!r} {link_says}; {setting}")):
        done = _dptrain_run(*flags, str(script), env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (flags, env, done.stderr)
        assert lines[0].startswith(f"dptrain run: error: {says}"), (flags, env, lines)
    assert not (tmp_path / "ran").exists()


def test_a_secret_file_reached_through_a_link_is_read(tmp_path):
    # As a Kubernetes secret volume mounts it: a link (to a link) to the regular file.
    real = tmp_path / "..data" / "job.secret"
    real.parent.mkdir()
    real.write_text(SECRET.decode() + "\n")
    real.chmod(0o600)
    (tmp_path / "job.secret").symlink_to(real)
    assert auth.load_secret(str(tmp_path / "job.secret"), {}) == SECRET


def test_a_node_with_another_secret_or_none_stops_before_its_ranks_start(job, tmp_path):
    _, gate, _ = job
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("another secret, sixteen or more")
    wrong.chmod(0o600)
    script = tmp_path / "ran.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    for extra, says in (([f"--secret-file={wrong}"], "did not let this node in"),
                        ([], "asks for the job's secret, and this node has none")):
        out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(gate.port), "--timeout", "10",
                              *extra, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and f"dptrain run: error: node 1: the rendezvous at 127.0.0.1:{gate.port} " \
                                       f"{says}" in out.stderr, out.stderr
        assert not (tmp_path / "ran").exists()


# -- (b), (c): other network namespaces ------------------------------------------------------------
@pytest.fixture
def outsider(two_nodes):  # noqa: F811 - the fixture of test_multinode
    """A third namespace, joined to node 0's by a veth pair of its own, with a route to the nodes' network."""
    name, tag = f"dptc{two_nodes[0][4:]}", two_nodes[0][4:]
    veth = (f"vc{tag}", f"vd{tag}")
    try:
        for cmd in (("ip", "netns", "add", name),
                    ("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
                    ("ip", "link", "set", veth[0], "netns", two_nodes[0]),
                    ("ip", "link", "set", veth[1], "netns", name),
                    ("ip", "-n", two_nodes[0], "addr", "add", "10.213.9.1/24", "dev", veth[0]),
                    ("ip", "-n", name, "addr", "add", f"{OUTSIDER}/24", "dev", veth[1]),
                    ("ip", "-n", two_nodes[0], "link", "set", veth[0], "up"),
                    ("ip", "-n", name, "link", "set", veth[1], "up"),
                    ("ip", "-n", name, "link", "set", "lo", "up"),
                    ("ip", "-n", name, "route", "add", "10.213.7.0/24", "via", "10.213.9.1")):
            out = _sh(*cmd)
            assert out.returncode == 0, (cmd, out.stderr)
        yield (*two_nodes, name)
    finally:
        _sh("ip", "netns", "del", name)


def _probe(ns: str, port: int) -> dict:
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, os.path.join(SCRIPTS, "store_probe.py"),
                          ADDR[0], str(port)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wait_for_files(paths, procs, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            outs = [p.communicate(timeout=30) for p in procs]
            pytest.fail(f"the job did not get ready: {outs}")
        time.sleep(0.05)


def test_with_a_secret_an_outsider_cannot_read_stop_or_join_the_job(outsider, tmp_path):
    node0, node1, stranger = outsider
    port = 29621
    secret = tmp_path / "job.secret"
    secret.write_text(SECRET.decode())
    secret.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # found from the route to node 0
    env["AUTH_DIR"] = str(tmp_path)
    # torchrun's way (the same command on both nodes, numbered as they arrive): the arrival passes the gate too.
    cmd = [sys.executable, "-m", "dptrain", "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{ADDR[0]}:{port}", "--timeout", "30", os.path.join(SCRIPTS, "auth_job.py")]
    nodes = []
    for ns, given in ((node1, {"DPTRAIN_SECRET_FILE": str(secret)}), (node0, {})):
        extra = [] if given else [f"--secret-file={secret}"]
        nodes.append(subprocess.Popen(["ip", "netns", "exec", ns] + cmd[:-1] + extra + cmd[-1:],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env=dict(env, **given)))
    nodes.reverse()
    try:
        _wait_for_files([tmp_path / "joined0", tmp_path / "joined1"], nodes)
        seen = _probe(stranger, port)
        open(tmp_path / "go", "w").close()
        outs = [p.communicate(timeout=90) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    print(json.dumps(seen), *(err for _, err in outs), sep="\n")
    answer = bytes.fromhex(seen["raw_answer"])
    # torch's client read nothing; the raw socket got the challenge, no answer, and was closed.
    assert "torch_read" not in seen and seen["raw_closed"], seen
    assert len(answer) == auth.HEAD + auth.NONCE and answer.startswith(auth.MAGIC), seen
    # The job was neither stopped nor joined: both ranks all-reduce again, and both launchers end well.
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
        assert "a rank of another node failed" not in err and "without a secret" not in err
    assert "[rank0] rank 0 finished, sum 4" in outs[0][0] and "[rank1] rank 1 finished, sum 4" in outs[1][0]
    assert "[rank1] rank 1 joined at 127.0.0.1, secret in its environment: False" in outs[1][0]
    assert "[rank0] rank 0 joined at 127.0.0.1, secret in its environment: False" in outs[0][0]
    assert f"dptrain run: refused a connection from {OUTSIDER}:" in outs[0][1]


def test_a_single_node_is_not_reachable_from_the_network(two_nodes, tmp_path):  # noqa: F811
    # Even with --master-addr set to the node's network address: nothing else needs the store.
    script = tmp_path / "wait.py"
    script.write_text("import os, time\n"
                      f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
                      f"while not os.path.exists({str(tmp_path / 'go')!r}): time.sleep(0.05)\n")
    port = 29623
    node = subprocess.Popen(["ip", "netns", "exec", two_nodes[0], sys.executable, "-m", "dptrain", "run",
                             "--nproc-per-node", "1", "--master-addr", ADDR[0], "--master-port", str(port),
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for_files([tmp_path / "ready"], [node], timeout_s=30)
        listening = _sh("ip", "netns", "exec", two_nodes[0], "cat", "/proc/net/tcp").stdout
        reach = subprocess.run(["ip", "netns", "exec", two_nodes[1], sys.executable, "-c",
                                f"import socket; socket.create_connection(({ADDR[0]!r}, {port}), timeout=3)"],
                               capture_output=True, text=True, timeout=30)
    finally:
        open(tmp_path / "go", "w").close()
        out, err = node.communicate(timeout=30)
    assert node.returncode == 0, err
    assert "ConnectionRefusedError" in reach.stderr, reach
    addresses = {line.split()[1].split(":")[0] for line in listening.splitlines()[1:] if line.split()[3] == "0A"}
    assert addresses == {"0100007F"}, listening  # 127.0.0.1 only


# -- (e) Slurm -------------------------------------------------------------------------------------
def test_slurm_script_gives_every_node_a_fresh_secret_only_the_user_can_read(tmp_path, capsys):
    assert main(["slurm-script", "--nodes", "2", "--per-node", "train.py"]) == 0
    text = capsys.readouterr().out
    assert "umask 077" in text and "DPTRAIN_SECRET_FILE" in text
    # Run it, with an srun that says what each node's launcher would find.
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\nstat -c "%a %U" "$DPTRAIN_SECRET_FILE" > seen\n'
                    'tr -d "\\n" < "$DPTRAIN_SECRET_FILE" | wc -c >> seen\necho "$*" >> seen\n')
    stub.chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    env = dict(os.environ, PATH=f"{stub.parent}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[01-02]")
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    mode, size, srun = (tmp_path / "seen").read_text().splitlines()
    assert mode.split()[0] == "600" and int(size) == 64, (mode, size)
    assert "-m dptrain run --nnodes 2" in srun and "train.py" in srun
    assert not list(tmp_path.glob(".dptrain*")), "the secret outlives the job"
    # One task per rank (no launcher inside the job): said in the file.
    assert main(["slurm-script", "--nodes", "2", "--per-task", "train.py"]) == 0
    assert "anything on the cluster's network can" in capsys.readouterr().out
