"""A survivor's wait for an asynchronous collective ends as soon as in-place recovery is announced.

[Note: a wait that gloo never ends]
Under ``dptrain run --recovery in-place`` a rank that waits in a collective when a peer dies
learns of it from the collective itself: the peer's sockets close, gloo fails the operation,
and the Trainer recovers. When the peer is silent instead, the heartbeat thread shuts the
group's sockets down once the launcher has announced the recovery (see [Note: cutting a
broken group's connections] in :mod:`dptrain.runtime.regroup`), with the same effect.

Neither is enough in one case, seen in CI (issue 48): DiLoCo's outer exchange, an
asynchronous all-reduce, was in flight on the survivor when its peer died inside the same
exchange. gloo saw the peer's end -- it closed the pair's socket, as it always does then --
but the operation it was running did not fail: the survivor stood in ``work.wait()`` for the
whole collective timeout (600 s by default) while the replacement waited for it in the next
generation's rendezvous, and the job hung. Nothing was left for the heartbeat thread to cut
(the descriptor it had noted was gone). An asynchronous collective is the whole of the
window: the peer's part of it may be sent, or half sent, when the peer dies.

So :func:`wait` (what ``comm.wait`` does for a ``torch.distributed`` work handle) does not
hand the wait to gloo alone while in-place recovery is on: it waits in slices of
:data:`SLICE_S` seconds -- a collective that completes within a slice costs exactly what
``work.wait()`` costs -- and between two slices it asks the store whether the launcher has
announced a failure (one ``check`` per slice, only once a wait lasts). When it has, the wait
is abandoned with :class:`~dptrain.runtime.interrupt.PeerLost`, which the Trainer recovers
from as from any failed collective, within a slice of the announcement.

The collective itself cannot be abandoned: it stays on a worker thread of its process group
until its own timeout, and the group's destructor joins that thread -- so destroying the group
(the next generation's first step) or the interpreter's exit would wait that long instead. So
the group and the work handle of an abandoned wait are kept alive for the rest of the process
(:data:`ABANDONED`, with one reference that is never released: a list's references go at the
interpreter's end, when its destructors run). What that costs is the group's idle threads and
its listening socket, once per abandoned wait; the group is cut and destroyed as usual first,
so no peer ever waits for it.
"""

from __future__ import annotations

import ctypes
import datetime
from typing import Any

import torch.distributed as dist

from dptrain.runtime import interrupt as _interrupt, regroup as _regroup, settings as _settings

__all__ = ["wait", "SLICE_S", "ABANDONED"]

#: Seconds a wait for an asynchronous collective lasts between two looks at the store (see the Note).
SLICE_S = 0.5
#: (process group, work handle) of every abandoned wait, kept for the process's life (see the Note).
ABANDONED: list[tuple[Any, Any]] = []
_SLICE = datetime.timedelta(seconds=SLICE_S)


def _watched(group: Any) -> tuple[Any, int] | None:
    """(store, generation) when in-place recovery may announce a failure to this rank and the wait
    is gloo's, else None. Not NCCL's: its ``wait(timeout)`` treats a slice that ends before the
    collective as the collective's timeout (and may abort the communicator); NCCL's own watchdog
    ends a wait for a dead peer."""
    if _settings.get("DPTRAIN_RECOVERY") != "in-place":
        return None
    try:
        if dist.get_backend(group) != "gloo":
            return None
    except (RuntimeError, ValueError):  # no group (any more): gloo's wait alone
        return None
    from dptrain.runtime import env

    store = env._STATE.store
    return None if store is None else (store, env._STATE.generation)


def _announced(store: Any, generation: int) -> tuple[int, dict] | None:
    """The newest generation announced after ``generation`` for a failure, and what was said of it."""
    try:
        failure = _regroup.failure_after(store, generation)
    except Exception:  # noqa: BLE001 - a store that cannot answer now: the next slice asks again
        return None
    if failure is None:
        return None
    newest, said = failure
    return newest, [entry for entry in said if not entry.get("joining")][-1]


def _keep(group: Any, work: Any) -> None:
    """Keep ``group`` and ``work`` alive until the process ends (see the Note)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    ABANDONED.append((pg, work))
    for obj in (pg, work):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # never released: no destructor joins its worker


def wait(work: Any, name: str, group: Any = None) -> Any:
    """``work.wait()``, abandoned once in-place recovery announces that a peer failed.

    Outside in-place recovery, on a group that is not gloo's, or for a handle that is not a
    ``torch.distributed`` work (a future, a shared-memory collective's) this is ``work.wait()``.
    Call it inside ``comm.guarded`` (``comm.wait`` does), which names the operation when it fails.

    Args:
        work: what an ``async_op=True`` collective returned (or a future).
        name: the operation, for the message.
        group: the process group it runs on (default None: the default group).

    Returns:
        What ``work.wait()`` returns.

    Raises:
        PeerLost: the launcher announced a failure while this rank waited (a
            :class:`~dptrain.CollectiveError`; the Trainer recovers from it in place).
        RuntimeError: the collective failed or timed out (gloo's or NCCL's own error).

    Example:
        >>> work = torch.distributed.all_reduce(t, async_op=True)   # doctest: +SKIP
        >>> with comm.guarded("my all-reduce"):                      # doctest: +SKIP
        ...     abandon.wait(work, "my all-reduce")
    """
    watched = _watched(group) if isinstance(work, dist.Work) else None
    if watched is None:
        return work.wait()
    store, generation = watched
    while True:
        try:
            return work.wait(_SLICE)
        except RuntimeError:
            if work.is_completed():
                # Either the collective's own failure (a peer's end, its timeout), or the slice
                # ran out just before the collective completed: a wait on a completed handle
                # returns at once, or raises that failure for the caller to explain.
                return work.wait()
        announced = _announced(store, generation)
        if announced is not None:
            newest, said = announced
            _keep(group, work)
            rank = said.get("rank")
            who = f"rank {rank}" if isinstance(rank, int) else "a peer"
            me = dist.get_rank() if dist.is_initialized() else 0
            raise _interrupt.PeerLost(
                f"rank {me}: {who} {said.get('why') or 'failed'}: dptrain run announced generation {newest} (in-place "
                f"recovery) while this rank waited in {name}, which its backend had not ended; the wait is "
                f"abandoned and the step redone in the next generation")
