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
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
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

    try:
        result = fn(rank, *args)
        try:
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - an unpicklable return value is the caller's bug
            conn.send(("error", f"rank {rank} returned a value that cannot be sent back: {exc!r}", ""))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", tb))
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
        ready = mp.connection.wait(list(pending_conns) + [p.sentinel for p in procs if not done[procs.index(p)]], wait_s)
        for obj in ready:
            if obj in pending_conns:
                rank = pending_conns.pop(obj)
                try:
                    msg = obj.recv()
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
    heartbeat_s: float = 0.0

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


def run_job(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node; return the launcher's exit code.

    Starts ``nproc_per_node`` ranks, relays their output, and stops them all as soon as one
    fails. With ``max_restarts`` > 0 the whole group is restarted after a failure.
    """
    single_node = config.nnodes == 1
    host = config.master_addr or "127.0.0.1"
    server = None
    if config.node_rank == 0:
        # Single node: 127.0.0.1 only. Several nodes: the explicit master address only.
        server = _StoreServer(host, config.master_port or 0, config.world_size, timeout_s=config.timeout or 600.0)
    port = server.port if server else config.master_port
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    omp, notice = _omp_threads(config.nproc_per_node)
    if notice:
        _log(notice)
    base_env = dict(os.environ)
    if omp:
        base_env["OMP_NUM_THREADS"] = omp
    if config.timeout is not None:
        base_env["DPTRAIN_TIMEOUT"] = str(config.timeout)
    if config.debug:
        base_env["DPTRAIN_DEBUG"] = "1"
    if single_node and "GLOO_SOCKET_IFNAME" not in base_env and _loopback_ifname():
        base_env["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
    base_env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-u"] + (["-m", config.program] if config.module else [config.program]) + list(config.args)

    interrupted = {"sig": None}

    def on_signal(signum, _frame):
        interrupted["sig"] = signum
        raise _Interrupted()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lock = threading.Lock()
    ranks: list[_RankProcess] = []
    try:
        for attempt in range(config.max_restarts + 1):
            ranks = []
            for local in range(config.nproc_per_node):
                rank = config.node_rank * config.nproc_per_node + local
                environ = dict(base_env)
                environ.update(
                    rank_environ(
                        rank=rank, local_rank=local, world_size=config.world_size,
                        local_world_size=config.nproc_per_node, node_rank=config.node_rank,
                        num_nodes=config.nnodes, master_addr=host, master_port=port, run_id=run_id,
                        restart_count=attempt, max_restarts=config.max_restarts,
                    )
                )
                show = config.log_ranks is None or rank in config.log_ranks
                ranks.append(_RankProcess(rank, local, cmd, environ, show, lock))
            failed = _watch_ranks(ranks)
            if failed is None:
                return 0
            code = failed.poll()
            others = [r for r in ranks if r is not failed]
            _log(
                f"dptrain run: rank {failed.rank} (local rank {failed.local_rank}, pid {failed.proc.pid}) "
                f"{_describe_exit(code)}; stopping the other {len(others)} rank(s)"
            )
            _stop_ranks(others)
            for r in ranks:
                r.finish_output()
            if failed.tail:
                _log(f"--- last lines of rank {failed.rank} ---\n" + "\n".join(failed.tail) + "\n---")
            if attempt < config.max_restarts:
                _log(f"dptrain run: restarting all ranks (restart {attempt + 1} of {config.max_restarts})")
                continue
            if config.max_restarts:
                _log(f"dptrain run: giving up after {config.max_restarts} restart(s)")
            return code if code and code > 0 else 1
        return 1
    except _Interrupted:
        _log(f"dptrain run: {signal.Signals(interrupted['sig']).name} received; stopping all ranks")
        _stop_ranks(ranks)
        return 130 if interrupted["sig"] == signal.SIGINT else 143
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if ranks:
            _stop_ranks(ranks, grace_s=0.5)
        if server:
            server.close()


def _watch_ranks(ranks: Sequence[_RankProcess]) -> _RankProcess | None:
    """Wait until every rank exits 0 (return None) or one fails (return it)."""
    while True:
        alive = False
        for r in ranks:
            code = r.poll()
            if code is None:
                alive = True
            elif code != 0:
                return r
        if not alive:
            for r in ranks:
                r.finish_output()
            return None
        time.sleep(0.05)
