"""What ranks and launchers tell each other through the rendezvous store, and in what words.

This module sits at the bottom of the import graph and needs no torch: the launcher uses it
before any rank (or torch) is started, and the ranks use the same keys and the same wording.

[Note: the store's key layout]
Everything of one launch attempt lives under ``dptrain/attempt<k>/`` (a restarted job never
reads a stale key of the attempt before), split in two: ``pg/`` for the process group's own
rendezvous, ``dp/`` for dptrain's keys, which are

* ``hb/<rank>``      a rank's heartbeat: collectives entered so far, the one it is in, steps
                     (the Trainer's, and DDP's synced backward passes);
* ``left/<rank>``    written by a rank as it shuts down (whether a collective of its own had
                     failed, and its DDP steps);
* ``exit/<rank>``    written by ``dptrain run`` when a rank's process exits: code and time;
* ``exit/published`` set by ``dptrain run``: exits will be published (so a rank may wait for one);
* ``joined``, ``ready``  the ranks that reached ``init`` / finished it (see ``_join``);
* ``debug/...``      the debug cross-check of collectives (see ``_diagnostics``).

[Note: heartbeats]
A daemon thread of every rank writes its progress every ``DPTRAIN_HEARTBEAT_S`` seconds
(default 2). The launcher reads them to report a rank that stops making progress; a rank
whose collective fails reads its peers' to say which one did not arrive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import weakref
from typing import Any

from dptrain.runtime import settings as _settings

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "attempt_prefix",
    "keys_prefix",
    "recovery_key",
    "tick",
    "enter",
    "leave",
    "start",
    "stop",
    "read_per_rank",
    "where",
    "describe_exit",
    "OomRecord",
    "unequal_steps",
]

#: Seconds a collective may wait before the job is failed, when neither ``init(timeout=)``
#: nor ``DPTRAIN_TIMEOUT`` (``dptrain run --timeout``) says otherwise. Long enough for a
#: slow checkpoint on rank 0, short enough that a stalled job does not burn a night of GPU time.
DEFAULT_TIMEOUT_S: float = _settings.default("DPTRAIN_TIMEOUT")

#: Sent by ``dptrain run`` to the other ranks of its node once it replaces a rank in place: they
#: stop the step they are computing (see [Note: stopping a step at once] in ``dptrain.runtime.interrupt``).
#: Ignored by default, so a process that does not handle it is unaffected.
STEP_STOP_SIGNAL = signal.SIGURG

PROCESS_GROUP_PART = "pg"
DPTRAIN_PART = "dp"
EXITS_PUBLISHED = "exit/published"


def attempt_prefix(attempt: int) -> str:
    """Where everything of launch attempt ``attempt`` lives in the store."""
    return f"dptrain/attempt{attempt}"


def keys_prefix(attempt: int) -> str:
    """Where dptrain's own keys of attempt ``attempt`` live (what the launcher reads and writes)."""
    return f"{attempt_prefix(attempt)}/{DPTRAIN_PART}"


def recovery_key(attempt: int, name: str) -> str:
    """``<keys_prefix(attempt)>/recovery/<name>``: what launchers and ranks say of in-place recovery
    (see [Note: in-place recovery, the launcher's side] in ``dptrain.launcher.inplace``)."""
    return f"{keys_prefix(attempt)}/recovery/{name}"


def key(kind: str, rank: int) -> str:
    """``hb/3``, ``left/3``, ``exit/3``: a per-rank key under :func:`keys_prefix`."""
    return f"{kind}/{rank}"


# -- this rank's progress, as its heartbeat publishes it ------------------------------------
# Collectives entered so far, the one it is in ("" when outside), progress ticks (the
# Trainer's steps), DDP's synced backward passes, and whether a collective of its own failed.
_progress: dict[str, Any] = {"seq": 0, "op": "", "ticks": 0, "ddp_steps": 0, "failed": False}


def tick() -> None:
    """Record one unit of progress (a training step); the launcher watches these."""
    _progress["ticks"] += 1


def note_ddp_step(num_steps: int) -> None:
    """DDP finished its ``num_steps``-th synced backward: the count a plain loop's stall report shows.

    Set, not added: with two DDP models (a GAN's) every rank reports the step both are at,
    not their sum, and the counts of two ranks compare the same way.
    """
    _progress["ddp_steps"] = num_steps


def enter(name: str) -> None:
    """Mark that this rank entered collective ``name`` (for stall reports)."""
    _progress["seq"] += 1
    _progress["op"] = name


def leave() -> None:
    _progress["op"] = ""


def mark_failed() -> None:
    """A collective of this rank failed: it is a victim, not the cause, when it leaves."""
    _progress["failed"] = True


def progress() -> dict[str, Any]:
    return _progress


def new_generation() -> None:
    """In-place recovery re-formed the process group: its collectives count from 0, as a replacement's
    do (the steps go on counting)."""
    _progress.update(seq=0, op="", failed=False)


def reset_progress() -> None:
    _progress.update(seq=0, op="", ticks=0, ddp_steps=0, failed=False)


def _loop(store: Any, rank: int, interval: float, stop_event: threading.Event, also: Any) -> None:
    while not stop_event.is_set():
        entry = dict(_progress, t=time.time(), pid=os.getpid())
        try:
            store.set(key("hb", rank), json.dumps(entry))
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            return
        if also is not None:
            try:
                also()
            except Exception:  # noqa: BLE001 - a store gone fails the next write; the beat goes on meanwhile
                pass
        stop_event.wait(interval)


_thread: dict[str, Any] = {}


def start(store: Any, rank: int, interval: float | None = None, also: Any = None) -> None:
    """Publish this rank's progress to ``store`` every ``interval`` seconds (default ``DPTRAIN_HEARTBEAT_S``).

    A daemon thread does it, and calls ``also()`` (no arguments; default None: nothing) after each
    write. Raises ``SettingError`` when ``DPTRAIN_HEARTBEAT_S`` is not a number of seconds.
    """
    interval = interval or _settings.get("DPTRAIN_HEARTBEAT_S")
    stop()
    stop_event = threading.Event()
    thread = threading.Thread(target=_loop, args=(store, rank, interval, stop_event, also), daemon=True,
                              name="dptrain-heartbeat")
    thread.start()
    _thread.update(stop=stop_event, thread=thread)


def stop() -> None:
    """Stop the heartbeat thread and wait until it has finished.

    [Note: no thread in a store call at exit]
    The wait has no time limit, on purpose. A thread that is still inside a C++ call (a
    store write) when the interpreter finalizes is killed by ``pthread_exit`` as soon as it
    asks for the GIL back; that unwinds through a ``noexcept`` C++ frame and ends the
    process in ``std::terminate``: "terminate called without an active exception" and
    SIGABRT, after the script has finished. Giving up after a few seconds (the thread
    starved of CPU on a loaded machine) left exactly that window open. A store write does
    not wait for the server's answer, so the thread always comes back quickly; ``init``
    registers :func:`dptrain.shutdown` with ``atexit`` so this runs before finalization
    even when a script never calls it.
    """
    if _thread:
        _thread["stop"].set()
        _thread["thread"].join()
        _thread.clear()


def note_leaving(store: Any, rank: int) -> None:
    """Write ``left/<rank>`` before this rank's connections close (best effort)."""
    try:
        # Its DDP steps too: the last heartbeat may be an interval old, and a peer that waits in
        # a later step reads them to tell that the ranks had unequal numbers of batches.
        entry = {"t": time.time(), "after_failure": _progress["failed"], "ddp_steps": _progress["ddp_steps"]}
        store.set(key("left", rank), json.dumps(entry))
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
        pass


# -- reading ------------------------------------------------------------------------------
def read_per_rank(store: Any, kind: str, world_size: int) -> dict[int, dict]:
    """Every rank's ``<kind>/<rank>`` entry that the store holds (ranks without one are absent)."""
    out = {}
    for r in range(world_size):
        try:
            if store.check([key(kind, r)]):
                out[r] = json.loads(store.get(key(kind, r)))
        except Exception:  # noqa: BLE001 - best effort: used only to explain a failure
            break
    return out


# -- the words ----------------------------------------------------------------------------
def where(beat: dict) -> str:
    """A heartbeat in words: ``waiting in all_reduce #7, 3 steps`` / ``outside any collective after #7, 3 steps``.

    The steps are the Trainer's; a plain loop has none, and DDP's synced backward passes
    stand in for them: ``outside any collective after #14, 9 DDP steps``.
    """
    place = f"waiting in {beat['op']} #{beat['seq']}" if beat["op"] else f"outside any collective after #{beat['seq']}"
    if beat["ddp_steps"] and not beat["ticks"]:
        return f"{place}, {_count(beat['ddp_steps'], 'DDP step')}"
    return f"{place}, {beat['ticks']} steps"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


# [Note: unequal batches]
# The commonest hang of a hand-written loop: rank 0 got 10 batches and rank 1 got 9. Rank 1
# leaves the loop after step 9 while rank 0 waits in step 10's gradient all-reduce until the
# timeout. The heartbeats show it: a rank waiting in one of DDP's per-step collectives is in
# step ``ddp_steps + 1``; a rank that has done fewer steps and is in none of them has left
# the loop -- for certain when it ended (exited, shut down) or waits in another collective
# (a barrier after the loop), and perhaps when it is outside any collective: it may also be
# stuck inside step 10 (a slow data loader, a hung op), so that message names both. Where
# no rank waits in a DDP step, or none has done fewer steps, nothing is said.

#: DDP's collectives inside a training step, by the start of the name its wait carries
#: (``dptrain.parallel.ddp``: the reducer's waits, the forward's buffer broadcast), and what
#: a message calls them. A joined rank's shadow all-reduce ("... of a joined rank") is not one.
_DDP_STEP_OPS = {
    "DDP gradient all-reduce (bucket": "gradient all-reduce",
    "DDP used-parameter all-reduce": "used-parameter all-reduce",
    "DDP buffer broadcast (forward)": "buffer broadcast",
}

#: How to give every rank the same number of batches.
EQUAL_BATCHES_FIX = ("Give every rank the same number of batches: shard the data with dptrain.DistributedSampler "
                     "(or dptrain.prepare_dataloader), or wrap the loop in `with model.join():`")


def _ddp_step_op(op: str) -> str | None:
    """What a message calls ``op`` if it is one of DDP's per-step collectives, else None."""
    for prefix, words in _DDP_STEP_OPS.items():
        if op.startswith(prefix):
            return words
    return None


def unequal_steps(states: dict[int, dict], timeout_s: float | None = None) -> str:
    """Ranks waiting in a DDP step that other ranks never entered, in words with the fix; "" if none.

    See [Note: unequal batches].

    Args:
        states: rank -> ``{"op": the collective it is in ("" outside any), "ddp_steps": its
            synced DDP steps so far, "gone": how it left ("exited with code 0", "shut down"),
            "" while it runs}``.
        timeout_s: the collective timeout, named when a rank may be stalled instead.

    Returns:
        e.g. "rank 1 exited with code 0 after 9 DDP steps, while rank 0 waits in step 10's
        gradient all-reduce: the ranks ran unequal numbers of steps, most likely because they
        got unequal numbers of batches. Give every rank ..."; "" where the states do not show it.
    """
    waiting = {r: s["ddp_steps"] + 1 for r, s in states.items() if not s.get("gone") and _ddp_step_op(s["op"])}
    if not waiting:
        return ""
    step = max(waiting.values())
    waiters = sorted(r for r, n in waiting.items() if n == step)
    short = {r: s for r, s in sorted(states.items()) if r not in waiting and s["ddp_steps"] < step}
    if not short:
        return ""
    groups: dict[tuple, list[int]] = {}  # (verb, one rank, several ranks; its steps) -> the ranks
    for r, s in short.items():
        if s.get("gone"):
            verb = (s["gone"], s["gone"])
        elif s["op"]:
            verb = (f"waits in {s['op']}", f"wait in {s['op']}")
        else:
            verb = ("is outside any collective", "are outside any collective")
        groups.setdefault((*verb, s["ddp_steps"]), []).append(r)
    did = "; ".join(f"{_ranks(rs)} {one if len(rs) == 1 else several} after {_count(n, 'DDP step')}"
                    for (one, several, n), rs in groups.items())
    what = _ddp_step_op(states[waiters[0]]["op"])
    text = f"{did}, while {_ranks(waiters)} {'waits' if len(waiters) == 1 else 'wait'} in step {step}'s {what}"
    unsure = [r for r, s in short.items() if not s.get("gone") and not s["op"]]
    if unsure:
        limit = f" for more than the {timeout_s:.0f}s timeout" if timeout_s else ""
        one = len(unsure) == 1
        text += (f": if {_ranks(unsure)} {'has' if one else 'have'} left the training loop, the ranks got unequal "
                 f"numbers of batches (else {'it is' if one else 'they are'} stalled in step {step}{limit})")
    else:
        text += ": the ranks ran unequal numbers of steps, most likely because they got unequal numbers of batches"
    return f"{text}. {EQUAL_BATCHES_FIX}"


def _ranks(ranks: list[int], limit: int = 16) -> str:
    """Ranks in words: ``rank 3``, ``ranks 1, 2, 3``, ``ranks 0, 1, ... (40 more)``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f", ... ({len(ranks) - limit} more)" if len(ranks) > limit else ""
    return f"ranks {', '.join(str(r) for r in ranks[:limit])}{more}"


# [Note: a rank killed by SIGKILL]
# SIGKILL comes from a person (``kill -9``), a program (a scheduler's time limit, a launcher ending
# a stalled rank) or the kernel's OOM killer. Saying "out of memory?" of every one sent users
# looking for a memory problem that a ``kill -9`` never had. So an exit by SIGKILL is said as
# that, and as "out of memory" only where the kernel says so, in what the launcher (which calls
# :func:`describe_exit`) can read without privileges (:class:`OomRecord`):
#
# * the OOM kills its memory cgroup counts (``oom_kill`` in cgroup v2's ``memory.events``, or in
#   v1's ``memory.oom_control``), the cgroup of the launcher and of the ranks it starts: a count
#   risen since the launcher started explains one SIGKILL per kill;
# * the kernel log (``/dev/kmsg``, readable unless ``kernel.dmesg_restrict`` is set): a line
#   written since the launcher started that names the process ("Killed process <pid>"). The log
#   is opened at its end as the launcher starts, so a look reads only what came since (a few
#   records, not the whole buffer: the look is on in-place recovery's way to a replacement).
#   Inside a container with its own process numbers the log names another number, and only the
#   count speaks.
#
# Both are read only for an exit by SIGKILL, with a bound on what is read and no wait (the log is
# read non-blocking); a file that is missing or unreadable is no evidence, never an error. A rank
# that reads a peer's exit code from the store says only "was killed by SIGKILL".

#: What one look at the kernel log reads at most (reads: a record each from /dev/kmsg; seconds).
_KERNEL_LOG_READS = 10_000
_KERNEL_LOG_S = 0.05
#: The OOM killer's lines kept from the kernel log, the newest (each names the process it killed).
_KERNEL_LOG_KEPT = 1000
_KILLED = re.compile(r"Killed process (\d+)|^oom-kill:.*[,:]pid=(\d+)\b")
#: What to change after a rank was killed for want of memory.
OOM_FIX = "give each rank less to hold (a smaller batch, fewer DataLoader workers) or the job more memory"


def _memory_cgroup_file() -> str:
    """The file holding this process's memory cgroup's ``oom_kill`` count; "" when there is none to read."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read(65536).splitlines()
    except OSError:
        return ""
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].lstrip("/")
        if controllers == "":  # v2: one hierarchy
            candidates += [os.path.join("/sys/fs/cgroup", path, "memory.events"), "/sys/fs/cgroup/memory.events"]
        elif "memory" in controllers.split(","):  # v1; a container may see its own cgroup as the mount's root
            candidates += [os.path.join("/sys/fs/cgroup/memory", path, "memory.oom_control"),
                           "/sys/fs/cgroup/memory/memory.oom_control"]
    return next((c for c in candidates if _oom_kills(c) is not None), "")


def _oom_kills(path: str) -> int | None:
    """The ``oom_kill`` count in a cgroup's ``memory.events`` or ``memory.oom_control``; None when unreadable."""
    if not path:
        return None
    try:
        with open(path) as fh:
            text = fh.read(4096)
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _open_log_at_end(path: str) -> int | None:
    """``path`` (the kernel log) opened non-blocking at its end, so that reads give only what is written
    from now on; None when it cannot be read."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        return None
    return fd


def _read_oom_lines(fd: int, rest: bytes) -> tuple[list[tuple[int, str]], bytes]:
    """The OOM killer's lines among the kernel log records that follow at ``fd``, as (the pid it killed,
    the line); ``rest``: a partial line left by the last read (a plain file is read in blocks)."""
    found = []
    ends = time.monotonic() + _KERNEL_LOG_S
    for _ in range(_KERNEL_LOG_READS):  # /dev/kmsg gives one record a read, a file a block
        try:
            block = os.read(fd, 8192)
        except BrokenPipeError:  # a record was overwritten before we read it: the next one follows
            continue
        except OSError:  # BlockingIOError: nothing more (yet)
            break
        if not block:
            break
        *records, rest = (rest + block).split(b"\n")
        for record in records:
            head, sep, message = record.partition(b";")  # "priority,sequence,microseconds,flags;message"
            if not sep or head.startswith(b" "):
                continue  # a continuation line (" KEY=value"), or not a record
            text = message.decode("utf-8", "replace")
            said = _KILLED.search(text)
            if said:
                found.append((int(said.group(1) or said.group(2)), text[:160]))
        if time.monotonic() > ends:
            break
    return found, rest


class OomRecord:
    """What the kernel recorded of its OOM killer since this object was made, to tell an exit by
    SIGKILL that was for want of memory from any other (see [Note: a rank killed by SIGKILL]).

    Cheap to make (one small file read; the kernel log opened at its end) and to ask (only
    :func:`describe_exit` of a SIGKILL asks; it reads what the kernel logged since); never raises,
    never blocks.

    Args:
        memory_events: the cgroup file with the ``oom_kill`` count (default None: this process's
            memory cgroup's, v2 ``memory.events`` or v1 ``memory.oom_control``; "": none).
        kernel_log: the kernel log device (default None: ``/dev/kmsg``; "": none).

    Example:
        >>> oom = OomRecord()                       # as the launcher starts
        >>> describe_exit(-9, oom, pid)             # later: 'was killed by SIGKILL', or '... out of memory ...'
    """

    def __init__(self, memory_events: str | None = None, kernel_log: str | None = None) -> None:
        self.memory_events = _memory_cgroup_file() if memory_events is None else memory_events
        self._start = _oom_kills(self.memory_events)  # the cgroup's count as the launcher started; None: unread
        self._explained = self._start  # ... plus the kills that explained an exit since
        self._log = _open_log_at_end("/dev/kmsg" if kernel_log is None else kernel_log)
        if self._log is not None:
            weakref.finalize(self, os.close, self._log)
        self._rest = b""  # a partial line of the log, read before the rest of it was written
        self._killed: list[tuple[int, str]] = []  # (pid, line): what the log said the OOM killer killed
        self._said: dict[int, str] = {}  # pid -> what was said of it (an exit is said more than once)

    def evidence(self, pid: int | None) -> str:
        """What says that the kernel's OOM killer killed process ``pid``, in words; "" when nothing does."""
        if pid is not None and pid in self._said:
            return self._said[pid]
        if self._log is not None:
            found, self._rest = _read_oom_lines(self._log, self._rest)
            self._killed = (self._killed + found)[-_KERNEL_LOG_KEPT:]
        lines = [text for killed, text in self._killed if killed == pid]
        line = next((text for text in lines if "Killed process" in text), lines[0] if lines else "")
        said = f'the kernel log: "{line}"' if line else ""
        now = _oom_kills(self.memory_events)
        if now is not None and self._explained is not None and now > self._explained:
            self._explained += 1  # one kill explains one exit
            said = said or (f"its memory cgroup counted OOM kills since the launcher started: oom_kill {self._start} "
                            f"-> {now} in {self.memory_events}")
        if pid is not None:
            self._said[pid] = said
        return said


def describe_exit(code: int | None, oom: OomRecord | None = None, pid: int | None = None) -> str:
    """A process's exit in words: ``exited with code 1``, ``was killed by SIGKILL``.

    Args:
        code: the exit code as ``subprocess`` gives it (``-N``: killed by signal N; None: running).
        oom: what the kernel recorded of its OOM killer (default None: nothing is known). Only with
            it is a SIGKILL said to be for want of memory, when the record says so.
        pid: the process, which the kernel log names (default None).

    Returns:
        e.g. ``was killed by SIGKILL``, or ``was killed by SIGKILL from the kernel's OOM killer, out of
        memory (the kernel log: "Out of memory: Killed process 4242 (python) ..."); give each rank ...``.
    """
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = oom.evidence(pid) if oom is not None and -code == signal.SIGKILL else ""
        if why:
            return f"was killed by {name} from the kernel's OOM killer, out of memory ({why}); {OOM_FIX}"
        return f"was killed by {name}"
    return f"exited with code {code}"
