"""Who a listener of the launcher lets in before a byte of the job is served.

Two rules, shared by the store (``store``), node 0's gate and the other nodes' forwarders
(``tunnel``), all served by ``_loop.SelectorLoop``:

* ``Pending``: connections that have not yet proved anything (the gate's handshake) hold a
  slot each, at most ``MAX_PENDING_PER_ADDRESS`` per source address and ``MAX_PENDING`` in
  all, and have ``FIRST_BYTE_S`` to say anything and ``auth.HANDSHAKE_S`` to finish.
* ``foreign_uid``: on Linux, a connection that arrives on a loopback address is let in only
  when the socket at its other end belongs to the job's own user.

[Note: a flood of silent connections]
The gate used to hold up to 4,096 connections in the handshake, each silent for up to 10 s,
and closed any further one at once. One outside address holding ~4,150 silent connections
thus kept a real node out: its launcher's connection was closed before the challenge, and it
gave up within 2 s saying that the secret was wrong. Now a new connection is never the one
refused: when its address already holds ``MAX_PENDING_PER_ADDRESS`` slots, that address's
oldest pending connection is closed; when all ``MAX_PENDING`` are taken, the oldest of all.
A node answers the challenge within a round trip, so it is evicted only by a flood of more
than ``MAX_PENDING`` connections from many addresses within that round trip; it then tries
again (``StoreClient``, ``Forwarder``) within its join timeout. A silent connection is closed
after ``FIRST_BYTE_S``, so an address that keeps its slots has to keep opening connections.
The first byte's deadline is short because a node sends its answer as soon as the challenge
arrives; ``auth.HANDSHAKE_S`` stays the limit for the whole handshake.

[Note: only the job's own user on loopback]
A store on 127.0.0.1 (one node), a forwarder (the other nodes' ranks' way to node 0) and a
gate reached on loopback can be reached by every user of the machine: on a login node or a
shared GPU server another user could read the job's keys, stop it by writing
``launcher/failed/<k>``, or ride on the forwarder's handshake into node 0's store. TCP has no
credentials, but on Linux the kernel knows every socket of the network namespace with its
owner's uid: the peer of an accepted loopback connection is the socket whose own address is
the connection's remote one and the other way round. It is asked by sock_diag (netlink, an
exact lookup by those addresses, as ``ss`` does; about 0.15 ms), else read from
``/proc/net/tcp`` and ``/proc/net/tcp6``, which the kernel writes by walking all its sockets:
tens of milliseconds on a busy host, once per batch of accepted connections. The listeners close a connection whose peer belongs to another uid than the job's
(``os.geteuid()`` of the launcher: its ranks are its children) and say so in one line naming
the uid and the port (at most once per ``SAY_EVERY_S`` for each uid, so a flood does not flood
the log). Root (uid 0) is refused too when the job is not root's: root can read the job's
memory anyway, so this guards against other users, not against root, but the rule has no
exception that would let a root-run tool in unnoticed. A peer that is not listed (it closed
already) is refused too. Where neither can be asked (not Linux, or /proc hidden) the
check is off and connections are let in as before; ``DPTRAIN_STORE=torch`` hosts a one-node
store with torch's server, which has no such check. The lookup is made when a connection is
accepted, never per request: see ``benchmarks/RESULTS.md`` for the cost.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections import OrderedDict
from typing import Hashable, Iterable

__all__ = ["Pending", "address_key", "foreign_uid", "peer_uids", "tables_readable", "is_loopback", "job_uid", "describe_uid",
           "MAX_PENDING", "MAX_PENDING_PER_ADDRESS", "FIRST_BYTE_S", "SAY_EVERY_S"]

#: Connections that may wait in the handshake at once, from all addresses together.
MAX_PENDING = 1024
#: ... and from one source address (an IPv6 address counts by its /64).
MAX_PENDING_PER_ADDRESS = 64
#: Seconds a new connection has to send its first byte.
FIRST_BYTE_S = 2.0
#: Seconds between two lines about refused connections of the same uid.
SAY_EVERY_S = 60.0

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


# -- pre-authentication slots ---------------------------------------------------------------------
def address_key(host: str) -> str:
    """The address a pending slot counts against: the IPv4 address, or an IPv6 address's /64
    (one host usually holds a whole /64); an IPv4-mapped IPv6 address counts as its IPv4 one."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Pending:
    """The connections that hold a pre-authentication slot, oldest first (see [Note: a flood of
    silent connections]).

    ``max_total`` (default ``MAX_PENDING``) and ``max_per_address`` (``MAX_PENDING_PER_ADDRESS``)
    bound the slots; ``first_byte_s`` (``FIRST_BYTE_S``) and ``deadline_s`` (10 s, the
    handshake's) are the deadlines, counted from ``add``. Items are any hashable values (the
    caller's connection objects); nothing here touches a socket.

    Example::

        pending = Pending(max_total=2, max_per_address=1)
        pending.add("a", "10.0.0.1", now=0.0)              # []
        pending.add("b", "10.0.0.1", now=0.1)              # ["a"]: that address's oldest goes
        pending.expired(now=5.0)                           # [("b", "first byte")]
    """

    def __init__(self, max_total: int = MAX_PENDING, max_per_address: int = MAX_PENDING_PER_ADDRESS,
                 first_byte_s: float = FIRST_BYTE_S, deadline_s: float = 10.0) -> None:
        if max_total < 1 or max_per_address < 1:
            raise ValueError(f"Pending needs room for at least one connection (max_total={max_total}, "
                             f"max_per_address={max_per_address})")
        self.max_total, self.max_per_address = max_total, max_per_address
        self.first_byte_s, self.deadline_s = first_byte_s, deadline_s
        self._all: OrderedDict[Hashable, list] = OrderedDict()  # item -> [address, since, heard]
        self._by_address: dict[str, OrderedDict[Hashable, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, item) -> bool:
        return item in self._all

    def count(self, address: str) -> int:
        """Slots that ``address`` (as ``address_key`` counts it) holds now."""
        return len(self._by_address.get(address_key(address), ()))

    def add(self, item, address: str, now: float) -> list:
        """Give ``item`` (from ``address``) a slot; return the items evicted to make room, oldest first.

        The caller closes what is returned. The new item is never among them.
        """
        key = address_key(address)
        evicted = []
        mine = self._by_address.get(key)
        if mine is not None and len(mine) >= self.max_per_address:
            evicted.append(next(iter(mine)))
        elif len(self._all) >= self.max_total:
            evicted.append(next(iter(self._all)))
        for old in evicted:
            self.discard(old)
        self._all[item] = [key, now, False]
        self._by_address.setdefault(key, OrderedDict())[item] = None
        return evicted

    def heard(self, item) -> None:
        """``item`` sent its first byte: from now on only the whole handshake's deadline applies."""
        entry = self._all.get(item)
        if entry is not None:
            entry[2] = True

    def discard(self, item) -> None:
        """``item`` is through (or closed): its slot is free."""
        entry = self._all.pop(item, None)
        if entry is None:
            return
        mine = self._by_address[entry[0]]
        del mine[item]
        if not mine:
            del self._by_address[entry[0]]

    def expired(self, now: float) -> list[tuple[Hashable, str]]:
        """The items past a deadline, each with ``"first byte"`` or ``"handshake"``; they keep their
        slots until ``discard``.

        Items are kept in the order they came, so the walk stops at the first one that is
        younger than the first byte's deadline.
        """
        out = []
        for item, (_, since, heard) in self._all.items():
            age = now - since
            if age <= self.first_byte_s:
                break
            if age > self.deadline_s:
                out.append((item, "handshake"))
            elif not heard:
                out.append((item, "first byte"))
        return out


# -- the uid at the other end of a loopback connection ---------------------------------------------
def job_uid() -> int | None:
    """The uid a loopback peer must have: this process's effective uid (None where there is none)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as ``accept`` gives it) is a loopback address: 127.0.0.0/8,
    ::1, or an IPv4-mapped 127.x."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _hex(host: str, port: int) -> tuple[str, str]:
    """``host:port`` as ``/proc/net/tcp`` (v4) and ``/proc/net/tcp6`` write it: the address's
    32-bit words in this machine's byte order, upper-case hex, then the port."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        v4 = ip.ipv4_mapped.packed
        v6 = ip.packed
    elif ip.version == 4:
        v4 = ip.packed
        v6 = b"\0" * 10 + b"\xff\xff" + ip.packed  # how an AF_INET6 socket lists a v4 peer
    else:
        v4, v6 = None, ip.packed
    four = "%08X" % struct.unpack("=I", v4)[0] if v4 is not None else None
    six = "".join("%08X" % w for w in struct.unpack("=4I", v6))
    return (f"{four}:{port:04X}" if four else ""), f"{six}:{port:04X}"


#: Linux's sock_diag: one exact lookup of a socket by its addresses (what ``ss`` uses).
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_NOCOOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12  # nlmsghdr, then inet_diag_msg: family..retrans, sockid, expires..wqueue


class _NoDiag(Exception):
    """sock_diag cannot answer here (not Linux, or no inet_diag in the kernel)."""


def _diag_request(seq: int, local, remote) -> bytes:
    """A sock_diag request for the TCP socket whose own address is ``local`` and peer ``remote``."""
    family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET

    def packed(host: str) -> bytes:
        return socket.inet_pton(family, host.split("%", 1)[0]).ljust(16, b"\0")

    sockid = (struct.pack("!HH", local[1], remote[1]) + packed(local[0]) + packed(remote[0])
              + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE))
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    return struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + body


def _uids_by_diag(pairs: list) -> dict:
    """The peers' uids by sock_diag: one exact lookup each (about 0.15 ms), however many sockets
    the machine has. Raises ``_NoDiag`` where it cannot answer."""
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    except (AttributeError, OSError) as exc:
        raise _NoDiag(str(exc)) from None
    found: dict = {}
    try:
        nl.settimeout(1.0)  # the kernel answers at once; never a hang of the loop
        asked = {}
        for seq, (local, remote) in enumerate(pairs, 1):
            # The peer's own socket: its address is our remote one, its peer our local one.
            nl.send(_diag_request(seq, remote, local))
            asked[seq] = remote
        while asked:
            data = nl.recv(1 << 16)
            at = 0
            while at + 16 <= len(data):
                length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, at)
                remote = asked.pop(seq, None)
                if kind == _NLMSG_ERROR:
                    code = -struct.unpack_from("=i", data, at + 16)[0]
                    if code not in (errno.ENOENT, 0):
                        raise _NoDiag(os.strerror(code))
                    if remote is not None:
                        found[remote] = None
                elif remote is not None and length >= _UID_AT + 4:
                    found[remote] = struct.unpack_from("=I", data, at + _UID_AT)[0]
                at += max(length, 16) + (-length % 4)
    except (OSError, struct.error) as exc:
        raise _NoDiag(str(exc)) from None
    finally:
        nl.close()
    return found


def tables_readable() -> bool:
    """Whether this machine can say who owns a socket (sock_diag, or ``/proc/net/tcp``): the
    uid check is on.

    Asked once, when a listener starts; a lookup that fails later (no descriptor left) refuses
    the loopback connections of that moment instead of letting them in.
    """
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            probe.listen(1)
            _uids_by_diag([(probe.getsockname(), ("127.0.0.1", 1))])
        return True
    except (_NoDiag, OSError):
        return any(os.access(path, os.R_OK) for path in _TCP_TABLES)


def peer_uids(pairs: Iterable[tuple[tuple, tuple]]) -> dict[tuple, int | None] | None:
    """The uid owning the peer's socket of each accepted connection in ``pairs``.

    ``pairs``: ``(local, remote)`` addresses as ``getsockname()`` and ``accept`` give them. The
    answer maps each remote address to its owner's uid, or None where no socket was found (it
    closed already). Asks sock_diag (an exact lookup per socket); where that cannot answer,
    reads ``/proc/net/tcp`` and ``/proc/net/tcp6`` once for all the pairs (the kernel walks
    all its sockets for that: tens of ms on a busy host). Returns None when neither can be read
    (not Linux): the check is off.
    """
    pairs = list(pairs)
    try:
        return _uids_by_diag(pairs)
    except _NoDiag:
        pass
    wanted: dict[str, tuple] = {}
    for local, remote in pairs:
        mine4, mine6 = _hex(local[0], local[1])
        theirs4, theirs6 = _hex(remote[0], remote[1])
        # The peer's own entry: its local address is our remote one, its remote ours.
        if theirs4:
            wanted[f"{theirs4} {mine4}"] = remote
        wanted[f"{theirs6} {mine6}"] = remote
    found: dict[tuple, int | None] = {}
    readable = False
    for path in _TCP_TABLES:
        try:
            with open(path, "rb") as table:
                text = table.read().decode("ascii", "replace")
        except OSError:
            continue
        readable = True
        for pattern, remote in wanted.items():
            at = text.find(pattern)
            if at < 0:
                continue
            # sl local rem st tx:rx tr:when retrnsmt uid ...: the uid is the 5th field after the addresses
            fields = text[at:text.find("\n", at)].split()
            try:
                found[remote] = int(fields[6])
            except (IndexError, ValueError):
                continue
    if not readable:
        return None
    return {remote: found.get(remote) for remote in wanted.values()}


def foreign_uid(sock: socket.socket, remote, uid: int | None = None) -> tuple[bool, int | None]:
    """Whether the accepted connection ``sock`` (from ``remote``) must be refused, and its peer's uid.

    Only loopback connections are checked (see [Note: only the job's own user on loopback]);
    ``uid``: the job's (default ``job_uid()``). ``(False, None)`` when the check does not apply.
    """
    uid = job_uid() if uid is None else uid
    if uid is None or not isinstance(remote, tuple) or not is_loopback(remote[0]):
        return False, None
    uids = peer_uids([(sock.getsockname(), remote)])
    if uids is None:
        return False, None
    owner = uids.get(remote)
    return owner != uid, owner


def describe_uid(uid: int | None) -> str:
    """``uid 1001 (alice)``, ``uid 1001`` when it has no name, or what is known when it is unknown."""
    if uid is None:
        return "a socket not listed in /proc/net/tcp (it closed already, or the table could not be read)"
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"
