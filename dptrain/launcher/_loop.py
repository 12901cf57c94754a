"""One listening socket served by one selector loop on a thread of its own.

The store (``store.StoreServer``), node 0's gate and the other nodes' forwarders
(``tunnel.Gate``, ``tunnel.Forwarder``) are each such a loop; this is what they share: the
thread and the wake-up pair that stops it, accepting (and what to do when descriptors run
out), the check that a loopback peer is the job's own user (``_admission.foreign_uid``'s rule,
one read of ``/proc/net/tcp`` per batch of accepted connections), and saying each kind of
trouble once. A subclass says what a connection is (``_accepted``), what its events do
(``_event``), what is due on every turn (``_tick``) and how it closes what it holds
(``_shutdown``).
"""

from __future__ import annotations

import errno
import selectors
import socket
import sys
import threading
import time
from typing import Callable

from dptrain.launcher._admission import SAY_EVERY_S, describe_uid, is_loopback, job_uid, peer_uids, tables_readable
from dptrain.launcher.store_values import clean

__all__ = ["SelectorLoop", "LISTEN_BACKLOG", "ACCEPT_RETRY_S", "ACCEPT_BATCH"]

#: Connections that may wait to be accepted. The kernel caps it at net.core.somaxconn (4096
#: by default since Linux 5.4): the host's maximum, which torch's server asks for too.
LISTEN_BACKLOG = 65535
#: Seconds to wait before accepting again after ``accept`` found no free descriptor.
ACCEPT_RETRY_S = 0.2
#: Connections accepted in one go (their peers' uids are looked up with one read of the tables).
ACCEPT_BATCH = 64


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class SelectorLoop:
    """Serve ``listener`` (bound) from a thread named ``name`` until ``close()``.

    ``log`` prints one line (default: standard error). ``check_uid`` (default True): refuse a
    loopback connection whose peer is another user's (see [Note: only the job's own user on
    loopback] in ``_admission``). The subclass calls this constructor last: the thread starts
    in it.
    """

    #: Names the listener in messages ("the rendezvous store on 127.0.0.1:4242").
    what = "the rendezvous"
    #: Starts every line of its own.
    prefix = "dptrain run: "
    #: Seconds between two turns of ``_tick`` when nothing happens.
    tick_s = 0.25

    def __init__(self, listener: socket.socket, name: str, log: Callable[[str], None] | None = None,
                 check_uid: bool = True) -> None:
        self._log = log or _stderr
        self._said: set[str] = set()
        listener.setblocking(False)
        listener.listen(LISTEN_BACKLOG)
        self.sock = listener
        self.port = listener.getsockname()[1]
        # None: every loopback peer is let in (asked not to check, or no /proc/net/tcp to check with)
        self.uid = job_uid() if check_uid and tables_readable() else None
        self._uid_said: dict[int | None, float] = {}  # uid -> when its last refusal was said
        self.refused_uids = 0  # connections refused for their uid (a count for tests and benchmarks)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._accepting = True
        self._resume_at: float | None = None  # when to accept again after running out of descriptors
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop: close every connection and the listening socket (idempotent)."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)

    # -- what a subclass does ------------------------------------------------------------------------
    def _accepted(self, sock: socket.socket, peer) -> None:
        """A new connection, non-blocking and let in."""
        raise NotImplementedError

    def _event(self, data, events: int) -> None:
        """``events`` on a socket registered with ``data``."""
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """Called after every turn of the loop: deadlines."""

    def _shutdown(self) -> None:
        """Close every connection (on the loop's thread, as it ends)."""

    def _full(self, accepted: int) -> str | None:
        """Why no further connection can be taken now, ``accepted`` of this batch not yet handed
        to ``_accepted`` (a line to say once), or None."""
        return None

    # -- the loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                timeout = self.tick_s
                if self._resume_at is not None:
                    timeout = min(timeout, max(0.0, self._resume_at - time.monotonic()))
                for key, events in self._selector.select(timeout=timeout):
                    if key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.data == "accept":
                        self._accept()
                    else:
                        self._event(key.data, events)
                    if self._stop:
                        break
                now = time.monotonic()
                if self._resume_at is not None and now >= self._resume_at:
                    self._listen(True)
                self._tick(now)
        finally:
            self._shutdown()
            for sock in (self.sock, self._wake_r, self._wake_w):
                try:
                    sock.close()
                except OSError:
                    pass
            self._selector.close()

    def _listen(self, on: bool, retry_at: float | None = None) -> None:
        """Accept connections again, or stop until ``_listen(True)`` (``retry_at`` None) or until ``retry_at``."""
        self._resume_at = None if on else retry_at
        if on != self._accepting and not self._stop:
            self._accepting = on
            if on:
                self._selector.register(self.sock, selectors.EVENT_READ, "accept")
            else:
                self._selector.unregister(self.sock)

    def _accept(self) -> None:
        batch = []
        while len(batch) < ACCEPT_BATCH:
            why = self._full(len(batch))
            if why is not None:
                self._say("connections", why)
                self._listen(False)
                break
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that client gave up before we took it
                # Out of descriptors (EMFILE, ENFILE) or memory: the waiting connection keeps the
                # socket readable, so stop listening a while instead of being woken at once, forever.
                self._say("descriptors", f"{self.prefix}{self.what} cannot take more connections ({exc.strerror}); "
                                         f"new ones wait. Raise the limit on open files (`ulimit -n`)")
                self._listen(False, time.monotonic() + ACCEPT_RETRY_S)
                break
            batch.append((sock, peer))
        if batch:
            self._admit(batch)

    def _admit(self, batch: list) -> None:
        """Let each accepted connection in, unless it is a loopback one of another user."""
        uids = None
        if self.uid is not None:
            local = []
            for sock, peer in batch:
                if isinstance(peer, tuple) and is_loopback(peer[0]):
                    try:
                        local.append((sock.getsockname(), peer))
                    except OSError:
                        continue
            if local:
                # Unreadable now (no descriptor left): refuse them rather than let them in unchecked.
                uids = peer_uids(local) or {peer: None for _, peer in local}
        for sock, peer in batch:
            if uids is not None and peer in uids and uids[peer] != self.uid:
                self._refuse_uid(peer, uids[peer])
                sock.close()
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # it was reset meanwhile
                sock.close()
                continue
            self._accepted(sock, peer)

    def _refuse_uid(self, peer, uid: int | None) -> None:
        self.refused_uids += 1
        now = time.monotonic()
        last = self._uid_said.get(uid)
        if last is not None and now - last < SAY_EVERY_S:
            return
        self._uid_said[uid] = now
        self._log(clean(f"{self.prefix}{self.what} refused a connection from port {peer[1]} on this machine: its "
                        f"socket belongs to {describe_uid(uid)}, not to the job's user (uid {self.uid}); on loopback "
                        f"only the job's own processes get in", 600))

    def _say(self, kind: str, line: str) -> None:
        """Log ``line``, the first time this kind of trouble happens."""
        if kind not in self._said:
            self._said.add(kind)
            self._log(clean(line, 600))
