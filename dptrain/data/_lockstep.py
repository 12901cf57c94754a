"""One pass of a stream loader on this rank: in step with the other ranks, one batch ahead.

The iteration half of :class:`~dptrain.data.StreamLoader` (``dptrain.data.stream`` builds
the readers and keeps the position between passes): it takes the readers' tagged items
(``dptrain.data._readers``) in order, agrees with the other ranks on every step, and hands
out batches or :class:`ShadowBatch` stand-ins.

[Note: the order of a rank's batches]
The readers of a rank are its loader workers (one without workers). The DataLoader takes
items from its workers in turn and keeps that order (``in_order=True``), so a rank's batches
come out in rounds: round ``m`` is batch ``m`` of every worker that has one, in worker
order; a worker that ran out drops out of the turn. Where the workers share one source
(split by sample) the rank's batches go to its workers in turn, so the rounds give them back
in stream order. A resumed worker that had already handed out its batch of the current
round starts with a ``HOLE`` item, so that the rounds line up as they did.

[Note: equal steps]
Every rank must call the model the same number of times per epoch (DDP's all-reduce). The
iterator reads one batch ahead, and each ``next()`` runs one all-reduce of three integers
through ``dptrain.comm``: the ranks that have a next batch, the ranks that could stand in
(they have had one), the ranks that saw a reader end. So every rank knows, before it hands
out a batch, whether it is the epoch's last (``iterator.is_last``). With ``uneven="join"``
an epoch runs while any rank has a batch; a rank whose share ran out yields
:class:`ShadowBatch` items holding its last real batch, to run with a zero loss weight, so
gradients are averaged over the world size as ``torch.distributed.algorithms.Join`` does.
A rank with no batch at all in an epoch cannot stand in: that epoch falls back to drop.
With ``uneven="drop"`` every rank stops when any runs out; the batches left over are counted
once (the ranks read them) and said from rank 0. One process runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from dptrain import comm
from dptrain.runtime import env
from dptrain.data import _readers

__all__ = ["Pass", "ShadowBatch", "StreamIterator"]

_SHADOW_REFUSAL = (
    "dptrain.data.ShadowBatch: this rank has used up its share of the stream in this epoch while other ranks still "
    "have batches (uneven='join'), so the loader hands it a stand-in, its last real batch (in .batch), to keep all "
    "ranks stepping together. Training on it like a real batch would train that batch twice. Run it with a zero "
    "loss weight: `if isinstance(batch, dptrain.data.ShadowBatch): loss = loss_fn(model(batch.batch)) * 0` (the "
    "Trainer does this), or build the loader with uneven='drop' to stop every rank at the shortest share"
)


class ShadowBatch:
    """A stand-in handed to a rank whose share of the stream ran out while others go on (``uneven="join"``).

    ``shadow.batch`` is that rank's last real batch. Run the model on it with a zero loss
    weight, so that the rank takes part in the gradient all-reduce without training anything
    (gradients are then averaged over the world size, as with PyTorch's ``Join``). It refuses
    to be unpacked, indexed, measured or used as a batch (``TypeError``/``AttributeError``
    naming the fix), so a plain loop cannot train a batch twice unnoticed.

    Example:
        >>> for batch in loader:
        ...     weight = 0.0 if isinstance(batch, ShadowBatch) else 1.0
        ...     x, y = batch.batch if weight == 0.0 else batch
        ...     (loss_fn(model(x), y) * weight).backward()
    """

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __iter__(self):
        raise TypeError(_SHADOW_REFUSAL)

    def __getitem__(self, key):
        raise TypeError(_SHADOW_REFUSAL)

    def __len__(self):
        raise TypeError(_SHADOW_REFUSAL)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)  # protocol lookups (copy, pickle) must see a plain absence
        raise AttributeError(f"{name!r}: {_SHADOW_REFUSAL}")

    def __repr__(self) -> str:
        return f"ShadowBatch(batch={self.batch!r})"


@dataclass
class Pass:
    """What one pass needs of its loader (not the loader itself: see ``StreamLoader.__iter__``'s Note)."""

    rank: int
    workers: int
    world_size: int
    uneven: str
    epoch: int
    synced: bool
    said: set

    def say_once(self, key: str, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            env._warn_once_main(message)


class StreamIterator:
    """One pass of a :class:`StreamLoader` on this rank: equal steps, look-ahead, the position (module Notes)."""

    def __init__(self, run: Pass, inner: Iterator | None, items: int, ends: dict[int, int], done: bool):
        self._run = run  # what this pass needs of its loader
        self._inner = inner
        self.items = items  # items handed out in this epoch, resumed ones included: the position
        self.ends = dict(ends)  # reader -> its number of batches, for every reader known to have ended
        self.finished = done
        self.is_last = False  # True once next() has handed out the epoch's last item
        self._started = False
        self._exists = False  # whether the step now due exists on the ranks
        self._current: tuple | None = None  # this rank's real item for the step now due
        self._last: Any = None  # this rank's last real batch: the stand-in
        self._news: dict[int, int] = {}  # readers of this rank seen ending since the last agreement
        self._order = (-1, -1)  # (round, worker) of the last batch: must grow
        self._falls_back = False  # a rank had no batch at all: this epoch drops
        self._stood_in = 0  # stand-in items on all ranks (from the sums)
        self._remaining_ranks = 0  # ranks with a real batch at the step that did not happen
        self._closed = False

    def __iter__(self) -> "StreamIterator":
        return self

    def close(self) -> None:
        """End this pass before its epoch's end: its loader worker processes stop now.

        The position (``items``, what the loader's ``state_dict()`` reports) stays. Without
        this, the workers of a pass left unfinished live until the next ``iter(loader)`` or
        until the garbage collector finds the pass, and a DataLoader iterator that the collector
        finalizes (one in a reference cycle, as a Trainer's loader is) waits 5 s per worker
        before it kills them. ``next()`` after ``close()`` raises ``RuntimeError``: the rank's
        share did not end, and a pass that went on without its readers would say it had.
        """
        self._closed = True
        self._inner = None

    def _fetch(self) -> tuple | None:
        """This rank's next real batch item, or None at the end of its share; ends met on the way become news."""
        loader = self._run
        while self._inner is not None:
            try:
                item = next(self._inner)
            except StopIteration:
                self._inner = None
                break
            tag, worker = item[0], item[1]
            if tag == _readers.HOLE:
                continue
            reader = loader.rank * loader.workers + worker
            if tag == _readers.END:
                if self.ends.get(reader) != item[2]:
                    self._news[reader] = item[2]
                continue
            if tag == _readers.STANDIN:
                self._last = item[3]
                continue
            key = (item[2], worker)
            if key <= self._order:
                raise RuntimeError(
                    f"rank {loader.rank}: the stream loader's batches came out of order (batch {item[2]} of worker "
                    f"{worker} after batch {self._order[0]} of worker {self._order[1]}); its position would be wrong. "
                    f"Keep the DataLoader's in_order=True"
                )
            self._order = key
            return item
        return None

    def _agree(self, item: tuple | None) -> bool:
        """Whether the step of ``item`` (this rank's, or None) happens on the ranks (Note "equal steps")."""
        loader = self._run
        has, can = item is not None, item is not None or self._last is not None
        news, self._news = self._news, {}
        if loader.synced:
            sums = torch.tensor([int(has), int(can), int(bool(news))], dtype=torch.int64, device=env.device())
            comm.all_reduce(sums)
            n_real, n_can, n_news = (int(v) for v in sums.tolist())
            if n_news:
                for part in comm.all_gather_object(news):
                    self.ends.update(part)
            world = loader.world_size
        else:
            n_real, n_can, world = int(has), int(can), 1
            self.ends.update(news)
        if loader.uneven == "join" and not self._falls_back and n_real > 0 and n_can < world:
            self._falls_back = True
            loader.say_once(
                "fallback",
                f"dptrain.StreamLoader: {world - n_can} of {world} ranks have no batch at all in epoch {loader.epoch} "
                f"(their share of the stream is empty), so they cannot stand in for uneven='join'; this epoch stops "
                f"on every rank as with uneven='drop'. Give the stream more samples or shards than ranks x workers",
            )
        if loader.uneven == "drop" or self._falls_back:
            exists = n_real == world
        else:
            exists = n_real > 0
        if exists:
            self._stood_in += world - n_real
        else:
            self._remaining_ranks = n_real
        return exists

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        if self._closed:
            raise RuntimeError(f"rank {self._run.rank}: this pass of the stream loader (epoch {self._run.epoch}) was "
                               f"closed after {self.items} item(s); start a new one with iter(loader)")
        if not self._started:
            self._started = True
            self._current = self._fetch()
            self._exists = self._agree(self._current)
        if not self._exists:
            self._finish()
            raise StopIteration
        if self._current is not None:
            self._last = self._current[3]
            out = self._current[3]
        else:
            out = ShadowBatch(self._last)
        self._current = self._fetch()  # look ahead: is this the last step?
        self._exists = self._agree(self._current)
        self.is_last = not self._exists
        self.items += 1
        return out

    def _finish(self) -> None:
        """The epoch ended on every rank: say once what joining or dropping did, release the workers."""
        self.finished = True
        loader = self._run
        if self._stood_in and not self._falls_back:
            loader.say_once(
                "join",
                f"dptrain.StreamLoader: the ranks' shares of epoch {loader.epoch} were uneven; uneven='join' kept all "
                f"{loader.world_size} ranks at {self.items} steps with {self._stood_in} stand-in batches "
                f"(dptrain.data.ShadowBatch, run with a zero loss weight). uneven='drop' stops at the shortest share",
            )
        if self._remaining_ranks and loader.synced and "drop" not in loader.said:
            left = [0, 0] if self._current is None else [1, self._current[4]]
            while (item := self._fetch()) is not None:  # counted once, for the notice
                left[0] += 1
                left[1] += item[4]
            counts = comm.all_gather_object(left)
            shown = ", ".join(f"rank {r}: {b} batch(es) ({s} samples)" for r, (b, s) in enumerate(counts))
            loader.say_once(
                "drop",
                f"dptrain.StreamLoader: epoch {loader.epoch} stopped on every rank after {self.items} steps because a "
                f"rank's share ran out (uneven='drop'); left unread: {shown}. uneven='join' trains them all",
            )
        self._inner = None
