"""dptrain's rendezvous store (dptrain/launcher/store.py) against torch's TCPStore, both ways round.

The launcher hosts the store with its own server and never imports torch; every rank talks
to it with torch's client. These tests pin that protocol: torch's client against our server,
our client against torch's server, and a job whose launcher is checked not to import torch.
"""

from __future__ import annotations

import datetime
import os
import socket
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
    with pytest.raises(ValueError, match="DPTRAIN_STORE='tcp': use 'python'"):
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
