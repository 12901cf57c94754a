"""What ranks and launchers tell each other through the rendezvous store, and in what words.

This module sits at the bottom of the import graph and needs no torch: the launcher uses it
before any rank (or torch) is started, and the ranks use the same keys and the same wording.

[Note: the store's key layout]
Everything of one launch attempt lives under ``dptrain/attempt<k>/`` (a restarted job never
reads a stale key of the attempt before), split in two: ``pg/`` for the process group's own
rendezvous, ``dp/`` for dptrain's keys, which are

* ``hb/<rank>``      a rank's heartbeat: collectives entered so far, the one it is in, steps;
* ``left/<rank>``    written by a rank as it shuts down (and whether a collective of its own had failed);
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
import signal
import threading
import time
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEARTBEAT_S",
    "attempt_prefix",
    "keys_prefix",
    "tick",
    "enter",
    "leave",
    "start",
    "stop",
    "read_per_rank",
    "where",
    "describe_exit",
]

#: Seconds a collective may wait before the job is failed, when neither ``init(timeout=)``
#: nor ``DPTRAIN_TIMEOUT`` (``dptrain run --timeout``) says otherwise. Long enough for a
#: slow checkpoint on rank 0, short enough that a stalled job does not burn a night of GPU time.
DEFAULT_TIMEOUT_S = 600.0

#: Seconds between heartbeats (``DPTRAIN_HEARTBEAT_S``).
HEARTBEAT_S = float(os.environ.get("DPTRAIN_HEARTBEAT_S", "2"))

PROCESS_GROUP_PART = "pg"
DPTRAIN_PART = "dp"
EXITS_PUBLISHED = "exit/published"


def attempt_prefix(attempt: int) -> str:
    """Where everything of launch attempt ``attempt`` lives in the store."""
    return f"dptrain/attempt{attempt}"


def keys_prefix(attempt: int) -> str:
    """Where dptrain's own keys of attempt ``attempt`` live (what the launcher reads and writes)."""
    return f"{attempt_prefix(attempt)}/{DPTRAIN_PART}"


def key(kind: str, rank: int) -> str:
    """``hb/3``, ``left/3``, ``exit/3``: a per-rank key under :func:`keys_prefix`."""
    return f"{kind}/{rank}"


# -- this rank's progress, as its heartbeat publishes it ------------------------------------
# Collectives entered so far, the one it is in ("" when outside), progress ticks (training
# steps), and whether a collective of its own failed.
_progress: dict[str, Any] = {"seq": 0, "op": "", "ticks": 0, "failed": False}


def tick() -> None:
    """Record one unit of progress (a training step); the launcher watches these."""
    _progress["ticks"] += 1


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


def reset_progress() -> None:
    _progress.update(seq=0, op="", ticks=0, failed=False)


def _loop(store: Any, rank: int, interval: float, stop_event: threading.Event) -> None:
    while not stop_event.is_set():
        entry = dict(_progress, t=time.time(), pid=os.getpid())
        try:
            store.set(key("hb", rank), json.dumps(entry))
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            return
        stop_event.wait(interval)


_thread: dict[str, Any] = {}


def start(store: Any, rank: int, interval: float | None = None) -> None:
    """Publish this rank's progress to ``store`` every ``interval`` seconds (a daemon thread)."""
    stop()
    stop_event = threading.Event()
    thread = threading.Thread(target=_loop, args=(store, rank, interval or HEARTBEAT_S, stop_event), daemon=True,
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
        store.set(key("left", rank), json.dumps({"t": time.time(), "after_failure": _progress["failed"]}))
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
    """A heartbeat in words: ``waiting in all_reduce #7, 3 steps`` / ``outside any collective after #7, 3 steps``."""
    place = f"waiting in {beat['op']} #{beat['seq']}" if beat["op"] else f"outside any collective after #{beat['seq']}"
    return f"{place}, {beat['ticks']} steps"


def describe_exit(code: int | None) -> str:
    """A process's exit in words: ``exited with code 1``, ``was killed by SIGKILL (out of memory? ...)``."""
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
