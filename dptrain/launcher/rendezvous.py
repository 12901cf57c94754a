"""The rendezvous: where the ranks and the launchers of a job meet, and how its nodes are numbered.

Node 0's launcher hosts the store (``RendezvousServer``: bound to one address only, served by
:mod:`dptrain.launcher.store` or torch's ``TCPStore``) on a port of its own (``free_port``);
every node's launcher and every rank connects to it (with the job's secret, through node 0's
gate and the other nodes' forwarders: see [Note: only the job gets in] in
:mod:`dptrain.launcher.auth`). The gloo interface a node's ranks use is
the one that reaches that address (``iface_towards``; ``loopback_ifname`` on a single node).
A node without ``--node-rank`` takes Slurm's node id or, with ``--rdzv-backend c10d``, its
order of arrival (``node_rank``). Node 0 keeps the store up until every node's ranks have
finished (``exit_barrier``); the key ``failed_key(k)`` tells every launcher that attempt k failed
(see [Note: restarts across nodes] in :mod:`dptrain.launcher.job`).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

from dptrain.runtime.heartbeat import DEFAULT_TIMEOUT_S
from dptrain.runtime.join import wait_for_listener
from dptrain.launcher.store import LISTEN_BACKLOG, StoreClient, StoreServer, use_python_store

__all__ = ["RendezvousServer", "listen_on", "free_port", "loopback_ifname", "iface_towards", "exit_barrier", "node_rank",
           "auto_node_rank", "default_node_rank", "ARRIVALS_KEY", "wait_s", "failed_key"]


def failed_key(attempt: int) -> str:
    """The store key a launcher sets when a rank of ``attempt`` failed: every launcher stops its
    ranks and starts the next attempt (see [Note: restarts across nodes] in ``job``)."""
    return f"launcher/failed/{attempt}"


def wait_s(timeout: float | None) -> float:
    """Seconds a launcher waits for the store and for other nodes: ``--timeout`` (``spawn``'s
    ``timeout=``) when given, else the ranks' own default, ``DEFAULT_TIMEOUT_S``."""
    return timeout or DEFAULT_TIMEOUT_S


#: Where :func:`free_port` draws from: below the kernel's ephemeral ports (32768 and up by
#: default) and below the 29xxx ports that launchers default to (torchrun's 29500).
FREE_PORTS = (15000, 29000)
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, for a store that another process binds later.

    Drawn at random (from the OS, not a seeded generator: two processes with the same seed
    would draw the same port) from :data:`FREE_PORTS`, outside the kernel's ephemeral range:
    a port the kernel hands out itself (``bind(0)``) may become the local end of any process's
    next outgoing connection before its user binds it, and that store then fails with "address
    in use" while its peers wait for it ("connection refused") until their timeout (seen in
    tests/scripts/exit_stress.py on a busy machine). Where the ephemeral range overlaps that
    span, or no drawn port is free, the kernel's choice.

    Example:
        >>> port = free_port()
    """
    import secrets

    low, high = FREE_PORTS
    try:
        with open(_EPHEMERAL) as fh:
            first_ephemeral = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    high = min(high, first_ephemeral)
    for _ in range(64 if high > low else 0):
        port = low + secrets.randbelow(high - low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening; ValueError with the fix when it cannot."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if port:
            raise ValueError(
                f"port {port} on {host} is not available ({exc.strerror}); pick another with "
                f"--master-port, or omit --master-port on a single node to get a free one"
            ) from None
        raise ValueError(f"cannot listen on {host} ({exc.strerror}); check --master-addr") from None
    sock.listen(LISTEN_BACKLOG)  # as the store listens once it serves: no overflow at thousands of ranks
    return sock


class RendezvousServer:
    """The rendezvous store, hosted by the launcher and bound to one address only.

    We bind the socket ourselves (to 127.0.0.1 on a single node, to the given master
    address across nodes; torch's ``TCPStore`` alone would listen on every interface) and
    hand it to the server: dptrain's own (:mod:`dptrain.launcher.store`, no torch import, see its
    [Note: why the launcher does not import torch]) or, with ``DPTRAIN_STORE=torch`` or a
    torch newer than that server was tested with, torch's ``TCPStore``.
    """

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        self.host = host
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = None
        self.ours = use_python_store()  # decided (and a bad DPTRAIN_STORE refused) before any rank starts
        # Listening already: ranks started before serve() queue in the backlog and are answered
        # once the store runs, so a launcher can start its ranks before its store is up.
        self._sock = listen_on(host, port)
        self.port = self._sock.getsockname()[1]

    def serve(self) -> None:
        """Start serving on the bound socket (idempotent)."""
        if self.store is not None:
            return
        if self.ours:
            self.store = StoreServer(self._sock)
            return
        import torch.distributed as dist

        td = datetime.timedelta(seconds=self.timeout_s)
        try:
            self.store = dist.TCPStore(
                self.host, self.port, self.world_size, True, timeout=td, wait_for_workers=False,
                master_listen_fd=self._sock.fileno(),
            )
        except NotImplementedError:
            # torch 2.4: its default (libuv) server cannot take a listening fd; the legacy one can.
            # It gets a duplicate: it polls the fd until it stops, which may be after close()
            # (or the interpreter's exit) has closed self._sock ("Unexpected poll revent ... 32").
            self.store = dist.TCPStore(
                self.host, self.port, self.world_size, True, timeout=td, wait_for_workers=False,
                master_listen_fd=os.dup(self._sock.fileno()), use_libuv=False,
            )
        except TypeError:  # torch without master_listen_fd: let the store bind by itself
            self._sock.close()
            self.store = dist.TCPStore(self.host, self.port, self.world_size, True, timeout=td,
                                       wait_for_workers=False)

    def close(self) -> None:
        store, self.store = self.store, None
        if self.ours and store is not None:  # torch's stops when its last reference goes
            store.close()
        try:
            self._sock.close()
        except OSError:
            pass


def loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def iface_towards(addr: str) -> str | None:
    """The network interface this host would use to reach ``addr`` (Linux), or None.

    Gloo picks its interface from the host name, which on many machines resolves to
    127.0.0.1; across nodes that address is useless to the peers. The interface that routes
    to the master is the one every rank of this node can be reached on.
    """
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, 9))  # UDP connect sends nothing; it only picks the route
            local_ip = probe.getsockname()[0]
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == local_ip:
            return name
    return None


def exit_barrier(store, prefix: str, num_nodes: int, host: bool, timeout_s: float, report_s: float,
                 log, peer_failure, check_signals) -> str | None:
    """This node's ranks all finished: count it, and on node 0 keep the store up until every node has.

    Node 0's launcher hosts the store. Were it to close it as soon as its own ranks are done,
    a node whose ranks are still finishing (flushing output, leaving the process group) would
    find the store gone, take that for node 0's failure and stop them: a run that succeeded
    would end with an error. torchrun's agents wait at a barrier of the same kind. Node 0
    waits at most ``timeout_s`` (a node whose launcher died never reports), says every
    ``report_s`` what it waits for, and returns a failure another node reported meanwhile.
    """
    if num_nodes <= 1:
        return None
    counter = f"{prefix}/nodes_finished"
    try:
        done = store.add(counter, 1)
    except Exception:  # noqa: BLE001 - node 0's store is gone: nobody is left to wait for us
        return None
    t0 = time.monotonic()
    next_report = t0 + report_s
    while host and done < num_nodes:
        check_signals()
        why = peer_failure()
        if why:
            return why
        now = time.monotonic()
        if now - t0 > timeout_s:
            log(f"dptrain run: {num_nodes - done} node(s) did not report their ranks finished within "
                f"{timeout_s:.0f}s; closing the rendezvous store")
            break
        if now >= next_report:
            log(f"dptrain run: the ranks of this node have finished; keeping the rendezvous store up until "
                f"every node's have ({done} of {num_nodes} nodes done)")
            next_report = now + report_s
        time.sleep(0.05)
        done = store.add(counter, 0)
    return None


#: The counter that numbers the nodes of a launch without ``--node-rank`` (see auto_node_rank).
ARRIVALS_KEY = "launcher/arrivals"


def auto_node_rank(host: str, port: int, nnodes: int, timeout_s: float, log, secret: bytes | None = None) -> int:
    """This node's rank when none was given (``--rdzv-backend c10d``, as with torchrun).

    Every node runs the same command. The node that owns the endpoint's address, and can
    take its port, hosts the store: node 0. The others take 1, 2, ... in the order in which
    they reach it, and keep that number for the whole job (restarts included). Waits for the
    store like a node with an explicit rank, saying every 30 s what it waits for. ``secret``:
    the job's (the arrival passes node 0's gate, see :mod:`dptrain.launcher.auth`).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return 0
        except OSError:
            pass  # not an address of this machine, or another launcher here hosts already
    wait_for_listener(host, port, timeout_s, "this node", "the rendezvous",
                      f"Is `dptrain run` running on the machine that owns {host}?", log)
    try:
        store = StoreClient(host, port, timeout=timeout_s, secret=secret)
    except RuntimeError as exc:  # StoreError: a wrong secret, or not a store
        raise ValueError(str(exc)) from None
    try:
        rank = store.add(ARRIVALS_KEY, 1)
    finally:
        store.close()
    if rank >= nnodes:
        raise ValueError(
            f"node {rank + 1} reached the rendezvous at {host}:{port}, but the job has --nnodes {nnodes}: start "
            f"one launcher per node (or give each its --node-rank)"
        )
    return rank




def default_node_rank(nnodes: int) -> int:
    """Inside a Slurm job with one ``dptrain run`` per node, the node's index is Slurm's."""
    if nnodes > 1:
        from dptrain.environments.slurm import node_id

        found = node_id(os.environ)
        if found is not None:
            return found
    return 0


def node_rank(given: int | None, backend: str, addr: str | None, port: int | None, nnodes: tuple[int | None, int],
              timeout: float | None, secret: bytes | None = None) -> int:
    """This node's rank: ``given`` (``--node-rank``), else its order of arrival at a c10d
    rendezvous across nodes (``auto_node_rank``, with the job's ``secret`` if it has one), else
    Slurm's node id, else 0.

    ``nnodes`` is ``--nnodes`` as parsed: (the minimum or None, the maximum).
    """
    if given is not None:
        return given
    if backend == "c10d" and nnodes[1] > 1:
        if not addr or not port:
            raise ValueError("--rdzv-backend c10d across nodes needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if nnodes[0] is not None:
            raise ValueError("elastic jobs (--nnodes MIN:MAX) number their nodes by --node-rank: give each node its own")
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        return auto_node_rank(addr, port, nnodes[1], wait_s(timeout), log, secret)
    return default_node_rank(nnodes[1])
