"""When DDP's reducer rebuilds its buckets in gradient-ready order, and with whose order.

[Note: bucket rebuild]
As PyTorch does, the reducer records the order in which gradients become ready during the
first synced backward (the second with ``static_graph``, whose first backward reduces
everything at its end) and, at the next forward, rebuilds the buckets once in that order,
using rank 0's order on every rank. A model whose forward order differs from its
registration order then still launches its first bucket as soon as the first gradients are
ready. With ``find_unused_parameters=True`` (and no static graph) the set of gradients can
change every iteration, so the buckets are never rebuilt (PyTorch's rule too).

Unlike PyTorch, whose first iteration reduces one bucket holding everything, our first
iteration already uses reverse-registration buckets, which is the observed order for most
models. The ranks agree on whether a rebuild changes anything through a vote in the last
bucket's status slots (each rank adds 1 if its order gives other buckets), so the one
broadcast of rank 0's order only happens when it does. With a communication hook there is
no slot, and the next forward always broadcasts (as PyTorch always does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dptrain import comm

__all__ = ["BucketRebuild"]

_WHAT = "DDP bucket rebuild (broadcast of rank 0's gradient order)"


class BucketRebuild:
    """The recording of one backward's gradient order and the agreement to rebuild from it."""

    def __init__(self, num_params: int, never: bool) -> None:
        self.num_params = num_params
        self.done = never  # rebuilt, found unnecessary, or never wanted (find_unused_parameters)
        self.agreed: list[int] | None = None  # this rank's order, for the next forward's broadcast
        self.recording = False  # whether the running backward records its order
        self.order: list[int] = []  # parameter indices in the order their gradients were ready
        self.observed: list[int] | None = None  # the complete order of the running backward

    def start_backward(self, first_static_iteration: bool) -> None:
        self.recording = not (self.done or self.agreed is not None or first_static_iteration)
        self.order = []
        self.observed = None

    def complete(self, unused: list[int]) -> list[int] | None:
        """The order once every gradient is in (unused parameters last, as in PyTorch), or None."""
        seen = set(self.order)
        order = self.order + [j for j in unused if j not in seen]
        self.observed = order if len(order) == self.num_params else None
        return self.observed

    def decide(self, votes: float | None) -> None:
        """After the recording backward: ``votes`` ranks want other buckets (None: unknown, rebuild)."""
        if self.observed is None:
            return  # incomplete: record again in the next backward
        if votes is None or votes > 0:
            self.agreed = self.observed
        else:
            self.done = True  # every rank's order gives the current buckets

    def decide_joined(self, first_static_iteration: bool, votes: float | None) -> None:
        """A joined rank follows the others' decision, offering registration order."""
        if self.done or self.agreed is not None or first_static_iteration:
            return
        self.observed = list(range(self.num_params))
        self.decide(votes)

    def exchange(self, group: Any, device: torch.device) -> list[int] | None:
        """At a forward: rank 0's order on every rank (one broadcast) if a rebuild was agreed."""
        if self.agreed is None or self.done:
            return None
        order = torch.tensor(self.agreed, dtype=torch.int64, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with comm.guarded(_WHAT, group):
            dist.broadcast(order, src=src, group=group)
        self.agreed = None
        self.done = True
        return order.tolist()
