"""Watching the ranks of one attempt: their exits, a failure on another node, ranks that stall.

The launcher polls its ranks every ``POLL_S`` seconds and, once a second, reads the store:
a failure another node's launcher reported (the key ``failed_key(attempt)``), and
the ranks' heartbeats (see [Note: heartbeats] in :mod:`dptrain.runtime.heartbeat`). A running rank
whose heartbeat stands still for ``DPTRAIN_STALL_REPORT_S`` seconds is reported as making no
progress; ranks that exited 0 while others still run are reported once, with what the
others are doing. Where a rank waits in a DDP step that another never entered, either report
says the likely cause, unequal numbers of batches, and its fix (see [Note: unequal batches]
in :mod:`dptrain.runtime.heartbeat`). Every exit is published in the store (see [Note: exits in the
store] in :mod:`dptrain.launcher.job`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Sequence

from dptrain.runtime.heartbeat import key, keys_prefix, unequal_steps, where
from dptrain.runtime.join import ranks_text
from dptrain.launcher import store_values
from dptrain.launcher.rendezvous import failed_key
from dptrain.launcher.store_values import Warnings
from dptrain.launcher.workers import RankProcess, finish_output

__all__ = ["Watch", "publish", "peer_failure", "POLL_S", "STALL_EVERY"]

# A rank's exit is seen within POLL_S: in-place recovery's replacement starts from here, so the
# poll is short (a waitpid per rank, 100 times a second, costs the launcher nothing measurable).
POLL_S = 0.01
STALL_EVERY = round(1 / POLL_S)  # check heartbeats and peers once a second
_WARN = Warnings()  # for callers without warnings of their own: malformed values, said on stderr


def publish(store: Any, name: str, value: str) -> None:
    """Set a key in the store, if it is still there."""
    try:
        store.set(name, value)
    except Exception:  # noqa: BLE001 - node 0's store is gone: its launcher reports that
        pass


def peer_failure(store: Any, attempt: int, warn: Warnings | None = None) -> str | None:
    """What another node's launcher reported failed in ``attempt``, or None.

    Only a well-formed report counts (``store_values.failure_report``); any other value under
    that key is ignored, said once through ``warn``.
    """
    try:
        return store_values.read(store, failed_key(attempt), store_values.failure_report, warn or _WARN)
    except Exception:  # noqa: BLE001 - node 0's launcher is gone: treat as a failure
        return "the launcher of node 0 is unreachable"


def heartbeat(store: Any, attempt: int, rank: int, kind: str = "hb", warn: Warnings | None = None) -> dict | None:
    """The last heartbeat of ``rank`` in ``attempt``, or None; ``kind="left"``: the note it wrote as it left.

    Checked (``store_values.heartbeat``, ``store_values.left_note``): a malformed one is None,
    said once through ``warn``.
    """
    name = f"{keys_prefix(attempt)}/{key(kind, rank)}"
    parse = store_values.left_note if kind == "left" else store_values.heartbeat
    try:
        return store_values.read(store, name, parse, warn or _WARN)
    except Exception:  # noqa: BLE001 - best effort: the store may be going away
        return None


class Watch:
    """The ranks of one attempt, as their launcher watches them.

    ``signals`` is the launcher's record of signals (``received``, and ``forward``: the
    SIGUSR1s to pass on); ``log`` prints a launcher line; ``nnodes`` > 1 makes it look for
    failures of other nodes; ``warnings`` reports malformed values read from the store (default:
    one of its own, through ``log``); ``early``: a rank that the kernel is still ending counts as
    exited already (in-place recovery; see [Note: a process that is dying] in :mod:`dptrain.runtime.proc`).
    """

    def __init__(self, store: Any, attempt: int, ranks: Sequence[RankProcess], signals: Any,
                 log: Callable[[str], None], stall_s: float, nnodes: int, warnings: Warnings | None = None,
                 early: bool = False) -> None:
        self.store = store
        self.attempt = attempt
        self.ranks = ranks
        self.signals = signals
        self.log = log
        self.stall_s = stall_s
        self.nnodes = nnodes
        self.warn = warnings or Warnings(log)
        self.early = early
        self.exits: dict[int, tuple[int, float]] = {}  # rank -> (exit code, time.monotonic())
        self._early_exit_reported = False
        self._unequal_reported = False  # the unequal-batches hint of a stall report is said once

    def _beat(self, rank: int, kind: str = "hb") -> dict | None:
        return heartbeat(self.store, self.attempt, rank, kind, self.warn)

    def _report_stalls(self, seen: dict[int, list], running: list[RankProcess]) -> None:
        """Print "rank r has made no progress for N s" for running ranks whose heartbeat stands still.

        ``seen[rank]`` holds [state, since, last_report]: the rank's last (collectives,
        steps, current op), when it last changed, and when we last reported it.
        """
        now = time.time()
        beats = {}
        reported = False
        for r in running:
            b = beats[r.rank] = self._beat(r.rank)
            if b is None:
                continue
            state = (b["seq"], b["ticks"], b["ddp_steps"], b["op"])
            entry = seen.setdefault(r.rank, [state, now, 0.0])
            if entry[0] != state:
                seen[r.rank] = [state, now, 0.0]
                continue
            idle = now - entry[1]
            if idle >= self.stall_s and now - entry[2] >= self.stall_s:
                entry[2] = now
                reported = True
                self.log(f"dptrain run: rank {r.rank} has made no progress for {idle:.0f}s ({where(b)})")
        if reported and not self._unequal_reported:
            # One rank waits in a DDP step that another never entered: most often unequal batches.
            hint = unequal_steps({r: {"op": b["op"], "ddp_steps": b["ddp_steps"]} for r, b in beats.items() if b})
            if hint:
                self._unequal_reported = True
                self.log(f"dptrain run: {hint}")

    def _record_exit(self, r: RankProcess, code: int) -> None:
        self.exits[r.rank] = (code, time.monotonic())
        publish(self.store, f"{keys_prefix(self.attempt)}/{key('exit', r.rank)}",
                json.dumps({"code": code, "t": time.time()}))

    def _report_early_exit(self, running: list[RankProcess]) -> None:
        """Once: ranks that exited 0 while others still run, ``stall_s`` after the first of them."""
        finished = sorted((t, rank) for rank, (code, t) in self.exits.items() if code == 0)
        if self._early_exit_reported or not finished:
            return
        waited = time.monotonic() - finished[0][0]
        if waited < self.stall_s:
            return
        self._early_exit_reported = True
        gone = [rank for _, rank in finished]
        who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {ranks_text(gone)}"
        live = [r.rank for r in running]
        still = f"rank {live[0]} is" if len(live) == 1 else f"ranks {ranks_text(live)} are"
        beats = {r: self._beat(r) for r in live}
        states = "; ".join(f"rank {r}: {where(b)}" for r, b in beats.items() if b)
        waiting = [r for r, b in beats.items() if b and b["op"]]
        hint = ""
        if waiting:
            hint = (f". Rank(s) {ranks_text(waiting)} wait in a collective that needs the ranks that exited: it "
                    f"fails at the timeout. Every rank must make the same collective calls until its end")
            unequal = unequal_steps({**self._ended_steps(gone), **{
                r: {"op": b["op"], "ddp_steps": b["ddp_steps"]} for r, b in beats.items() if b}})
            if unequal:
                hint = f". {unequal}"
        self.log(f"dptrain run: {who} exited with code 0 while {still} still running, {waited:.0f}s later"
                 f"{f' ({states})' if states else ''}{hint}")

    def _ended_steps(self, ranks: list[int]) -> dict[int, dict]:
        """The DDP steps of ranks that exited 0, from the note each wrote as it left (else its
        last heartbeat, which may be an interval old), for :func:`unequal_steps`."""
        out = {}
        for r in ranks:
            entry = self._beat(r, "left") or self._beat(r)
            if entry is not None:
                out[r] = {"op": "", "ddp_steps": entry["ddp_steps"], "gone": "exited with code 0"}
        return out

    def run(self, check: Callable[[list[RankProcess]], str | None] | None = None
            ) -> tuple[RankProcess | None, str | None]:
        """Wait until all ranks exit 0 (None, None), a local rank fails (rank, None), a peer
        node fails (None, why), or a signal arrives (None, None; see ``signals``).

        ``check``, when given, is called once a second with the ranks still running (in-place
        recovery ends stalled ranks there, see ``inplace``); a text it returns ends the watch as
        a peer failure would (a node lost for good, see ``resize``).
        """
        seen: dict[int, list] = {}
        polls = 0
        while not self.signals.received:
            while self.signals.forward:
                sig = self.signals.forward.pop(0)
                for r in self.ranks:  # the rank only: SIGUSR1 would end its DataLoader workers
                    if r.alive():
                        os.kill(r.proc.pid, sig)
            running = []
            for r in self.ranks:
                code = r.poll()
                if code is None and self.early:
                    code = r.dying()
                if code is None:
                    running.append(r)
                elif r.rank not in self.exits:
                    self._record_exit(r, code)
                    if code != 0:
                        return r, None
            if not running:
                finish_output(self.ranks)
                return None, None
            polls += 1
            if polls % STALL_EVERY == 0:
                if self.nnodes > 1:
                    peer = peer_failure(self.store, self.attempt, self.warn)
                    if peer:
                        return None, peer
                if self.exits:  # a rank that is gone makes no progress; say so once instead
                    self._report_early_exit(running)
                else:
                    self._report_stalls(seen, running)
                if check is not None:
                    ended = check(running)
                    if ended:
                        return None, ended
            time.sleep(POLL_S)
        return None, None
