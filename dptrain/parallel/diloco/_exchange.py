"""One outer exchange: a fragment's pseudo-gradient averaged over the replicas.

[Note: the same bits on every rank]
The outer step must leave every replica bitwise equal, so the mean is made the same way
everywhere: fp32 pseudo-gradients are summed by one all-reduce (every rank receives the
same sum) and divided by the number of replicas; quantised ones are all-gathered and every
rank decodes and adds them in rank order. With a hierarchical topology (see ``_groups.py``)
the ranks of a node hold the same pseudo-gradient, so local rank ``i`` exchanges only the
``i``-th slice of it with local rank ``i`` of the other nodes, and the node's ranks then
all-gather their averaged slices: the link between nodes carries each byte once per node,
not once per rank.

[Note: counting bytes]
``bytes_sent`` counts what this rank sends between replicas under the bandwidth-optimal
ring algorithms: an all-reduce of ``B`` bytes over ``n`` ranks sends ``2 (n - 1) / n * B``,
an all-gather of ``B`` bytes from each sends ``(n - 1) * B``. The exchange inside a node
(shared memory or loopback) is counted apart, in ``node_bytes_sent``. The backend may pick
another algorithm for small messages; the count is the payload's, not a packet capture.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.parallel.diloco import _codec

__all__ = ["Topology", "Exchange"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Whom a rank averages its pseudo-gradients with."""

    outer: Any = None  # the group of the replicas' exchange (None: the default group)
    outer_size: int = 1  # replicas in it; 1: nothing to exchange
    node: Any = None  # the group of the ranks that hold the same replica (a DDP group), or None
    node_size: int = 1
    node_index: int = 0  # this rank's place in ``node``

    @property
    def alone(self) -> bool:
        return self.outer_size == 1


class Exchange:
    """Average ``delta`` (1-D fp32) over the replicas: launched here, finished by :meth:`result`.

    The collective runs on the backend's own thread (gloo) or stream (NCCL) while the caller
    goes on with inner steps; :meth:`result` waits for it through :func:`dptrain.comm.wait`, so
    a peer that died is named, and then divides (and shares the slices inside the node).
    """

    def __init__(self, delta: torch.Tensor, topology: Topology, codec: str, name: str) -> None:
        self.name = name
        self.numel = delta.numel()
        self._topology = topology
        self._codec = codec
        self._mean: torch.Tensor | None = None
        self._work: Any = None
        self.bytes_sent = 0
        self.node_bytes_sent = 0
        self._chunk = -(-self.numel // topology.node_size)
        piece = delta
        if topology.node_size > 1:
            start = min(topology.node_index * self._chunk, self.numel)
            piece = torch.zeros(self._chunk, dtype=torch.float32, device=delta.device)
            mine = delta[start : start + self._chunk]
            piece[: mine.numel()] = mine
        self._launch(piece.contiguous())

    def _launch(self, piece: torch.Tensor) -> None:
        top, n = self._topology, self._topology.outer_size
        if top.alone:
            self._held = piece
            return
        if self._codec == "fp32":
            self._held = piece.clone()
            self.bytes_sent = 2 * (n - 1) * piece.numel() * 4 // n
            with comm.guarded(f"{self.name}: launch", top.outer):
                self._work = dist.all_reduce(self._held, group=top.outer, async_op=True)
            return
        message = _codec.encode(piece, self._codec)
        self._held = [torch.empty_like(message) for _ in range(n)]
        self.bytes_sent = (n - 1) * message.numel() * message.element_size()
        with comm.guarded(f"{self.name}: launch", top.outer):
            self._work = dist.all_gather(self._held, message, group=top.outer, async_op=True)
        self._piece_numel = piece.numel()

    def result(self) -> torch.Tensor:
        """The mean pseudo-gradient (1-D fp32, ``numel`` elements), the same bits on every rank."""
        if self._mean is not None:
            return self._mean
        top = self._topology
        comm.wait(self._work, self.name, top.outer)
        self._work = None
        if top.alone:
            mean = self._held
        elif self._codec == "fp32":
            mean = self._held.div_(top.outer_size)
        else:
            mean = _codec.decode(self._held[0], self._piece_numel, self._codec).clone()
            for message in self._held[1:]:
                mean.add_(_codec.decode(message, self._piece_numel, self._codec))
            mean.div_(top.outer_size)
        self._held = None
        if top.node_size > 1:
            slices = [torch.empty_like(mean) for _ in range(top.node_size)]
            with comm.guarded(f"{self.name}: sharing the slices inside the node", top.node):
                dist.all_gather(slices, mean, group=top.node)
            self.node_bytes_sent = (top.node_size - 1) * mean.numel() * 4
            mean = torch.cat(slices)[: self.numel]
        self._mean = mean
        return mean

    @classmethod
    def finished(cls, mean: torch.Tensor, name: str) -> "Exchange":
        """An exchange whose result is already known (restored from a checkpoint)."""
        done = cls.__new__(cls)
        done.name, done.numel, done._mean, done._work = name, mean.numel(), mean, None
        done.bytes_sent = done.node_bytes_sent = 0
        return done
