"""Joining a job: what ``dptrain.init`` waits for, said out loud while it waits.

[Note: waiting in the open]
``init`` blocks twice: connecting to the rendezvous store (MASTER_ADDR:MASTER_PORT), and
creating the process group, which needs every rank. Either can last until the timeout
(600 s by default) when a node cannot reach the master, or when only some ranks were ever
started -- e.g. ``python train.py`` in an sbatch script, where the one process reads
SLURM_NTASKS=4 and waits for three ranks that nobody starts. So while ``init`` waits, a
thread says what it waits for: after ``DPTRAIN_WAIT_REPORT_S`` seconds (default 30), then
again every as many seconds, on local rank 0 of each node:

    dptrain.init: rank 0 of 4 has waited 30s at 10.0.0.1:15042: 1 of 4 ranks have joined (missing: 1, 2, 3) ...

Each rank counts itself in by appending its rank to a key of the store; the reporter reads
it over a connection of its own (the main thread's connection is busy waiting inside the
process-group creation). Nothing of this runs when ``init`` finishes in time, and the
reporter is joined before ``init`` returns or raises: a thread left inside a store call
when the interpreter exits aborts the process.

Ranks also leave ``init`` together (the ``ready`` count): otherwise a rank that is done
first -- a script that only prints its rank -- can shut down and close its connections
while a peer still completes its side of them, which then fails. The rank that hosts the
store leaves last of all (the ``ready/seen`` count): its process ending ends the store.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Protocol

from dptrain.runtime import settings as _settings


def probe(addr: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None if something accepts connections at ``addr:port``, else why not, in words."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return None
    except socket.gaierror:
        return f"the host name {addr!r} does not resolve"
    except ConnectionRefusedError:
        return "nothing listens there yet (connection refused)"
    except (socket.timeout, TimeoutError):
        return "no answer (a firewall, or an address this machine cannot reach?)"
    except OSError as exc:
        return exc.strerror or str(exc)


def wait_for_listener(host: str, port: int, timeout_s: float, who: str, what: str, hint: str,
                      log: Callable[[str], None], check: Callable[[], None] = lambda: None) -> None:
    """Return once something accepts connections at ``host:port`` (a launcher waiting for node 0).

    Every ``DPTRAIN_WAIT_REPORT_S`` seconds it logs "dptrain run: <who> has waited Ns for <what> at host:port:
    <why>. <hint>"; after ``timeout_s`` it raises ValueError "<who> could not reach <what> at
    host:port within Ts: <why>". ``check`` runs between probes (it may raise to stop waiting).
    """
    where = f"{host}:{port}"
    report_s = _settings.get("DPTRAIN_WAIT_REPORT_S")
    t0 = time.monotonic()
    next_report = t0 + report_s
    while (why := probe(host, port, timeout_s=1.0)) is not None:
        check()
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            raise ValueError(f"{who} could not reach {what} at {where} within {timeout_s:.0f}s: {why}")
        if time.monotonic() >= next_report:
            next_report += report_s
            log(f"dptrain run: {who} has waited {waited:.0f}s for {what} at {where}: {why}. {hint}")
        time.sleep(0.1)  # nodes start together: a node that looked too early must not wait half a second more


def ranks_text(ranks: list[int], limit: int = 16) -> str:
    """``[1, 2, 3]`` as "1, 2, 3"; long lists are cut: "1, 2, ... (40 more)"."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", ... ({len(ranks) - limit} more)" if len(ranks) > limit else "")


def parse_joined(raw: bytes) -> set[int]:
    return {int(r) for r in raw.decode().split(",") if r.strip().isdigit()}


class Seat(Protocol):
    """What a report reads of the world joining (:class:`dptrain.World` has it). Named here,
    not imported from ``env``, because ``env`` calls into this module: the arrow runs one way."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str


class JoinWatch:
    """Reports, from a thread, what ``init`` is waiting for, until :meth:`stop`.

    ``open_reader`` returns a new store connection whose keys are the ones the ranks
    count themselves in under (``joined``, ``ready``); it is called only when a report is due.
    """

    def __init__(self, world: Seat, timeout_s: float, open_reader: Callable[[], Any],
                 report_s: float | None = None) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self._open_reader = open_reader
        self._report_s = _settings.get("DPTRAIN_WAIT_REPORT_S") if report_s is None else report_s
        self._t0 = time.monotonic()
        self.connected = False  # the main thread reached the store
        self._stop = threading.Event()
        self._thread = None
        if world.local_rank == 0 and self._report_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True, name="dptrain-join-watch")
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._report_s):
            text = self.describe()
            if not self._stop.is_set():
                sys.stderr.write(text + "\n")
                sys.stderr.flush()

    def stop(self) -> None:
        """Stop reporting; returns once the reporter has finished (see the note above)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def describe(self) -> str:
        """One line: who waits, for how long, where, and for what."""
        return f"dptrain.init: {self._state()} (timeout {self.timeout_s:.0f}s)"

    def _state(self) -> str:
        w = self.world
        waited = time.monotonic() - self._t0
        where = f"{w.master_addr}:{w.master_port}"
        head = f"rank {w.rank} of {w.world_size} has waited {waited:.0f}s"
        if not self.connected:
            why = probe(w.master_addr, w.master_port) or (
                "a server answers there now and the connection is being retried (if this lasts, "
                "MASTER_PORT may be another service's port)")
            return (f"{head} to reach the rendezvous store at {where} (MASTER_ADDR:MASTER_PORT): {why}. "
                    f"Is the job's first node up, and is {w.master_addr} its address as seen from this "
                    f"node?{self._slurm_hint()}")
        return f"{head} at {where}: {self._peers()}"

    def _peers(self) -> str:
        n = self.world.world_size
        try:
            reader = self._open_reader()
            joined = parse_joined(reader.get("joined")) if reader.check(["joined"]) else set()
            ready = int(reader.add("ready", 0))
        except Exception as exc:  # noqa: BLE001 - a report must never fail the wait itself
            return f"waiting for the other ranks (could not read who joined: {type(exc).__name__})"
        missing = sorted(set(range(n)) - joined)
        if missing:
            return (f"{len(joined)} of {n} ranks have joined (missing: {ranks_text(missing)}).{self._slurm_hint()} "
                    f"Every rank must run dptrain.init(); a missing rank was not started or cannot reach this store")
        if ready < n:
            return (f"all {n} ranks have joined the store, {ready} of them have connected to each other; "
                    f"the ranks must reach each other's addresses too (firewall? GLOO_SOCKET_IFNAME / "
                    f"NCCL_SOCKET_IFNAME name the network interface to use)")
        return f"all {n} ranks are connected; finishing"

    def _slurm_hint(self) -> str:
        if self.world.source != "slurm":
            return ""
        return (f" The world comes from Slurm (SLURM_NTASKS={self.world.world_size}): start every task with "
                f"srun (`srun python {os.path.basename(sys.argv[0]) or 'train.py'} ...`, see `dptrain slurm-script`); "
                f"a script started with plain python inside sbatch runs as a single task.")

    def failure(self, exc: BaseException) -> RuntimeError:
        """The error ``init`` raises when joining failed: the cause, and what it was waiting for."""
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return RuntimeError(f"dptrain.init failed ({type(exc).__name__}: {first}): {self._state()}")


def wait_until_all_ready(store: Any, world_size: int, timeout: datetime.timedelta, hosts_store: bool = False) -> None:
    """Return once every rank has created its process group (see the note above).

    The rank whose process hosts the store (``hosts_store``: rank 0 without a launcher's store)
    returns only once every rank has seen that: a host that leaves first (a script that ends right
    after ``init``) takes the store with it while a peer still waits for ``ready/all``, and that
    peer's ``init`` fails with "Connection reset by peer".
    """
    if int(store.add("ready", 1)) >= world_size:
        store.set("ready/all", "1")
    else:
        store.wait(["ready/all"], timeout)
    # The others need no second wait: their count below is their last use of the store in init.
    if int(store.add("ready/seen", 1)) >= world_size:
        store.set("ready/seen/all", "1")
    elif hosts_store:
        store.wait(["ready/seen/all"], timeout)
