"""In-place recovery, the launcher's side (``dptrain run --recovery in-place``): a rank that
fails is replaced by a new process, and the other ranks keep running.

[Note: in-place recovery, the launcher's side]
The ranks and their launchers talk through the job's store, under ``keys_prefix(attempt)``
(see ``dptrain.runtime.heartbeat``), in ``recovery/``:

* ``capable/<rank>`` = "1" (or "cuda", by one that uses a GPU), written by a rank that can
  recover in place (the Trainer, as fit starts). A failure is recovered in place only when
  every rank of the job wrote it;
* ``fallback`` = why not, written by a rank that cannot go on in place (it then exits with
  code 75);
* ``count``, a counter: the launcher whose rank failed takes the next generation number
  from it (1, 2, ...; across nodes too);
* ``generation/<g>`` = ``{"rank", "why", "pid", "time", "spare", "forked"}``: written by that launcher
  before it starts the replacement; the other ranks wait for it, then re-form the process
  group with the replacement (``dptrain.train.recovery``).

When a rank of this node exits with a code other than 0 (or is killed; seen as soon as it
starts to exit, while the kernel still frees its memory: see [Note: a process that is dying]
in ``dptrain.runtime.proc``; a rank that said it uses a GPU is waited for), restarts remain,
every rank said it is capable and none wrote ``fallback``, the launcher stops what is left of
that rank (its DataLoader workers), takes a generation number, writes the generation, and
starts the replacement with the rank's own environment (``RANK``, ``LOCAL_RANK``,
``TORCHELASTIC_RESTART_COUNT``: unchanged) and ``DPTRAIN_GENERATION=g``, its output under the
same ``[rankN]`` prefix -- a hot spare when there is one (``spare``), else a child forked from
the node's warm template (``template``), else a new interpreter. Otherwise the failure
goes the usual way (every rank stopped, the whole job restarted if restarts remain), and the
reason in-place recovery did not apply is said once.

``--max-restarts K`` counts both: the restarts spent so far are the whole-job restarts (the
attempt number) plus every generation of every attempt, read from the store, so that each
node counts the same.

[Note: when a rank counts as stalled]
A rank that stalls is ended and replaced like one that died: its heartbeat (see [Note:
heartbeats] in ``dptrain.runtime.heartbeat``) stands still outside any collective -- or stops
altogether, its ``t`` not written anew for ``FRESH_BEATS`` intervals (a process stopped by
SIGSTOP or a debugger, or in a call that holds the GIL: its last heartbeat, written up to one
interval before, may still say it waits in a collective it has left) -- for longer than
the collective timeout (``--timeout``, ``DPTRAIN_TIMEOUT``), and another rank has waited in
one collective (the same ``op`` and ``seq``) all that time -- so long that its wait has timed
out or is about to -- or says that a collective of its own failed (``failed``: it waits for
the recovery). A rank that is merely slow to reach a collective the others have just entered
(a replacement still receiving its state, a rank writing a checkpoint) is left alone, and so
is one that is leaving the job (it wrote ``left/<rank>`` after its first heartbeat: a slow
shutdown is not a stall). A waiter counts only while its heartbeat is alive (its ``t`` changed
within ``FRESH_BEATS`` intervals): the last heartbeat of a rank that exited, or stopped its
heartbeat, may say it waits in a collective forever.

The others' heartbeats are read only while a rank of this node stands still (from
``WATCH_AFTER_BEATS`` heartbeat intervals on, at most half the timeout), so a healthy job
costs one more store read per rank of this node a second. A wait is timed from when the
launcher first saw it, at most that head start into the rank's stillness; the wait asked
for is therefore the timeout less the head start. Only a heartbeat this very process wrote
counts (its ``pid``): a replacement is never judged by the last heartbeat of the rank it
replaced, and every rank gets a whole timeout afresh after each recovery.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Callable

from dptrain.runtime import settings as _settings
from dptrain.runtime.heartbeat import STEP_STOP_SIGNAL, describe_exit, keys_prefix, recovery_key, where
from dptrain.runtime.join import ranks_text
from dptrain.launcher import store_values
from dptrain.launcher.resize import ENTRY_WAIT_S, Nodes, start_beat
from dptrain.launcher.spare import Spares
from dptrain.launcher.watch import Watch, heartbeat
from dptrain.launcher.workers import RankProcess, error_file, finish_output, read_error_file

__all__ = ["InPlaceRecovery", "rank_settings", "recovery_key", "FALLBACK_EXIT"]

#: Exit code of a rank that cannot recover in place (after it wrote ``recovery/fallback``).
FALLBACK_EXIT = 75
#: Heartbeat intervals a rank of this node stands still before the others' waits are watched
#: (see [Note: when a rank counts as stalled]); at most half the collective timeout.
WATCH_AFTER_BEATS = 3
#: Heartbeat intervals within which a waiter's heartbeat must have been written anew to count.
FRESH_BEATS = 3
#: Seconds after a failure by which the next hot spare starts even if its recovery was not said to
#: be over (see ``InPlaceRecovery._refill_spares``).
REFILL_AFTER_S = 10.0
#: The settings ``dptrain run`` gives its ranks for in-place recovery (and removes otherwise).
RANK_SETTINGS = ("DPTRAIN_RECOVERY", "DPTRAIN_RECOVERY_DIR", "DPTRAIN_GENERATION", "DPTRAIN_RECOVERY_ADMIT")


def rank_settings(environ: dict[str, str], directory: str | None, admit: bool = False) -> None:
    """Set in ``environ`` what a rank reads of in-place recovery: with ``directory`` (the job's
    recovery folder) that it is on, and with ``admit`` that a node may join the running job (see
    ``resize``); without, nothing: a value inherited from the launcher's own environment must not
    make ranks wait for a replacement no launcher starts."""
    for name in RANK_SETTINGS:
        environ.pop(name, None)
    if directory is not None:
        environ.update(DPTRAIN_RECOVERY="in-place", DPTRAIN_RECOVERY_DIR=directory, DPTRAIN_GENERATION="0")
        if admit:
            environ["DPTRAIN_RECOVERY_ADMIT"] = "1"


def _make_directory() -> str:
    """The job's recovery folder: private (0700, as ``mkdtemp`` makes it), in memory where /dev/shm is.

    Its name carries the launcher's pid (``dptrain_recovery_<pid>_<random>``): a folder that a
    SIGKILLed launcher left behind can be told from a running job's, whose folder must never be
    touched (see ``orphaned_directories``)."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    return tempfile.mkdtemp(prefix=f"dptrain_recovery_{os.getpid()}_", dir=where)


def orphaned_directories(where: str = "/dev/shm") -> list[str]:
    """The recovery folders in ``where`` whose launcher (the pid in the name) no longer runs.

    A launcher removes its folder when it ends; only one killed with its janitor leaves it. A
    folder without a pid in its name, or whose launcher runs, is never listed."""
    out = []
    try:
        names = os.listdir(where)
    except OSError:
        return out
    for name in names:
        parts = name.split("_")
        if len(parts) < 4 or not name.startswith("dptrain_recovery_") or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            out.append(os.path.join(where, name))
        except (PermissionError, OverflowError):
            pass  # another user's launcher runs with that pid, or not a pid at all: not ours to judge
    return sorted(out)


def _how(spare: Any, forked: bool) -> tuple[str, str]:
    """How a replacement started, for the launcher's line: after its pid (a hot spare, as it has
    always been said) and at the end (forked from the warm template: the line of a replacement
    without a spare keeps the words it had before the template, up to "keep running")."""
    if spare is None:
        return "", ""
    return ("", " (the replacement is forked from the warm template)") if forked else (" (a hot spare)", "")


class InPlaceRecovery:
    """In-place recovery for one launcher (``job``: its ``_Job``; see [Note: in-place recovery,
    the launcher's side]).

    Owns the job's recovery folder and the hot spares. ``watch`` replaces the ranks of this
    node that fail while it can; what it cannot recover it returns, as ``Watch.run`` does.
    """

    def __init__(self, job: Any) -> None:
        config = job.config
        self.job = job
        self.directory = _make_directory()
        job.janitor.tell("dir", self.directory)
        self.timeout_s: float = config.timeout or _settings.get("DPTRAIN_TIMEOUT")
        self.why_not: tuple[str, str] | None = None  # (kind, message): why the last failure went the usual way
        self._said: set[str] = set()  # kinds of fallback already explained
        self._counts: dict[int, int] = {}  # generations of attempts that ended
        self._since: dict[int, tuple[tuple, float]] = {}  # rank -> (its heartbeat's state, since when)
        self._waits: dict[int, tuple[tuple, float]] = {}  # another rank -> (the collective it waits in, seen since)
        # rank -> (its heartbeat's t, seen first or changing when, seen changing at all)
        self._beating: dict[int, tuple[float, float, bool]] = {}
        self._first_t: dict[int, float] = {}  # pid of a rank of this node -> the t of its first heartbeat seen
        beat_s = _settings.get("DPTRAIN_HEARTBEAT_S")
        # How long a rank of this node stands still before the others' waits are watched.
        self.watch_after_s = min(self.timeout_s / 2, WATCH_AFTER_BEATS * beat_s)
        self.fresh_s = FRESH_BEATS * beat_s + 1.0
        self.ended: dict[int, str] = {}  # pid -> why this launcher ended it (a stall)
        self.nodes: Nodes | None = None  # the job's nodes, while an attempt of several is watched
        self.joined_at = 0  # the generation this node's ranks started in (> 0: let into a running job)
        self._refill: tuple[int, int, float] | None = None  # a spare to start: (attempt, generation, since)
        self._beat: tuple[int, Any] | None = None  # (attempt, this node's beat), started before its ranks

    # -- set-up ------------------------------------------------------------------------------
    def beat(self, attempt: int) -> None:
        """Across nodes: this launcher beats for ``attempt`` from now on (its store served), not
        only from its watch: its ranks may wait seconds for the template's imports, and node 0
        would take a silent node for lost."""
        if self.job.config.nnodes > 1 and self._beat is None:
            self._beat = (attempt, start_beat(self.job, attempt))

    @property
    def spares(self) -> Spares | None:
        """The node's hot spares and warm template (the job's, see ``template.WarmStarts``)."""
        return self.job.warm.spares

    def started(self) -> None:
        """The ranks of an attempt are started (after ``prepare``): start (or top up) the hot spares."""
        if self.spares is not None:
            self._refill = None
            self.spares.fill()

    def _beat_for(self, attempt: int) -> Any:
        """The beat ``beat`` started for ``attempt`` (now the watch's to close), or None."""
        beat, self._beat = self._beat, None
        if beat is not None and beat[0] != attempt:
            beat[1].close()
            return None
        return beat[1] if beat is not None else None

    def close(self) -> None:
        self._beat_for(-1)  # one started for an attempt that was never watched
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- restarts ----------------------------------------------------------------------------
    def _count(self, attempt: int) -> int:
        """Generations taken in ``attempt`` so far (``add`` of 0 reads a counter)."""
        return self.job.store.add(recovery_key(attempt, "count"), 0)

    def _recoveries(self, attempt: int) -> int:
        """Generations of ``attempt`` that recovered from a failure: all but the nodes let in (see ``resize``)."""
        return self._count(attempt) - self.job.store.add(recovery_key(attempt, "admissions"), 0)

    def _spent_before(self, attempt: int) -> int:
        """Restarts spent before ``attempt`` began: whole-job restarts and the recoveries of earlier attempts."""
        for k in range(attempt):
            if k not in self._counts:
                self._counts[k] = self._recoveries(k)
        return attempt + sum(self._counts[k] for k in range(attempt))

    def restarts_spent(self, attempt: int) -> int:
        """Restarts spent up to now: whole-job restarts (``attempt``) and every recovery in place."""
        return self._spent_before(attempt) + self._recoveries(attempt)

    def say_why_not(self) -> None:
        """Once per kind: why the whole job restarts instead of recovering in place."""
        if self.why_not is not None and self.why_not[0] not in self._said:
            self._said.add(self.why_not[0])
            self.job.log(f"dptrain run: {self.why_not[1]}")

    # -- watching ----------------------------------------------------------------------------
    def watch(self, watch: Watch, attempt: int) -> tuple[RankProcess | None, str | None]:
        """``watch.run()``, replacing the ranks of this node that fail while in-place recovery can,
        and across nodes going on without a node lost for good (see ``resize``)."""
        self.why_not = None
        self.forget_progress()
        self.nodes = Nodes(self, attempt, beat=self._beat_for(attempt)) if self.job.config.nnodes > 1 else None
        try:
            while True:
                failed, peer = watch.run(lambda running: self._tick(running, attempt))
                if failed is None or self.job.signals.received:
                    return failed, peer
                # As the watch recorded it: the kernel may still be ending it (see Watch's ``early``).
                why = (self.ended.get(failed.proc.pid)
                       or describe_exit(watch.exits[failed.rank][0], self.job.oom, failed.proc.pid))
                try:
                    replaced = self._replace(watch, attempt, failed, why, time.time())
                except (RuntimeError, OSError):  # the store is gone (node 0 ended): the usual failure
                    replaced = False
                if not replaced:
                    failed.join(None)  # the usual failure reads its exit code: it has one once the kernel is done
                    return failed, None
        finally:
            if self.nodes is not None:
                # A resize announced as the ranks finished still counts: the exit barrier waits for its nodes only.
                with contextlib.suppress(RuntimeError, OSError):
                    self.nodes.catch_up()
                self.nodes.close()

    @property
    def dropped(self) -> str | None:
        """Why this node was left out of the job by a resize (see ``resize``), or None."""
        return self.nodes.dropped if self.nodes is not None else None

    def _tick(self, running: list[RankProcess], attempt: int) -> str | None:
        """Once a second in the watch: nodes that left (a failure text ends the attempt), then stalled ranks."""
        if self.nodes is not None:
            try:
                ended = self.nodes.tick()
            except (RuntimeError, OSError):  # the store is gone: the watch reports node 0's end
                ended = None
            if ended is not None:
                return ended
        self._end_stalled(running, attempt)
        self._refill_spares()
        return None

    def forget_progress(self, renumbered: bool = False) -> None:
        """Every rank gets a whole timeout afresh (after a recovery); ``renumbered``: the ranks' numbers
        changed (see ``resize``), so what was seen of each number's heartbeat is another rank's."""
        self._since.clear()
        self._waits.clear()
        if renumbered:
            self._beating.clear()

    def _blocker(self, attempt: int, resizing: bool = False, growing: bool = False) -> tuple[str, str] | None:
        """Why the failure at hand cannot be recovered in place (``resizing``: on another world
        size, see ``resize``; ``growing``: with nodes let in): (kind, message), or None."""
        store, warn = self.job.store, self.job.warnings
        note = store_values.read(store, recovery_key(attempt, "fallback"), store_values.fallback_note, warn)
        if note is not None:
            return "fallback", f"a rank cannot recover in place ({note}); restarting all ranks instead"
        if not resizing and store.check([recovery_key(attempt, "finished")]):
            # Rank 0's Trainer.fit had returned: no rank trains any more for a replacement to join,
            # and the others may be gone already (a replacement would wait for them until its timeout).
            return "finished", ("a rank failed after rank 0's Trainer.fit had returned, where no rank can hand its "
                                "state over in place; restarting all ranks instead (they resume from the newest "
                                "checkpoint)")
        world = self.job.layout.world_size
        if store.check([recovery_key(attempt, f"capable/{r}") for r in range(world)]):
            if not resizing:
                return None
            unable = [r for r in range(world) if not store.check([recovery_key(attempt, f"resizable/{r}")])]
            if not unable and growing:
                # A rank that can go on without a node but not take a new one (DiLoCo: see SHRINK_ONLY in
                # dptrain.train.recovery).
                shrink = [r for r in range(world) if store.get(recovery_key(attempt, f"resizable/{r}")) == b"shrink"]
                if shrink:
                    return "resizable", (f"rank(s) {ranks_text(shrink)} train DiLoCo replicas, which go on without a "
                                         f"node in place but cannot take a new one (it would have no replica to start "
                                         f"from); restarting all ranks")
            if not unable:
                return None
            return "resizable", (f"rank(s) {ranks_text(unable)} cannot share an epoch out anew on fewer ranks (every "
                                 f"loader, dev and test ones too, must use dptrain's DistributedSampler, e.g. from "
                                 f"dptrain.prepare_dataloader, and the loop must be the Trainer's); restarting all "
                                 f"ranks")
        missing = [r for r in range(world) if not store.check([recovery_key(attempt, f"capable/{r}")])]
        return "capable", (f"in-place recovery needs every rank to train with dptrain.Trainer or "
                           f"dptrain.RecoverableLoop on dptrain's DDP (rank(s) {ranks_text(missing)} did not say they "
                           f"can; a Trainer that cannot says why when it starts); restarting all ranks instead")

    def _replace(self, watch: Watch, attempt: int, failed: RankProcess, why: str, noticed: float) -> bool:
        """Start a replacement for ``failed``; False when in-place recovery cannot (see ``why_not``)."""
        job, config = self.job, self.job.config
        if self.restarts_spent(attempt) >= config.max_restarts:
            return False  # the usual failure: no restart is left for any kind of recovery
        self.why_not = self._blocker(attempt)
        if self.why_not is not None:
            return False
        generation = job.store.add(recovery_key(attempt, "count"), 1)
        restart = self.restarts_spent(attempt)
        if restart > config.max_restarts:  # another node took the last one meanwhile
            return False
        if self.nodes is not None:  # the rank is named in the numbering of the generation before
            self.nodes.catch_up(upto=generation, wait_s=ENTRY_WAIT_S)
            if self.nodes.dropped is not None:
                return False
        traceback = self._bury(failed, attempt)
        # A GPU's memory is freed only when the kernel has ended the rank: a replacement started before
        # that could run out of it (on the CPU the two overlapping costs nothing but a little memory).
        reaped = self._holds_a_gpu(attempt, failed.rank)
        if reaped:
            self._reap(failed)
        spare = self.spares.take() if self.spares is not None else None
        forked = getattr(spare, "on_demand", False)  # not waiting before: forked now from the warm template
        entry = {"rank": failed.rank, "why": why, "pid": failed.proc.pid, "time": noticed,
                 "spare": spare is not None and not forked, "forked": forked}
        job.store.set(recovery_key(attempt, f"generation/{generation}"), json.dumps(entry))
        self._stop_steps(failed)  # as soon as the generation is announced: they re-form while the replacement starts
        environ = dict(failed.environ, DPTRAIN_GENERATION=str(generation))
        if spare is not None and not self.job.warm.assign(spare, environ):
            spare = None
        new = RankProcess(failed.rank, failed.local_rank, failed.cmd, environ, failed.show, job.console, failed.logs,
                          proc=spare)
        job.ranks[job.ranks.index(failed)] = new
        job.janitor.tell("group", new.proc.pid)
        watch.exits.pop(failed.rank, None)  # the rank runs again: its next exit is the replacement's
        self.forget_progress()
        self.ended.pop(failed.proc.pid, None)
        spare_said, forked_said = _how(spare, forked)
        job.log(f"dptrain run: rank {failed.rank} (local rank {failed.local_rank}, pid {failed.proc.pid}) {why}; "
                f"in-place recovery: replacement pid {new.proc.pid}{spare_said} "
                f"joins generation {generation} (restart {restart} of {config.max_restarts}); the other ranks keep "
                f"running{forked_said}")
        # Its end and its last output are waited for now, off the path from the failure to the replacement.
        if not reaped:
            self._reap(failed)
        finish_output([failed], timeout_s=2.0)
        tail = traceback or "\n".join(failed.tail)
        if tail:
            job.log(f"--- last lines of rank {failed.rank} ---\n{tail}\n---")
        if self.spares is not None:
            self._refill = (attempt, generation, time.monotonic())  # see _refill_spares
        return True

    def _stop_steps(self, failed: RankProcess) -> None:
        """Tell this node's ranks other than ``failed`` to stop the step they compute, which they would
        otherwise find out only at its next collective (see [Note: stopping a step at once] in
        ``dptrain.runtime.interrupt``); the generation is announced by now."""
        for rank in self.job.ranks:
            if rank is not failed and getattr(rank.proc, "returncode", None) is None:  # not reaped: its pid is its own
                with contextlib.suppress(OSError):
                    os.kill(rank.proc.pid, STEP_STOP_SIGNAL)

    def _refill_spares(self) -> None:
        """Start the next spare once the recovery it would slow is over.

        A spare's start (an interpreter, then imports at the idle class) takes the CPU from the
        ranks that are recovering when the cores are all theirs (CPU training): started right
        after the failure it delayed the replacement's first step by a third. It starts at the
        first tick after rank 0 said the generation is recovered (``recovery/done/<g>``), or
        ``REFILL_AFTER_S`` after the failure when that never comes (a fallback, a node lost);
        a spare is not warm before its seconds of imports anyway.
        """
        if self._refill is None or self.spares is None:
            return
        attempt, generation, since = self._refill
        try:
            done = self.job.store.check([recovery_key(attempt, f"done/{generation}")])
        except (RuntimeError, OSError):  # the store is gone: the job is ending
            done = False
        if done or time.monotonic() - since >= REFILL_AFTER_S:
            self._refill = None
            self.spares.fill()

    def _bury(self, failed: RankProcess, attempt: int) -> str:
        """Stop what is left of ``failed`` (its process group: DataLoader workers) and return the
        traceback it left ("" if none); its error file is removed, so that the replacement's own
        failure is never reported with this one's traceback. The rank may still be ending (see
        [Note: a process that is dying] in ``dptrain.runtime.proc``): it writes nothing more, and
        ``_reap`` waits for it."""
        failed.send(signal.SIGKILL)
        # The file named when it started: a rank renumbered since (see ``resize``) still writes there.
        path = failed.environ.get("TORCHELASTIC_ERROR_FILE") or error_file(self.job.error_dir, attempt, failed.rank)
        traceback = read_error_file(path)
        try:
            os.remove(path)
        except OSError:
            pass
        return traceback

    def _reap(self, failed: RankProcess) -> None:
        """Wait until the kernel has ended ``failed`` (SIGKILLed by ``_bury``; it frees the memory first)."""
        failed.join(None)
        self.job.janitor.tell("forget", failed.proc.pid)

    def _holds_a_gpu(self, attempt: int, rank: int) -> bool:
        """Whether ``rank`` said, as its Trainer started, that it uses CUDA (``capable/<rank>`` = "cuda")."""
        try:
            return self.job.store.get(recovery_key(attempt, f"capable/{rank}")) == b"cuda"
        except (RuntimeError, OSError):  # read before, by _blocker: the store went away since
            return True

    # -- stalled ranks -----------------------------------------------------------------------
    def _end_stalled(self, running: list[RankProcess], attempt: int) -> None:
        """SIGKILL a rank of this node that stalls (see [Note: in-place recovery, the launcher's
        side]); the watch then finds it dead and it is replaced, ``ended`` saying why."""
        now = time.monotonic()
        idle_ranks = []
        for proc in running:
            if proc.proc.pid in self.ended:
                continue  # ended already; not reaped yet
            beat = heartbeat(self.job.store, attempt, proc.rank, warn=self.job.warnings)
            if beat is None or beat["pid"] != proc.proc.pid:
                self._since.pop(proc.rank, None)
                continue
            self._first_t.setdefault(proc.proc.pid, beat["t"] or 0.0)
            state = (beat["seq"], beat["ticks"], beat["ddp_steps"], beat["op"])
            seen = self._since.get(proc.rank)
            if seen is None or seen[0] != state:
                self._since[proc.rank] = (state, now)
            elif (now - seen[1] >= self.watch_after_s and (not beat["op"] or self._frozen(proc.rank, beat, now))
                  and not self._leaving(attempt, proc)):
                idle_ranks.append((proc, beat, now - seen[1]))
        if not idle_ranks:
            self._waits.clear()
            return
        waits = self._read_waits(attempt, now)
        for proc, beat, idle in idle_ranks:
            if idle < self.timeout_s:
                continue
            # The others' waits were first seen ``watch_after_s`` into this rank's stillness at the latest.
            long_enough = self.timeout_s - self.watch_after_s
            waiter = next(((r, op) for r, (op, waited) in waits.items()
                           if r != proc.rank and (waited is None or waited >= long_enough)), None)
            if waiter is None:
                continue
            rank, op = waiter
            text = f"made no progress for {idle:.0f}s ({where(beat)}) while rank {rank} waited in {op}"
            self.job.log(f"dptrain run: rank {proc.rank} (local rank {proc.local_rank}, pid {proc.proc.pid}) {text}, "
                         f"longer than the {self.timeout_s:g}s collective timeout; ending it")
            self.ended[proc.proc.pid] = f"stalled: it {text}"
            proc.send(signal.SIGKILL)

    def _read_waits(self, attempt: int, now: float) -> dict[int, tuple[str, float | None]]:
        """The ranks of the job that wait in a collective: rank -> ("op #seq", seconds seen waiting in it);
        or whose collective failed: rank -> ("a collective that failed", None)."""
        out: dict[int, tuple[str, float | None]] = {}
        for rank in range(self.job.layout.world_size):
            beat = heartbeat(self.job.store, attempt, rank, warn=self.job.warnings)
            if beat is None or not self._alive(rank, beat, now):
                self._waits.pop(rank, None)
                continue
            if beat["failed"] and not beat["op"]:
                out[rank] = ("a collective that failed", None)
            if not beat["op"]:
                self._waits.pop(rank, None)
                continue
            where_ = (beat["pid"], beat["op"], beat["seq"])
            seen = self._waits.get(rank)
            if seen is None or seen[0] != where_:
                seen = self._waits[rank] = (where_, now)
            out[rank] = (f"{beat['op']} #{beat['seq']}", now - seen[1])
        return out

    def _still(self, rank: int, beat: dict, now: float) -> tuple[bool, float]:
        """Record ``rank``'s heartbeat time: (whether it was ever seen changing, seconds it has not
        changed since this launcher first saw it or saw it change)."""
        seen = self._beating.get(rank)
        if seen is None or seen[0] != beat["t"]:
            self._beating[rank] = (beat["t"], now, seen is not None)
            return seen is not None, 0.0
        return seen[2], now - seen[1]

    def _alive(self, rank: int, beat: dict, now: float) -> bool:
        """Whether ``rank``'s heartbeat was written anew within ``fresh_s`` (first sight: not yet known, so no)."""
        changing, still = self._still(rank, beat, now)
        return changing and still <= self.fresh_s

    def _frozen(self, rank: int, beat: dict, now: float) -> bool:
        """Whether ``rank``'s heartbeat has not been written anew for longer than ``fresh_s``: the whole
        process stands still (stopped, or a call that holds the GIL), whatever its last heartbeat said."""
        return self._still(rank, beat, now)[1] > self.fresh_s

    def _leaving(self, attempt: int, proc: RankProcess) -> bool:
        """Whether ``proc`` wrote its ``left`` note (it is shutting down) since its first heartbeat."""
        name = f"{keys_prefix(attempt)}/left/{proc.rank}"
        note = store_values.read(self.job.store, name, store_values.left_note, self.job.warnings)
        return note is not None and note["t"] is not None and note["t"] >= self._first_t.get(proc.proc.pid, 0.0)
