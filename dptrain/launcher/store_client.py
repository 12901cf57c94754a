"""TCPStore's wire protocol, and a blocking client that speaks it without torch.

A request is a one-byte command and its arguments; strings and values go as a little-endian
uint64 length and the bytes, numbers as little-endian int64. The launcher of every node talks
to node 0's store with ``StoreClient`` (it never imports torch, see [Note: why the launcher
does not import torch] in ``store``); the ranks use torch's own client. The rest of dptrain
imports both through :mod:`dptrain.launcher.store`.
"""

from __future__ import annotations

import datetime
import random
import socket
import struct
import threading
import time

from dptrain.launcher import auth

__all__ = ["StoreClient", "StoreError", "StoreTimeout", "StoreRefused"]

# TCPStore's request codes, in the order of torch's QueryType enum.
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, NUM_KEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET,
 CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN) = range(17)
MAGIC = 0x3C85F7CE  # what a client sends first, after VALIDATE
READY, NOT_READY = 0, 1  # answers to CHECK
STOP_WAITING, WAIT_CANCELED = 0, 1  # answers to WAIT and CANCEL_WAIT
_PING = 0x70696E67  # the number a ping asks the store to send back ("ping")


class StoreError(RuntimeError):
    """The store could not be reached or answered out of protocol."""


class StoreTimeout(StoreError):
    """A key did not appear within the timeout."""


class StoreRefused(StoreError):
    """The rendezvous answered but did not let this client in (the job's secret: see ``auth``)."""


def _blob(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value



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

    def __init__(self, host: str, port: int, timeout=300.0, connect_timeout: float = 30.0,
                 secret: bytes | None = None) -> None:
        """Connect to the store at ``host:port`` (retrying for ``connect_timeout`` seconds).

        ``secret``: the job's, for node 0's gate (see [Note: only the job gets in] in
        :mod:`dptrain.launcher.auth`); the connection passes the handshake before any request.
        Without one, a ping checks that a store answers (and not a gate that asks for a secret).
        A handshake closed or cut before it was through is tried again with backoff for up to
        ``timeout`` (or ``connect_timeout``, the longer) seconds in all; a secret that does not
        match is not.

        Raises:
            StoreRefused: the secrets differ, the other side is no dptrain gate, or every
                handshake was refused or closed (the message says which).
            StoreError: no store answered at ``host:port`` within ``connect_timeout``.
        """
        self.timeout = _seconds(timeout)
        self._lock = threading.Lock()
        started = time.monotonic()
        deadline = started + connect_timeout
        where = f"{host}:{port}"
        tries = 0
        while True:
            self._connect(host, port, deadline)
            if secret is None:
                break
            try:
                auth.run_blocking(self._sock, auth.client(secret))
                break
            except auth.AuthClosed as exc:
                # Nothing was proved either way (a flood may have evicted it): try again within the
                # join timeout, see [Note: a flood of silent connections] in _admission.
                self.close()
                tries += 1
                now = time.monotonic()
                delay = min(1.0, 0.05 * 2 ** tries) * random.uniform(0.5, 1.0)
                if now + delay - started > max(connect_timeout, self.timeout):
                    raise StoreRefused(
                        f"the rendezvous at {where} did not let this node in: the handshake was refused or closed "
                        f"by the rendezvous ({tries} tries over {now - started:.1f}s; something may be flooding it, "
                        f"or it is not a dptrain gate). The last try: {exc}") from None
                time.sleep(delay)
                deadline = max(deadline, started + max(connect_timeout, self.timeout))  # the gate may be restarting
            except auth.AuthError as exc:
                self.close()
                raise StoreRefused(f"the rendezvous at {where} did not let this node in: {exc}. Give every node the "
                                   f"same secret (--secret-file, DPTRAIN_SECRET_FILE or DPTRAIN_SECRET)") from None
        self._send(struct.pack("<BI", VALIDATE, MAGIC))
        if secret is None:
            self._check_store(where)

    def _connect(self, host: str, port: int, deadline: float) -> None:
        """Open the socket, trying again until ``deadline`` while nothing listens."""
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

    def _check_store(self, where: str) -> None:
        """A ping: a store answers with its number; node 0's gate, which asks for a secret, with its challenge."""
        self._send(struct.pack("<BI", PING, _PING))
        try:
            answer = self._recv(4, timeout=self.timeout)
        except StoreError:
            answer = b""
        if answer == struct.pack("<I", _PING):
            return
        self.close()
        if answer == auth.MAGIC:
            raise StoreRefused(f"the rendezvous at {where} asks for the job's secret, and this node has none: give "
                               f"every node the same one (--secret-file, DPTRAIN_SECRET_FILE or DPTRAIN_SECRET)")
        why = "no answer" if answer is None else "an answer out of protocol" if answer else "it closed the connection"
        raise StoreError(f"no rendezvous store answered at {where} ({why})")

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
