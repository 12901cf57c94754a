"""``dptrain run``: start, watch and stop the ranks of a job on this node.

Gives every rank exactly the environment ``torchrun`` gives its workers, hosts the
rendezvous store itself (so it outlives any rank), relays each rank's output under a
``[rankN]`` prefix, and never leaves a rank running: when one rank fails the others are
stopped (TERM, then KILL after a grace period) and the failure is reported with the rank,
its exit code and the tail of its traceback. ``--max-restarts`` restarts the whole job.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from typing import Sequence

from dptrain._rendezvous import (
    GRACE_S,
    RankFailedError,
    _describe_exit,
    _iface_towards,
    _loopback_ifname,
    _StoreServer,
    free_port,
    rank_environ,
)
from dptrain.spawn import spawn

__all__ = ["LaunchConfig", "run_job", "spawn", "RankFailedError", "free_port", "rank_environ"]


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
