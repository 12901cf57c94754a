"""How a stream is split among its readers (rank x loader worker), and what one reader yields.

A :class:`~dptrain.data.StreamLoader` on ``world`` ranks with ``W = max(num_workers, 1)``
loader workers has ``R = world * W`` readers; reader ``q = rank * W + worker`` yields its
batches in its own order. :func:`plan_split` picks how the readers share the stream
(:class:`Split`), and :class:`Readers` is the ``IterableDataset`` that the DataLoader's
workers (or the main process, without workers) iterate: each yields tagged items, never
bare batches, so that the main process knows which reader a batch came from and where a
reader ended.

[Note: the ways to split]
From the cheapest to the dearest in reading:

- ``"shards"``: the stream has ``shard(num_shards, index)`` (the dptrain protocol, see
  :mod:`dptrain.data.stream`) and at least ``R`` shards, or is a webdataset over at least
  ``R`` shard files: reader ``q`` reads ``shard(R, q)`` and nothing else.
- ``"datasets"``: a Hugging Face ``datasets.IterableDataset``. It splits itself among the
  DataLoader workers inside each worker (by its shards), which no wrapper can turn off, so
  dptrain leaves that to it and splits only among the ranks, with
  ``datasets.distributed.split_dataset_by_node``: by shards when it has at least one per
  rank, else by examples (then every rank reads the whole stream).
- ``"rank-shards"``: fewer shards than readers but at least one per rank: rank ``r`` reads
  ``shard(world, r)``, and each of its workers reads all of it and keeps its own batches.
- ``"interleave"``: no shards (or fewer than ranks): every reader reads the whole stream and
  keeps its own samples -- sample ``i`` goes to rank ``i % world``, and a rank's batches go
  to its workers in turn.

In the last two a source is read by ``P`` ranks (``P = world`` when interleaved, else 1) and
``Q`` workers (``Q = W`` when the workers share a source, else 1): sample ``i`` of the source
belongs to rank ``i % P``, as sample ``j = i // P`` of that rank's stream, in its batch
``b = j // B``, read by worker ``b % Q`` as that worker's batch ``b // Q``. So the start of a
reader's ``d``-th batch in the source is a number, and a reader resumes there (see
:func:`start_index`).

[Note: the items]
A reader yields ``(BATCH, worker, m, batch, n)`` for its ``m``-th batch of ``n`` samples,
``(END, worker, m)`` once after its last one (``m`` batches in all), ``(HOLE, worker)`` where
a resumed reader must keep its turn (see ``dptrain.data.stream``'s Note "the order of a
rank's batches") and ``(STANDIN, worker, m, batch, n)`` for a batch read again only to stand
in for a rank whose share is used up at the resumed position.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.utils.data as tud

__all__ = ["BATCH", "END", "HOLE", "STANDIN", "Readers", "Split", "cut", "plan_split", "start_index"]

BATCH, END, HOLE, STANDIN = "batch", "end", "hole", "standin"

# The columns of a rank's plan (one row per worker), written by the main process before an
# iteration starts and read by each reader when its iteration starts.
EPOCH, SKIP, HOLE_FIRST, STAND_IN, KNOWN_END = range(5)
PLAN_COLUMNS = 5


def _is_hf_datasets(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "_ex_iterable")


def _webdataset_urls(dataset: Any) -> list[str] | None:
    """The shard files of a webdataset pipeline that starts from a plain shard list, else None."""
    if not type(dataset).__module__.startswith("webdataset."):
        return None
    stages = getattr(dataset, "pipeline", None)
    if not stages or type(stages[0]).__name__ != "SimpleShardList":
        return None  # resampled or yaml-specified shards: no fixed list to share out
    urls = getattr(stages[0], "urls", None)
    return list(urls) if isinstance(urls, (list, tuple)) else None


def _webdataset_subset(dataset: Any, urls: list[str]) -> Any:
    """A copy of a webdataset pipeline over ``urls`` only, without its own node and worker splitters.

    Those stages split the shard list again by ``torch.distributed`` rank and DataLoader
    worker; dptrain already gave this reader its share.
    """
    from webdataset import shardlists  # the user's stream is a webdataset: the package is there

    own_splitters = {shardlists.split_by_node, shardlists.split_by_worker, shardlists.single_node_only}
    if not urls:
        return []
    first = copy.copy(dataset.pipeline[0])
    first.urls = list(urls)
    subset = copy.copy(dataset)
    subset.pipeline = [first] + [s for s in dataset.pipeline[1:] if s not in own_splitters]
    return subset


def _num_shards(dataset: Any) -> int | None:
    """How many parts ``dataset`` splits into without reading the others' (None: any number)."""
    urls = _webdataset_urls(dataset)
    if urls is not None:
        return len(urls)
    for name in ("num_shards", "n_shards"):
        n = getattr(dataset, name, None)
        if isinstance(n, int):
            return n
    return None


@dataclass(frozen=True)
class Split:
    """How the ``world * workers`` readers share a stream (see the module Note "the ways to split")."""

    kind: str  # "shards", "datasets", "rank-shards" or "interleave"
    world: int
    workers: int  # W = max(num_workers, 1)

    @property
    def ranks_per_source(self) -> int:
        """P: the ranks that read one source and keep every P-th sample."""
        return self.world if self.kind == "interleave" else 1

    @property
    def workers_per_source(self) -> int:
        """Q: the workers of a rank that read one source and keep every Q-th batch."""
        return self.workers if self.kind in ("interleave", "rank-shards") else 1

    def source(self, dataset: Any, rank: int, worker: int) -> Iterable:
        """The iterable that reader ``(rank, worker)`` reads."""
        if self.kind == "datasets":
            if self.world == 1:
                return dataset
            from datasets.distributed import split_dataset_by_node  # the user's stream is one of theirs

            if "strategy" not in inspect.signature(split_dataset_by_node).parameters:
                return split_dataset_by_node(dataset, rank=rank, world_size=self.world)  # older: shards if they divide
            shards = _num_shards(dataset)
            strategy = "shards" if shards is not None and shards >= self.world else "examples"
            return split_dataset_by_node(dataset, rank=rank, world_size=self.world, strategy=strategy)
        if self.kind == "shards":
            return _shard(dataset, self.world * self.workers, rank * self.workers + worker)
        if self.kind == "rank-shards":
            return _shard(dataset, self.world, rank)
        urls = _webdataset_urls(dataset)
        return dataset if urls is None else _webdataset_subset(dataset, urls)


def _shard(dataset: Any, num_shards: int, index: int) -> Iterable:
    urls = _webdataset_urls(dataset)
    if urls is not None:
        return _webdataset_subset(dataset, urls[index::num_shards])
    return dataset.shard(num_shards, index)


def plan_split(dataset: Any, world: int, workers: int) -> tuple[Split, str | None]:
    """The way ``dataset`` is shared by ``world * workers`` readers, and a notice when it costs reading.

    The notice (None when each reader reads only its own samples) names the cost and the fix;
    the caller says it once, from rank 0.
    """
    readers = world * workers
    name = type(dataset).__name__
    if _is_hf_datasets(dataset):
        if world > 1 and getattr(dataset, "_distributed", None) is not None:
            raise ValueError(
                f"the Hugging Face stream is already split by node (datasets.distributed.split_dataset_by_node), so "
                f"each rank would keep only a part of its part; pass the whole stream: the loader splits it among "
                f"the {world} ranks itself"
            )
        n = _num_shards(dataset)
        if world > 1 and (n is None or n < world):
            return Split("datasets", world, workers), (
                f"dptrain.StreamLoader: the Hugging Face stream has {n} shard(s) for {world} ranks, so it is split by "
                f"examples: every rank reads the whole stream and keeps 1 example in {world}. Give it at least one "
                f"shard (file) per rank, better one per rank and loader worker ({readers})"
            )
        if n is not None and n < readers:
            return Split("datasets", world, workers), (
                f"dptrain.StreamLoader: the Hugging Face stream has {n} shard(s) for {world} rank(s) x {workers} "
                f"loader worker(s); it gives each worker whole shards, so some workers have nothing to read. Give it "
                f"at least {readers} shards (files), or use fewer workers"
            )
        return Split("datasets", world, workers), None
    n = _num_shards(dataset)
    splittable = _webdataset_urls(dataset) is not None or callable(getattr(dataset, "shard", None))
    if splittable and (n is None or n >= readers):
        return Split("shards", world, workers), None
    if splittable and n >= world:
        return Split("rank-shards", world, workers), (
            f"dptrain.StreamLoader: {name} has {n} shards for {world} rank(s) x {workers} loader worker(s) = {readers} "
            f"readers, so each rank reads its shards with all its {workers} workers and each keeps 1 batch in "
            f"{workers} (the rank's shards are read {workers} times). Give it at least {readers} shards, or fewer "
            f"workers"
        )
    why = f"it has only {n} shard(s) for {world} ranks" if splittable else "it has no shard(num_shards, index) method"
    if readers == 1:
        return Split("interleave", world, workers), None
    return Split("interleave", world, workers), (
        f"dptrain.StreamLoader: {name} cannot be split without reading ({why}), so each of the {readers} readers "
        f"({world} rank(s) x {workers} loader worker(s)) reads the whole stream and keeps its own samples "
        f"(sample i goes to rank i % {world}). Give the stream a shard(num_shards, index) method, or at least "
        f"{readers} shards"
    )


def start_index(split: Split, rank: int, worker: int, batches: int, batch_size: int) -> int:
    """Where reader ``(rank, worker)``'s batch number ``batches`` starts in its source (module Note)."""
    p, q = split.ranks_per_source, split.workers_per_source
    b = batches * q + (worker if q > 1 else 0)
    return b * batch_size * p + (rank if p > 1 else 0)


def cut(items: int, ends: list[int | None]) -> list[tuple[int, bool]]:
    """Per worker of a rank: (batches it had handed out, whether it did so in the last round) after ``items``.

    A rank's batches come out in rounds: round ``m`` holds batch ``m`` of every worker that
    has one, in worker order (see ``dptrain.data.stream``'s Note "the order of a rank's
    batches"). ``ends[w]`` is worker ``w``'s number of batches where known (None: not ended
    yet, so it has more than any round reached). ``items`` may pass the rank's total: then
    every worker handed out all of its batches.
    """
    workers = len(ends)
    m, left = 0, items
    while True:
        active = [w for w in range(workers) if ends[w] is None or ends[w] > m]
        if not active:
            return [(ends[w], False) for w in range(workers)]
        finite = [ends[w] for w in active if ends[w] is not None]
        if finite and left >= (min(finite) - m) * len(active):
            left -= (min(finite) - m) * len(active)
            m = min(finite)
            continue
        full, rest = divmod(left, len(active))
        m += full
        this_round = set(active[:rest])
        out = []
        for w in range(workers):
            if ends[w] is not None and ends[w] <= m:
                out.append((ends[w], False))  # ended before this round
            else:
                out.append((m + 1, True) if w in this_round else (m, False))
        return out


def _open_at(source: Iterable, start: int) -> Iterator:
    """The source's samples from number ``start`` on: seeking where it can (``iter_from``), else read and dropped."""
    if start == 0:
        return iter(source)
    iter_from = getattr(source, "iter_from", None)
    if callable(iter_from):
        return iter(iter_from(start))
    it = iter(source)
    next(itertools.islice(it, start, start), None)  # read and drop the samples before start
    return it


class Readers(tud.IterableDataset):
    """The dataset the DataLoader's workers iterate: one reader per worker, tagged items (module Notes).

    ``plan`` holds one row per worker (see the ``EPOCH``... column names), written by the
    main process before each iteration; it lives in shared memory when there are workers,
    so persistent workers see each iteration's plan too.
    """

    def __init__(
        self, dataset: Any, split: Split, rank: int, batch_size: int, unbatched: bool, collate_fn: Callable,
        drop_last: bool, plan: torch.Tensor,
    ) -> None:  # fmt: skip
        self.dataset = dataset
        self.split = split
        self.rank = rank
        self.batch_size = batch_size
        self.unbatched = unbatched  # batch_size=None: single samples, as DataLoader(batch_size=None)
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.plan = plan

    def __iter__(self) -> Iterator[tuple]:
        info = tud.get_worker_info()
        worker = info.id if info is not None else 0
        epoch, skip, hole, standin, known_end = (int(v) for v in self.plan[worker].tolist())
        if hole:
            yield (HOLE, worker)
        if known_end >= 0 and skip >= known_end and not standin:
            yield (END, worker, known_end)  # used up at the resumed position: nothing to read
            return
        _set_epoch(self.dataset, epoch)
        source = self.split.source(self.dataset, self.rank, worker)
        if source is not self.dataset:
            _set_epoch(source, epoch)
        first = skip - 1 if standin else skip
        yield from self._batches(source, worker, first, standin)

    def _batches(self, source: Iterable, worker: int, first: int, standin: bool) -> Iterator[tuple]:
        p, q, size = self.split.ranks_per_source, self.split.workers_per_source, self.batch_size
        rank_at = self.rank if p > 1 else 0
        worker_at = worker if q > 1 else 0
        i = start_index(self.split, self.rank, worker, first, size)
        m, batch = first, []
        for sample in _open_at(source, i):
            mine = i % p == rank_at and (q == 1 or ((i // p) // size) % q == worker_at)
            i += 1
            if not mine:
                continue
            batch.append(sample)
            if len(batch) == size:
                yield self._item(STANDIN if standin and m == first else BATCH, worker, m, batch)
                m, batch = m + 1, []
        if batch and not self.drop_last:
            yield self._item(STANDIN if standin and m == first else BATCH, worker, m, batch)
            m += 1
        yield (END, worker, m)

    def _item(self, tag: str, worker: int, m: int, samples: list) -> tuple:
        batch = self.collate_fn(samples[0]) if self.unbatched else self.collate_fn(samples)
        return (tag, worker, m, batch, len(samples))


def _set_epoch(dataset: Any, epoch: int) -> None:
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
