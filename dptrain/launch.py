"""Start, watch and stop the ranks of a job: ``dptrain run`` and :func:`spawn`.

Both give every rank exactly the environment ``torchrun`` gives its workers, host the
rendezvous store themselves (so it outlives any rank), and never leave a rank running:
when one rank fails the others are stopped (TERM, then KILL after a grace period) and the
failure is reported with the rank, its exit code and the tail of its traceback.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from typing import Any, Callable, Sequence

__all__ = ["spawn", "RankFailedError", "LaunchConfig", "run_job", "free_port"]

#: Seconds between TERM and KILL when stopping ranks.
GRACE_S = 3.0


class RankFailedError(RuntimeError):
    """A rank of a job raised or exited non-zero.

    Attributes:
        rank: the global rank that failed first.
        exit_code: its exit code (negative: killed by that signal), or None if it raised.
        traceback_text: the traceback it printed or sent, when there was one.
    """

    def __init__(self, message: str, rank: int, exit_code: int | None = None, traceback_text: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.traceback_text = traceback_text


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class _StoreServer:
    """The rendezvous store, hosted by the launcher and bound to one address only.

    ``TCPStore`` on its own listens on every interface; we bind the socket ourselves (to
    127.0.0.1 on a single node, to the given master address across nodes) and hand it over.
    """

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.host = host
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
        self._sock.listen(512)
        self.port = self._sock.getsockname()[1]
        td = datetime.timedelta(seconds=timeout_s)
        try:
            self.store = dist.TCPStore(
                host, self.port, world_size, True, timeout=td, wait_for_workers=False,
                master_listen_fd=self._sock.fileno(),
            )
        except TypeError:  # torch without master_listen_fd: let the store bind by itself
            self._sock.close()
            self.store = dist.TCPStore(host, self.port, world_size, True, timeout=td, wait_for_workers=False)

    def close(self) -> None:
        self.store = None
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


# ---------------------------------------------------------------------------------------
# spawn(): the in-process launcher
# ---------------------------------------------------------------------------------------


def _spawn_entry(fn, rank, nprocs, port, args, conn, extra_env) -> None:
    os.environ.update(
        rank_environ(
            rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs, node_rank=0,
            num_nodes=1, master_addr="127.0.0.1", master_port=port, run_id="spawn",
        )
    )
    os.environ.update(extra_env)
    import dptrain

    # Results travel as plain pickles (bytes): multiprocessing's own pickler would share tensors
    # through file descriptors that vanish when this process exits.
    try:
        result = fn(rank, *args)
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as exc:  # noqa: BLE001 - an unpicklable return value is the caller's bug
            payload = pickle.dumps(("error", f"rank {rank} returned a value that cannot be sent back: {exc!r}", ""))
        conn.send_bytes(payload)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", tb)))
        except Exception:  # noqa: BLE001
            pass
        conn.close()
        os._exit(1)
    finally:
        try:
            dptrain.shutdown()
        except Exception:  # noqa: BLE001 - the result is already on its way
            pass
    conn.close()


def _stop_processes(procs: Sequence[Any], grace_s: float = GRACE_S) -> None:
    """TERM every live process, then KILL what is left after ``grace_s``."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = None,
    start_method: str = "spawn",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and return their results.

    The in-process form of ``dptrain run`` for notebooks and tests, shaped like
    ``torch.multiprocessing.spawn``. Each process gets torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, a free MASTER_PORT, ...), so ``dptrain.init()``
    inside ``fn`` joins the job; the process group is shut down when ``fn`` returns.

    Args:
        fn: a picklable (module-level) function; called as ``fn(rank, *args)``.
        nprocs: number of ranks, >= 1.
        args: extra positional arguments for ``fn``. Default ``()``.
        timeout: seconds after which every rank still running is killed and
            ``TimeoutError`` is raised. Default None (no limit).
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``.
        env: extra environment variables for the ranks.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        ValueError: ``nprocs < 1``.
        RankFailedError: a rank raised or died; names the rank and carries its traceback.
            The other ranks are stopped first.
        TimeoutError: ``timeout`` passed; names the ranks still running.

    Example:
        >>> def work(rank):
        ...     dptrain.init()
        ...     return dptrain.world_size()
        >>> dptrain.spawn(work, nprocs=2)   # doctest: +SKIP
        [2, 2]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn needs nprocs >= 1, got {nprocs!r}")
    ctx = mp.get_context(start_method)
    server = _StoreServer("127.0.0.1", 0, nprocs, timeout_s=timeout or 600.0)
    extra_env = dict(env or {})
    if "GLOO_SOCKET_IFNAME" not in os.environ and _loopback_ifname():
        extra_env.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_spawn_entry,
                args=(fn, rank, nprocs, server.port, tuple(args), child_end, extra_env),
                name=f"dptrain-rank{rank}",
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _watch_spawned(procs, conns, timeout)
    finally:
        _stop_processes(procs)
        for c in conns:
            c.close()
        server.close()


def _watch_spawned(procs, conns, timeout) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    done = [False] * n
    deadline = None if timeout is None else time.monotonic() + timeout
    pending_conns = {c: r for r, c in enumerate(conns)}
    while not all(done):
        wait_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        sentinels = [p.sentinel for rank, p in enumerate(procs) if not done[rank]]
        ready = mp.connection.wait(list(pending_conns) + sentinels, wait_s)
        for obj in ready:
            if obj in pending_conns:
                rank = pending_conns.pop(obj)
                try:
                    msg = pickle.loads(obj.recv_bytes())
                except EOFError:
                    continue  # died without a word: the sentinel reports it
                if msg[0] == "ok":
                    results[rank] = msg[1]
                    done[rank] = True
                else:
                    _, summary, tb = msg
                    raise RankFailedError(
                        f"rank {rank} of {n} failed: {summary}\n\n--- traceback of rank {rank} ---\n{tb}",
                        rank, None, tb,
                    )
        for rank, p in enumerate(procs):
            if done[rank] or p.is_alive():
                continue
            p.join()
            conn = conns[rank]
            if conn in pending_conns and conn.poll():
                continue  # its message is waiting: read it on the next pass
            if p.exitcode == 0 and not done[rank]:
                raise RankFailedError(f"rank {rank} of {n} exited without returning a result", rank, 0)
            if p.exitcode != 0:
                raise RankFailedError(f"rank {rank} of {n} {_describe_exit(p.exitcode)}", rank, p.exitcode)
        if deadline is not None and time.monotonic() >= deadline:
            running = [r for r in range(n) if not done[r]]
            raise TimeoutError(
                f"rank(s) {running} of {n} still running after the {timeout:.0f}s timeout; they were killed "
                f"(a stalled collective or an endless loop?)"
            )
    return results


# ---------------------------------------------------------------------------------------
# dptrain run: the command-line launcher
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class LaunchConfig:
    """What ``dptrain run`` was asked to do; validated on construction.

    Attributes mirror torchrun's flags: ``nproc_per_node``, ``nnodes``, ``node_rank``,
    ``master_addr``, ``master_port``; plus ``log_ranks`` (ranks whose output is shown,
    None for all), ``max_restarts``, ``timeout`` (seconds for collectives), ``debug``,
    ``module`` (run ``python -m``), ``program`` and ``args``.
    """

    program: str
    args: list[str] = dataclasses.field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    module: bool = False
    log_ranks: list[int] | None = None
    max_restarts: int = 0
    timeout: float | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}; e.g. --nproc-per-node 2")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} for --nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and (not self.master_addr or not self.master_port):
            raise ValueError(
                "a job on several nodes needs an explicit rendezvous address: add "
                "--master-addr <node 0's address> --master-port <port> on every node"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port (1..65535)")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if not self.module and not os.path.isfile(self.program):
            raise ValueError(f"script {self.program!r} not found; give the path of a Python file (or -m module)")
        if self.log_ranks is not None:
            world = self.nproc_per_node * self.nnodes
            bad = [r for r in self.log_ranks if not 0 <= r < world]
            if bad:
                raise ValueError(f"--log-ranks {bad} outside the {world} ranks of this job")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class _RankProcess:
    """One rank as a child process, with its output relayed line by line under a prefix."""

    def __init__(self, rank: int, local_rank: int, cmd: list[str], environ: dict[str, str], show: bool, lock):
        self.rank = rank
        self.local_rank = local_rank
        self.tail: deque[str] = deque(maxlen=30)  # last stderr lines, for the failure report
        self.proc = subprocess.Popen(
            cmd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: we can stop its DataLoader workers too
        )
        self._threads = [
            threading.Thread(target=self._relay, args=(self.proc.stdout, sys.stdout, show, False, lock), daemon=True),
            threading.Thread(target=self._relay, args=(self.proc.stderr, sys.stderr, show, True, lock), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _relay(self, stream, out, show: bool, keep: bool, lock) -> None:
        prefix = f"[rank{self.rank}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            if keep:
                self.tail.append(line.rstrip("\n"))
            if show:
                with lock:
                    out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                    out.flush()
        stream.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout: float = 2.0) -> None:
        for t in self._threads:
            t.join(timeout)


def _stop_ranks(ranks: Sequence[_RankProcess], grace_s: float = GRACE_S) -> None:
    for r in ranks:
        if r.poll() is None:
            r.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in ranks:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for r in ranks:
        if r.poll() is None:
            r.signal(signal.SIGKILL)
            r.proc.wait()
        else:
            r.signal(signal.SIGKILL)  # leftover children of a rank that already exited


def _omp_threads(nproc: int) -> tuple[str | None, str | None]:
    if "OMP_NUM_THREADS" in os.environ or nproc <= 1:
        return None, None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // nproc)
    notice = (
        f"dptrain run: OMP_NUM_THREADS={threads} for each of {nproc} ranks ({cores} cores / {nproc} ranks); "
        f"set OMP_NUM_THREADS yourself to change it"
    )
    return str(threads), notice


def _log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


class _Interrupted(Exception):
    pass


def _read_error_file(path: str) -> str:
    """The traceback a rank's ``@record`` handler wrote (torchrun's error-file format)."""
    import json

    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        return str(message.get("extraInfo", {}).get("py_callstack") or message.get("message", ""))
    return str(message)


class _Job:
    """One launcher's share of a job: its ranks, their restarts, and the shared store.

    [Note: restarts across nodes]
    Every node's launcher watches the key ``launcher/failed/<attempt>`` in the rendezvous
    store. The launcher whose rank fails sets it; all launchers then stop their ranks and
    start attempt+1 together. Ranks of attempt k use keys under ``dptrain/attempt<k>``, so a
    restarted job never reads a stale key of the attempt before.
    """

    def __init__(self, config: LaunchConfig) -> None:
        import tempfile

        self.config = config
        self.host = config.master_addr or "127.0.0.1"
        self.server = None
        if config.node_rank == 0:
            # Single node: 127.0.0.1 only. Several nodes: the explicit master address only.
            self.server = _StoreServer(self.host, config.master_port or 0, config.world_size,
                                       timeout_s=config.timeout or 600.0)
            self.store = self.server.store
        else:
            import torch.distributed as dist

            self.store = dist.TCPStore(self.host, config.master_port, None, False,
                                       timeout=datetime.timedelta(seconds=config.timeout or 600.0))
        self.port = self.server.port if self.server else config.master_port
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        self.error_dir = tempfile.mkdtemp(prefix="dptrain_run_")
        self.lock = threading.Lock()
        self.ranks: list[_RankProcess] = []
        self.stall_s = float(os.environ.get("DPTRAIN_STALL_REPORT_S", "60"))
        self.base_env = self._base_env()
        self.cmd = [sys.executable, "-u"] + (["-m", config.program] if config.module else [config.program])
        self.cmd += list(config.args)

    def _base_env(self) -> dict[str, str]:
        config = self.config
        env = dict(os.environ)
        omp, notice = _omp_threads(config.nproc_per_node)
        if notice:
            _log(notice)
        if omp:
            env["OMP_NUM_THREADS"] = omp
        if config.timeout is not None:
            env["DPTRAIN_TIMEOUT"] = str(config.timeout)
        if config.debug:
            env["DPTRAIN_DEBUG"] = "1"
        if "GLOO_SOCKET_IFNAME" not in env:
            iface = _loopback_ifname() if config.nnodes == 1 else _iface_towards(self.host)
            if iface:
                env["GLOO_SOCKET_IFNAME"] = iface
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, attempt: int) -> None:
        config = self.config
        self.ranks = []
        for local in range(config.nproc_per_node):
            rank = config.node_rank * config.nproc_per_node + local
            environ = dict(self.base_env)
            environ.update(
                rank_environ(
                    rank=rank, local_rank=local, world_size=config.world_size,
                    local_world_size=config.nproc_per_node, node_rank=config.node_rank,
                    num_nodes=config.nnodes, master_addr=self.host, master_port=self.port, run_id=self.run_id,
                    restart_count=attempt, max_restarts=config.max_restarts, error_dir=self.error_dir,
                )
            )
            os.makedirs(os.path.dirname(environ["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
            show = config.log_ranks is None or rank in config.log_ranks
            self.ranks.append(_RankProcess(rank, local, self.cmd, environ, show, self.lock))

    def _peer_failure(self, attempt: int) -> str | None:
        key = f"launcher/failed/{attempt}"
        try:
            if self.store.check([key]):
                return self.store.get(key).decode()
        except Exception:  # noqa: BLE001 - node 0's launcher is gone: treat as a failure
            return "the launcher of node 0 is unreachable"
        return None

    def _report_stalls(self, attempt: int, seen: dict[int, list]) -> None:
        """Print "rank r has made no progress for N s" for ranks whose heartbeat stands still.

        ``seen[rank]`` holds [state, since, last_report]: the rank's last (collectives,
        steps, current op), when it last changed, and when we last reported it.
        """
        import json

        now = time.time()
        for r in self.ranks:
            key = f"{dist_prefix(attempt)}/hb/{r.rank}"
            try:
                if not self.store.check([key]):
                    continue
                b = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - best effort: the store may be going away
                return
            state = (b["seq"], b["ticks"], b["op"])
            entry = seen.setdefault(r.rank, [state, now, 0.0])
            if entry[0] != state:
                seen[r.rank] = [state, now, 0.0]
                continue
            idle = now - entry[1]
            if idle >= self.stall_s and now - entry[2] >= self.stall_s:
                entry[2] = now
                where = f"waiting in {b['op']} #{b['seq']}" if b["op"] else f"outside any collective after #{b['seq']}"
                _log(f"dptrain run: rank {r.rank} has made no progress for {idle:.0f}s ({where}, {b['ticks']} steps)")

    def watch(self, attempt: int) -> tuple[_RankProcess | None, str | None]:
        """Wait until all ranks exit 0 (None, None), a local rank fails (rank, None), or a peer node fails."""
        seen: dict[int, list] = {}
        polls = 0
        while True:
            alive = False
            for r in self.ranks:
                code = r.poll()
                if code is None:
                    alive = True
                elif code != 0:
                    return r, None
            if not alive:
                for r in self.ranks:
                    r.finish_output()
                return None, None
            polls += 1
            if polls % _STALL_EVERY == 0:
                if self.config.nnodes > 1:
                    peer = self._peer_failure(attempt)
                    if peer:
                        return None, peer
                self._report_stalls(attempt, seen)
            time.sleep(_POLL_S)

    def close(self) -> None:
        import shutil

        if self.ranks:
            _stop_ranks(self.ranks, grace_s=0.5)
        if self.server:
            self.server.close()
        shutil.rmtree(self.error_dir, ignore_errors=True)


_POLL_S = 0.05
_STALL_EVERY = 20  # check heartbeats and peers once a second


def dist_prefix(attempt: int) -> str:
    """Store prefix under which ranks of ``attempt`` keep dptrain's own keys (see env.init)."""
    return f"dptrain/attempt{attempt}/dp"


def run_job(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node; return the launcher's exit code.

    Starts ``nproc_per_node`` ranks, relays their output, reports ranks that stop making
    progress, and stops them all as soon as one fails. With ``max_restarts`` > 0 the whole
    job (every node) is restarted after a failure, up to that many times.
    """
    interrupted = {"sig": None}

    def on_signal(signum, _frame):
        interrupted["sig"] = signum
        raise _Interrupted()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    job = None
    try:
        job = _Job(config)
        for attempt in range(config.max_restarts + 1):
            job.start(attempt)
            failed, peer = job.watch(attempt)
            if failed is None and peer is None:
                return 0
            if failed is not None:
                code = failed.poll()
                what = (f"rank {failed.rank} (local rank {failed.local_rank}, pid {failed.proc.pid}) "
                        f"{_describe_exit(code)}")
                try:
                    job.store.set(f"launcher/failed/{attempt}", f"on node {config.node_rank}: {what}")
                except Exception:  # noqa: BLE001 - single node or store gone: nothing to tell
                    pass
            else:
                code = 1
                what = f"a rank of another node failed ({peer})"
            others = [r for r in job.ranks if r is not failed]
            _log(f"dptrain run: {what}; stopping the other {len(others)} rank(s) of this node")
            _stop_ranks(others)
            for r in job.ranks:
                r.finish_output()
            if failed is not None:
                tb = _read_error_file(os.path.join(job.error_dir, f"attempt_{attempt}", str(failed.rank), "error.json"))
                tail = tb or "\n".join(failed.tail)
                if tail:
                    _log(f"--- last lines of rank {failed.rank} ---\n{tail}\n---")
            if attempt < config.max_restarts:
                _log(f"dptrain run: restarting all ranks (restart {attempt + 1} of {config.max_restarts})")
                continue
            if config.max_restarts:
                _log(f"dptrain run: giving up after {config.max_restarts} restart(s)")
            return code if code and code > 0 else 1
        return 1
    except _Interrupted:
        _log(f"dptrain run: {signal.Signals(interrupted['sig']).name} received; stopping all ranks")
        if job:
            _stop_ranks(job.ranks)
        return 130 if interrupted["sig"] == signal.SIGINT else 143
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if job:
            job.close()
