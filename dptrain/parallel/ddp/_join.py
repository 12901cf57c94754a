"""DistributedDataParallel's part in ``join()``: what ranks that ran out of data do each round.

A joined rank keeps answering the collectives of the ranks still training -- the buffer
broadcast, the "does this backward synchronise" flag, a backward's all-reduces with zero
gradients (:func:`shadow_backward`, on the reducer's buckets) -- and at the end every rank
takes the model of the last rank to finish (PyTorch's semantics of
``DistributedDataParallel.join``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from dptrain import comm
from dptrain.parallel.ddp import _setup as setup
from dptrain.parallel.ddp._hook_pipeline import flush_hook_state

__all__ = ["DDPJoinHook", "find_common_rank", "all_reduce_requires_sync", "shadow_backward"]


def find_common_rank(ddp: Any, rank: int, candidate: bool) -> int:
    """The highest group rank among candidates (PyTorch's rule for join's authoritative rank)."""
    t = torch.tensor([rank if candidate else -1], device=ddp.device)
    with comm.guarded("DDP join (the last rank to join)", ddp.process_group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ddp.process_group)
    return int(t.item())


def all_reduce_requires_sync(ddp: Any, joined: bool) -> bool | None:
    """Join: tell the joined ranks whether this iteration's backward synchronises (1 per rank)."""
    syncing = not joined and ddp.require_backward_grad_sync
    flag = torch.full((1,), float(syncing), device=ddp.device)
    work = dist.all_reduce(flag, group=ddp.process_group, async_op=True)
    if not joined:
        return None
    comm.wait(work, "DDP join (which ranks still train)", ddp.process_group)
    return bool(flag.item() != 0)


class DDPJoinHook(JoinHook):
    """What a joined rank does each round: the collectives of one forward and backward, with zeros."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()  # matches the rebuild in the other ranks' forward
        buffers = ddp._buffers_to_sync()
        if buffers:
            ddp._sync_buffers(find_common_rank(ddp, ddp._rank, False), buffers)
        should_sync = all_reduce_requires_sync(ddp, joined=True)
        ddp.require_forward_param_sync = bool(should_sync)
        if should_sync:
            shadow_backward(ddp.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = find_common_rank(ddp, ddp._rank, is_last_joiner)
        tensors = setup.managed_tensors(ddp.module, ddp.parameters_to_ignore, ddp.forward_sync_buffers)
        setup.broadcast_coalesced(tensors, src, ddp.process_group, "DDP join (final model broadcast)")


def shadow_backward(reducer: Any) -> None:
    """For a rank that has joined: run the collectives of one synced backward with zeros."""
    works, zeros = [], None
    for bucket in reducer.buckets:
        zeros = torch.zeros_like(bucket.flat if reducer.comm_hook is None else bucket.buffer)
        if reducer.comm_hook is None:
            works.append(reducer._all_reduce(zeros, bucket.index))
        else:
            works.append(reducer._run_hook(bucket, zeros))
    flush_hook_state(reducer.comm_hook_state)
    for bucket, w in zip(reducer.buckets, works):
        comm.wait(w, f"DDP gradient all-reduce of a joined rank (bucket {bucket.index})", reducer.process_group)
    if reducer._tracks_used:
        # [Note: join and the used map] Like PyTorch, a joined rank contributes the map left
        # from its last reduction (reduced in place, so it only grows), not zeros: parameters
        # used before it joined count as used, and get zero gradients instead of None.
        with comm.guarded("DDP join (used parameters of a joined rank)", reducer.process_group):
            dist.all_reduce(reducer._used_map(reducer.params[0].device), group=reducer.process_group)
    _shadow_rebuild_decision(reducer, zeros)
    reducer.num_iterations += 1
    if reducer.observer is not None:
        reducer.observer.backward_finished(joined=True)
    reducer._in_flight = False  # as after a backward of its own (the reducer's [Note: the learnt state])


def _shadow_rebuild_decision(reducer: Any, last_flat: torch.Tensor) -> None:
    # The ranks still training decide on a rebuild after this backward; this rank reads the
    # same vote and takes part in the broadcast (see the reducer's [Note: bucket rebuild]).
    last = reducer.buckets[-1]
    if reducer.comm_hook is None and last.flat.numel() > last.numel and last_flat[last.numel].item() > 0:
        return  # a rank failed: nobody decides this time
    first_static = reducer.static_graph and reducer.num_iterations == 0
    reducer._rebuild.decide_joined(first_static, reducer._rebuild_votes(last_flat))
