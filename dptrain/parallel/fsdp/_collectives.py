"""FSDP's collectives: gather equal shards into one flat tensor, reduce-scatter it back.

Both use the single-tensor collectives (one launch for the whole unit) and fall back to the
list forms on backends that lack them. When the ranks share one node and the tensors are on
the CPU, both run in shared memory instead (see ``attach_shared_memory``). Waiting on what they return goes through
:func:`dptrain.comm.wait`, so a peer that never arrives is named like everywhere else.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from dptrain import comm

__all__ = ["all_gather_flat", "reduce_scatter_flat", "wait", "attach_shared_memory"]

# Newer torch renamed the tensor collectives; the old names still work but warn.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Backends without the tensor collectives (older gloo builds) get list-based fallbacks.
_FALLBACK = {"all_gather": False, "reduce_scatter": False}


def _unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return "not supported" in text or "does not support" in text or "no implementation" in text


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: Any, world: int, async_op: bool, shm: Any = None):
    """Gather equal shards into ``out`` (rank order). Returns a work handle or None.

    ``shm``: the root's :class:`dptrain._shm.ShmGroup` when its ranks share one node (CPU).
    """
    if world == 1:
        out.copy_(shard)
        return None
    if shm is not None:
        return _handed_back(shm.all_gather_into(out, shard, tag="FSDP all-gather"), async_op)
    if not _FALLBACK["all_gather"]:
        try:
            return _ALL_GATHER(out, shard, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError) as err:
            if not _unsupported(err):
                raise
            _FALLBACK["all_gather"] = True
    # List all_gather into views of ``out``: same bytes, one extra launch per rank.
    return dist.all_gather(list(out.chunk(world)), shard, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: Any, world: int, rank: int, async_op: bool,
                        shm: Any = None):
    """Sum ``full`` over ranks and leave this rank's chunk in ``out``. Returns work or None."""
    if world == 1:
        out.copy_(full)
        return None
    if shm is not None:
        return _handed_back(shm.reduce_scatter_into(out, full, tag="FSDP reduce-scatter"), async_op)
    if not _FALLBACK["reduce_scatter"]:
        try:
            return _REDUCE_SCATTER(out, full, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError) as err:
            if not _unsupported(err):
                raise
            _FALLBACK["reduce_scatter"] = True
    # Fallback: all-reduce the whole tensor, then keep our slice (2x the bytes of a
    # reduce-scatter; only used when the backend has no reduce_scatter at all).
    comm.wait(dist.all_reduce(full, group=group, async_op=True), "FSDP reduce-scatter (all-reduce fallback)", group)
    out.copy_(full.chunk(world)[rank])
    return None


def _handed_back(work: Any, async_op: bool) -> Any:
    """A shared-memory collective's result as torch's collectives give it: the work, or None once done."""
    if async_op:
        return work
    work.wait()
    return None


#: The most a rank's shared-memory region takes (bytes); what is larger goes in pieces.
SHM_REGION_BYTES = 8 << 20


def attach_shared_memory(units: Sequence[Any], group: Any, device: torch.device, want: bool | None = None) -> Any:
    """Give the sharded units one shared-memory group when the ranks share a node; collective.

    A rank publishes its gradient there for the reduce-scatter and its shard for the
    all-gather (one collective at a time, on the group's worker thread, in issue order). Each
    rank's region holds the largest unit's flat tensor up to ``SHM_REGION_BYTES``; larger
    tensors pass in pieces, so ``/dev/shm`` needs at most that per rank whatever the model.
    Returns the group, or None on every rank (other nodes, GPUs, ``DPTRAIN_SHM=0``, ``want``
    False): gloo. ``want`` True raises ValueError where shared memory cannot be used.
    """
    from dptrain._shm import ShmGroup

    sharded = [u for u in units if u.shard_numel < u.padded_numel]  # none in a single process
    if not sharded:
        return None
    nbytes = min(max(u.padded_numel * u.dtype.itemsize for u in sharded), SHM_REGION_BYTES)
    shm = ShmGroup.create(group, nbytes, what="FSDP all-gather / reduce-scatter", want=want, devices=[device])
    for unit in sharded:
        unit.shm = shm
    return shm


def wait(work: Any, what: str, group: Any) -> None:
    """Wait for an FSDP collective; a failure names the operation and the missing rank."""
    comm.wait(work, what, group)
