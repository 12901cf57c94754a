"""The pipes between a job's nodes when it has a secret: node 0's gate, the other nodes' forwarders.

See [Note: only the job gets in] in :mod:`dptrain.launcher.auth`. Both are a thread of the
launcher with one selector loop (``_loop.SelectorLoop``), which pipes every accepted
connection to a connection of its own to the target; one side of each pair passes the
handshake first:

* ``Gate`` (node 0) listens on ``--master-addr:--master-port``; an accepted connection must
  pass the handshake as a client (``auth.server`` runs on it) before the gate connects it to
  the store on 127.0.0.1. Nothing it sends before that reaches the store, and one that fails,
  says nothing within ``FIRST_BYTE_S`` or is not through within ``auth.HANDSHAKE_S`` is closed
  with no answer but the challenge (and ``auth.REFUSED`` for a wrong proof). Connections in the
  handshake are bounded per address and in all, the oldest evicted for a new one (see [Note:
  a flood of silent connections] in ``_admission``).
* ``Forwarder`` (every other node) listens on 127.0.0.1 (a free port, handed to the ranks as
  ``MASTER_PORT``); for every accepted connection it opens one to node 0's gate, passes the
  handshake there (``auth.client``), then sends on what the rank has sent meanwhile; a
  connection to the gate closed during the handshake is made again, within ``retry_s``.

Both refuse a loopback connection from another user's socket (see [Note: only the job's own
user on loopback] in ``_admission``).

Bytes are passed on as they come, in both directions, and a side that does not read its
answers is not read from (``MAX_HELD`` bytes at most wait on either side). When one side
closes, what it sent is delivered and the other side is closed too.
"""

from __future__ import annotations

import errno
import random
import selectors
import socket
import time
from typing import Callable

from dptrain.launcher import auth
from dptrain.launcher._admission import FIRST_BYTE_S, MAX_PENDING, MAX_PENDING_PER_ADDRESS, Pending
from dptrain.launcher._loop import SelectorLoop

__all__ = ["Gate", "Forwarder", "RETRY_S"]

#: Bytes that may wait on one side of a pipe before the other side is not read from.
MAX_HELD = 4 * 1024 * 1024
#: Seconds a forwarder keeps making a rank's connection to the gate again (see ``Forwarder``).
RETRY_S = 60.0


class _End:
    """One socket of a pipe: what waits to be written to it, and its handshake while it runs."""

    __slots__ = ("sock", "where", "peer", "out", "held", "step", "want", "connecting", "ready", "events", "heard",
                 "closing", "tries", "since")

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
        self.tries = 0  # a rank's end (forwarder): connections to the gate made again for it
        self.since = 0.0  # ... since when it waits for one that passes


class _Pipes(SelectorLoop):
    """The event loop both kinds share (see ``_loop.SelectorLoop``): hand each accepted connection
    its pair, pass bytes on."""

    what = "the rendezvous"

    def __init__(self, listener: socket.socket, log: Callable[[str], None] | None) -> None:
        self._ends: set[_End] = set()
        self._deadlines: dict[_End, float] = {}  # ends in a handshake of our own as a client -> its deadline
        self._next_expiry = 0.0
        super().__init__(listener, f"dptrain-{type(self).__name__.lower()}", log)

    # -- what each kind does with a new connection ---------------------------------------------
    def _new(self, end: _End, peer) -> None:
        raise NotImplementedError

    def _through(self, end: _End) -> None:
        """``end`` passed its handshake."""

    def _heard(self, end: _End) -> None:
        """``end`` sent its first byte."""

    def _closed(self, end: _End) -> None:
        """``end`` is closed."""

    def _lost(self, end: _End, kind: str, why: str) -> bool:
        """``end`` failed (``kind``: connect, auth, closed, deadline); True: handled (tried again)."""
        return False

    # -- the loop (see _loop.SelectorLoop) -------------------------------------------------------
    def _accepted(self, sock: socket.socket, peer) -> None:
        self._new(self._register(sock, f"{peer[0]}:{peer[1]}"), peer)

    def _shutdown(self) -> None:
        for end in list(self._ends):
            self._close(end)

    def _register(self, sock: socket.socket, where: str, connect_to=None) -> _End | None:
        """A new end of a pipe; ``connect_to``: its outgoing connection starts now (not blocking),
        None when it failed at once (said)."""
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end = _End(sock, where)
        self._ends.add(end)
        if connect_to is not None:
            code = sock.connect_ex(connect_to)
            if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self._say("connect", self._failure(end, f"cannot connect ({errno.errorcode.get(code, code)})"))
                self._close(end)
                return None
            end.connecting = True
        self._update(end)
        return end

    def _pair(self, a: _End, b: _End) -> None:
        a.peer, b.peer = b, a

    def _start_handshake(self, end: _End, step, started: bool = True, timed: bool = True) -> None:
        """``end`` has to pass ``step``, within ``auth.HANDSHAKE_S`` when ``timed`` (else its
        deadline is kept elsewhere); ``started``: it begins now (else once its connection is up,
        see ``_connected``)."""
        end.step = step
        if timed:
            self._deadlines.setdefault(end, time.monotonic() + auth.HANDSHAKE_S)
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
            self._deadlines.pop(end, None)
            self._through(end)
            self._flush_held(end)
        except auth.AuthError as exc:
            self._fail(end, "auth", str(exc))  # a mismatch or another protocol: trying again will not help
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
        if not end.heard:
            end.heard = True
            self._heard(end)
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
        if end.step is not None or end.connecting:
            if self._lost(end, "closed", "it closed the connection during the handshake"):
                return
            if end.heard:
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
        if self._lost(end, kind, why):
            return
        self._say(kind, self._failure(end, why))
        if end.out:  # the gate's REFUSED: said before it closes, so that the node knows why
            try:
                end.sock.send(end.out)
            except OSError:
                pass
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
        self._deadlines.pop(end, None)
        self._closed(end)
        if end.events:
            self._selector.unregister(end.sock)
        end.sock.close()
        end.step = None

    def _tick(self, now: float) -> None:
        if now < self._next_expiry:
            return
        self._next_expiry = now + 0.25
        for end in [e for e, deadline in self._deadlines.items() if now > deadline]:
            self._fail(end, "deadline", f"no answer to the handshake from {end.where} within {auth.HANDSHAKE_S:g}s")


class Gate(_Pipes):
    """Node 0: takes connections on ``listener`` (bound to ``--master-addr:--master-port``) and pipes
    those that prove the secret to the store at 127.0.0.1:``store_port``.

    A connection waiting in the handshake holds one of ``max_pending`` slots (default
    ``MAX_PENDING``), at most ``max_per_address`` (``MAX_PENDING_PER_ADDRESS``) per source
    address; a new one takes the slot of the oldest (of its address, when that address holds its
    most), and one that says nothing within ``first_byte_s`` (``FIRST_BYTE_S``) is closed: see
    [Note: a flood of silent connections] in ``_admission``. ``log`` prints one launcher line
    (default: standard error); each kind of refusal is said once.

    Example::

        gate = Gate(listen_on("10.0.0.1", 29500), store_port, secret)   # node 0
        ...
        gate.close()
    """

    def __init__(self, listener: socket.socket, store_port: int, secret: bytes,
                 log: Callable[[str], None] | None = None, max_pending: int = MAX_PENDING,
                 max_per_address: int = MAX_PENDING_PER_ADDRESS, first_byte_s: float = FIRST_BYTE_S) -> None:
        self.secret = secret
        self.target = ("127.0.0.1", store_port)
        host, port = listener.getsockname()[:2]
        self.what = f"the rendezvous at {host}:{port}"
        self.slots = Pending(max_pending, max_per_address, first_byte_s, auth.HANDSHAKE_S)
        self.evicted = 0  # connections closed to make room (a count for tests)
        super().__init__(listener, log)

    def _new(self, end: _End, peer) -> None:
        for old in self.slots.add(end, peer[0], time.monotonic()):
            self.evicted += 1
            if self.slots.count(peer[0]) >= self.slots.max_per_address:
                self._say("evicted-address", f"dptrain run: {self.what} holds {self.slots.max_per_address} "
                                             f"connections from {peer[0]} in the handshake, the most one address may; "
                                             f"the oldest are closed as new ones come. Something may be flooding it")
            else:
                self._say("evicted", f"dptrain run: {self.what} holds {self.slots.max_total} connections in the "
                                     f"handshake, the most it takes; the oldest are closed as new ones come. "
                                     f"Something may be flooding it")
            self._close(old)
        self._start_handshake(end, auth.server(self.secret), timed=False)  # its deadlines are the slot's

    def _heard(self, end: _End) -> None:
        self.slots.heard(end)

    def _closed(self, end: _End) -> None:
        self.slots.discard(end)

    def _through(self, end: _End) -> None:
        self.slots.discard(end)
        store = self._register(socket.socket(socket.AF_INET, socket.SOCK_STREAM), "the store", self.target)
        if store is not None:
            self._pair(end, store)
        elif end in self._ends:
            self._close(end)

    def _tick(self, now: float) -> None:
        if now >= self._next_expiry:
            for end, what in self.slots.expired(now):
                if what == "first byte":  # most likely a port probe or a flood: not a line each
                    self._say("silent", self._failure(end, f"it said nothing within {self.slots.first_byte_s:g}s"))
                    self._close(end)
                else:
                    self._fail(end, "deadline", f"no answer to the handshake from {end.where} within "
                                                f"{auth.HANDSHAKE_S:g}s")
        super()._tick(now)

    def _failure(self, end: _End, why: str) -> str:
        if end.where == "the store":
            return f"dptrain run: {self.what} could not reach its own store at 127.0.0.1:{self.target[1]}: {why}"
        return (f"dptrain run: refused a connection from {end.where} to {self.what}: {why}. Only the job's nodes, "
                f"with its secret, get in (give every node the same --secret-file)")


class Forwarder(_Pipes):
    """Every other node: takes the ranks' connections on 127.0.0.1 (``port``) and pipes each to
    node 0's gate at ``host:port`` over a connection that passed the handshake with ``secret``.

    A connection to the gate that cannot be made, or is closed or silent during the handshake
    (a flood may evict it there), is made again with backoff for up to ``retry_s`` seconds
    (default ``RETRY_S``; the launcher passes its join timeout) while the rank's bytes wait; a
    secret that does not match is not tried again. ``log`` prints one launcher line (default:
    standard error).

    Raises ValueError when ``host`` does not resolve.

    Example::

        forwarder = Forwarder("10.0.0.1", 29500, secret)   # every node but node 0
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(forwarder.port)
    """

    def __init__(self, host: str, port: int, secret: bytes, log: Callable[[str], None] | None = None,
                 retry_s: float = RETRY_S) -> None:
        self.secret = secret
        self.retry_s = retry_s
        try:
            self.target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
        except socket.gaierror as exc:
            raise ValueError(f"--master-addr {host}: the name does not resolve ({exc.strerror})") from None
        self.what = f"node 0's rendezvous at {host}:{port}"
        self._retries: list[tuple[float, _End]] = []  # (when, the rank's end) for another connection to the gate
        self.retried = 0  # connections to the gate made again (a count for tests)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        super().__init__(listener, log)

    def _new(self, end: _End, peer) -> None:
        end.ready = True  # a rank's connection: plain; what it sends waits until the gate lets us in
        end.since = time.monotonic()
        self._upstream(end)

    def _upstream(self, end: _End) -> None:
        """A connection to the gate for the rank's ``end``, its handshake once it is up."""
        upstream = self._register(socket.socket(socket.AF_INET, socket.SOCK_STREAM), self.what, self.target)
        if upstream is None:
            if not self._again(end, "cannot connect"):
                self._close(end)
            return
        self._pair(end, upstream)
        self._start_handshake(upstream, auth.client(self.secret), started=False)  # once connected

    def _lost(self, end: _End, kind: str, why: str) -> bool:
        rank = end.peer
        if kind not in ("connect", "closed", "deadline") or rank is None or end.where != self.what:
            return False
        self._close(end)
        rank.peer = None
        if self._again(rank, why):
            return True
        self._say(kind, self._failure(end, f"the handshake was refused or closed by the rendezvous ({rank.tries + 1} "
                                           f"tries over {time.monotonic() - rank.since:.1f}s; something may be "
                                           f"flooding it, or it is not a dptrain gate): {why}"))
        self._close(rank)
        return True

    def _again(self, rank: _End, why: str) -> bool:
        """Schedule another connection to the gate for ``rank``; False when its time is up."""
        if rank not in self._ends:
            return True
        now = time.monotonic()
        delay = min(1.0, 0.05 * 2 ** rank.tries) * random.uniform(0.5, 1.0)
        if now + delay - rank.since > self.retry_s:
            return False
        rank.tries += 1
        self.retried += 1
        self._retries.append((now + delay, rank))
        return True

    def _tick(self, now: float) -> None:
        if self._retries:
            due = [rank for when, rank in self._retries if when <= now]
            self._retries = [(when, rank) for when, rank in self._retries if when > now]
            for rank in due:
                if rank in self._ends:
                    self._upstream(rank)
        super()._tick(now)

    def _connected(self, end: _End) -> None:
        if end.step is not None:  # the gate's connection is up: its handshake starts
            self._advance(end, None)
            return
        super()._connected(end)

    def _failure(self, end: _End, why: str) -> str:
        return (f"dptrain run: a rank's connection to {self.what} failed: {why}. Is that node 0's address and "
                f"port, and does every node have the same secret?")
