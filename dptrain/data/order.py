"""The index order of an epoch, held without a Python list of every index.

:class:`~dptrain.data.DistributedSampler` describes an epoch in three layers, each small:

- the *base order*: position ``p`` of ``[0, n)`` to a dataset index. PyTorch's order is
  ``torch.randperm(n)`` (a tensor, built once per epoch and dropped as soon as this rank's
  share is read out of it); ``shuffle=False`` is the identity; ``shuffle="lazy"`` is a keyed
  bijection (:func:`keyed_permutation`) computed index by index.
- a *segment*: which base positions, in which order, one part of an epoch covers. A fresh
  epoch is ``range(0, n)``; a resume on another world size leaves the unseen rest, which is
  an explicit (short) ``head`` of base positions followed by a ``range(start, stop)``.
- a :class:`Shard`: this rank's positions of a segment arranged for ``world`` ranks (padded
  by repeats or cut, as PyTorch does), as a read-only sequence of Python ints.

[Note: why the rest of an epoch stays small]
After rank r consumed ``c_r`` samples of a segment of length L arranged for W ranks, the
consumed positions are ``r, r + W, ..., r + (c_r - 1) W``. Every position below
``min(c) * W`` is consumed and every position of ``[max(c) * W, L)`` is not; only the
``(max(c) - min(c)) * W`` positions between are mixed. A padding repeat (positions ``L``
and beyond, fewer than W of them) stands for the sample at ``q % L``: it is never part of
the rest, and when it was consumed, its original is dropped from the rest too. So the rest
is the mixed positions that were not consumed (explicitly, at most ``(max(c) - min(c)) * W``
of them plus W) followed by a range: O(1) when the ranks stopped together, which is always
the case under lockstep DDP. This is the same rule as filtering the materialized order
(``dptrain.data.sampler``'s Note on resuming), computed without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Callable, Iterator

import numpy as np
import torch

__all__ = ["Segment", "Shard", "arranged_size", "index_dtype", "keyed_permutation", "materialize", "remainder", "shard"]

_ROUNDS = 6  # Feistel rounds; 4 make a pseudo-random permutation, 6 leave a margin
_CHUNK = 1 << 16  # indices computed at a time: bounds the temporaries, not the result
_FIRST_CHUNK = 1 << 10  # a short first chunk, so the first index comes at once
_EMPTY = torch.zeros(0, dtype=torch.int64)


def index_dtype(n: int) -> torch.dtype:
    """The narrowest integer dtype that holds every index of ``[0, n)``."""
    return torch.int32 if n <= torch.iinfo(torch.int32).max else torch.int64


# ---- the keyed bijection of [0, n) ------------------------------------------------------

def _round_keys(seed: int, epoch: int) -> np.ndarray:
    digest = hashlib.sha256(f"dptrain-keyed-permutation/{seed}/{epoch}".encode()).digest()
    return np.frombuffer(digest[: 8 * _ROUNDS], dtype=np.uint64).copy()


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64's finalizer: every input bit changes each output bit with probability ~1/2.
    # uint64 array arithmetic wraps modulo 2**64, which is what the mixing wants.
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << np.uint64(half)) | right


def keyed_permutation(positions: torch.Tensor, n: int, seed: int, epoch: int) -> torch.Tensor:
    """Map positions of ``[0, n)`` through a bijection of ``[0, n)`` keyed by ``(seed, epoch)``.

    A balanced Feistel network over the smallest even number of bits that covers ``n`` is a
    bijection of ``[0, 2**bits)``; cycle-walking (apply it again while the value is ``>= n``)
    restricts it to a bijection of ``[0, n)``. Since ``2**bits < 4 n``, a value walks fewer
    than 4 times on average. Costs O(len(positions)), whatever ``n``.
    """
    if positions.numel() == 0:
        return positions.to(torch.int64)
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    keys = _round_keys(seed, epoch)
    y = _feistel(positions.to(torch.int64).numpy().astype(np.uint64), bits // 2, keys)
    out = y >= np.uint64(n)
    while out.any():
        y[out] = _feistel(y[out], bits // 2, keys)
        out[out] = y[out] >= np.uint64(n)
    return torch.from_numpy(y.astype(np.int64))


# ---- segments of an epoch ---------------------------------------------------------------

class Segment:
    """Base positions ``head`` followed by ``range(start, stop)``, in that order."""

    __slots__ = ("head", "start", "stop")

    def __init__(self, head: torch.Tensor, start: int, stop: int) -> None:
        self.head = head  # int64, short: the unseen positions where ranks stopped unevenly
        self.start = start
        self.stop = max(start, stop)

    def __len__(self) -> int:
        return self.head.numel() + self.stop - self.start

    def base_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """The base positions at segment positions ``pos`` (int64, each in ``[0, len)``)."""
        h = self.head.numel()
        out = pos + (self.start - h)
        if h:
            in_head = pos < h
            out[in_head] = self.head[pos[in_head]]
        return out


def arranged_size(length: int, world: int, drop_last: bool, pad: bool) -> int:
    """Entries of a segment of ``length`` after PyTorch's padding or cut for ``world`` ranks."""
    if not pad:
        return length
    return (length // world) * world if drop_last else -(-length // world) * world


def remainder(seg: Segment, world: int, counts: Sequence[int], drop_last: bool, pad: bool) -> Segment:
    """The unseen rest of ``seg`` after rank r of ``world`` consumed ``counts[r]`` samples.

    Positions consumed, padding repeats and (with ``drop_last``) the cut tail are removed;
    see the module's Note for why the result stays small.
    """
    length = len(seg)
    total = arranged_size(length, world, drop_last, pad)
    end = min(length, total)  # positions past a drop_last cut are not part of this segment
    lo, hi = min(min(counts) * world, end), min(max(counts) * world, end)
    c = torch.tensor(list(counts), dtype=torch.int64)
    dropped = _EMPTY
    if total > length > 0:  # the padding repeats some rank consumed: their originals are seen
        q = torch.arange(length, max(length, min(max(counts) * world, total)), dtype=torch.int64)
        dropped = torch.remainder(q[c[q % world] > q // world], length)
    if dropped.numel():
        hi = max(hi, min(int(dropped.max()) + 1, end))
    mixed = torch.arange(lo, hi, dtype=torch.int64)
    keep = c[mixed % world] <= mixed // world
    if dropped.numel():
        keep &= ~torch.isin(mixed, dropped)
    h = seg.head.numel()
    head = torch.cat([seg.base_positions(mixed[keep]), seg.head[hi:end] if hi < h else _EMPTY])
    return Segment(head, seg.start + max(hi - h, 0), seg.start + max(end - h, 0))


# ---- this rank's share ------------------------------------------------------------------

class Shard(Sequence):
    """A rank's dataset indices for one pass: a read-only sequence of Python ints.

    Computed in chunks as it is read (or held as one tensor, for PyTorch's order, where the
    permutation had to be built anyway). It compares equal to a list with the same items,
    converts with ``np.asarray`` / ``torch.as_tensor`` / :meth:`tolist`, and pickles as a list.
    """

    __hash__ = None  # a sequence compared by value

    def __init__(self, length: int, fetch: Callable[[int, int], torch.Tensor], offset: int = 0) -> None:
        self._length = length
        self._fetch = fetch  # (start, stop) -> the indices at [start, stop) as a 1-D tensor
        self._offset = offset

    @classmethod
    def of_tensor(cls, values: torch.Tensor) -> "Shard":
        return cls(values.numel(), lambda a, b: values[a:b])

    def __len__(self) -> int:
        return self._length

    def _chunk(self, a: int, b: int) -> torch.Tensor:
        return self._fetch(self._offset + a, self._offset + b)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(self._length)
            if step != 1:
                return self.tolist()[i]
            return Shard(max(b - a, 0), self._fetch, self._offset + a)
        i = i.__index__()
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"shard index {i} out of range for {self._length} indices")
        return int(self._chunk(i, i + 1)[0])

    def __iter__(self) -> Iterator[int]:
        a, size = 0, _FIRST_CHUNK
        while a < self._length:
            b = min(a + size, self._length)
            yield from self._chunk(a, b).tolist()  # Python ints, as a dataset's __getitem__ expects
            a, size = b, _CHUNK

    def tensor(self) -> torch.Tensor:
        """All indices as one int64 tensor."""
        if not self._length:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([self._chunk(a, min(a + _CHUNK, self._length)).to(torch.int64)
                          for a in range(0, self._length, _CHUNK)])

    def tolist(self) -> list[int]:
        return list(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.tensor().numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (Shard, list, tuple, range)):
            return len(self) == len(other) and all(x == y for x, y in zip(self, other))
        return NotImplemented

    def __reduce__(self) -> tuple:
        return (list, (self.tolist(),))

    def __repr__(self) -> str:
        more = ", ..." if self._length > 6 else ""
        return f"Shard({str(self[:6].tolist())[:-1]}{more}], {self._length} indices)"


def shard(seg: Segment, world: int, rank: int, drop_last: bool, pad: bool,
          order: Callable[[torch.Tensor], torch.Tensor]) -> Shard:
    """Rank ``rank``'s share of ``seg`` arranged for ``world`` ranks, read through ``order``.

    ``order`` maps base positions (int64) to dataset indices. The share is computed chunk
    by chunk when read; nothing here is the size of the data set.
    """
    length = len(seg)
    total = arranged_size(length, world, drop_last, pad)
    count = len(range(rank, total, world))

    def fetch(a: int, b: int) -> torch.Tensor:
        q = torch.arange(a, b, dtype=torch.int64) * world + rank
        if total > length:
            q = torch.remainder(q, length)  # padding repeats the segment from its start
        return order(seg.base_positions(q))

    return Shard(count, fetch)


def materialize(lazy: Shard, dtype: torch.dtype) -> Shard:
    """The same indices held as one tensor of ``dtype`` (filled chunk by chunk)."""
    values = torch.empty(len(lazy), dtype=dtype)
    for a in range(0, len(lazy), _CHUNK):
        b = min(a + _CHUNK, len(lazy))
        values[a:b] = lazy._chunk(a, b)
    return Shard.of_tensor(values)
