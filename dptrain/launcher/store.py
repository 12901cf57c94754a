"""The rendezvous store in plain Python: a server that speaks torch's TCPStore protocol.

The door of the store: the server is here; the protocol and the client that speaks it
(``StoreClient``) are in ``store_client``, and what the launcher reads from a store is
checked by ``store_values``.

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

[Note: what the store refuses]
Whatever reaches the port can talk to the store (across nodes without a secret; with one,
only the job's own connections reach it, see [Note: only the job gets in] in ``auth``), and
one job of thousands of ranks must not be able to break it by accident either. So:

* connections: the server raises its process's soft limit on open files to the hard one,
  holds at most ``max_connections`` (the limit less ``FD_RESERVE``, at most half of it, which
  the launcher keeps for its ranks' pipes), and while it holds that many -- or ``accept``
  fails for want of descriptors -- it stops listening for a while instead of being woken, at
  once and forever, by a connection it cannot take (the CPU spin that starved every other
  client). Those that wait stay in the listen backlog (``LISTEN_BACKLOG``, as large as the kernel allows: the 512
  of before overflowed when a thousand ranks connected at once, and each overflowed
  connection waited a second for its SYN to be sent again). A connection that has not sent
  TCPStore's handshake within ``HANDSHAKE_S`` is closed.
* bytes: a request is parsed as its bytes arrive (``_Conn.parser``, a generator that asks for
  the next n bytes), never again from its start; the keys, values and queued items of the
  job take at most ``max_bytes`` (``DPTRAIN_STORE_MAX_MB``), counting a value as soon as its
  length is read, so a value on its way takes its room before it is buffered; a client that
  does not read its answers is not read from until it does.
* counters: a key that ``add`` made is a counter; a write that ``add`` could no longer read
  (not decimal int64 text), and an ``add`` that would pass the int64 limits, are refused. An
  ``add`` to a key that another request set to text counts it from 0, and says so.

TCPStore's protocol has no error answer, so a refused request closes the connection that
sent it (its client fails on its next call, as with torch's server, which closes on a request
it cannot handle) and the store goes on unchanged for everyone else; the server says so in
one line per kind of refusal.
"""

from __future__ import annotations

import re
import selectors
import socket
import struct
import time
from collections import deque

from dptrain.runtime import settings as _settings
from dptrain.runtime import torch_version as _torch_version_module
from dptrain.launcher._loop import ACCEPT_RETRY_S, LISTEN_BACKLOG, SelectorLoop  # noqa: F401 - re-exported
from dptrain.launcher.store_client import (ADD, APPEND, CANCEL_WAIT, CHECK, COMPARE_SET, DELETE_KEY, GET, MAGIC,
                                           MULTI_GET, MULTI_SET, NOT_READY, NUM_KEYS, PING, QUEUE_LEN, QUEUE_POP,
                                           QUEUE_PUSH, READY, SET, STOP_WAITING, VALIDATE, WAIT, WAIT_CANCELED,
                                           StoreClient, StoreError, StoreRefused, StoreTimeout, _blob)
from dptrain.launcher.store_values import clean

__all__ = ["StoreServer", "StoreClient", "StoreError", "StoreRefused", "StoreTimeout", "use_python_store", "raise_open_files_limit"]

MAX_KEYS = 128 * 1024  # torch's limits: a request past them is malformed
MAX_KEY = 8 * 1024
MAX_VALUE = 8 * 1024 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: The newest torch whose clients were tested against this server (tests/launcher/test_store.py).
TESTED_TORCH = (2, 13)

#: Open-file descriptors the server leaves to the rest of its process, at most half of them
#: (see [Note: what the store refuses]).
FD_RESERVE = 128
#: Seconds a new connection has to send TCPStore's handshake.
HANDSHAKE_S = 30.0
#: Bytes of answers a client may leave unread before the server stops reading its requests.
MAX_UNREAD = 16 * 1024 * 1024
#: What one job may store by default, in MiB (``DPTRAIN_STORE_MAX_MB``).
DEFAULT_MAX_MB: int = _settings.default("DPTRAIN_STORE_MAX_MB")

_INT = re.compile(rb"[+-]?[0-9]{1,19}")


def use_python_store() -> bool:
    """Whether to host the store with this module rather than torch's ``TCPStore``.

    ``DPTRAIN_STORE=python`` or ``=torch`` decides. Otherwise this server is used with the
    torch versions it was tested against (up to ``TESTED_TORCH``), read from the package
    metadata without importing torch; a newer torch might send requests it does not know.
    """
    choice = _settings.get("DPTRAIN_STORE")  # None, "python" or "torch"; SettingError (a ValueError) else
    if choice is not None:
        return choice == "python"
    return _torch_version() <= TESTED_TORCH


def _torch_version() -> tuple[int, int]:
    return _torch_version_module.installed() or (99, 0)  # unknown: leave it to torch's own server


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return the soft limit now.

    Linux starts processes at 1,024 open files while allowing far more (the hard limit): a
    store with a connection per rank needs one descriptor each. Processes started afterwards
    (the ranks of later attempts) inherit the raised limit.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        for target in ((hard,) if hard != resource.RLIM_INFINITY else ()) + (1 << 20, 65536):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                break
            except (ValueError, OSError):  # e.g. macOS: the hard limit may exceed what the kernel allows
                continue
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (1 << 30) if soft == resource.RLIM_INFINITY else soft


def default_max_bytes() -> int:
    """What one job may store: ``DPTRAIN_STORE_MAX_MB`` MiB, else ``DEFAULT_MAX_MB``."""
    return int(_settings.get("DPTRAIN_STORE_MAX_MB") * 1024 * 1024)  # SettingError (a ValueError) when malformed


class _Malformed(ValueError):
    """A request out of protocol: its connection is closed, as torch's server does."""


class _Refused(Exception):
    """A well-formed request the store does not carry out (see [Note: what the store refuses])."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _parse_number(fmt: str):
    """Parser step: a number in ``struct`` format ``fmt``."""
    return struct.unpack(fmt, (yield struct.calcsize(fmt)))[0]


def _parse_key():
    """Parser step: a key (a length and its bytes)."""
    size = yield from _parse_number("<Q")
    if size > MAX_KEY:
        raise _Malformed(f"a key of {size} bytes (at most {MAX_KEY})")
    return (yield size)


def _parse_count():
    """Parser step: the number of keys of a request."""
    n = yield from _parse_number("<Q")
    if n > MAX_KEYS:
        raise _Malformed(f"{n} keys in one request (at most {MAX_KEYS})")
    return n


def _int64(value: bytes) -> int | None:
    """``value`` as a counter reads it (decimal int64 text; empty is 0), else None."""
    if not value:
        return 0
    if not _INT.fullmatch(value):
        return None
    n = int(value)
    return n if INT64_MIN <= n <= INT64_MAX else None


def _show(value: bytes) -> str:
    return clean(repr(value[:40]) + ("..." if len(value) > 40 else ""), 80)


class _Conn:
    """One client connection: its socket, its buffers and where it stands in the protocol.

    ``parser`` is a generator that reads the connection's requests (see ``StoreServer._requests``):
    it yields how many bytes it needs next (``want``) and is sent exactly those. A step before
    the first request (the handshake; authentication would come after it) is a step of it.
    """

    __slots__ = ("sock", "peer", "inbuf", "outbuf", "parser", "want", "validated", "awaited", "reserved", "events")

    def __init__(self, sock: socket.socket, peer) -> None:
        self.sock, self.peer = sock, peer
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.parser = None
        self.want = 0
        self.validated = False
        self.awaited = 0  # keys of its pending WAIT not set yet
        self.reserved = 0  # bytes of values in its request under way, counted against the job's room
        self.events = 0  # what the selector watches it for

    def where(self) -> str:
        try:
            return f"{self.peer[0]}:{self.peer[1]}"
        except (TypeError, IndexError):
            return str(self.peer)


class StoreServer(SelectorLoop):
    """Serves the store on a listening socket from a thread of its own until ``close()``.

    All state lives on that thread (one selector loop, as torch's libuv server), so no
    request needs a lock. ``sock`` must be bound and listening; the server takes it over (and
    listens again with ``LISTEN_BACKLOG``, as torch's server does with a socket it is given).
    ``max_connections`` (None: the open-files limit less ``FD_RESERVE``, or half of it) and
    ``max_bytes`` (None: ``default_max_bytes()``) bound what it holds; see [Note: what the
    store refuses]. ``check_uid`` (default True): on Linux, a connection on a loopback address
    from another user's socket is closed at once, with one line naming its uid and port (see
    [Note: only the job's own user on loopback] in ``_admission``). ``log`` prints one line
    (default: standard error).
    """

    prefix = "dptrain: "
    tick_s = 1.0

    def __init__(self, sock: socket.socket, max_connections: int | None = None, max_bytes: int | None = None,
                 check_uid: bool = True, log=None) -> None:
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        limit = raise_open_files_limit()
        self.max_connections = limit - min(FD_RESERVE, limit // 2) if max_connections is None else max_connections
        host, port = sock.getsockname()[:2]
        self.what = f"the rendezvous store on {host}:{port}"
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque] = {}
        self.counters: set[bytes] = set()  # keys that add made (see [Note: what the store refuses])
        self.stored = 0  # bytes of keys, values and queued items
        self.reserved = 0  # bytes of values in requests under way
        self.waiting: dict[bytes, list[_Conn]] = {}
        self.conns: set[_Conn] = set()
        self._handshakes: dict[_Conn, float] = {}  # connections yet to send the handshake -> deadline
        super().__init__(sock, "dptrain-store", log=log, check_uid=check_uid)

    # -- the loop (see _loop.SelectorLoop) ---------------------------------------------------
    def _event(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
                if conn.inbuf and conn in self.conns:
                    self._feed(conn)  # requests held back while its answers were unread
            if events & selectors.EVENT_READ and conn in self.conns:
                self._read(conn)
        except Exception as exc:  # noqa: BLE001 - one bad connection must not stop the store
            self._say("error", f"the rendezvous store closed the connection from {conn.where()}: "
                               f"{type(exc).__name__}: {exc}")
            self._drop(conn)

    def _tick(self, now: float) -> None:
        while self._handshakes:
            conn, deadline = next(iter(self._handshakes.items()))  # the oldest first
            if deadline > now:
                break
            self._say("handshake", f"the rendezvous store closed the connection from {conn.where()}: no "
                                   f"TCPStore handshake within {HANDSHAKE_S:.0f}s")
            self._drop(conn)

    def _shutdown(self) -> None:
        for conn in list(self.conns):
            self._drop(conn)

    def _full(self, accepted: int) -> str | None:
        if len(self.conns) + accepted < self.max_connections:
            return None
        return (f"dptrain: the rendezvous store holds {len(self.conns) + accepted} connections, the most it takes; "
                f"new ones wait until one closes. A job of more ranks needs a higher limit on open files "
                f"(`ulimit -Hn`)")

    def _accepted(self, sock: socket.socket, peer) -> None:
        conn = _Conn(sock, peer)
        conn.parser = self._requests(conn)
        conn.want = next(conn.parser)
        conn.events = selectors.EVENT_READ
        self.conns.add(conn)
        self._handshakes[conn] = time.monotonic() + HANDSHAKE_S
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
        self._feed(conn)

    def _feed(self, conn: _Conn) -> None:
        """Hand ``conn``'s parser the bytes it waits for, as long as they are there (and its answers are read)."""
        buf, pos = conn.inbuf, 0
        try:
            with memoryview(buf) as view:
                while conn.want <= len(buf) - pos and len(conn.outbuf) < MAX_UNREAD and conn.parser is not None:
                    data = view[pos:pos + conn.want].tobytes()
                    pos += conn.want
                    conn.want = conn.parser.send(data)
        except _Malformed as exc:  # torch's server drops such a client too
            self._say("malformed", f"the rendezvous store closed the connection from {conn.where()}: {exc}. If a "
                                   f"torch newer than {TESTED_TORCH[0]}.{TESTED_TORCH[1]} sent it, run with "
                                   f"DPTRAIN_STORE=torch to host the store with torch's own server")
            self._drop(conn)
        except _Refused as exc:
            self._say(exc.kind, f"the rendezvous store refused a request from {conn.where()} and closed its "
                                f"connection: {exc}")
            self._drop(conn)
        finally:
            if conn in self.conns:
                del buf[:pos]

    # -- the requests ------------------------------------------------------------------------
    def _requests(self, conn: _Conn):
        """The requests of one connection, each carried out once all of its bytes are there."""
        if (yield 1)[0] != VALIDATE or (yield from _parse_number("<I")) != MAGIC:
            raise _Malformed("a connection that did not start with TCPStore's handshake")
        conn.validated = True
        self._handshakes.pop(conn, None)
        while True:
            self._release(conn)
            command = (yield 1)[0]
            if command in (SET, APPEND, QUEUE_PUSH):
                key = yield from _parse_key()
                value = yield from self._value(conn, key if command == SET else None)
                if command == SET:
                    self._put(key, value)
                elif command == APPEND:
                    self._put(key, self.data.get(key, b"") + value)
                else:
                    self._push(key, value)
            elif command == GET:
                self._send(conn, _blob(self.data.get((yield from _parse_key()), b"")))
            elif command == ADD:
                key, amount = (yield from _parse_key()), (yield from _parse_number("<q"))
                self._send(conn, struct.pack("<q", self._add(key, amount)))
            elif command == COMPARE_SET:
                key = yield from _parse_key()
                expected, new = (yield from self._value(conn)), (yield from self._value(conn, key))
                self._send(conn, _blob(self._compare_set(key, expected, new)))
            elif command in (CHECK, WAIT, MULTI_GET):
                keys = []
                for _ in range((yield from _parse_count())):
                    keys.append((yield from _parse_key()))
                if command == MULTI_GET:
                    self._send(conn, b"".join(_blob(self.data.get(k, b"")) for k in keys))
                elif command == CHECK:
                    self._send(conn, bytes([READY if self._present(keys) else NOT_READY]))
                else:
                    self._await(conn, keys)
            elif command == MULTI_SET:
                pairs = []
                for _ in range((yield from _parse_count())):
                    key = yield from _parse_key()
                    pairs.append((key, (yield from self._value(conn, key))))
                for key, value in pairs:
                    self._put(key, value)
            elif command == NUM_KEYS:
                self._send(conn, struct.pack("<q", len(self.data)))
            elif command == DELETE_KEY:
                self._send(conn, struct.pack("<q", self._delete((yield from _parse_key()))))
            elif command == CANCEL_WAIT:
                self._forget_waits(conn)
                self._send(conn, bytes([WAIT_CANCELED]))
            elif command == PING:
                self._send(conn, struct.pack("<I", (yield from _parse_number("<I"))))
            elif command == QUEUE_POP:
                self._send(conn, self._pop((yield from _parse_key())))
            elif command == QUEUE_LEN:
                self._send(conn, struct.pack("<q", len(self.queues.get((yield from _parse_key()), ()))))
            else:
                raise _Malformed(f"request code {command}, which this store does not know")

    def _value(self, conn: _Conn, replaces: bytes | None = None):
        """Parser step: a value, its room in the job's store taken as soon as its length is read.

        ``replaces``: the key whose value it will replace (that value's room counts as free).
        """
        size = yield from _parse_number("<Q")
        if size > MAX_VALUE:
            raise _Malformed(f"a value of {size} bytes (at most {MAX_VALUE})")
        freed = len(self.data.get(replaces, b"")) if replaces is not None else 0
        if self.stored + self.reserved + size - freed > self.max_bytes:
            raise _Refused("room", f"a value of {size} bytes: the job's store holds {self.stored} bytes (and "
                                   f"{self.reserved} on their way) of the {self.max_bytes} it may "
                                   f"(DPTRAIN_STORE_MAX_MB={self.max_bytes / 2**20:g})")
        conn.reserved += size
        self.reserved += size
        return (yield size)

    def _release(self, conn: _Conn) -> None:
        self.reserved -= conn.reserved
        conn.reserved = 0

    # -- the data ----------------------------------------------------------------------------
    def _put(self, key: bytes, value: bytes, counter: bool = False) -> None:
        """Every write of a key goes through here (see [Note: what the store refuses])."""
        if not counter and key in self.counters and _int64(value) is None:
            raise _Refused("counter", f"a write of {_show(value)} to the counter {_show(key)}, which `add` could "
                                      f"not read (decimal int64 text only)")
        old = self.data.get(key)
        grow = len(value) - len(old) if old is not None else len(key) + len(value)
        if grow > 0 and self.stored + grow > self.max_bytes:
            raise _Refused("room", f"a write of {len(value)} bytes to {_show(key)}: the job's store holds "
                                   f"{self.stored} bytes of the {self.max_bytes} it may "
                                   f"(DPTRAIN_STORE_MAX_MB={self.max_bytes / 2**20:g})")
        self.data[key] = value
        self.stored += grow
        if counter:
            self.counters.add(key)
        self._wake(key)

    def _add(self, key: bytes, amount: int) -> int:
        old = self.data.get(key, b"")
        current = _int64(old)
        if current is None:  # set by another request than add: count it from 0, as if absent
            self._say("not-a-number", f"the rendezvous store key {_show(key)} held {_show(old)}, not a number; "
                                      f"`add` counted it from 0")
            current = 0
        total = current + amount
        if not INT64_MIN <= total <= INT64_MAX:
            raise _Refused("counter", f"`add` of {amount} to the counter {_show(key)} at {current}, past the int64 "
                                      f"limits")
        self._put(key, str(total).encode(), counter=True)
        return total

    def _compare_set(self, key: bytes, expected: bytes, new: bytes) -> bytes:
        if key not in self.data:
            if expected:
                return expected
            self._put(key, new)
            return new
        if self.data[key] == expected:
            self._put(key, new)
        return self.data[key]

    def _delete(self, key: bytes) -> int:
        value = self.data.pop(key, None)
        if value is None:
            return 0
        self.stored -= len(key) + len(value)
        self.counters.discard(key)
        return 1

    def _push(self, key: bytes, value: bytes) -> None:
        grow = len(value) + (0 if key in self.queues else len(key))
        if self.stored + grow > self.max_bytes:
            raise _Refused("room", f"a queue item of {len(value)} bytes: the job's store holds {self.stored} "
                                   f"bytes of the {self.max_bytes} it may")
        self.queues.setdefault(key, deque()).append(value)
        self.stored += grow
        self._wake(key, only_one=True)

    def _pop(self, key: bytes) -> bytes:
        queue = self.queues.get(key)
        if not queue:
            return struct.pack("<q", 0)
        out = struct.pack("<q", len(queue)) + _blob(queue.popleft())
        self.stored -= len(out) - 16
        if not queue:
            del self.queues[key]
            self.stored -= len(key)
        return out

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
        """``key`` exists now: answer the waits it completes (``only_one``: the first, for a queue item)."""
        waiters = self.waiting.get(key)
        if not waiters:
            return
        ready = []
        done = 0
        for conn in waiters:
            done += 1
            conn.awaited -= 1
            if conn.awaited == 0:
                ready.append(conn)
                if only_one:
                    break
        del waiters[:done]  # one slice: thousands of ranks may wait for one key
        if not waiters:
            del self.waiting[key]
        for conn in ready:
            self._send(conn, bytes([STOP_WAITING]))

    def _forget_waits(self, conn: _Conn) -> None:
        if not conn.awaited:
            return
        conn.awaited = 0
        for key in [k for k, waiters in self.waiting.items() if conn in waiters]:
            self.waiting[key] = [c for c in self.waiting[key] if c is not conn]
            if not self.waiting[key]:
                del self.waiting[key]

    # -- the connections ---------------------------------------------------------------------
    def _send(self, conn: _Conn, payload: bytes) -> None:
        if conn in self.conns:
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
        # Read its requests only while its answers are read too; write while any are left.
        events = (selectors.EVENT_READ if len(conn.outbuf) < MAX_UNREAD else 0) | (
            selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:
            conn.events = events
            self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        self._handshakes.pop(conn, None)
        self._release(conn)
        self._forget_waits(conn)
        conn.parser = None
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if not self._accepting and self._resume_at is None:
            self._listen(True)  # it was full: there is room again

    def _say(self, kind: str, message: str) -> None:
        """One line on standard error, the first time this kind of trouble happens."""
        super()._say(kind, message if message.startswith(self.prefix) else self.prefix + message)
