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

import contextlib
import json
import os
import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dptrain import env

_local = threading.local()
_seq: dict[str, int] = {}


def debug_enabled() -> bool:
    return os.environ.get("DPTRAIN_DEBUG", "0") not in ("", "0", "false", "False")


@contextlib.contextmanager
def suspended():
    prev = getattr(_local, "suspended", False)
    _local.suspended = True
    try:
        yield
    finally:
        _local.suspended = prev


def _group_key(group: Any) -> str:
    if group is None:
        return "world"
    try:
        return "g" + "-".join(str(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - older torch: fall back to the object's identity
        return f"g{id(group)}"


def _describe(name: str, tensors: Sequence[torch.Tensor]) -> dict:
    return {"op": name, "tensors": [[list(t.shape), str(t.dtype).replace("torch.", "")] for t in tensors]}


def _fmt(entry: dict) -> str:
    shapes = ", ".join(f"{tuple(s)} {d}" for s, d in entry["tensors"]) or "no tensors"
    return f"{entry['op']}({shapes})"


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one with different shapes."""


def before_collective(name: str, tensors: Sequence[torch.Tensor], group: Any) -> None:
    if not debug_enabled() or getattr(_local, "suspended", False):
        return
    store = env._store()
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
    timeout = env._timeout()
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


def after_collective(name: str, group: Any) -> None:
    return None


def explain_failure(name: str, exc: BaseException, group: Any) -> BaseException:
    """Wrap a failed collective's exception with this rank, the operation and the timeout."""
    from dptrain.comm import CollectiveError

    if isinstance(exc, (CollectiveMismatchError, CollectiveError, ValueError, TypeError)):
        return exc
    me = dist.get_rank() if dist.is_initialized() else 0
    timeout = env._timeout().total_seconds()
    return CollectiveError(
        f"rank {me}: {name} failed ({type(exc).__name__}: {exc}). A peer rank exited, stalled for more than "
        f"the {timeout:.0f}s timeout, or called a different collective; its own log says which "
        f"(rerun with DPTRAIN_DEBUG=1 to compare collectives across ranks)"
    )
