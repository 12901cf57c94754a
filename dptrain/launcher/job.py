"""``dptrain run``: start, watch and stop the ranks of a job on this node; the attempt loop.

Gives every rank exactly the environment ``torchrun`` gives its workers, hosts the
rendezvous store itself (so it outlives any rank), relays each rank's output live under a
``[rankN]`` prefix (progress bars included, see ``relay``), and never leaves a rank
running: when one rank fails the others are stopped (TERM, then KILL after a grace period)
and the failure is reported with the rank, its exit code and the tail of its traceback.
SIGINT, SIGTERM, SIGHUP and SIGQUIT stop every rank and end the launcher with 128 + the
signal's number; if the launcher dies without a chance to do so (SIGKILL), its ranks die
with it (see ``janitor``). ``--max-restarts`` restarts the whole job; with ``--nnodes
MIN:MAX`` on the nodes that are still there (see ``membership``); with ``--recovery in-place``
only the rank that failed is replaced (see ``inplace``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import uuid
from typing import Callable

from dptrain.runtime.heartbeat import EXITS_PUBLISHED, OomRecord, describe_exit, keys_prefix
from dptrain.runtime import settings as _settings
from dptrain.runtime.join import ranks_text, wait_for_listener
from dptrain.launcher.inplace import InPlaceRecovery, rank_settings
from dptrain.launcher.janitor import Janitor
from dptrain.launcher.membership import Elastic, Membership
from dptrain.launcher.relay import Console
from dptrain.launcher.rendezvous import (RendezvousServer, exit_barrier, failed_key, iface_towards, listen_on,
                                         loopback_ifname, wait_s)
from dptrain.launcher.preflight import preflight
from dptrain.launcher.store import StoreClient, StoreError, StoreRefused
from dptrain.launcher.tunnel import Forwarder, Gate
from dptrain.launcher.template import WarmStarts
from dptrain.launcher.store_values import Warnings, failure_text
from dptrain.launcher.watch import Watch, peer_failure, publish
from dptrain.launcher.workers import (RankProcess, error_file, finish_output, omp_threads, process_environ,
                                      rank_log_files, read_error_file, stop_processes)

__all__ = ["LaunchConfig", "run_job"]


# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class LaunchConfig:
    """What ``dptrain run`` was asked to do; validated on construction.

    Attributes mirror torchrun's flags: ``nproc_per_node``, ``nnodes`` (the most nodes),
    ``node_rank``, ``master_addr``, ``master_port``; ``min_nodes`` (None: exactly ``nnodes``;
    fewer: elastic, see :mod:`dptrain.launcher.membership`) and ``join_timeout`` (seconds node 0
    waits at each attempt for nodes beyond ``min_nodes``); plus ``log_ranks`` (ranks whose output is shown,
    None for all), ``max_restarts``, ``timeout`` (seconds for collectives), ``debug``,
    ``profile`` (the Trainer's per-rank step report), ``module`` (run ``python -m``),
    ``program`` and ``args``; ``run_id`` (the ranks' ``TORCHELASTIC_RUN_ID``; None: inherited,
    else random); ``log_dir``, ``redirects`` and ``tee`` (torchrun's per-rank log files: 0-3
    for every local rank, or a dict local rank -> 0-3; see ``rank_log_files``); ``secret`` (the
    job's, the same on every node; None: a job across nodes is open to its network, see
    [Note: only the job gets in] in :mod:`dptrain.launcher.auth`; never shown in the repr);
    ``recovery`` (``"restart"``: a failure stops every rank and restarts the whole job;
    ``"in-place"``: only the failed rank is replaced, see :mod:`dptrain.launcher.inplace`) and
    ``spares`` (with in-place recovery: processes kept ready to replace a rank, see
    :mod:`dptrain.launcher.spare`).
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
    profile: bool = False
    min_nodes: int | None = None
    join_timeout: float = 30.0
    run_id: str | None = None
    log_dir: str | None = None
    redirects: int | dict = 0
    tee: int | dict = 0
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    recovery: str = "restart"
    spares: int = 0

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}; e.g. --nproc-per-node 2")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} for --nnodes {self.nnodes}"
            )
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.nnodes}: the minimum must be between 1 and the "
                             f"maximum, e.g. --nnodes 1:{self.nnodes}")
        if self.join_timeout <= 0:
            raise ValueError(f"--join-timeout must be a positive number of seconds, got {self.join_timeout}")
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
        if self.recovery not in ("restart", "in-place"):
            raise ValueError(f"--recovery {self.recovery!r}: choose restart (restart every rank) or in-place (replace "
                             f"the failed rank only), e.g. --recovery in-place")
        if self.recovery == "in-place" and self.max_restarts == 0:
            raise ValueError("--recovery in-place replaces a failed rank at most --max-restarts times, and that is 0; "
                             "add e.g. --max-restarts 3")
        if self.spares < 0:
            raise ValueError(f"--spares must be >= 0, got {self.spares}")
        if self.spares and self.recovery != "in-place":
            raise ValueError(f"--spares {self.spares} keeps processes ready to replace a failed rank, which only "
                             f"in-place recovery does; add --recovery in-place")
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

    @property
    def wait_s(self) -> float:
        """Seconds the launcher waits for the store and for other nodes (see ``rendezvous.wait_s``)."""
        return wait_s(self.timeout)

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes


def base_environ(config: LaunchConfig, host: str, log: Callable[[str], None]) -> dict[str, str]:
    """The environment every rank of this node starts from: the launcher's (but the job's secret), and
    what ``config`` sets. ``host`` is node 0's address (gloo's interface is the one towards it)."""
    env = {name: value for name, value in os.environ.items() if name not in _settings.LAUNCHER_ONLY}
    omp, notice = omp_threads(config.nproc_per_node)
    if notice:
        log(notice)
    if omp:
        env["OMP_NUM_THREADS"] = omp
    if config.timeout is not None:
        env["DPTRAIN_TIMEOUT"] = str(config.timeout)
    if config.debug:
        env["DPTRAIN_DEBUG"] = "1"
    if config.profile:
        env["DPTRAIN_PROFILE"] = "1"
    if "GLOO_SOCKET_IFNAME" not in env:
        iface = loopback_ifname() if config.nnodes == 1 else iface_towards(host)
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Interrupted(Exception):
    pass


class _Signals:
    """Records SIGINT, SIGTERM, SIGHUP and SIGQUIT; the launcher acts on them between steps.

    The handler only takes note: raising from it could land between starting a rank and
    registering it, and leave that rank behind.
    """

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

    def __init__(self) -> None:
        self.received: int | None = None
        self.count = 0
        self.forward: list[int] = []  # SIGUSR1s to pass on to the ranks
        self._old: dict[int, object] = {}

    def _on_signal(self, signum: int, _frame) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def _on_forwarded(self, signum: int, _frame) -> None:
        self.forward.append(signum)

    def install(self) -> None:
        for name in self.NAMES:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._on_signal)
        # Slurm's warning before the end of a job (`#SBATCH --signal=USR1@90`) reaches the
        # launcher when srun runs one task per node: the ranks' Trainer is what acts on it.
        if hasattr(signal, "SIGUSR1"):
            self._old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_forwarded)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class _Job:
    """One launcher's share of a job: its ranks, their restarts, and the shared store.

    [Note: restarts across nodes]
    Every node's launcher watches the key ``launcher/failed/<attempt>`` in the rendezvous
    store. The launcher whose rank fails sets it; all launchers then stop their ranks and
    start attempt+1 together. Ranks of attempt k use keys under ``dptrain/attempt<k>``, so a
    restarted job never reads a stale key of the attempt before.

    [Note: exits in the store]
    Each launcher writes every exit of its ranks -- code and time -- under
    ``<attempt keys>/exit/<rank>``. A rank whose collective fails reads them, so its error
    says "rank 0 exited with code 0 3s ago" instead of a bare "connection closed by peer".
    """

    def __init__(self, config: LaunchConfig, signals: _Signals) -> None:
        import tempfile

        self.config = config
        self.signals = signals
        self.console = Console(sys.stdout, sys.stderr)
        self.janitor = Janitor()
        self.error_dir = tempfile.mkdtemp(prefix="dptrain_run_")
        self.janitor.tell("dir", self.error_dir)
        self.ranks: list[RankProcess] = []
        self.watching: Watch | None = None  # the ranks of the current attempt
        self.recovery: InPlaceRecovery | None = None  # --recovery in-place
        self.warm = WarmStarts(self)  # where the ranks come from: the warm template (see template.WarmStarts)
        self.server = None
        self.gate: Gate | None = None  # node 0 of a job with a secret: the way in from the network
        self.forwarder: Forwarder | None = None  # another node of such a job: its ranks' way to node 0
        self.store: StoreClient | None = None
        self.elastic: Elastic | None = None
        self.warnings = Warnings(self.log)  # malformed values read from the store, each said once
        self.oom = OomRecord()  # what tells a rank killed for want of memory from one killed by hand
        # This node's place in the current attempt; fixed unless the job is elastic.
        self.layout = Membership(node_rank=config.node_rank, rank_base=config.node_rank * config.nproc_per_node,
                                 num_nodes=config.nnodes, world_size=config.world_size, nodes=())
        try:
            self._connect()
            if config.nnodes > 1 and config.secret is None:
                self.log(f"dptrain run: warning: this job spans nodes without a secret, so anything that can reach "
                         f"{self.host}:{config.master_port} can read its rendezvous store, stop it, or join it as a "
                         f"rank. Give every node the same secret: --secret-file FILE (or DPTRAIN_SECRET_FILE), "
                         f"made once with (umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > FILE)")
            if config.elastic:  # membership is decided in the store before any rank starts
                self._open_store()
                self.elastic = Elastic(self.store, config.node_rank, config.nproc_per_node, config.min_nodes,
                                       config.nnodes, config.join_timeout, config.wait_s,
                                       self.log, self._check_signals, self.warnings)
        except BaseException:
            self.close()
            raise
        self.run_id = config.run_id or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        self.log_dir = None  # rank log files are written only with --tee or --redirects, as torchrun's
        if config.redirects or config.tee:
            self.log_dir = config.log_dir or tempfile.mkdtemp(prefix="dptrain_logs_")  # as torchrun: a new folder
            self.log(f"dptrain run: rank logs go to {os.path.join(self.log_dir, self.run_id)}")
        self.stall_s = _settings.get("DPTRAIN_STALL_REPORT_S")
        self.base_env = base_environ(config, self.host, self.log)
        if config.recovery == "in-place":
            self.recovery = InPlaceRecovery(self)
        rank_settings(self.base_env, self.recovery.directory if self.recovery else None, admit=config.elastic)
        self.cmd = [sys.executable, "-u"] + (["-m", config.program] if config.module else [config.program])
        self.cmd += list(config.args)

    def log(self, message: str) -> None:
        """A line of the launcher's own on stderr (it first moves a progress line out of the way)."""
        self.console.emit(self, 1, [message.encode("utf-8", "replace")])

    def _connect(self) -> None:
        """Bind node 0's store (and its gate), or wait for node 0 (and open this node's forwarder).

        Sets where this launcher's client talks to the store (``store_at``) and where the ranks
        do (``ranks_at``): with a secret, 127.0.0.1 on every node (see [Note: only the job gets
        in] in :mod:`dptrain.launcher.auth`).
        """
        config = self.config
        # A single node listens on 127.0.0.1 only, whatever --master-addr says: nothing else needs it.
        self.host = config.master_addr if config.nnodes > 1 else "127.0.0.1"
        timeout = config.wait_s
        secret = config.secret if config.nnodes > 1 else None
        self.store = None
        if config.node_rank == 0:
            # Only bound here: the store itself starts after the ranks (see _open_store).
            if secret is None:
                self.server = RendezvousServer(self.host, config.master_port or 0, config.world_size, timeout_s=timeout)
                self.store_at = (self.host, self.server.port, None)
            else:
                self.server = RendezvousServer("127.0.0.1", 0, config.world_size, timeout_s=timeout)
                self.gate = Gate(listen_on(self.host, config.master_port), self.server.port, secret, self.log)
                self.store_at = ("127.0.0.1", self.server.port, None)
            self.ranks_at = self.store_at[:2]
        else:
            self._wait_for_master(timeout)
            self.store_at = (self.host, config.master_port, secret)
            self.ranks_at = self.store_at[:2]
            # Before any rank starts: a wrong secret, none where the job asks for one, or no store
            # on that port ends here (the client is plain Python: there is no import to overlap).
            self._open_store()
            if secret is not None:
                self.forwarder = Forwarder(self.host, config.master_port, secret, self.log, retry_s=config.wait_s)
                self.ranks_at = ("127.0.0.1", self.forwarder.port)

    def _interrupted(self) -> bool:
        return bool(self.signals.received)

    def _check_signals(self) -> None:
        if self.signals.received:
            raise _Interrupted()

    def admit(self, attempt: int) -> bool:
        """Elastic jobs: take this node's place in ``attempt`` (False: not admitted to it)."""
        if self.elastic is None:
            return True
        layout = self.elastic.join(attempt)
        if layout is not None:
            self.layout = layout
        return layout is not None

    def _open_store(self) -> None:
        """Serve the store (node 0) and connect this launcher's client to it (every node).

        Node 0 calls it while the warm template imports, or (without a template) once the first
        ranks are started, so that with torch's server (which imports torch, see
        ``RendezvousServer``) the ranks spend that second importing torch themselves; the other
        nodes call it before their ranks start (a refusal starts none).
        """
        if self.store is not None:
            return
        if self.server is not None:
            self.server.serve()
        config = self.config
        host, port, secret = self.store_at
        try:
            self.store = StoreClient(host, port, timeout=config.wait_s, secret=secret)
        except StoreRefused as exc:
            raise ValueError(f"node {config.node_rank}: {exc}") from None
        except StoreError as exc:
            raise ValueError(f"node {config.node_rank} reached {host}:{port} but no "
                             f"rendezvous store answered there ({str(exc).strip()[:200]}); is --master-port "
                             f"the port that `dptrain run --node-rank 0` listens on?") from None

    def _wait_for_master(self, timeout: float) -> None:
        """Wait for node 0's store, saying every ``DPTRAIN_WAIT_REPORT_S`` what it waits for."""
        wait_for_listener(self.host, self.config.master_port, timeout, f"node {self.config.node_rank}",
                          "node 0's rendezvous", f"Is `dptrain run --node-rank 0` running there, and is {self.host} "
                          f"its address as seen from this node?", self.log, self._check_signals)

    def start(self, attempt: int, joining: int = 0) -> None:
        """Start this node's ranks of ``attempt``; ``joining`` > 0: as newcomers to a running job, in
        that generation of in-place recovery (see ``resize``)."""
        config = self.config
        self.ranks = []
        # The warm template forks the ranks: one import of torch for the node (template.WarmStarts).
        self.warm.prepare(self.base_env, config.nproc_per_node)
        if self.warm.spares is not None or self.recovery is not None:
            self._open_store()  # (torch's store imports torch: while the template imports, not after it)
        if self.recovery is not None:
            self.recovery.beat(attempt)  # in the store, while the ranks wait for the template
        for local in range(config.nproc_per_node):
            if self.signals.received:
                return
            rank = self.layout.rank_base + local
            show = config.log_ranks is None or rank in config.log_ranks
            environ = process_environ(
                self.base_env, self.console, show, rank=rank, local_rank=local, world_size=self.layout.world_size,
                local_world_size=config.nproc_per_node, node_rank=self.layout.node_rank,
                num_nodes=self.layout.num_nodes, master_addr=self.ranks_at[0], master_port=self.ranks_at[1],
                run_id=self.run_id,
                restart_count=attempt, max_restarts=config.max_restarts, error_dir=self.error_dir,
            )
            if joining:
                environ["DPTRAIN_GENERATION"] = str(joining)
            logs = rank_log_files(self.log_dir, self.run_id, attempt, local, config.redirects, config.tee)
            ready = self.warm.rank_process(environ, self._interrupted)
            if ready is None and self.signals.received:  # came while waiting for the template: none starts now
                return
            proc = RankProcess(rank, local, self.cmd, environ, show, self.console, logs, proc=ready)
            self.ranks.append(proc)
            self.janitor.tell("group", proc.proc.pid)
        self._open_store()
        publish(self.store, f"{keys_prefix(attempt)}/{EXITS_PUBLISHED}", "1")
        if self.recovery is not None:
            self.recovery.joined_at = joining
            self.recovery.started()

    def watch(self, attempt: int) -> tuple[RankProcess | None, str | None]:
        """Watch the ranks of ``attempt`` until they are done, one fails, or a signal arrives (see ``Watch.run``)."""
        self.watching = Watch(self.store, attempt, self.ranks, self.signals, self.log, self.stall_s, self.config.nnodes,
                              self.warnings, early=self.recovery is not None)
        if self.recovery is not None:
            return self.recovery.watch(self.watching, attempt)
        return self.watching.run()

    def restarts_spent(self, attempt: int) -> int:
        """Restarts spent so far: the attempt number, and with in-place recovery every replacement too."""
        if self.recovery is None:
            return attempt
        try:
            return self.recovery.restarts_spent(attempt)
        except (RuntimeError, OSError):  # the store is gone: count what this launcher knows
            return attempt

    def stop_all(self) -> None:
        """Stop every rank (a second signal cuts the grace period short) and show their last output."""
        count = self.signals.count
        stop_processes(self.ranks, hurry=lambda: self.signals.count > count)
        finish_output(self.ranks)
        for r in self.ranks:
            self.janitor.tell("forget", r.proc.pid)

    def report_failure(self, attempt: int, failed: RankProcess | None, peer: str | None) -> int:
        """Stop the other ranks, say who failed and show its last lines; return the exit code."""
        config = self.config
        if failed is not None:
            code = failed.poll()
            how = ((self.recovery.ended.get(failed.proc.pid) if self.recovery else None)
                   or describe_exit(code, self.oom, failed.proc.pid))
            what = f"rank {failed.rank} (local rank {failed.local_rank}, pid {failed.proc.pid}) {how}"
            publish(self.store, failed_key(attempt), failure_text(config.node_rank, what))
            earlier = sorted(rank for rank, (c, _) in self.watching.exits.items() if c == 0)
            if earlier:
                what += f" (after rank(s) {ranks_text(earlier)} had exited with code 0)"
        else:
            code = 1
            what = f"a rank of another node failed ({peer})"
        running = [r for r in self.ranks if r is not failed and r.poll() is None]
        stopping = f"; stopping the other {len(running)} rank(s) of this node" if running else ""
        self.log(f"dptrain run: {what}{stopping}")
        self.stop_all()
        if failed is not None:
            tb = read_error_file(error_file(self.error_dir, attempt, failed.rank))
            tail = tb or "\n".join(failed.tail)
            if tail:
                self.log(f"--- last lines of rank {failed.rank} ---\n{tail}\n---")
        return code if code and code > 0 else 1

    def close(self) -> None:
        import shutil

        if self.ranks:
            stop_processes(self.ranks, grace_s=0.5)
        self.warm.close()
        if self.recovery is not None:
            self.recovery.close()
        if self.elastic is not None and self.elastic.coordinator:
            self.elastic.finish()  # nodes still waiting to be admitted end too
        self.janitor.done()
        if self.store is not None:
            self.store.close()
        for pipes in (self.forwarder, self.gate):
            if pipes is not None:
                pipes.close()
        if self.server:
            self.server.close()
        shutil.rmtree(self.error_dir, ignore_errors=True)


def run_job(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node; return the launcher's exit code.

    Starts ``nproc_per_node`` ranks, relays their output, reports ranks that stop making
    progress, and stops them all as soon as one fails. With ``max_restarts`` > 0 the whole
    job (every node) is restarted after a failure, up to that many times. SIGINT, SIGTERM,
    SIGHUP and SIGQUIT stop every rank; the exit code is then 128 + the signal's number.
    """
    preflight(config)  # bad DPTRAIN_* values, more ranks than can start: refused before any rank starts
    signals = _Signals()
    signals.install()
    job = None
    try:
        job = _Job(config, signals)
        code = _run_attempts(job)
        return _interrupted(job, signals) if signals.received else code
    except _Interrupted:
        return _interrupted(job, signals)
    finally:
        if job is not None:
            job.close()
        signals.restore()  # last: a second signal while stopping must still find our handler


def _run_attempts(job: _Job) -> int:
    config, signals = job.config, job.signals
    attempt = job.elastic.first_attempt() if job.elastic else 0
    while attempt <= config.max_restarts and not signals.received:
        joining = 0  # > 0: let into the running attempt as generation `joining` (see resize)
        if not job.admit(attempt):
            if not job.elastic.wait_for_next(attempt, in_place=job.recovery is not None):
                job.log(f"dptrain run: the job ended without node {config.node_rank}")
                return 0
            if job.elastic.admitted is None:
                attempt += 1
                continue
            job.layout, joining = job.elastic.admitted
        job.start(attempt, joining)
        failed, peer = job.watch(attempt)
        if not (signals.received or failed or peer):
            peer = exit_barrier(job.store, keys_prefix(attempt), job.layout.num_nodes, job.server is not None,
                                config.wait_s, _settings.get("DPTRAIN_WAIT_REPORT_S"), job.log,
                                lambda: peer_failure(job.store, attempt, job.warnings), job._check_signals)
        if signals.received or (failed is None and peer is None):
            break
        if job.recovery is not None and job.recovery.dropped is not None:
            job.log(f"dptrain run: {job.recovery.dropped}")
            job.stop_all()
            return 1
        code = job.report_failure(attempt, failed, peer)
        if signals.received:
            return code
        spent = job.restarts_spent(attempt)
        if spent < config.max_restarts:
            if job.recovery is not None:
                job.recovery.say_why_not()
            job.log(f"dptrain run: restarting all ranks (restart {spent + 1} of {config.max_restarts})")
            attempt += 1
            continue
        if config.max_restarts:
            job.log(f"dptrain run: giving up after {config.max_restarts} restart(s)")
        return code
    return 0


def _interrupted(job: _Job | None, signals: _Signals) -> int:
    """The launcher got a signal: stop every rank, say so, exit with 128 + the signal's number."""
    message = f"dptrain run: {signal.Signals(signals.received).name} received; stopping all ranks"
    if job is None:
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    else:
        job.log(message)
        job.stop_all()
    return 128 + signals.received
