"""dptrain's rendezvous store (dptrain/launcher/store.py) against torch's TCPStore, both ways round.

The launcher hosts the store with its own server and never imports torch; every rank talks
to it with torch's client. These tests pin that protocol: torch's client against our server,
our client against torch's server, and a job whose launcher is checked not to import torch.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dptrain.launcher import store as _store
from dptrain.launcher.store import StoreClient, StoreServer, StoreTimeout, use_python_store
from tests.launcher.test_launch import SCRIPTS, dptrain_run

TD = datetime.timedelta(seconds=5)


@pytest.fixture
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    srv = StoreServer(sock)
    yield srv
    srv.close()


def _torch_client(port: int, timeout=TD) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)


def test_torchs_client_gets_torchs_answers_from_our_server(server):
    c = _torch_client(server.port)
    c.set("a", "1")
    assert c.get("a") == b"1"
    assert (c.add("n", 3), c.add("n", 4), c.add("n", 0)) == (3, 7, 7)
    assert c.get("n") == b"7"  # add keeps decimal text, as torch's server
    assert c.check(["a", "n"]) and not c.check(["a", "absent"])
    assert c.compare_set("cs", "", "x") == b"x"  # a missing key with an empty expectation is created
    assert c.compare_set("cs", "x", "y") == b"y"
    assert c.compare_set("cs", "wrong", "z") == b"y"  # a mismatch leaves the value and returns it
    assert c.compare_set("absent", "q", "z") == b"q" and not c.check(["absent"])
    c.append("ap", "x")
    c.append("ap", "y")
    assert c.get("ap") == b"xy"
    c.multi_set(["m1", "m2"], ["v1", "v2"])
    assert c.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert c.num_keys() == 6
    assert c.delete_key("a") and not c.delete_key("a")
    assert c.num_keys() == 5
    if hasattr(c, "queue_push"):  # torch 2.4's client has no queues
        c.queue_push("q", "e1")
        c.queue_push("q", "e2")
        assert (c.queue_pop("q"), c.queue_pop("q")) == (b"e1", b"e2")
    c.set("bytes", bytes(range(256)) * 300)  # binary values, larger than one read
    assert c.get("bytes") == bytes(range(256)) * 300


def test_a_timed_out_wait_is_withdrawn_and_the_connection_stays_usable(server):
    c = _torch_client(server.port)
    with pytest.raises(dist.DistStoreError):
        c.wait(["never"], datetime.timedelta(seconds=0.3))
    c.set("later", "still answered")  # the cancelled wait left nothing behind on this connection
    assert c.get("later") == b"still answered"
    with pytest.raises(dist.DistStoreError):  # get waits for the key, up to the client's timeout
        _torch_client(server.port, datetime.timedelta(seconds=1)).get("missing")


def _until(condition, timeout=30.0):
    """Wait for ``condition()`` to hold (polling); the timeout only ends a test that would hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def _awaited(server, key):
    """How many keys each connection that waits for ``key`` still misses (the server answers at 0)."""
    return [conn.awaited for conn in server.waiting.get(b"/" + key, [])]  # clients put "/" before keys


def test_a_waiter_wakes_only_once_another_client_set_all_its_keys(server):
    c = _torch_client(server.port)
    ours = StoreClient("127.0.0.1", server.port)
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (c.wait(["k1", "k2"]), woke.set()))
    waiter.start()
    _until(lambda: _awaited(server, b"k2") == [2])  # the server holds the wait, for both keys
    ours.set("k1", "one")
    assert ours.get("k1") == b"one"  # a round trip: the set was handled, with any answer it caused
    assert _awaited(server, b"k2") == [1] and not woke.is_set()  # not answered: k2 is still missing
    ours.add("k2", 5)
    waiter.join(30)
    assert woke.is_set() and _awaited(server, b"k2") == []
    assert c.get("k1") == b"one" and c.get("k2") == b"5"


def test_our_client_and_torchs_see_the_same_keys(server):
    torch_c, ours = _torch_client(server.port), StoreClient("127.0.0.1", server.port, timeout=2)
    torch_c.set("from_torch", "t")
    ours.set("from_us", "u")
    assert ours.get("from_torch") == b"t" and torch_c.get("from_us") == b"u"
    assert ours.add("count", 2) == 2 and torch_c.add("count", 1) == 3
    assert ours.check(["from_torch", "count"]) and not ours.check(["nothing"])
    assert ours.compare_set("c", "", "v") == b"v"
    assert ours.delete_key("c") and ours.num_keys() == 3
    with pytest.raises(StoreTimeout, match="did not appear within 0.2s"):
        ours.wait(["nothing"], 0.2)
    assert ours.get("from_us") == b"u"  # still in step after the cancelled wait


def test_our_client_speaks_to_torchs_server():
    """Nodes other than 0 use our client; node 0 may host torch's server (DPTRAIN_STORE=torch)."""
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TD, wait_for_workers=False)
    ours = StoreClient("127.0.0.1", master.port, timeout=2)
    ours.set("k", "v")
    assert master.get("k") == b"v" and ours.get("k") == b"v"
    assert ours.add("n", 2) == 2 and master.add("n", 1) == 3
    assert ours.check(["k"]) and not ours.check(["x"])
    assert ours.compare_set("k", "v", "w") == b"w"
    with pytest.raises(StoreTimeout):
        ours.wait(["x"], 0.2)
    master.set("x", "1")
    ours.wait(["x"], 1)
    assert ours.delete_key("x")
    ours.close()


def test_a_connection_without_the_handshake_is_dropped_and_the_server_goes_on(server, capfd):
    with socket.create_connection(("127.0.0.1", server.port)) as bad:
        bad.sendall(b"GET / HTTP/1.0\r\n\r\n")
        bad.settimeout(5)
        assert bad.recv(10) == b""  # closed by the server
    assert "did not start with TCPStore's handshake" in capfd.readouterr().err
    c = _torch_client(server.port)
    c.set("ok", "1")
    assert c.get("ok") == b"1"


def test_an_unknown_request_names_the_torch_version_fix(server, capfd):
    ours = StoreClient("127.0.0.1", server.port, timeout=1)
    ours._send(bytes([200]))
    with pytest.raises(_store.StoreError):
        ours._recv(1)
    err = capfd.readouterr().err
    assert "request code 200" in err and "DPTRAIN_STORE=torch" in err


def test_a_client_that_leaves_mid_wait_does_not_disturb_the_others(server):
    leaver = StoreClient("127.0.0.1", server.port)
    leaver._send(bytes([_store.WAIT]) + leaver._keys(["k"]))
    _until(lambda: _awaited(server, b"k") == [1])
    leaver.close()
    _until(lambda: _awaited(server, b"k") in ([], [0]))  # the server saw it leave
    c = _torch_client(server.port)
    c.set("k", "v")
    assert c.get("k") == b"v"


def test_closing_the_server_ends_its_clients_with_an_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    srv = StoreServer(sock)
    ours = StoreClient("127.0.0.1", srv.port, timeout=5)
    ours.set("a", "1")
    srv.close()
    srv.close()  # idempotent
    with pytest.raises(_store.StoreError):
        ours.get("a")


def test_a_client_with_no_server_says_where_it_looked():
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    with pytest.raises(_store.StoreError, match=f"no rendezvous store answered at 127.0.0.1:{free}"):
        StoreClient("127.0.0.1", free, connect_timeout=0.3)


def test_which_server_hosts_the_store(monkeypatch):
    monkeypatch.delenv("DPTRAIN_STORE", raising=False)
    monkeypatch.setattr(_store, "_torch_version", lambda: _store.TESTED_TORCH)
    assert use_python_store()
    monkeypatch.setattr(_store, "_torch_version", lambda: (_store.TESTED_TORCH[0], _store.TESTED_TORCH[1] + 1))
    assert not use_python_store()  # a newer torch: torch's own server, which surely speaks its protocol
    monkeypatch.setenv("DPTRAIN_STORE", "python")
    assert use_python_store()
    monkeypatch.setenv("DPTRAIN_STORE", "torch")
    assert not use_python_store()
    monkeypatch.setenv("DPTRAIN_STORE", "tcp")
    with pytest.raises(ValueError, match="DPTRAIN_STORE='tcp' is not one of python, torch"):
        use_python_store()


def test_the_installed_torch_version_is_read_without_importing_it():
    code = "import sys; from dptrain.launcher import store as _store; v = _store._torch_version(); print(v, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    import torch

    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert out.stdout.split() == [f"({major},", f"{minor})", "False"], out.stderr


@pytest.mark.parametrize("which", ["python", "torch"])
def test_a_job_runs_with_either_server_and_only_torchs_makes_the_launcher_import_torch(which):
    # -X importtime lists every module the launcher process imports (the ranks run without it).
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dptrain", "run", "--nproc-per-node", "2",
         os.path.join(SCRIPTS, "train_toy.py")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, DPTRAIN_STORE=which),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    launcher_imports = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                        if line.startswith("import time:")}
    assert ("torch" in launcher_imports) == (which == "torch")
    assert "dptrain.launcher.store" in launcher_imports


def _listen_backlog(port: int) -> int:
    """Connections waiting in the accept queue of the socket listening on ``port`` (Linux)."""
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                return int(fields[4].split(":")[1], 16)  # rx_queue: the accept backlog
    return -1


def test_a_rank_connecting_before_the_store_serves_is_answered_once_it_does():
    """The launcher binds and listens first and may start serving later; early clients wait in the backlog."""
    from dptrain.launcher.rendezvous import RendezvousServer

    server = RendezvousServer("127.0.0.1", 0, 2, timeout_s=10)
    try:
        answers = []
        t = threading.Thread(target=lambda: answers.append(_torch_client(server.port).add("x", 1)))
        t.start()
        _until(lambda: _listen_backlog(server.port) == 1)  # the client is connected, in the backlog
        assert answers == []
        server.serve()
        t.join(10)
        assert answers == [1]
    finally:
        server.close()


def test_dptrain_run_with_a_bad_store_choice_says_so():
    out = dptrain_run("--nproc-per-node", "1", os.path.join(SCRIPTS, "train_toy.py"), env={"DPTRAIN_STORE": "redis"})
    assert out.returncode != 0
    assert "DPTRAIN_STORE='redis'" in out.stderr


# -- what the store refuses (issue 31, points 9-11; see [Note: what the store refuses]) -------------
def _blob(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


HANDSHAKE = struct.pack("<BI", _store.VALIDATE, _store.MAGIC)


def _raw_add(port: int, key: bytes, amount: int, timeout: float) -> int | None:
    """An ``add`` over a raw socket: the store's answer, or None if none came within ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(HANDSHAKE + bytes([_store.ADD]) + _blob(b"/" + key) + struct.pack("<q", amount))
        answer = b""
        try:
            while len(answer) < 8:
                chunk = s.recv(8 - len(answer))
                if not chunk:
                    return None
                answer += chunk
        except socket.timeout:
            return None
        return struct.unpack("<q", answer)[0]


def _cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (Linux)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# A store in a process of its own with RLIMIT_NOFILE (soft, hard); "hog" then opens files until
# none is left, and a line on its stdin closes them.
_LIMITED_SERVER = """
import os, resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
from dptrain.launcher.store import StoreServer
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
server = StoreServer(sock)
hog = []
while sys.argv[3] == "hog":
    try:
        hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
print(server.port, resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
sys.stdin.readline()
for fd in hog:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
"""


def _limited_server(soft: int, hard: int, hog: bool) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", _LIMITED_SERVER, str(soft), str(hard), "hog" if hog else "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port, limit = (int(x) for x in proc.stdout.readline().split())
    return proc, port, limit


def test_the_store_raises_its_open_files_limit_and_serves_more_connections_than_the_soft_one():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard limit on open files is {hard}")
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    proc, port, limit = _limited_server(64, hard, hog=False)  # 1,024 of 1,100 in the audit, scaled down
    idle = []
    try:
        assert limit == hard
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        assert _raw_add(port, b"n", 1, timeout=10) == 1  # one more client, answered
    finally:
        for s in idle:
            s.close()
        proc.kill()
        proc.wait()


def test_a_store_out_of_descriptors_waits_without_spinning_and_serves_once_some_are_free():
    proc, port, _ = _limited_server(64, 64, hog=True)
    waiting = []
    try:
        waiting = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]  # it cannot accept these
        time.sleep(0.2)
        before = _cpu_s(proc.pid)
        time.sleep(1.0)
        assert _cpu_s(proc.pid) - before < 0.2  # it spun at a full core before: woken at once, forever
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "freed"
        assert _raw_add(port, b"n", 2, timeout=10) == 2
    finally:
        for s in waiting:
            s.close()
        proc.kill()
        proc.wait()


def test_a_store_at_its_connection_cap_lets_new_ones_wait_until_one_closes():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    srv = StoreServer(sock, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
    try:
        clock = time.pthread_getcpuclockid(srv._thread.ident)
        before = time.clock_gettime(clock)
        assert _raw_add(srv.port, b"early", 1, timeout=0.5) is None  # a fifth waits in the listen backlog
        assert time.clock_gettime(clock) - before < 0.1  # ... while the store sleeps
        idle.pop().close()
        assert _raw_add(srv.port, b"n", 1, timeout=10) == 1
    finally:
        for s in idle:
            s.close()
        srv.close()


def _listen_queue_limit(port: int) -> int | None:
    """The backlog of the socket listening on ``port``, as ``ss`` shows it (Send-Q); None without ``ss``."""
    try:
        out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out.split()[2]) if out.split() else None


def test_the_store_listens_with_the_largest_backlog_the_host_allows():
    from dptrain.launcher.rendezvous import RendezvousServer

    with open("/proc/sys/net/core/somaxconn") as fh:
        somaxconn = int(fh.read())
    server = RendezvousServer("127.0.0.1", 0, 2, timeout_s=10)
    try:
        server.serve()
        found = _listen_queue_limit(server.port)
        if found is None:
            pytest.skip("no `ss` to read the listen backlog with")
        assert found >= min(somaxconn, 4096)  # 512 before: overflowed by 1,024 ranks connecting at once
    finally:
        server.close()


def _store_thread_cpu_s(srv: StoreServer) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(srv._thread.ident))


def _trickle_multi_get(srv: StoreServer, num_keys: int) -> float:
    """CPU seconds of the store's thread for one MULTI_GET of ``num_keys`` keys sent 256 bytes at a time."""
    request = HANDSHAKE + bytes([_store.MULTI_GET]) + struct.pack("<Q", num_keys)
    request += b"".join(_blob(b"/k%07d" % i) for i in range(num_keys))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before = _store_thread_cpu_s(srv)
        for i in range(0, len(request), 256):
            s.sendall(request[i:i + 256])
            time.sleep(0.0002)  # as a slow client: the store reads each piece on its own
        answer = 0
        while answer < 8 * num_keys:  # one empty value per key
            answer += len(s.recv(1 << 20))
        return _store_thread_cpu_s(srv) - before


def test_a_request_trickled_in_is_parsed_as_it_arrives_not_again_from_its_start(server):
    # Parsed from its start on every read, 4x the keys took 16x the work (a ping waited 916 ms
    # behind one such request). Parsed as it arrives, the work grows as the request does.
    small, large = _trickle_multi_get(server, 3000), _trickle_multi_get(server, 12000)
    assert large < 8 * small + 0.02, (small, large)


def test_what_one_job_keeps_in_the_store_is_capped(capfd):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    srv = StoreServer(sock, max_bytes=1 << 20)
    try:
        writer = StoreClient("127.0.0.1", srv.port, timeout=5)
        for i in range(3):
            writer.set(f"v{i}", b"x" * 300_000)
        writer.set("v3", b"x" * 300_000)  # 1.2 MB of 1 MiB: refused, and its connection closed
        with pytest.raises(_store.StoreError):
            writer.get("v0")
        err = capfd.readouterr().err
        assert err.count("refused a request") == 1 and "DPTRAIN_STORE_MAX_MB=1" in err, err
        reader = StoreClient("127.0.0.1", srv.port, timeout=5)
        assert reader.get("v2") == b"x" * 300_000 and not reader.check(["v3"])
        reader.set("v0", b"y" * 300_000)  # replacing a value takes no more room
        assert reader.get("v0") == b"y" * 300_000 and srv.stored <= 1 << 20
        # A value is refused when its length arrives, before its bytes are buffered.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(HANDSHAKE + bytes([_store.SET]) + _blob(b"/big") + struct.pack("<Q", 8 << 20))
            assert s.recv(1) == b""
    finally:
        srv.close()


def test_the_default_cap_comes_from_dptrain_store_max_mb(monkeypatch):
    monkeypatch.setenv("DPTRAIN_STORE_MAX_MB", "64")
    assert _store.default_max_bytes() == 64 << 20
    monkeypatch.setenv("DPTRAIN_STORE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="DPTRAIN_STORE_MAX_MB='lots' is not a number of MiB"):
        _store.default_max_bytes()
    monkeypatch.delenv("DPTRAIN_STORE_MAX_MB")
    assert _store.default_max_bytes() == _store.DEFAULT_MAX_MB << 20


def test_a_counter_pushed_past_int64_or_set_to_text_keeps_working(server, capfd):
    top = 2**63 - 1
    first = _torch_client(server.port)
    assert first.add("n", top - 1) == top - 1
    with pytest.raises(RuntimeError):  # refused: the connection that asked is closed, the counter unchanged
        first.add("n", 5)
    assert _torch_client(server.port).add("n", 1) == top  # every later add works
    _torch_client(server.port).set("n", "abc")  # refused too: add could no longer read it
    assert _torch_client(server.port).add("n", -top) == 0
    err = capfd.readouterr().err
    assert "past the int64 limits" in err and err.count("refused a request") == 1, err  # said once per kind
    other = _torch_client(server.port)
    other.set("text", "abc")  # not a counter yet: add counts it from 0, and says so
    assert other.add("text", 2) == 2 and other.get("text") == b"2"
    assert "held b'abc', not a number; `add` counted it from 0" in capfd.readouterr().err


def test_a_free_port_is_one_the_kernel_does_not_hand_out_to_connections():
    # A port from bind(0) is an ephemeral one: any process's next outgoing connection may take it
    # before the store binds it, and the job's ranks then wait for a store that never came.
    import random
    import socket

    from dptrain.launcher.rendezvous import FREE_PORTS, free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        first_ephemeral = int(fh.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) >= 18  # drawn from thousands
    random.seed(0)  # a seeded generator does not decide it: two processes seeded alike draw different ports
    first = [free_port() for _ in range(4)]
    random.seed(0)
    assert [free_port() for _ in range(4)] != first
    for port in ports:
        assert FREE_PORTS[0] <= port < min(FREE_PORTS[1], first_ephemeral), port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed
