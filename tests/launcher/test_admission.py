"""Who gets in before a byte of the job is served (issue 46, points 1 and 6): pre-authentication
slots bounded per address and in all, the oldest evicted (dptrain.launcher._admission.Pending,
tunnel.Gate), a node that tells a closed handshake from a wrong secret and tries again
(StoreClient, Forwarder), and loopback connections of another user refused by the store, the
gate and the forwarder.

A second local user is played by a forked child that drops to uid 65534 (needs root); a flood
comes from a third network namespace (tests/launcher/test_auth.py's ``outsider``).
"""

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from dptrain.launcher import _admission, auth
from dptrain.launcher._admission import Pending, address_key, is_loopback, peer_uids
from dptrain.launcher.rendezvous import free_port, listen_on
from dptrain.launcher.store import StoreClient, StoreRefused, StoreServer
from dptrain.launcher.store_client import GET, MAGIC, SET, VALIDATE, _blob
from dptrain.launcher.tunnel import Forwarder, Gate
from tests.launcher.test_auth import OUTSIDER, SECRET, SCRIPTS, outsider  # noqa: F401 - the fixture
from tests.launcher.test_multinode import ADDR, ROOT, two_nodes  # noqa: F401 - the fixture

OTHER_UID = 65534  # "nobody": a second local user


# -- the slots ------------------------------------------------------------------------------------
def test_a_full_address_gives_up_its_own_oldest_and_a_full_gate_the_oldest_of_all():
    pending = Pending(max_total=4, max_per_address=2, first_byte_s=2.0, deadline_s=10.0)
    assert pending.add("a1", "10.0.0.1", 0.0) == [] and pending.add("a2", "10.0.0.1", 0.1) == []
    assert pending.add("b1", "10.0.0.2", 0.2) == []
    # The flooding address's third evicts its own oldest, never the other address's.
    assert pending.add("a3", "10.0.0.1", 0.3) == ["a1"]
    assert pending.count("10.0.0.1") == 2 and "b1" in pending and len(pending) == 3
    assert pending.add("c1", "10.0.0.3", 0.4) == []
    # All four taken, by addresses under their own bound: the oldest of all goes (b1, then a2).
    assert pending.add("d1", "10.0.0.4", 0.5) == ["a2"]
    assert pending.add("e1", "10.0.0.5", 0.6) == ["b1"]
    assert list(pending._all) == ["a3", "c1", "d1", "e1"]
    pending.discard("c1")
    assert pending.add("f1", "10.0.0.6", 0.7) == [] and len(pending) == 4
    with pytest.raises(ValueError, match="room for at least one connection"):
        Pending(max_total=0)


def test_a_silent_connection_expires_after_the_first_bytes_deadline_a_talking_one_after_the_handshakes():
    pending = Pending(max_total=8, max_per_address=8, first_byte_s=2.0, deadline_s=10.0)
    pending.add("silent", "10.0.0.1", 0.0)
    pending.add("talks", "10.0.0.1", 0.5)
    pending.add("young", "10.0.0.1", 5.0)
    pending.heard("talks")
    assert pending.expired(1.9) == []
    assert pending.expired(3.0) == [("silent", "first byte")]
    pending.discard("silent")
    assert pending.expired(9.0) == [("young", "first byte")]
    pending.heard("young")
    assert pending.expired(10.6) == [("talks", "handshake")]


def test_addresses_count_as_a_host_and_ipv6_by_its_64():
    assert address_key("10.0.0.1") == "10.0.0.1"
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback(a) for a in ("10.0.0.1", "::ffff:10.0.0.1", "2001:db8::1", "not an address"))


@contextlib.contextmanager
def _loopback_pair():
    """(the accepted socket, the client's address) of a connection on 127.0.0.1, closed after."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        accepted, remote = listener.accept()
        try:
            yield accepted, remote
        finally:
            client.close()
            accepted.close()


def test_the_peers_uid_is_read_from_the_kernels_table():
    if peer_uids([]) is None:
        pytest.skip("no /proc/net/tcp here: the uid check is off")
    with _loopback_pair() as (accepted, remote):
        assert peer_uids([(accepted.getsockname(), remote)]) == {remote: os.geteuid()}
        gone = ("127.0.0.1", 1)  # nobody's socket
        assert peer_uids([(accepted.getsockname(), gone)]) == {gone: None}


# -- a closed handshake or a wrong secret ---------------------------------------------------------
@pytest.fixture
def job():
    lines = []
    store = StoreServer(listen_on("127.0.0.1", 0), log=lines.append)
    gate = Gate(listen_on("127.0.0.1", 0), store.port, SECRET, log=lines.append)
    yield store, gate, lines
    gate.close()
    store.close()


def test_a_wrong_secret_is_named_at_once_and_not_tried_again(job):
    _, gate, _ = job
    t0 = time.monotonic()
    with pytest.raises(StoreRefused, match=r"did not let this node in: the secret does not match: the rendezvous "
                                           r"refused this node's proof\. Give every node the same secret"):
        StoreClient("127.0.0.1", gate.port, timeout=30, secret=b"another secret, sixteen or more")
    assert time.monotonic() - t0 < 5  # no tries again for 30 s


def test_a_handshake_closed_after_the_challenge_is_tried_again_and_named_for_what_it_was():
    # A listener that sends a gate's challenge and hangs up, as a gate under a flood evicts a node's
    # connection. The node used to give up at once, saying its secret was wrong.
    listener = listen_on("127.0.0.1", 0)
    port = listener.getsockname()[1]
    calls = []

    def serve():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            calls.append(1)
            sock.sendall(auth.MAGIC + bytes([auth.VERSION]) + os.urandom(auth.NONCE))
            sock.close()

    import threading

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreRefused) as caught:
            StoreClient("127.0.0.1", port, timeout=1.5, connect_timeout=1.0, secret=SECRET)
        took = time.monotonic() - t0
    finally:
        listener.close()
    message = str(caught.value)
    assert "the handshake was refused or closed by the rendezvous (" in message, message
    assert "something may be flooding it, or it is not a dptrain gate" in message and "secret" not in message
    tries = int(message.split("rendezvous (")[1].split(" tries")[0])
    # It gives up when the next try would start past the 1.5 s join timeout: after about half of it at
    # the least (the backoff is randomised), never at once.
    assert tries >= 3 and len(calls) == tries and 0.5 < took < 10, (message, took)


def test_a_forwarder_makes_its_connection_to_the_gate_again_until_the_gate_is_there():
    # The gate comes up 0.5 s after the rank's connection: the forwarder tries again meanwhile,
    # and the rank's request, held, goes through.
    port = free_port()
    lines = []
    forwarder = Forwarder("127.0.0.1", port, SECRET, log=lines.append, retry_s=20)
    store = gate = None
    try:
        rank = socket.create_connection(("127.0.0.1", forwarder.port), timeout=10)
        rank.sendall(struct.pack("<BI", VALIDATE, MAGIC) + bytes([SET]) + _blob(b"/k") + _blob(b"v"))
        time.sleep(0.5)
        store = StoreServer(listen_on("127.0.0.1", 0))
        gate = Gate(listen_on("127.0.0.1", port), store.port, SECRET)
        rank.sendall(bytes([GET]) + _blob(b"/k"))
        size = struct.unpack("<Q", rank.recv(8, socket.MSG_WAITALL))[0]
        assert rank.recv(size, socket.MSG_WAITALL) == b"v"
        assert forwarder.retried >= 1, lines
        rank.close()
    finally:
        forwarder.close()
        for part in (gate, store):
            if part is not None:
                part.close()


def test_an_address_flooding_the_gate_does_not_keep_a_node_out(job):
    # In one process: 200 silent connections from 127.0.0.1 against a gate that lets one address
    # hold 8; a node's connection from another loopback address (127.0.0.2) is never the one evicted.
    store, _, lines = job
    gate = Gate(listen_on("0.0.0.0", 0), store.port, SECRET, log=lines.append, max_pending=64, max_per_address=8)
    flood = []
    try:
        for _ in range(200):
            flood.append(socket.create_connection(("127.0.0.1", gate.port), timeout=5))
        _until(lambda: gate.evicted >= 200 - 8)
        node = socket.socket()
        node.bind(("127.0.0.2", 0))
        node.connect(("127.0.0.1", gate.port))
        more = [socket.create_connection(("127.0.0.1", gate.port), timeout=5) for _ in range(50)]
        flood += more
        auth.run_blocking(node, auth.client(SECRET), timeout_s=10)  # through, while the flood goes on
        node.sendall(struct.pack("<BI", VALIDATE, MAGIC) + bytes([SET]) + _blob(b"/in") + _blob(b"1"))
        _until(lambda: store.data.get(b"/in") == b"1")
        node.close()
        assert gate.slots.count("127.0.0.1") <= 8
        assert any("connections from 127.0.0.1 in the handshake, the most one address may" in line for line in lines)
    finally:
        for sock in flood:
            sock.close()
        gate.close()


def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_flood_from_another_namespace_does_not_keep_node_1_out(outsider, tmp_path):  # noqa: F811
    # The audit: ~4,150 silent connections from one outside address made node 1's launcher exit
    # within 2 s ("closed the connection during the handshake. Give every node the same secret"),
    # and node 0 then failed with "1 of 2 ranks have joined".
    node0, node1, stranger = outsider
    port = 29631
    secret = tmp_path / "job.secret"
    secret.write_text(SECRET.decode())
    secret.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["LATE_S"] = "0"
    cmd = [sys.executable, "-m", "dptrain", "run", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr",
           ADDR[0], "--master-port", str(port), "--timeout", "60", f"--secret-file={secret}"]
    script = os.path.join(SCRIPTS, "late_finisher.py")
    first = subprocess.Popen(["ip", "netns", "exec", node0] + cmd + ["--node-rank", "0", script],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    ready = tmp_path / "flooding"
    flood = subprocess.Popen(["ip", "netns", "exec", stranger, sys.executable, os.path.join(SCRIPTS, "flood_gate.py"),
                              ADDR[0], str(port), "4150", "40", str(ready)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    nodes = [first]
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert flood.poll() is None and first.poll() is None and time.monotonic() < deadline, \
                flood.communicate(timeout=30)
            time.sleep(0.05)
        nodes.append(subprocess.Popen(["ip", "netns", "exec", node1] + cmd + ["--node-rank", "1", script],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env))
        outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes + [flood]:
            if p.poll() is None:
                p.kill()
        flood.communicate(timeout=30)
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    assert "[rank0] rank 0 finished, sum 2" in outs[0][0] and "[rank1] rank 1 finished, sum 2" in outs[1][0]
    assert f"connections from {OUTSIDER} in the handshake, the most one address may" in outs[0][1], outs[0][1]


# -- another user of the same machine -------------------------------------------------------------
def _as_other_user(fn, timeout_s: float = 20.0):
    """``fn()`` in a forked child that runs as uid ``OTHER_UID``; its JSON answer."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (setuid)")
    if peer_uids([]) is None:
        pytest.skip("no /proc/net/tcp here: the uid check is off (not Linux)")
    # The child may not read this interpreter's library once it is the other user (a home folder of
    # mode 700): what its connect imports (the codec of host names) is imported here, first.
    "localhost".encode("idna")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads of ours; only sockets
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            answer = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            answer = {"error": repr(exc)}
        os.write(w, json.dumps(answer).encode())
        os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                pytest.fail(f"the second user's client still runs after {timeout_s} s")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return json.loads(data)


def _tcpstore_probe(port: int):
    """As the audit's second user: TCPStore's handshake, stop the job, read a key back."""
    def probe():
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        got = b""
        try:
            sock.sendall(struct.pack("<BI", VALIDATE, MAGIC) + bytes([SET]) + _blob(b"/launcher/failed/0")
                         + _blob(b"written by another user") + bytes([GET]) + _blob(b"/launcher/failed/0"))
            while chunk := sock.recv(4096):
                got += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
        except socket.timeout:
            return {"got": got.hex(), "closed": False, "port": sock.getsockname()[1]}
        return {"got": got.hex(), "closed": True, "port": sock.getsockname()[1]}
    return probe


def test_another_user_gets_nothing_from_a_single_node_store_and_one_line_names_it(tmp_path):
    # The audit: any local user read 14 keys of a one-node job's store on 127.0.0.1 and wrote
    # launcher/failed/0 there.
    env = dict(os.environ, AUTH_DIR=str(tmp_path))
    job = subprocess.Popen([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "1", "--timeout", "30",
                            os.path.join(SCRIPTS, "store_port_then_wait.py")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "port0").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=30)
            time.sleep(0.05)
        port = int((tmp_path / "port0").read_text())
        seen = [_as_other_user(_tcpstore_probe(port)) for _ in range(3)]
        mine = StoreClient("127.0.0.1", port, timeout=5)  # the job's own user still gets in
        assert mine.check(["launcher/failed/0"]) is False
        mine.close()
    finally:
        open(tmp_path / "go", "w").close()
        out, err = job.communicate(timeout=60)
    assert all(s.get("closed") and s["got"] == "" for s in seen), seen
    assert job.returncode == 0 and "rank 0 finished" in out, err
    lines = [line for line in err.splitlines() if "refused a connection from port" in line]
    assert len(lines) == 1, err  # three refusals, one line
    assert f"port {seen[0]['port']} on this machine: its socket belongs to uid {OTHER_UID}" in lines[0], lines
    assert f"not to the job's user (uid {os.geteuid()})" in lines[0] and f"127.0.0.1:{port}" in lines[0], lines


def test_another_user_cannot_ride_a_forwarders_handshake_into_node_0(job):
    store, gate, lines = job
    forwarded = []
    forwarder = Forwarder("127.0.0.1", gate.port, SECRET, log=forwarded.append)
    try:
        seen = _as_other_user(_tcpstore_probe(forwarder.port))
        assert seen.get("closed") and seen["got"] == "", seen
        assert store.data == {} and forwarder.refused_uids == 1
        assert len(forwarded) == 1 and f"its socket belongs to uid {OTHER_UID}" in forwarded[0], forwarded
        assert f"from port {seen['port']} on this machine" in forwarded[0] and "node 0's rendezvous" in forwarded[0]
        # The gate reached on loopback refuses the second user too (a node 0 started with --master-addr 127.0.0.1).
        seen = _as_other_user(_tcpstore_probe(gate.port))
        assert seen.get("closed") and seen["got"] == "" and gate.refused_uids == 1, seen
        # The job's own user goes through both.
        mine = StoreClient("127.0.0.1", forwarder.port, timeout=5)
        mine.set("launcher/x", "1")
        assert mine.get("launcher/x") == b"1" and store.data[b"/launcher/x"] == b"1"
        mine.close()
    finally:
        forwarder.close()


def _no_diag(pairs):
    raise _admission._NoDiag("not here")


def test_the_kernels_table_answers_where_sock_diag_cannot(monkeypatch):
    with _loopback_pair() as (accepted, remote):
        pairs = [(accepted.getsockname(), remote), (accepted.getsockname(), ("127.0.0.1", 1))]
        by_diag = peer_uids(pairs)
        monkeypatch.setattr(_admission, "_uids_by_diag", _no_diag)
        assert peer_uids(pairs) == by_diag == {remote: os.geteuid(), ("127.0.0.1", 1): None}


def test_the_uid_check_is_off_where_the_kernel_lists_no_owners(monkeypatch):
    # Not Linux, or /proc hidden: connections are let in as before (said in the README).
    monkeypatch.setattr(_admission, "_uids_by_diag", _no_diag)
    monkeypatch.setattr(_admission, "_TCP_TABLES", ("/nonexistent/tcp",))
    store = StoreServer(listen_on("127.0.0.1", 0))
    try:
        assert store.uid is None
        client = StoreClient("127.0.0.1", store.port, timeout=5)
        client.set("k", "v")
        client.close()
    finally:
        store.close()
