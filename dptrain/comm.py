"""The collectives: PyTorch's seven, plus object and uneven gathers, that also run alone.

Every function takes PyTorch's arguments in PyTorch's order and moves bytes with
``torch.distributed``. Differences that matter:

- With no process group (a single process, world size 1) each call does what it would do
  in a world of one -- ``all_reduce`` leaves the tensor as it is, ``all_gather`` copies it
  into ``tensor_list[0]`` -- so single-process code runs unchanged. Under a launcher that
  says the world is larger, a call without a process group raises ``RuntimeError`` naming
  ``dptrain.init()`` instead of letting every rank go on alone.
- ``op`` is a string (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``) or a
  ``torch.distributed.ReduceOp``. ``"avg"`` is computed as a sum and a division because
  gloo has no reliable AVG.
- A collective that fails (a peer died, the timeout passed) raises :class:`CollectiveError`
  naming this rank, the collective and, where the store can tell, the ranks that never
  arrived.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dptrain.runtime import abandon as _abandon, diagnostics as _diagnostics, env
from dptrain.runtime import exit as _exit  # noqa: F401 - a clean end for a rank that runs collectives
from dptrain.runtime.errors import CollectiveError, CollectiveMismatchError

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "broadcast",
    "reduce",
    "all_reduce",
    "scatter",
    "gather",
    "all_gather",
    "barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object",
    "all_gather_uneven",
    "is_distributed",
    "wait",
    "guarded",
]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards; see the module docstring
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
}


def is_distributed(group: Any = None) -> bool:
    """True when a process group with more than one rank is active."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _alone(name: str, group: Any) -> bool:
    """True when collective ``name`` runs as in a world of one: locally, without communicating.

    That is a process group of one rank, or none at all in a plain single process. With no
    process group under a launcher that says the world is larger, it raises instead
    (:func:`dptrain.runtime.env.check_joined`): each rank going on alone would split the job silently.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group) == 1
    env.check_joined(f"dptrain.comm.{name}")
    return True


def _op(op: Any) -> tuple[dist.ReduceOp, bool]:
    """The torch op to run and whether to divide by the world size afterwards."""
    if isinstance(op, str):
        key = op.lower()
        if key not in _OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of 'sum', 'avg', 'max', 'min', 'product'")
        return _OPS[key], key in ("avg", "mean")
    if op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    return op, False


def _check_tensor(name: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(tensor).__name__}")


def _call(name: str, fn: Callable[[], Any], tensors: Sequence[torch.Tensor] = (), group: Any = None) -> Any:
    """Run one collective with dptrain's checks around it.

    The debug cross-check (``DPTRAIN_DEBUG=1``) compares the operation and the tensor
    shapes of every rank before the bytes move; a failure is re-raised naming this rank
    and the operation, so a log line says more than "Connection closed by peer".
    """
    _diagnostics.before_collective(name, tensors, group)
    t0 = time.perf_counter() if _WAIT_CLOCK["on"] else 0.0
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised with context below
        raise _diagnostics.explain_failure(name, exc, group) from exc
    finally:
        if _WAIT_CLOCK["on"]:
            _WAIT_CLOCK["seconds"] += time.perf_counter() - t0
    _diagnostics.leave()
    return out


@contextlib.contextmanager
def guarded(name: str, group: Any = None) -> Iterator[None]:
    """Run a block of communication as one named collective, with dptrain's failure message.

    The one guarded path of the package: :func:`wait`, DDP's and FSDP's waits, ZeRO's
    parameter sharing and the shared-memory collectives all end here, so a peer that died
    or stalled past the timeout is named the same way everywhere ("rank 1 did not arrive
    ..."), and the heartbeat shows which operation this rank is in while it waits.

    Args:
        name: the operation, for the message (e.g. ``"FSDP all-gather of unit 'layers.0'"``).
        group: the process group it runs on.

    Raises:
        CollectiveError: the block failed; names this rank, the operation and, where the
            heartbeats tell, the ranks that never arrived.

    Example:
        >>> with comm.guarded("parameter sync"):
        ...     torch.distributed.broadcast(t, src=0)
    """
    _diagnostics.enter(name)
    t0 = time.perf_counter() if _WAIT_CLOCK["on"] else 0.0
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        # The heartbeats describe the whole world: the default group is the world.
        world_group = group is None or (dist.is_initialized() and group is dist.group.WORLD)
        raise _diagnostics.explain_failure(name, exc, None if world_group else group) from exc
    finally:
        if _WAIT_CLOCK["on"]:
            _WAIT_CLOCK["seconds"] += time.perf_counter() - t0
    _diagnostics.leave()


# Seconds spent blocked in collectives (guarded blocks and synchronous calls), counted only
# while a profiler asks for it, so that the hot path pays nothing otherwise.
_WAIT_CLOCK = {"on": False, "seconds": 0.0}


def count_waiting(on: bool) -> None:
    """Start (or stop) counting the seconds this process spends blocked in collectives."""
    _WAIT_CLOCK["on"] = bool(on)


def waited_seconds() -> float:
    """Seconds blocked in collectives since counting started (see :func:`count_waiting`)."""
    return _WAIT_CLOCK["seconds"]


def wait(work: Any, name: str, group: Any = None) -> Any:
    """Wait for an asynchronous collective's work handle (or future) through :func:`guarded`.

    Args:
        work: what an ``async_op=True`` collective returned, or a future (None: nothing to wait for).
        name: the operation, for the message.
        group: the process group it ran on.

    Returns:
        What ``work.wait()`` returned (a future's value).

    Raises:
        CollectiveError: the collective failed or timed out (see :func:`guarded`); under
            ``--recovery in-place`` also ``PeerLost`` once the launcher announced a peer's failure.
    """
    if work is None:
        return None
    with guarded(name, group):
        # Under in-place recovery, a wait that the backend never ends is left once a failure is
        # announced (see [Note: a wait that gloo never ends] in dptrain.runtime.abandon).
        return _abandon.wait(work, name, group)


#: Bytes per flat broadcast of :func:`broadcast_coalesced` (PyTorch's DDP ``broadcast_bucket_size``).
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0, group: Any = None,
                        name: str = "broadcast_coalesced") -> None:
    """Copy ``tensors`` from group rank ``src`` to every rank: one flat broadcast per dtype and
    device (and per 250 MiB) instead of one per tensor, each guarded as ``name``.

    What DDP does with its model at construction and its buffers at each forward, and the
    Trainer with the buffers before an evaluation.

    Args:
        tensors: the same shapes and dtypes on every rank; overwritten on all but ``src``.
        src: the sender, a rank *of* ``group`` (as DDP's own broadcasts count). Default 0.
        group: process group; default the whole world.
        name: the operation, for the failure message. Default ``"broadcast_coalesced"``.

    Raises:
        CollectiveError: a peer failed or the timeout passed (see :func:`guarded`).

    Example:
        >>> comm.broadcast_coalesced(list(model.buffers()), src=0)   # doctest: +SKIP
    """
    chunks: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in chunks or sizes[key] + nbytes > BROADCAST_BUCKET_BYTES:
            chunks.setdefault(key, []).append([])
            sizes[key] = 0
        chunks[key][-1].append(t)
        sizes[key] += nbytes
    me = dist.get_rank(group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    with torch.no_grad():
        for chunk_list in chunks.values():
            for chunk in chunk_list:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                with guarded(f"{name} from rank {src}", group):
                    dist.broadcast(flat, src=global_src, group=group)
                if me != src:
                    offset = 0
                    for t in chunk:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False):
    """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank (in place).

    Args:
        tensor: the data on ``src``; the destination, of the same shape and dtype, elsewhere.
        src: global rank that sends. Default 0.
        group: process group; default the whole world.
        async_op: return a work handle instead of waiting. Default False.

    Returns:
        A work handle when ``async_op``, else None.

    Raises:
        CollectiveError: a peer failed or the timeout passed.

    Example:
        >>> t = torch.arange(3.) if dptrain.rank() == 0 else torch.zeros(3)
        >>> comm.broadcast(t, src=0)   # every rank now holds [0., 1., 2.]
    """
    _check_tensor("broadcast", tensor)
    if _alone("broadcast", group):
        return None
    return _call("broadcast", lambda: dist.broadcast(tensor, src, group=group, async_op=async_op), [tensor], group)


class _DivideOnWait:
    """Work handle for an asynchronous 'avg': the division happens when the sum is in."""

    def __init__(self, work, tensor: torch.Tensor, divisor: int) -> None:
        self._work, self._tensor, self._divisor = work, tensor, divisor

    def wait(self, timeout=None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._tensor.div_(self._divisor)
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()


def all_reduce(tensor: torch.Tensor, op: Any = "sum", group: Any = None, async_op: bool = False):
    """Reduce ``tensor`` across ranks and leave the result in ``tensor`` on every rank.

    Args:
        tensor: input and output, in place.
        op: ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"``, ``"product"`` or a ``ReduceOp``.
        group: process group; default the whole world.
        async_op: return a work handle instead of waiting (for ``"avg"``, the division
            happens in ``wait()``). Default False.

    Raises:
        ValueError: unknown ``op``.
        CollectiveError: a peer failed or the timeout passed.

    Example:
        >>> t = torch.tensor([float(dptrain.rank())])
        >>> comm.all_reduce(t, op="avg")   # 0.5 on 2 ranks
    """
    _check_tensor("all_reduce", tensor)
    torch_op, divide = _op(op)
    if _alone("all_reduce", group):
        return None
    work = _call("all_reduce", lambda: dist.all_reduce(tensor, torch_op, group=group, async_op=async_op), [tensor], group)
    n = dist.get_world_size(group)
    if async_op:
        return _DivideOnWait(work, tensor, n) if divide else work
    if divide:
        tensor.div_(n)
    return None


def reduce(tensor: torch.Tensor, dst: int = 0, op: Any = "sum", group: Any = None, async_op: bool = False):
    """Reduce ``tensor`` across ranks into ``tensor`` on rank ``dst``.

    On ranks other than ``dst`` the content of ``tensor`` afterwards is unspecified, as in
    PyTorch.

    Args:
        tensor: input, and the output on ``dst``.
        dst: global rank that receives. Default 0.
        op: as for :func:`all_reduce`. Default ``"sum"``.
        group: process group; default the whole world.
        async_op: return a work handle. Default False.

    Raises:
        ValueError: unknown ``op``. CollectiveError: a peer failed or timed out.

    Example:
        >>> comm.reduce(t, dst=0, op="max")
    """
    _check_tensor("reduce", tensor)
    torch_op, divide = _op(op)
    if _alone("reduce", group):
        return None
    work = _call("reduce", lambda: dist.reduce(tensor, dst, torch_op, group=group, async_op=async_op), [tensor], group)
    n = dist.get_world_size(group)
    is_dst = dist.get_rank() == dst
    if async_op:
        return _DivideOnWait(work, tensor, n) if divide and is_dst else work
    if divide and is_dst:
        tensor.div_(n)
    return None


def _check_root_list(name: str, role: str, root: int, list_name: str, tensors: Any, group: Any, alone: bool) -> int:
    """Check the per-rank list that only the root of scatter/gather passes; return this rank."""
    n = 1 if alone else dist.get_world_size(group)
    me = 0 if alone else dist.get_rank()
    if me == root and (tensors is None or len(tensors) != n):
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise ValueError(f"{name} on the {role} rank {root} needs {list_name} of {n} tensors, got {got}")
    return me


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
):
    """Send ``scatter_list[i]`` from rank ``src`` into ``tensor`` on rank ``i``.

    Args:
        tensor: output on every rank.
        scatter_list: on ``src``, one tensor per rank shaped like ``tensor``; ignored elsewhere.
        src: global rank that sends. Default 0.
        group, async_op: as for :func:`broadcast`.

    Raises:
        ValueError: ``scatter_list`` missing or of the wrong length on ``src``.
        CollectiveError: a peer failed or timed out.

    Example:
        >>> out = torch.empty(2)
        >>> parts = [torch.full((2,), float(i)) for i in range(dptrain.world_size())]
        >>> comm.scatter(out, parts if dptrain.rank() == 0 else None, src=0)
    """
    _check_tensor("scatter", tensor)
    alone = _alone("scatter", group)
    me = _check_root_list("scatter", "source", src, "scatter_list", scatter_list, group, alone)
    if alone:
        tensor.copy_(scatter_list[0])
        return None
    return _call(
        "scatter",
        lambda: dist.scatter(tensor, scatter_list if me == src else None, src, group=group, async_op=async_op),
        [tensor],
        group,
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
):
    """Collect ``tensor`` from every rank into ``gather_list`` on rank ``dst``.

    Args:
        tensor: this rank's input (same shape on every rank; see :func:`all_gather_uneven`).
        gather_list: on ``dst``, one tensor per rank to receive into; ignored elsewhere.
        dst: global rank that receives. Default 0.
        group, async_op: as for :func:`broadcast`.

    Raises:
        ValueError: ``gather_list`` missing or of the wrong length on ``dst``.
        CollectiveError: a peer failed or timed out.

    Example:
        >>> out = [torch.empty(3) for _ in range(dptrain.world_size())] if dptrain.rank() == 0 else None
        >>> comm.gather(torch.ones(3), out, dst=0)
    """
    _check_tensor("gather", tensor)
    alone = _alone("gather", group)
    me = _check_root_list("gather", "destination", dst, "gather_list", gather_list, group, alone)
    if alone:
        gather_list[0].copy_(tensor)
        return None
    return _call(
        "gather",
        lambda: dist.gather(tensor, gather_list if me == dst else None, dst, group=group, async_op=async_op),
        [tensor],
        group,
    )


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """Collect ``tensor`` from every rank into ``tensor_list`` on every rank.

    Args:
        tensor_list: one output tensor per rank, shaped like ``tensor``.
        tensor: this rank's input.
        group, async_op: as for :func:`broadcast`.

    Raises:
        ValueError: ``tensor_list`` has the wrong length.
        CollectiveError: a peer failed or timed out.

    Example:
        >>> out = [torch.empty(2) for _ in range(dptrain.world_size())]
        >>> comm.all_gather(out, torch.full((2,), float(dptrain.rank())))
    """
    _check_tensor("all_gather", tensor)
    alone = _alone("all_gather", group)
    n = 1 if alone else dist.get_world_size(group)
    if len(tensor_list) != n:
        raise ValueError(f"all_gather needs tensor_list of {n} tensors (one per rank), got {len(tensor_list)}")
    if alone:
        tensor_list[0].copy_(tensor)
        return None
    return _call("all_gather", lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op), [tensor], group)


def barrier(group: Any = None) -> None:
    """Block until every rank of ``group`` has entered ``barrier``.

    Raises:
        CollectiveError: a peer failed or the timeout passed.

    Example:
        >>> comm.barrier()
    """
    if _alone("barrier", group):
        return None
    _call("barrier", lambda: dist.barrier(group=group), (), group)
    return None


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Collect one picklable object from every rank; every rank gets the list in rank order.

    Unlike ``torch.distributed.all_gather_object`` this returns the list instead of filling
    one you allocate. Objects are pickled: only use it with peers you trust.

    Raises:
        CollectiveError: a peer failed or timed out.

    Example:
        >>> comm.all_gather_object({"rank": dptrain.rank()})
        [{'rank': 0}, {'rank': 1}]
    """
    if _alone("all_gather_object", group):
        return [obj]
    if _on_cpu(group):
        pickles = _call("all_gather_object", lambda: _gather_pickles(pickle.dumps(obj), group), (), group)
        return [pickle.loads(p) for p in pickles]
    out: list[Any] = [None] * dist.get_world_size(group)
    _call("all_gather_object", lambda: dist.all_gather_object(out, obj, group=group), (), group)
    return out


def gather_object(obj: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Collect one picklable object from every rank on rank ``dst`` only.

    Unlike :func:`all_gather_object`, the other ranks never hold their peers' objects,
    which matters when the objects are large (per-rank state for a checkpoint).

    Args:
        obj: this rank's object.
        dst: global rank that receives. Default 0.
        group: process group; default the whole world.

    Returns:
        On ``dst``, the objects in rank order; elsewhere None.

    Raises:
        CollectiveError: a peer failed or timed out.

    Example:
        >>> states = comm.gather_object(get_rng_state(), dst=0)   # a list on rank 0, None elsewhere
    """
    if _alone("gather_object", group):
        return [obj]
    me = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size(group) if me == dst else None
    _call("gather_object", lambda: dist.gather_object(obj, out, dst=dst, group=group), (), group)
    return out


def broadcast_object(obj: Any = None, src: int = 0, group: Any = None) -> Any:
    """Send one picklable object from rank ``src``; every rank returns it.

    Args:
        obj: the object on ``src``; ignored elsewhere. Default None.
        src: global rank that sends. Default 0.

    Raises:
        CollectiveError: a peer failed or timed out.

    Example:
        >>> cfg = comm.broadcast_object(load_config() if dptrain.rank() == 0 else None)
    """
    if _alone("broadcast_object", group):
        return obj
    if _on_cpu(group):
        mine = pickle.dumps(obj) if dist.get_rank() == src else None
        return pickle.loads(_call("broadcast_object", lambda: _broadcast_pickle(mine, src, group), (), group))
    box = [obj if dist.get_rank() == src else None]
    _call("broadcast_object", lambda: dist.broadcast_object_list(box, src=src, group=group), (), group)
    return box[0]


# [Note: small objects in one exchange]
# torch's all_gather_object and broadcast_object_list take two collectives (sizes, then pickles):
# 1.5 ms per call on two CPU ranks, six calls of a few hundred bytes on in-place recovery's way to
# the next step. On gloo a slot carries the pickle's size and, when it fits, the pickle: one
# collective; else a second one moves the pickles padded to the largest. The slot shrinks on large
# groups (256 KiB in all, 256 bytes at least). NCCL keeps torch's. Only with peers you trust.
_OBJECT_SLOT = 4096


def _slot_size(n: int) -> int:
    return min(_OBJECT_SLOT, max(256, (256 << 10) // n))


def _on_cpu(group: Any) -> bool:
    return str(dist.get_backend(group)) == "gloo"


def _slot(data: bytes | None, size: int) -> torch.Tensor:
    """``size`` bytes: the length of ``data`` (8 bytes), then ``data`` when it fits."""
    slot = torch.zeros(size, dtype=torch.uint8)
    if data is not None:
        slot[:8].view(torch.int64)[0] = len(data)
        if 0 < len(data) <= size - 8:
            slot[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return slot


def _padded(data: bytes | None, size: int) -> torch.Tensor:
    """``data`` in ``size`` bytes (zeros after it); all zeros for None."""
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _gather_pickles(data: bytes, group: Any) -> list[bytes]:
    """Every rank's ``data``, in rank order (see [Note: small objects in one exchange])."""
    n = dist.get_world_size(group)
    size = _slot_size(n)
    slots = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(slots, _slot(data, size), group=group)
    sizes = [int(s[:8].view(torch.int64)[0]) for s in slots]
    if max(sizes) <= size - 8:
        return [s[8:8 + k].numpy().tobytes() for s, k in zip(slots, sizes)]
    whole = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(whole, _padded(data, max(sizes)), group=group)
    return [w[:k].numpy().tobytes() for w, k in zip(whole, sizes)]


def _broadcast_pickle(data: bytes | None, src: int, group: Any) -> bytes:
    """Rank ``src``'s ``data`` on every rank (see [Note: small objects in one exchange])."""
    room = _slot_size(dist.get_world_size(group))
    slot = _slot(data, room)
    dist.broadcast(slot, src=src, group=group)
    size = int(slot[:8].view(torch.int64)[0])
    if size <= room - 8:
        return slot[8:8 + size].numpy().tobytes()
    whole = _padded(data, size)
    dist.broadcast(whole, src=src, group=group)
    return whole.numpy().tobytes()


# all_gather_uneven exchanges shapes as fixed-size vectors: [ndim, d0, ..., d7].
_MAX_DIMS = 8


def all_gather_uneven(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Gather tensors whose first dimension differs across ranks; every rank gets all of them.

    The other dimensions and the dtype must agree. The typical use is distributed
    evaluation, where the last batch of each rank has a different size.

    Args:
        tensor: this rank's tensor, at least one dimension.
        group: process group; default the whole world.

    Returns:
        One tensor per rank, in rank order, each with that rank's first dimension.

    Raises:
        ValueError: the trailing shapes differ between ranks (raised on every rank, with
            every rank's shape), or the tensor is 0-d or has more than 8 dimensions.
        CollectiveError: a peer failed or timed out.

    Example:
        >>> preds = model(x).argmax(1)            # 5 rows on rank 0, 4 on rank 1
        >>> torch.cat(comm.all_gather_uneven(preds))   # 9 rows on every rank
    """
    _check_tensor("all_gather_uneven", tensor)
    if tensor.dim() == 0 or tensor.dim() > _MAX_DIMS:
        raise ValueError(f"all_gather_uneven needs a tensor of 1 to {_MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}")
    if _alone("all_gather_uneven", group):
        return [tensor.clone()]
    n = dist.get_world_size(group)
    shape = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=tensor.device)
    shape[0] = tensor.dim()
    shape[1 : tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(n)]
    _call("all_gather_uneven", lambda: dist.all_gather(shapes, shape, group=group), [shape], group)
    dims = [tuple(s[1 : int(s[0]) + 1].tolist()) for s in shapes]
    if any(d[1:] != dims[0][1:] for d in dims):
        listing = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dims))
        raise ValueError(
            f"all_gather_uneven needs the same shape apart from the first dimension on every rank; got {listing}"
        )
    longest = max(d[0] for d in dims)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    bufs = [torch.empty_like(padded) for _ in range(n)]
    _call("all_gather_uneven", lambda: dist.all_gather(bufs, padded.contiguous(), group=group), [padded], group)
    return [buf[: d[0]] for buf, d in zip(bufs, dims)]
