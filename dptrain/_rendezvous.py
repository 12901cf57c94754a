"""Pieces shared by both launchers: the rendezvous store (hosting it, numbering the nodes of a
c10d-style launch, the exit barrier), torchrun's worker environment and defaults,
network-interface choice, and how a rank's exit is described."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import time

from dptrain._errors import RankFailedError
from dptrain._heartbeat import describe_exit

__all__ = ["RankFailedError", "free_port", "rank_environ", "describe_exit", "stop_processes", "exit_barrier", "omp_threads",
           "read_error_file", "auto_node_rank", "rank_log_files"]

#: Seconds between TERM and KILL when stopping ranks.
GRACE_S = 3.0


def stop_processes(procs, grace_s: float = GRACE_S, hurry=lambda: False) -> None:
    """TERM every live process, KILL what is left after ``grace_s`` (or as soon as ``hurry()``), reap all.

    Both launchers stop their ranks this way. Each process offers ``alive()``, ``send(sig)``
    and ``join(timeout)``; KILL is sent to every one, exited or not, since a rank's
    children (DataLoader workers) may outlive it in its process group.
    """
    for p in procs:
        if p.alive():
            p.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.alive() for p in procs) and not hurry():
        time.sleep(0.02)
    for p in procs:
        p.send(signal.SIGKILL)
        p.join(None)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def auto_node_rank(host: str, port: int, nnodes: int, timeout_s: float, log) -> int:
    """This node's rank when none was given (``--rdzv-backend c10d``, as with torchrun).

    Every node runs the same command. The node that owns the endpoint's address, and can
    take its port, hosts the store: node 0. The others take 1, 2, ... in the order in which
    they reach it, and keep that number for the whole job (restarts included). Waits for the
    store like a node with an explicit rank, saying every 30 s what it waits for.
    """
    from dptrain._join import wait_for_listener

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return 0
        except OSError:
            pass  # not an address of this machine, or another launcher here hosts already
    wait_for_listener(host, port, timeout_s, "this node", "the rendezvous",
                      f"Is `dptrain run` running on the machine that owns {host}?", log)
    from dptrain._store import StoreClient

    store = StoreClient(host, port, timeout=timeout_s)
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


class _StoreServer:
    """The rendezvous store, hosted by the launcher and bound to one address only.

    We bind the socket ourselves (to 127.0.0.1 on a single node, to the given master
    address across nodes; torch's ``TCPStore`` alone would listen on every interface) and
    hand it to the server: dptrain's own (``dptrain._store``, no torch import, see its
    [Note: why the launcher does not import torch]) or, with ``DPTRAIN_STORE=torch`` or a
    torch newer than that server was tested with, torch's ``TCPStore``.
    """

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        from dptrain._store import use_python_store

        self.host = host
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = None
        self.ours = use_python_store()  # decided (and a bad DPTRAIN_STORE refused) before any rank starts
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            if port:
                raise ValueError(
                    f"port {port} on {host} is not available ({exc.strerror}); pick another with "
                    f"--master-port, or omit --master-port on a single node to get a free one"
                ) from None
            raise ValueError(f"cannot listen on {host} ({exc.strerror}); check --master-addr") from None
        # Listening already: ranks started before serve() queue in the backlog and are answered
        # once the store runs, so a launcher can start its ranks before its store is up.
        self._sock.listen(512)
        self.port = self._sock.getsockname()[1]

    def serve(self) -> None:
        """Start serving on the bound socket (idempotent)."""
        from dptrain._store import StoreServer

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


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _iface_towards(addr: str) -> str | None:
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


def rank_environ(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    num_nodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int = 0,
    max_restarts: int = 0,
    error_dir: str | None = None,
) -> dict[str, str]:
    """The variables ``torchrun`` sets for a worker, with the same names and meanings."""
    out = {
        "RANK": str(rank),
        "GROUP_RANK": str(node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(num_nodes),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if error_dir is not None:
        # Where torch's @record decorator writes a rank's exception as JSON; we read it back
        # for the failure report, as torchrun does.
        out["TORCHELASTIC_ERROR_FILE"] = os.path.join(error_dir, f"attempt_{restart_count}", str(rank), "error.json")
    return out


def omp_threads(nproc: int) -> tuple[str | None, str | None]:
    """torchrun's default: one OpenMP thread per core and rank, with the notice to print (or None)."""
    if "OMP_NUM_THREADS" in os.environ or nproc <= 1:
        return None, None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // nproc)
    notice = (
        f"dptrain run: OMP_NUM_THREADS={threads} for each of {nproc} ranks ({cores} cores / {nproc} ranks); "
        f"set OMP_NUM_THREADS yourself to change it"
    )
    return str(threads), notice


def read_error_file(path: str) -> str:
    """The traceback a rank's ``@record`` handler wrote (torchrun's error-file format)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        return str(message.get("extraInfo", {}).get("py_callstack") or message.get("message", ""))
    return str(message)


def rank_log_files(base: str | None, run_id: str, attempt: int, local_rank: int, redirects, tee) -> list:
    """torchrun's ``--log-dir``/``--redirects``/``--tee``: per stream (stdout, stderr) of one
    rank, its log file (or None) and whether the console still shows it.

    ``redirects`` and ``tee`` are 0-3 (1 stdout, 2 stderr, 3 both) for every local rank, or a
    dict local rank -> 0-3. Files: ``<base>/<run_id>/attempt_<k>/<local_rank>/stdout.log``.
    """
    out = []
    for bit, name in ((1, "stdout"), (2, "stderr")):
        redirected = bool(_for_rank(redirects, local_rank) & bit)
        teed = bool(_for_rank(tee, local_rank) & bit)
        path = None
        if base and (redirected or teed):
            folder = os.path.join(base, run_id, f"attempt_{attempt}", str(local_rank))
            path = os.path.join(folder, f"{name}.log")
            try:  # here, before the rank starts: a rank must never run without its relay
                os.makedirs(folder, exist_ok=True)
                open(path, "ab").close()
            except OSError as exc:
                raise ValueError(f"--log-dir: cannot write {path} ({exc.strerror}); give a writable folder") from None
        out.append((path, not redirected))
    return out


def _for_rank(spec, local_rank: int) -> int:
    return spec.get(local_rank, 0) if isinstance(spec, dict) else int(spec or 0)
