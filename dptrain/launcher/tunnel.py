"""The pipes between a job's nodes when it has a secret: node 0's gate, the other nodes' forwarders.

See [Note: only the job gets in] in :mod:`dptrain.launcher.auth`. Both are a thread of the
launcher with one selector loop, which pipes every accepted connection to a connection of its
own to the target; one side of each pair passes the handshake first:

* ``Gate`` (node 0) listens on ``--master-addr:--master-port``; an accepted connection must
  pass the handshake as a client (``auth.server`` runs on it) before the gate connects it to
  the store on 127.0.0.1. Nothing it sends before that reaches the store, and one that fails,
  or says nothing within ``auth.HANDSHAKE_S``, is closed with no answer but the challenge.
* ``Forwarder`` (every other node) listens on 127.0.0.1 (a free port, handed to the ranks as
  ``MASTER_PORT``); for every accepted connection it opens one to node 0's gate, passes the
  handshake there (``auth.client``), then sends on what the rank has sent meanwhile.

Bytes are passed on as they come, in both directions, and a side that does not read its
answers is not read from (``MAX_HELD`` bytes at most wait on either side). When one side
closes, what it sent is delivered and the other side is closed too.
"""

from __future__ import annotations

import errno
import selectors
import socket
import sys
import threading
import time
from typing import Callable

from dptrain.launcher import auth
from dptrain.launcher.store import LISTEN_BACKLOG
from dptrain.launcher.store_values import clean

__all__ = ["Gate", "Forwarder"]

#: Bytes that may wait on one side of a pipe before the other side is not read from.
MAX_HELD = 4 * 1024 * 1024
#: Connections the gate holds in the handshake at once; further ones are closed at once.
MAX_PENDING = 4096
#: Seconds the gate stops accepting after ``accept`` found no free descriptor.
ACCEPT_RETRY_S = 0.2


class _End:
    """One socket of a pipe: what waits to be written to it, and its handshake while it runs."""

    __slots__ = ("sock", "where", "peer", "out", "held", "step", "want", "connecting", "ready", "events", "heard",
                 "closing")

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock, self.where = sock, where
        self.peer: _End | None = None
        self.out = bytearray()  # to be written to this socket
        self.held = bytearray()  # read from it: the handshake's bytes, then what waits for the peer
        self.step = None  # its handshake generator while it runs
        self.want = 0  # bytes the handshake needs next
        self.connecting = False
        self.ready = False  # connected and through its handshake: bytes for it go to ``out``
        self.events = 0
        self.heard = False  # it sent any byte (a port probe sends none and is closed without a word)
        self.closing = False  # its peer hung up: close it once ``out`` is written


class _Pipes:
    """The event loop both kinds share: accept, hand each connection its pair, pass bytes on."""

    what = "the rendezvous"

    def __init__(self, listener: socket.socket, log: Callable[[str], None] | None) -> None:
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._said: set[str] = set()
        listener.setblocking(False)
        listener.listen(LISTEN_BACKLOG)
        self.sock = listener
        self.port = listener.getsockname()[1]
        self._ends: set[_End] = set()
        self._pending: dict[_End, float] = {}  # ends in their handshake -> its deadline
        self._next_expiry = 0.0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._resume_at: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"dptrain-{type(self).__name__.lower()}")
        self._thread.start()

    def close(self) -> None:
        """Stop: close the listening socket and every pipe (idempotent)."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)

    # -- what each kind does with a new connection ---------------------------------------------
    def _accepted(self, end: _End) -> None:
        raise NotImplementedError

    def _through(self, end: _End) -> None:
        """``end`` passed its handshake."""

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                for key, events in self._selector.select(timeout=0.25):
                    if key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.data == "accept":
                        self._accept()
                    else:
                        self._event(key.data, events)
                self._expire()
        finally:
            for end in list(self._ends):
                self._close(end)
            for sock in (self.sock, self._wake_r, self._wake_w):
                sock.close()
            self._selector.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                # Out of descriptors: stop listening a while instead of being woken, at once, forever.
                self._say("descriptors", f"dptrain run: {self.what} cannot take more connections ({exc.strerror}); "
                                         f"raise the limit on open files (`ulimit -n`)")
                self._selector.unregister(self.sock)
                self._resume_at = time.monotonic() + ACCEPT_RETRY_S
                return
            end = self._register(sock, f"{peer[0]}:{peer[1]}")
            self._accepted(end)

    def _register(self, sock: socket.socket, where: str, connect_to=None) -> _End:
        """A new end of a pipe; ``connect_to``: its outgoing connection starts now (not blocking)."""
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end = _End(sock, where)
        self._ends.add(end)
        if connect_to is not None:
            code = sock.connect_ex(connect_to)
            if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self._fail(end, "connect", f"cannot connect ({errno.errorcode.get(code, code)})")
                return end
            end.connecting = True
        self._update(end)
        return end

    def _pair(self, a: _End, b: _End) -> None:
        a.peer, b.peer = b, a

    def _start_handshake(self, end: _End, step, started: bool = True) -> None:
        """``end`` has to pass ``step`` within ``auth.HANDSHAKE_S``; ``started``: it begins now
        (else once its connection is up, see ``_connected``)."""
        end.step = step
        self._pending.setdefault(end, time.monotonic() + auth.HANDSHAKE_S)
        if started:
            self._advance(end, None)

    def _advance(self, end: _End, data: bytes | None) -> None:
        """Feed ``end``'s handshake; on success the end is ready and what waited moves on."""
        try:
            send, end.want = end.step.send(data)
            end.out += send
            while end.want == 0:
                send, end.want = end.step.send(b"")
                end.out += send
        except StopIteration:
            end.step = None
            end.ready = True
            self._pending.pop(end, None)
            self._through(end)
            self._flush_held(end)
        except auth.AuthError as exc:
            self._fail(end, "auth", str(exc))
            return
        self._update(end)

    def _event(self, end: _End, events: int) -> None:
        if end not in self._ends:
            return
        if end.connecting and events & selectors.EVENT_WRITE:
            code = end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._fail(end, "connect", f"cannot connect ({errno.errorcode.get(code, code)})")
                return
            end.connecting = False
            self._connected(end)
            if end not in self._ends:
                return
        if events & selectors.EVENT_WRITE and end.out:
            self._write(end)
        if end in self._ends and events & selectors.EVENT_READ:
            self._read(end)

    def _connected(self, end: _End) -> None:
        """``end``'s outgoing connection is up; a plain one is ready at once."""
        if end.step is None:
            end.ready = True
            self._flush_held(end)
        self._update(end)

    def _read(self, end: _End) -> None:
        try:
            chunk = end.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._hang_up(end)
            return
        end.heard = True
        end.held += chunk
        while end.step is not None and len(end.held) >= end.want and end in self._ends:
            data = bytes(end.held[:end.want])
            del end.held[:end.want]
            self._advance(end, data)
        if end in self._ends and end.step is None:
            self._pass_on(end)

    def _pass_on(self, end: _End) -> None:
        """What ``end`` sent goes to its peer once the peer is ready (else it waits in ``held``)."""
        peer = end.peer
        if peer is not None and peer.ready and end.held:
            peer.out += end.held
            end.held.clear()
            self._update(peer)
        self._update(end)

    def _flush_held(self, end: _End) -> None:
        """``end`` became ready: what its peer sent meanwhile goes to it, and its own leftovers on."""
        if end.peer is not None and end.peer.held and end.peer.step is None:
            self._pass_on(end.peer)
        if end.held:
            self._pass_on(end)

    def _write(self, end: _End) -> None:
        try:
            while end.out:
                sent = end.sock.send(end.out)
                del end.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._hang_up(end)
            return
        if end.peer is not None and end.peer in self._ends:
            self._update(end.peer)  # it may be read from again
        if not end.out and end.closing:
            self._close(end)
            return
        self._update(end)

    def _update(self, end: _End) -> None:
        """Watch ``end`` for what it can do now: read (unless too much waits), write (when it has bytes)."""
        if end not in self._ends:
            return
        if end.connecting:
            events = selectors.EVENT_WRITE
        else:
            waiting = len(end.held) + (len(end.peer.out) if end.peer is not None else 0)
            events = (selectors.EVENT_READ if end.step is not None or waiting < MAX_HELD else 0) | (
                selectors.EVENT_WRITE if end.out else 0)
        if events == end.events:
            return
        if not end.events:
            self._selector.register(end.sock, events, end)
        elif not events:
            self._selector.unregister(end.sock)
        else:
            self._selector.modify(end.sock, events, end)
        end.events = events

    def _hang_up(self, end: _End) -> None:
        """``end`` closed (or broke): deliver what it sent, then close its peer."""
        peer = end.peer
        if end.step is not None and end.heard:
            self._say("hung-up", self._failure(end, "it hung up during the handshake"))
        self._close(end)
        if peer is None or peer not in self._ends:
            return
        if not peer.ready or not peer.out and not end.held:
            self._close(peer)
            return
        if end.held and peer.ready:
            peer.out += end.held
        peer.closing = True
        self._update(peer)

    def _fail(self, end: _End, kind: str, why: str) -> None:
        self._say(kind, self._failure(end, why))
        peer = end.peer
        self._close(end)
        if peer is not None:
            self._close(peer)

    def _failure(self, end: _End, why: str) -> str:
        return f"dptrain run: {self.what}: {why}"

    def _close(self, end: _End) -> None:
        if end not in self._ends:
            return
        self._ends.discard(end)
        self._pending.pop(end, None)
        if end.events:
            self._selector.unregister(end.sock)
        end.sock.close()
        end.step = None

    def _expire(self) -> None:
        now = time.monotonic()
        if self._resume_at is not None and now >= self._resume_at and not self._stop:
            self._resume_at = None
            self._selector.register(self.sock, selectors.EVENT_READ, "accept")
        if now < self._next_expiry:
            return
        self._next_expiry = now + 0.25
        for end in [e for e, deadline in self._pending.items() if now > deadline]:
            self._fail(end, "deadline", f"no answer to the handshake from {end.where} within {auth.HANDSHAKE_S:g}s")

    def _say(self, kind: str, message: str) -> None:
        """One line, the first time this kind of trouble happens."""
        if kind not in self._said:
            self._said.add(kind)
            self._log(clean(message, 600))


class Gate(_Pipes):
    """Node 0: takes connections on ``listener`` (bound to ``--master-addr:--master-port``) and pipes
    those that prove the secret to the store at 127.0.0.1:``store_port``.

    ``log`` prints one launcher line (default: standard error); each kind of refusal is said once.
    """

    def __init__(self, listener: socket.socket, store_port: int, secret: bytes,
                 log: Callable[[str], None] | None = None) -> None:
        self.secret = secret
        self.target = ("127.0.0.1", store_port)
        host, port = listener.getsockname()[:2]
        self.what = f"the rendezvous at {host}:{port}"
        super().__init__(listener, log)

    def _accepted(self, end: _End) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._say("pending", f"dptrain run: {self.what} holds {MAX_PENDING} connections in the handshake; "
                                 f"further ones are closed until they are through")
            self._close(end)
            return
        self._start_handshake(end, auth.server(self.secret))

    def _through(self, end: _End) -> None:
        store = self._register(socket.socket(socket.AF_INET, socket.SOCK_STREAM), "the store", self.target)
        if store in self._ends:
            self._pair(end, store)
        elif end in self._ends:
            self._close(end)

    def _failure(self, end: _End, why: str) -> str:
        if end.where == "the store":
            return f"dptrain run: {self.what} could not reach its own store at 127.0.0.1:{self.target[1]}: {why}"
        return (f"dptrain run: refused a connection from {end.where} to {self.what}: {why}. Only the job's nodes, "
                f"with its secret, get in (give every node the same --secret-file)")


class Forwarder(_Pipes):
    """Every other node: takes the ranks' connections on 127.0.0.1 (``port``) and pipes each to
    node 0's gate at ``host:port`` over a connection that passed the handshake with ``secret``.

    Raises ValueError when ``host`` does not resolve.
    """

    def __init__(self, host: str, port: int, secret: bytes, log: Callable[[str], None] | None = None) -> None:
        self.secret = secret
        try:
            self.target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
        except socket.gaierror as exc:
            raise ValueError(f"--master-addr {host}: the name does not resolve ({exc.strerror})") from None
        self.what = f"node 0's rendezvous at {host}:{port}"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        super().__init__(listener, log)

    def _accepted(self, end: _End) -> None:
        end.ready = True  # a rank's connection: plain; what it sends waits until the gate lets us in
        upstream = self._register(socket.socket(socket.AF_INET, socket.SOCK_STREAM), self.what, self.target)
        if upstream not in self._ends:
            self._close(end)
            return
        self._pair(end, upstream)
        self._start_handshake(upstream, auth.client(self.secret), started=False)  # once connected

    def _connected(self, end: _End) -> None:
        if end.step is not None:  # the gate's connection is up: its handshake starts
            self._advance(end, None)
            return
        super()._connected(end)

    def _failure(self, end: _End, why: str) -> str:
        return (f"dptrain run: a rank's connection to {self.what} failed: {why}. Is that node 0's address and "
                f"port, and does every node have the same secret?")
