"""What every collective does around the bytes: the debug cross-check and failure messages.

[Note: the debug cross-check]
With ``DPTRAIN_DEBUG=1`` (``dptrain run --debug``) every rank, before a collective, writes
"what I am about to call" -- the operation, the shapes and dtypes of its tensors -- under a
per-group sequence number in the rendezvous store, then reads every other rank's entry for
the same sequence number. All ranks read the same entries, so a mismatch (rank 0
all-reduces a (3,) tensor while rank 1 all-reduces a (4,) one; rank 1 calls barrier while
rank 0 calls all_gather) is seen by every rank at once and raised everywhere with the
difference spelled out -- instead of a hang or silently mixed bytes. A rank that never
writes its entry is named when the wait for it times out.

It costs a store round trip per rank per collective, so it is off by default.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dptrain.runtime import heartbeat as _heartbeat, settings as _settings
from dptrain.runtime.errors import CollectiveError, CollectiveMismatchError
from dptrain.runtime.heartbeat import enter, leave, read_per_rank

__all__ = ["configure", "reset", "before_collective", "explain_failure", "debug_enabled", "CollectiveMismatchError"]


class _Job:
    """What ``dptrain.init`` hands down: the store for dptrain's keys and the collective timeout."""

    store: Any = None
    timeout = datetime.timedelta(seconds=_heartbeat.DEFAULT_TIMEOUT_S)
    generation = 0  # of the process group (see dptrain.runtime.regroup)
    namespace = ""  # of this init's keys (see dptrain.runtime.env's [Note: init again in the same process])


_JOB = _Job()
_seq: dict[str, int] = {}  # debug cross-check: collectives per group so far


def configure(store: Any, timeout: datetime.timedelta, namespace: str = "") -> None:
    """Called by ``dptrain.init``: where dptrain's keys live, and how long a collective may wait.

    ``namespace`` sets the collectives of a second init of the process apart from the first's
    (see [Note: init again in the same process] in :mod:`dptrain.runtime.env`)."""
    _JOB.store, _JOB.timeout, _JOB.namespace = store, timeout, namespace


def new_generation(generation: int) -> None:
    """In-place recovery formed process group ``generation``: collectives count from 0 again, under
    its name, and this rank is no longer one whose collective failed."""
    _JOB.generation = generation
    _seq.clear()
    _heartbeat.new_generation()


def reset() -> None:
    """Forget this process's job (a later init starts over).

    Also notes in the store that this rank is leaving (``left/<rank>``), before its
    connections close, and whether a collective of its own had failed: a peer whose
    collective then fails can say why (see :func:`explain_failure`), under any launcher.
    """
    if _JOB.store is not None and dist.is_initialized():
        _heartbeat.note_leaving(_JOB.store, dist.get_rank())
    _heartbeat.stop()
    _seq.clear()
    _heartbeat.reset_progress()
    _JOB.store = None
    _JOB.generation = 0


def debug_enabled() -> bool:
    return _settings.get("DPTRAIN_DEBUG")


def _group_key(group: Any) -> str:
    # After an in-place recovery the collectives count from 0 again under the new generation's name.
    gen = (f"{_JOB.namespace}/" if _JOB.namespace else "") + (f"gen{_JOB.generation}/" if _JOB.generation else "")
    if group is None:
        return gen + "world"
    try:
        return gen + "g" + "-".join(str(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - older torch: fall back to the object's identity
        return f"{gen}g{id(group)}"


def _describe(name: str, tensors: Sequence[torch.Tensor]) -> dict:
    return {"op": name, "tensors": [[list(t.shape), str(t.dtype).replace("torch.", "")] for t in tensors]}


def _fmt(entry: dict) -> str:
    shapes = ", ".join(f"{tuple(s)} {d}" for s, d in entry["tensors"]) or "no tensors"
    return f"{entry['op']}({shapes})"


def before_collective(name: str, tensors: Sequence[torch.Tensor], group: Any) -> None:
    enter(name)
    if not debug_enabled():
        return
    store = _JOB.store
    if store is None:
        return
    key = _group_key(group)
    seq = _seq.get(key, 0)
    _seq[key] = seq + 1
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mine = _describe(name, tensors)
    store.set(f"debug/{key}/{seq}/{me}", json.dumps(mine))
    wanted = [f"debug/{key}/{seq}/{r}" for r in ranks]
    timeout = _JOB.timeout
    try:
        store.wait(wanted, timeout)
    except Exception:  # noqa: BLE001 - name who is missing instead of the store's generic text
        missing = [r for r, k in zip(ranks, wanted) if not store.check([k])]
        raise CollectiveMismatchError(
            f"rank {me}: collective #{seq} {_fmt(mine)} waited {timeout.total_seconds():.0f}s for rank(s) "
            f"{missing}, which never reached a collective #{seq}; they are stalled or took another code path"
        ) from None
    entries = {r: json.loads(store.get(k)) for r, k in zip(ranks, wanted)}
    reference = entries[ranks[0]]
    differing = [r for r in ranks if entries[r] != reference]
    if differing:
        listing = "; ".join(f"rank {r}: {_fmt(entries[r])}" for r in ranks)
        raise CollectiveMismatchError(
            f"rank {me}: collective #{seq} differs between ranks -- {listing}. Every rank must call the same "
            f"collectives in the same order with the same shapes and dtypes"
        )


def _heartbeats(world_size: int) -> dict[int, dict]:
    """Every rank's last heartbeat that the store holds (none without a store)."""
    return read_per_rank(_JOB.store, "hb", world_size) if _JOB.store is not None else {}


def _who_is_missing(world_size: int, beats: dict[int, dict]) -> str:
    """From the heartbeats: which ranks are not in the collective this rank waits in."""
    if _JOB.store is None:
        return ""
    mine = _heartbeat.progress()["seq"]
    now = time.time()
    lines = []
    me = dist.get_rank()
    for r in range(world_size):
        if r == me:
            continue
        b = beats.get(r)
        if b is None:
            lines.append(f"rank {r} never sent a heartbeat")
        elif b.get("failed") and b["seq"] >= mine:
            continue  # it was in this collective too, and its own wait failed first: a victim, not missing
        elif b["seq"] < mine or not b["op"]:
            lines.append(f"rank {r} did not arrive (last seen {now - b['t']:.0f}s ago {_heartbeat.where(b)})")
    return "; ".join(lines)


#: Seconds a failed collective waits for the launcher to publish the exit of a peer that left.
EXIT_WAIT_S = 5.0


class _Gone:
    """A peer that has left the job: how, when, and the DDP steps it had done."""

    def __init__(self, how: str, ago: str, clean: bool, ddp_steps: int | None) -> None:
        self.how = how  # "exited with code 0", "shut down"
        self.said = f"{how} {ago}"  # "exited with code 0 3s ago"
        self.clean = clean  # exit code 0, or shut down: it ended its script, it did not crash
        self.ddp_steps = ddp_steps  # from its left/<rank> note; None without one


def _peers_gone(world_size: int) -> dict[int, _Gone]:
    """Peers that have left the job: "exited with code 0 3s ago", and what they had done.

    A collective fails the moment a peer's connections close; the peer wrote ``left/<rank>``
    just before (:func:`reset`), and its launcher, if it publishes exits, writes the exit
    code once the process is gone -- a moment later (it polls every 50 ms; the interpreter's
    exit takes a while). So wait a little for the code of a peer known to be leaving.
    """
    store = _JOB.store
    if store is None:
        return {}
    me = dist.get_rank()
    deadline = time.monotonic() + EXIT_WAIT_S
    try:
        published = store.check([_heartbeat.EXITS_PUBLISHED])
        while True:
            left = read_per_rank(store, "left", world_size)
            # A peer that left after a collective of its own failed shares our fate; it is
            # not the cause (several ranks time out waiting for the same stalled one).
            victims = {r for r, e in left.items() if e.get("after_failure")} | {me}
            left = {r: e for r, e in left.items() if r not in victims}
            exits = {r: e for r, e in read_per_rank(store, "exit", world_size).items() if r not in victims}
            waiting = published and (set(left) - set(exits) or not (left or exits))
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - best effort: used only to explain a failure
        return {}
    now = time.time()
    gone = {}
    for r, e in exits.items():
        ago = f"{max(0.0, now - e['t']):.0f}s ago"
        gone[r] = _Gone(_heartbeat.describe_exit(e["code"]), ago, e["code"] == 0, left.get(r, {}).get("ddp_steps"))
    for r, e in left.items():
        if r not in gone:
            ago = f"{max(0.0, now - e['t']):.0f}s ago (it returned or called dptrain.shutdown())"
            gone[r] = _Gone("shut down", ago, True, e.get("ddp_steps"))
    return gone


def _unequal_steps(name: str, world_size: int, beats: dict[int, dict], gone: dict[int, _Gone]) -> str:
    """Whether this rank waits in a DDP step that peers never entered (see [Note: unequal batches])."""
    mine = _heartbeat.progress()
    states = {dist.get_rank(): {"op": name, "ddp_steps": mine["ddp_steps"], "gone": ""}}
    for r in range(world_size):
        if r in states:
            continue
        if r in gone:
            g = gone[r]
            steps = g.ddp_steps if g.ddp_steps is not None else beats.get(r, {}).get("ddp_steps")
            if not g.clean or steps is None:
                continue  # it crashed (its own error is the cause), or nothing says what it had done
            states[r] = {"op": "", "ddp_steps": steps, "gone": g.how}
        elif r in beats:
            states[r] = {"op": beats[r]["op"], "ddp_steps": beats[r]["ddp_steps"], "gone": ""}
    return _heartbeat.unequal_steps(states, _JOB.timeout.total_seconds())


def explain_failure(name: str, exc: BaseException, group: Any = None) -> BaseException:
    """Wrap a failed collective's exception with this rank, the operation and who is missing.

    When a peer has already left, that is the reason given: "rank 1: all_reduce #7 failed:
    rank 0 exited with code 0 3s ago (...)" where the launcher publishes exits
    (``dptrain run``), else "rank 0 shut down 3s ago". When this rank waits in a DDP step
    that a peer never entered, the message says that the ranks had unequal numbers of
    batches, and how to fix it (see [Note: unequal batches]).
    """
    if isinstance(exc, (CollectiveMismatchError, CollectiveError, ValueError, TypeError)):
        leave()
        return exc
    me = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timeout = _JOB.timeout.total_seconds()
    cause = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    _heartbeat.mark_failed()
    gone = _peers_gone(world) if world > 1 else {}
    beats = _heartbeats(world) if world > 1 and group is None else {}
    missing = _who_is_missing(world, beats) if group is None and not gone else ""
    # The heartbeats describe the whole world, so only a collective of the world is compared.
    unequal = _unequal_steps(name, world, beats, gone) if world > 1 and group is None else ""
    seq = _heartbeat.progress()["seq"]
    leave()
    if gone:
        said = "; ".join(f"rank {r} {g.said}" for r, g in sorted(gone.items()))
        advice = unequal or ("Every rank must make the same collective calls to the end: a rank that returns or "
                             "exits early leaves the others without a partner")
        return CollectiveError(f"rank {me}: {name} #{seq} failed: {said} ({cause}). {advice}")
    detail = f" {missing}." if missing else ""
    advice = unequal or (f"A peer rank exited, stalled for more than the {timeout:.0f}s timeout, or called a "
                         f"different collective (rerun with DPTRAIN_DEBUG=1 to compare collectives across ranks)")
    return CollectiveError(f"rank {me}: {name} #{seq} failed ({cause}).{detail} {advice}")
