"""The rendezvous store in plain Python: a server and a client that speak torch's TCPStore protocol.

[Note: why the launcher does not import torch]
Every rank connects to the store its launcher hosts (``TORCHELASTIC_USE_AGENT_STORE``), with
torch's own ``TCPStore`` client. Hosting that store with torch's server means importing torch
in the launcher: about 1.2 s of CPU, spent while the ranks import torch themselves. On a
machine whose cores are all busy with ranks that import is time added to the first step, and
torchrun pays it too. The store is a small key-value server, so the launcher runs this one
instead, on a thread of its own, and never imports torch. Its wire format is TCPStore's:
a request is a one-byte command and its arguments; strings and values go as a little-endian
uint64 length and the bytes; numbers as little-endian int64.

The server keeps the semantics of torch's (libuv) server: a value read before it was set is
empty (the client waits for the key first), ``add`` keeps the number as decimal text,
``wait`` answers once every key exists, a queue counts as present for ``check`` when it is
not empty. A request it does not know closes that connection with a message naming the
torch version, and ``DPTRAIN_STORE=torch`` switches back to torch's server (see
``use_python_store``).
"""

from __future__ import annotations

import datetime
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections import deque

from dptrain import _torch_version as _torch_version_module

__all__ = ["StoreServer", "StoreClient", "StoreError", "StoreTimeout", "use_python_store"]

# TCPStore's request codes, in the order of torch's QueryType enum.
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, NUM_KEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET,
 CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN) = range(17)
MAGIC = 0x3C85F7CE  # what a client sends first, after VALIDATE
READY, NOT_READY = 0, 1  # answers to CHECK
STOP_WAITING, WAIT_CANCELED = 0, 1  # answers to WAIT and CANCEL_WAIT
MAX_KEYS = 128 * 1024  # torch's limits: a request past them is malformed
MAX_VALUE = 8 * 1024 * 1024
#: The newest torch whose clients were tested against this server (tests/launcher/test_store.py).
TESTED_TORCH = (2, 13)


class StoreError(RuntimeError):
    """The store could not be reached or answered out of protocol."""


class StoreTimeout(StoreError):
    """A key did not appear within the timeout."""


def use_python_store() -> bool:
    """Whether to host the store with this module rather than torch's ``TCPStore``.

    ``DPTRAIN_STORE=python`` or ``=torch`` decides. Otherwise this server is used with the
    torch versions it was tested against (up to ``TESTED_TORCH``), read from the package
    metadata without importing torch; a newer torch might send requests it does not know.
    """
    choice = os.environ.get("DPTRAIN_STORE", "").strip().lower()
    if choice in ("python", "torch"):
        return choice == "python"
    if choice:
        raise ValueError(f"DPTRAIN_STORE={choice!r}: use 'python' (dptrain's store server) "
                         "or 'torch' (torch's TCPStore)")
    return _torch_version() <= TESTED_TORCH


def _torch_version() -> tuple[int, int]:
    return _torch_version_module.installed() or (99, 0)  # unknown: leave it to torch's own server


class _Incomplete(Exception):
    """The request is not all there yet: wait for more bytes."""


class _Reader:
    """Reads one request from the front of a connection's buffer."""

    def __init__(self, buf: bytearray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise _Incomplete
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def number(self, fmt: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def blob(self) -> bytes:
        size = self.number("<Q")
        if size > MAX_VALUE:
            raise ValueError(f"a value of {size} bytes (at most {MAX_VALUE})")
        return self.take(size)

    def count(self) -> int:
        n = self.number("<Q")
        if n > MAX_KEYS:
            raise ValueError(f"{n} keys in one request (at most {MAX_KEYS})")
        return n


def _blob(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "validated", "awaited", "peer")

    def __init__(self, sock: socket.socket, peer) -> None:
        self.sock, self.peer = sock, peer
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.validated = False
        self.awaited = 0  # keys of its pending WAIT not set yet


class StoreServer:
    """Serves the store on a listening socket from a thread of its own until ``close()``.

    All state lives on that thread (one selector loop, as torch's libuv server), so no
    request needs a lock. ``sock`` must be bound and listening; the server takes it over.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque] = {}
        self.waiting: dict[bytes, list[_Conn]] = {}
        self.conns: set[_Conn] = set()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = False
        self._warned = False
        self._selector.register(sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="dptrain-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving, close every connection and the listening socket (idempotent)."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for conn in list(self.conns):
            self._drop(conn)
        for s in (self.sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self._selector.close()

    def _loop(self) -> None:
        while not self._stop:
            for key, events in self._selector.select(timeout=1.0):
                if key.data == "wake":
                    return
                if key.data is None:
                    self._accept()
                    continue
                conn = key.data
                try:
                    if events & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if events & selectors.EVENT_READ and conn in self.conns:
                        self._read(conn)
                except Exception as exc:  # noqa: BLE001 - one bad connection must not stop the store
                    self._complain(conn, f"{type(exc).__name__}: {exc}")
                    self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: the client retries its connect
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer)
            self.conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        conn.inbuf += chunk
        while conn.inbuf and conn in self.conns:
            reader = _Reader(conn.inbuf)
            try:
                self._handle(conn, reader)
            except _Incomplete:
                return
            except ValueError as exc:  # malformed: torch's server drops such a client too
                self._complain(conn, str(exc))
                self._drop(conn)
                return
            del conn.inbuf[:reader.pos]

    def _handle(self, conn: _Conn, r: _Reader) -> None:
        command = r.number("<B")
        if not conn.validated:
            if command != VALIDATE or r.number("<I") != MAGIC:
                raise ValueError("a connection that did not start with TCPStore's handshake")
            conn.validated = True
            return
        if command in (SET, APPEND, QUEUE_PUSH):
            key, value = r.blob(), r.blob()
            if command == SET:
                self.data[key] = value
            elif command == APPEND:
                self.data[key] = self.data.get(key, b"") + value
            else:
                self.queues.setdefault(key, deque()).append(value)
                self._wake(key, only_one=True)
                return
            self._wake(key)
        elif command == GET:
            self._send(conn, _blob(self.data.get(r.blob(), b"")))
        elif command == ADD:
            key, amount = r.blob(), r.number("<q")
            total = int(self.data.get(key, b"0") or b"0") + amount
            self.data[key] = str(total).encode()
            self._wake(key)
            self._send(conn, struct.pack("<q", total))
        elif command == COMPARE_SET:
            key, expected, new = r.blob(), r.blob(), r.blob()
            if key not in self.data:
                answer = expected
                if not expected:
                    self.data[key] = answer = new
                    self._wake(key)
            else:
                if self.data[key] == expected:
                    self.data[key] = new
                    self._wake(key)
                answer = self.data[key]
            self._send(conn, _blob(answer))
        elif command in (CHECK, WAIT, MULTI_GET):
            keys = [r.blob() for _ in range(r.count())]
            if command == MULTI_GET:
                self._send(conn, b"".join(_blob(self.data.get(k, b"")) for k in keys))
            elif command == CHECK:
                self._send(conn, bytes([READY if self._present(keys) else NOT_READY]))
            else:
                self._await(conn, keys)
        elif command == MULTI_SET:
            pairs = [(r.blob(), r.blob()) for _ in range(r.count())]
            for key, value in pairs:
                self.data[key] = value
                self._wake(key)
        else:
            self._handle_rest(conn, r, command)

    def _handle_rest(self, conn: _Conn, r: _Reader, command: int) -> None:
        if command == NUM_KEYS:
            self._send(conn, struct.pack("<q", len(self.data)))
        elif command == DELETE_KEY:
            self._send(conn, struct.pack("<q", 1 if self.data.pop(r.blob(), None) is not None else 0))
        elif command == CANCEL_WAIT:
            self._forget_waits(conn)
            self._send(conn, bytes([WAIT_CANCELED]))
        elif command == PING:
            self._send(conn, struct.pack("<I", r.number("<I")))
        elif command == QUEUE_POP:
            queue = self.queues.get(r.blob(), deque())
            out = struct.pack("<q", len(queue))
            self._send(conn, out + _blob(queue.popleft()) if queue else out)
        elif command == QUEUE_LEN:
            self._send(conn, struct.pack("<q", len(self.queues.get(r.blob(), ()))))
        else:
            raise ValueError(f"request code {command}, which this store does not know")

    def _present(self, keys: list[bytes]) -> bool:
        return all(k in self.data or self.queues.get(k) for k in keys)

    def _await(self, conn: _Conn, keys: list[bytes]) -> None:
        if self._present(keys):
            self._send(conn, bytes([STOP_WAITING]))
            return
        missing = [k for k in keys if k not in self.data]
        conn.awaited = len(missing)
        for key in missing:
            self.waiting.setdefault(key, []).append(conn)

    def _wake(self, key: bytes, only_one: bool = False) -> None:
        waiters = self.waiting.get(key)
        if not waiters:
            return
        for conn in list(waiters):
            waiters.remove(conn)
            conn.awaited -= 1
            if conn.awaited == 0:
                self._send(conn, bytes([STOP_WAITING]))
                if only_one:
                    break
        if not waiters:
            del self.waiting[key]

    def _forget_waits(self, conn: _Conn) -> None:
        conn.awaited = 0
        for key in [k for k, waiters in self.waiting.items() if conn in waiters]:
            self.waiting[key] = [c for c in self.waiting[key] if c is not conn]
            if not self.waiting[key]:
                del self.waiting[key]

    def _send(self, conn: _Conn, payload: bytes) -> None:
        conn.outbuf += payload
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        self._forget_waits(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _complain(self, conn: _Conn, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        print(f"dptrain: the rendezvous store closed the connection from {conn.peer[0]}:{conn.peer[1]}: {what}. "
              f"If a torch newer than {TESTED_TORCH[0]}.{TESTED_TORCH[1]} sent it, run with DPTRAIN_STORE=torch "
              f"to host the store with torch's own server", file=sys.stderr, flush=True)


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _key(key) -> bytes:
    # torch's TCPStore client puts "/" before every key; so do we, so that both see the same keys.
    return _blob(b"/" + _as_bytes(key))


class StoreClient:
    """A blocking client with the methods of torch's ``Store`` the launcher uses.

    Works against this module's server and torch's alike. Thread-safe: one request at a
    time. Errors are ``StoreError`` (``StoreTimeout`` for a key that did not appear); both
    are ``RuntimeError``, as torch's are.
    """

    def __init__(self, host: str, port: int, timeout=300.0, connect_timeout: float = 30.0) -> None:
        self.timeout = _seconds(timeout)
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(f"no rendezvous store answered at {host}:{port} ({exc})") from None
                time.sleep(0.05)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)
        self._send(struct.pack("<BI", VALIDATE, MAGIC))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    # -- the Store API --------------------------------------------------------------------
    def set(self, key, value) -> None:
        with self._lock:
            self._send(bytes([SET]) + _key(key) + _blob(_as_bytes(value)))

    def get(self, key) -> bytes:
        """The value of ``key``, waiting for it up to the client's timeout (as torch's ``get``)."""
        self.wait([key])
        with self._lock:
            self._send(bytes([GET]) + _key(key))
            return self._recv_blob()

    def add(self, key, amount: int) -> int:
        with self._lock:
            self._send(bytes([ADD]) + _key(key) + struct.pack("<q", int(amount)))
            return struct.unpack("<q", self._recv(8))[0]

    def compare_set(self, key, expected, desired) -> bytes:
        with self._lock:
            self._send(bytes([COMPARE_SET]) + _key(key) + _blob(_as_bytes(expected))
                       + _blob(_as_bytes(desired)))
            return self._recv_blob()

    def check(self, keys) -> bool:
        with self._lock:
            self._send(bytes([CHECK]) + self._keys(keys))
            return self._recv(1)[0] == READY

    def delete_key(self, key) -> bool:
        with self._lock:
            self._send(bytes([DELETE_KEY]) + _key(key))
            return struct.unpack("<q", self._recv(8))[0] == 1

    def num_keys(self) -> int:
        with self._lock:
            self._send(bytes([NUM_KEYS]))
            return struct.unpack("<q", self._recv(8))[0]

    def wait(self, keys, timeout=None) -> None:
        """Return once every key exists; ``StoreTimeout`` after ``timeout`` (default: the client's)."""
        limit = self.timeout if timeout is None else _seconds(timeout)
        with self._lock:
            self._send(bytes([WAIT]) + self._keys(keys))
            if self._recv(1, timeout=limit) is not None:
                return
            # Timed out: withdraw the wait. An answer that crossed the cancel comes first.
            self._send(bytes([CANCEL_WAIT]))
            if self._recv(1)[0] == STOP_WAITING:
                self._recv(1)
        raise StoreTimeout(f"the store keys {list(keys)} did not appear within {limit:g}s")

    # -- the wire ---------------------------------------------------------------------------
    @staticmethod
    def _keys(keys) -> bytes:
        keys = list(keys)
        return struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys)

    def _send(self, payload: bytes) -> None:
        try:
            self._sock.sendall(payload)
        except OSError as exc:
            raise StoreError(f"the rendezvous store is gone ({exc})") from None

    def _recv(self, n: int, timeout: float | None = None):
        """``n`` bytes; None if ``timeout`` passed before the first of them arrived."""
        out = bytearray()
        self._sock.settimeout(timeout)
        try:
            while len(out) < n:
                try:
                    chunk = self._sock.recv(n - len(out))
                except socket.timeout:
                    if timeout is not None and not out:
                        return None
                    raise StoreError("the rendezvous store stopped answering") from None
                except OSError as exc:
                    raise StoreError(f"the rendezvous store is gone ({exc})") from None
                if not chunk:
                    raise StoreError("the rendezvous store closed the connection")
                out += chunk
        finally:
            self._sock.settimeout(None)
        return bytes(out)

    def _recv_blob(self) -> bytes:
        size = struct.unpack("<Q", self._recv(8))[0]
        return self._recv(size) if size else b""
