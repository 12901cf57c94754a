"""Streamed data sets (``IterableDataset``) split among ranks and loader workers, in step, resumable.

``prepare_dataloader(stream, batch_size, num_workers=...)`` (or :class:`StreamLoader`
directly) gives this rank its share of a stream that has no indices: a Hugging Face
``datasets`` stream, a webdataset, a generator over files. Each sample is read by exactly one
rank and one loader worker; every rank yields the same number of items per epoch (uneven ends
joined with :class:`ShadowBatch` stand-ins, or dropped); and ``state_dict()`` /
``load_state_dict()`` resume mid-epoch at the same batch, seeking where the stream can.

The protocol a stream may follow (all optional; duck-typed):

- ``shard(num_shards, index)``: the stream of part ``index`` of ``num_shards``, reading
  nothing of the other parts (each sample in exactly one part, every time); and an int
  attribute ``num_shards`` (or ``n_shards``): the most parts it splits into. Hugging Face
  ``datasets.IterableDataset`` has both (its shards are its files), and a webdataset's shard
  list is used the same way. Without it every reader reads the whole stream and keeps its
  own samples (said once).
- ``iter_from(start)``: an iterator over the same stream (this epoch) beginning at its sample
  number ``start`` (from 0), without reading the ones before: a resume seeks with it. The
  parts ``shard()`` returns should have it too. Without it a resume reads and drops each
  reader's consumed samples (said once, with the count). Hugging Face's ``skip(n)`` is no
  seek (it reads the skipped examples too and freezes the shard order of later epochs) and
  its ``state_dict()`` describes one reader's position, which a position shared by all ranks
  cannot rebuild; so a Hugging Face stream and a webdataset resume by reading and dropping.
- ``set_epoch(epoch)``: called by :meth:`StreamLoader.set_epoch` and again in every loader
  worker when an iteration starts, for streams that reshuffle per epoch (Hugging Face's
  ``ds.shuffle(seed=..., buffer_size=...)``).

Give the loader the whole stream: one that already splits itself by rank or worker
(``dptrain.rank()``, ``get_worker_info()``) inside its ``__iter__`` is split twice. A
Hugging Face stream is the exception: it splits itself among the workers in a way no
wrapper can turn off, so dptrain splits it only among the ranks
(``datasets.distributed.split_dataset_by_node``) and counts each worker's part as a reader.

How the readers share a stream: ``dptrain.data._readers``. How a pass keeps the ranks in
step (one all-reduce per batch, looking one batch ahead) and in what order a rank's workers
hand out their batches: ``dptrain.data._lockstep``.

[Note: the position]
``state_dict()`` is the same on every rank at the same step (a checkpoint keeps rank 0's;
in-place recovery sends one rank's to all): the epoch, the items handed out so far (real and
stand-in: the same count everywhere) and, for each reader that has ended, its number of
batches (every rank learns those in the per-step all-reduce, see ``_lockstep``'s Note "equal
steps"). From these each rank works out how many batches each of its workers had handed out
(the rounds of ``_lockstep``'s Note "the order of a rank's batches") and where in its source
that worker's next batch starts, and each worker starts there: ``iter_from`` where the source
has it, else reading and dropping. A rank whose share was used up at the saved step reads
its last batch again to stand in. The loop's count, not the workers' (which fetch ahead), is
the position.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.data as tud

from dptrain import comm
from dptrain.runtime import env
from dptrain.data import _readers
from dptrain.data._lockstep import Pass, ShadowBatch, StreamIterator
from dptrain.data._seeds import derive_seed

__all__ = ["ShadowBatch", "StreamLoader", "shard_stream_loader"]

_STATE_VERSION = 1


def _pass_through(item: Any) -> Any:
    """The DataLoader's collate function: the readers collate, the loader passes their items on."""
    return item


class StreamLoader(tud.DataLoader):
    """A DataLoader that gives this rank its share of a stream (an ``IterableDataset``), in step and resumable.

    Usually built by :func:`dptrain.prepare_dataloader` when its data set is an
    ``IterableDataset``. Each sample goes to exactly one rank and one loader worker (the
    module docstring says how, and what the stream may offer to make it cheaper); every rank
    yields the same number of items per epoch; ``state_dict()`` is the position as the loop
    saw it, the same on every rank.

    Args:
        dataset: the whole stream (``torch.utils.data.IterableDataset``; a Hugging Face
            ``datasets.IterableDataset`` and a webdataset pipeline are ones).
        batch_size: samples per batch on this rank; ``None`` yields single samples. Default 1.
        num_workers: DataLoader worker processes; each is a reader. Default 0.
        drop_last: drop each reader's incomplete last batch. Default False.
        uneven: ``"join"`` (default): a rank whose share ran out yields :class:`ShadowBatch`
            items until every rank is done; ``"drop"``: every rank stops as soon as one runs
            out (the left-over batches are said once, from rank 0).
        mode: ``"train"`` (default) keeps the ranks in step; ``"eval"``: each rank yields
            exactly its share, no stand-ins, no per-step collective (combine the outputs
            with :func:`dptrain.gather_results` or your own gather).
        seed: seeds the workers with the rank and the epoch (``dptrain.data.loader``'s Note
            "worker seeds"). Default 0.
        num_replicas, rank: the world to split for. Default: the current process group.
            Without a process group (both given explicitly, in one process) the ranks cannot
            agree: each loader yields its own share and stops.
        collate_fn: merges a batch's samples. Default: PyTorch's default collate
            (``default_convert`` for single samples).
        pin_memory, persistent_workers, **kwargs: as ``DataLoader`` (``timeout``,
            ``worker_init_fn``, ``prefetch_factor``, ``multiprocessing_context``, ...).

    Raises:
        TypeError: ``dataset`` is not an ``IterableDataset``.
        ValueError: a bad ``uneven``, ``mode`` or ``batch_size``; ``sampler``,
            ``batch_sampler``, ``shuffle`` or ``in_order=False`` given; ``num_replicas`` or
            ``rank`` differing from the process group's; a ``rank`` outside the world; a
            Hugging Face stream already split by node.

    Example:
        >>> loader = dptrain.prepare_dataloader(stream, batch_size=32, num_workers=2)
        >>> for epoch in range(epochs):
        ...     loader.set_epoch(epoch)
        ...     for batch in loader:
        ...         if isinstance(batch, dptrain.data.ShadowBatch):
        ...             ...  # this rank's share is used up: run batch.batch with a zero loss weight
        ...     torch.save({"data": loader.state_dict()}, path)
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        num_workers: int = 0,
        drop_last: bool = False,
        uneven: str = "join",
        mode: str = "train",
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, tud.IterableDataset):
            raise TypeError(f"StreamLoader reads an IterableDataset, got {type(dataset).__name__}; for a map-style "
                            f"data set use dptrain.prepare_dataloader (or dptrain.DistributedDataLoader)")
        if uneven not in ("join", "drop"):
            raise ValueError(f"uneven must be 'join' or 'drop', got {uneven!r}")
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        for bad in ("sampler", "batch_sampler", "shuffle"):
            if bad in kwargs:
                raise ValueError(f"a stream has no indices to sample or shuffle; drop {bad}= (shuffle inside the "
                                 f"stream, e.g. Hugging Face's ds.shuffle(seed=..., buffer_size=...))")
        if kwargs.get("in_order", True) is False:
            raise ValueError("in_order=False lets batches come out of order, and the stream's position would be wrong; "
                             "drop in_order=False")
        world, rank = self._world(num_replicas, rank)
        self.stream = dataset  # the user's stream (``.dataset`` is the readers wrapped around it)
        self.world_size = world
        self.rank = rank
        self.mode = mode
        self.uneven = uneven
        self.seed = seed
        self.epoch = 0
        self._workers = max(num_workers, 1)
        self._split, notice = _readers.plan_split(dataset, world, self._workers)
        if notice:
            env._warn_once_main(notice)
        self._plan = torch.zeros((self._workers, _readers.PLAN_COLUMNS), dtype=torch.int64)
        if num_workers > 0:
            self._plan.share_memory_()  # persistent workers read each iteration's plan from here
        if collate_fn is None:
            collate_fn = tud.default_convert if batch_size is None else tud.default_collate
        readers = _readers.Readers(dataset, self._split, rank, batch_size or 1, batch_size is None, collate_fn,
                                   drop_last, self._plan)
        super().__init__(readers, batch_size=None, collate_fn=_pass_through, num_workers=num_workers,
                         pin_memory=pin_memory, persistent_workers=persistent_workers, **kwargs)
        # DataLoader forbids setting these after its __init__; they describe this loader's batches
        # (the DataLoader itself batches nothing: the readers do).
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "drop_last", drop_last)
        self._iterator_now: StreamIterator | None = None
        self._resume: tuple[int, dict[int, int], bool] | None = None
        self._said: set[str] = set()
        self._lengths: list[int] | None | bool = False  # False: not worked out yet

    @staticmethod
    def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
        if num_replicas is None or rank is None:
            env.check_joined("dptrain.StreamLoader", "(or pass num_replicas= and rank= explicitly)")
            world = env.get_world()
            num_replicas = world.world_size if num_replicas is None else num_replicas
            rank = world.rank if rank is None else rank
        num_replicas, rank = int(num_replicas), int(rank)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank}")
        if comm.is_distributed():
            size, mine = torch.distributed.get_world_size(), torch.distributed.get_rank()
            if (num_replicas, rank) != (size, mine):
                raise ValueError(
                    f"rank {mine}: num_replicas={num_replicas}, rank={rank} but this is rank {mine} of a process "
                    f"group of {size}; a stream loader keeps the ranks of the process group in step, so build it on "
                    f"every rank without num_replicas/rank"
                )
        return num_replicas, rank

    def _synced(self) -> bool:
        """Whether the ranks agree on every step (training on a process group of more than one rank)."""
        return self.mode == "train" and self.world_size > 1 and comm.is_distributed()

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> StreamIterator:
        # [Note: no reference cycle] The iteration holds a Pass, not this loader: a cycle
        # loader <-> iterator would leave an abandoned pass (and its worker processes) to the
        # garbage collector, which may run it in a worker forked later, where torch's clean-up
        # of those workers fails ("can only test a child process").
        if self._iterator_now is not None:
            self._iterator_now.close()  # a pass left unfinished: its workers stop before new ones start
        items, ends, done = self._resume if self._resume is not None else (0, {}, False)
        self._resume = None
        run = Pass(self.rank, self._workers, self.world_size, self.uneven, self.epoch, self._synced(), self._said)
        if done:
            self._iterator_now = StreamIterator(run, None, items, ends, True)
            return self._iterator_now
        if items:
            self._say_reading(items, ends)
        rows = self._rank_plan(self.rank, items, ends)
        for worker, row in enumerate(rows):
            self._plan[worker] = torch.tensor(row, dtype=torch.int64)
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, self.rank, self.epoch))
        self.generator = g
        self._iterator_now = StreamIterator(run, super().__iter__(), items, ends, False)
        return self._iterator_now

    @property
    def is_last(self) -> bool:
        """Whether the item the current iteration handed out last is the epoch's last on every rank.

        The same as ``iterator.is_last`` of the iterator a ``for`` loop holds.
        """
        return self._iterator_now is not None and self._iterator_now.is_last

    def _rank_plan(self, rank: int, items: int, ends: dict[int, int]) -> list[list[int]]:
        """Each worker's plan row for ``rank`` at position ``items`` (module Note "the position")."""
        w_all = self._workers
        known = [ends.get(rank * w_all + w) for w in range(w_all)]
        done = _readers.cut(items, known)
        rows = [[self.epoch, d, int(in_round), 0, -1 if n is None else n] for (d, in_round), n in zip(done, known)]
        used_up = all(n is not None and d == n for (d, _), n in zip(done, known))
        if items and used_up and any(known):
            # This rank's share is used up: its last batch (the last of the last round) is read
            # again, only to stand in while the other ranks finish the epoch.
            last = max((n - 1, w) for w, n in enumerate(known) if n)[1]
            rows[last][_readers.STAND_IN] = 1
        return rows

    def _say_reading(self, items: int, ends: dict[int, int]) -> None:
        """Say once (rank 0) how much a resume reads again where the stream cannot seek."""
        seekable = (self._split.kind != "datasets" and _readers._webdataset_urls(self.stream) is None
                    and callable(getattr(self.stream, "iter_from", None)))
        if seekable:
            return
        if "reading" in self._said or not env.is_main_process():  # rank 0 counts for every rank
            return
        total = most = 0
        for rank in range(self.world_size):
            for worker, row in enumerate(self._rank_plan(rank, items, ends)):
                skip = row[_readers.SKIP] - row[_readers.STAND_IN]
                if 0 <= row[_readers.KNOWN_END] <= row[_readers.SKIP] and not row[_readers.STAND_IN]:
                    continue
                n = _readers.start_index(self._split, rank, worker, skip, self.batch_size or 1)
                total, most = total + n, max(most, n)
        if total:
            self._said.add("reading")
            env._warn_once_main(
                f"dptrain.StreamLoader: resuming epoch {self.epoch} after {items} steps: {type(self.stream).__name__} "
                f"cannot seek (it has no iter_from(start)), so its readers read and drop {total} samples they had "
                f"already passed (at most {most} for one reader). Give the stream iter_from(start) to resume without "
                f"reading them",
            )

    # -- epochs, position, length ---------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: calls the stream's ``set_epoch`` (if any) and resets the position.

        A position restored by :meth:`load_state_dict` for the same epoch is kept. Worker
        seeds follow ``(seed, rank, epoch)``.
        """
        epoch = int(epoch)
        if self._resume is not None and epoch != self.epoch:
            self._resume = None
        if epoch != self.epoch:
            self._iterator_now = None
        self.epoch = epoch
        set_epoch = getattr(self.stream, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch as the loop saw it; the same dict on every rank at the same step.

        Plain ints and lists (``torch.save``-able): ``epoch``, ``items`` (items handed out in
        the epoch, stand-ins included), ``done`` (the epoch ended), ``ends`` (``[reader,
        batches]`` of the readers that ended), and what a load checks: ``batch_size``,
        ``world_size``, ``num_workers``, ``split``.
        """
        it = self._iterator_now
        if it is not None:
            items, ends, done = it.items, it.ends, it.finished
        elif self._resume is not None:
            items, ends, done = self._resume
        else:
            items, ends, done = 0, {}, False
        return {
            "stream_state": _STATE_VERSION,
            "epoch": self.epoch,
            "items": items,
            "done": done,
            "ends": [[q, n] for q, n in sorted(ends.items())],
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "num_workers": self._workers,
            "split": self._split.kind,
            "uneven": self.uneven,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` at the next iteration of its epoch.

        The next ``iter()`` yields the rest of the saved epoch: the same batches in the same
        order as the run that saved it, on every rank and worker. ``set_epoch`` with the
        saved epoch keeps the position; another epoch discards it.

        Raises:
            ValueError: not a stream loader's state; or it was saved with another batch size,
                number of ranks, of loader workers or way of splitting (the readers' shares
                would differ); the message shows both.
        """
        if not isinstance(state, dict) or state.get("stream_state") != _STATE_VERSION:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a StreamLoader state (got {keys}); pass what StreamLoader.state_dict() returned")
        mine = {"batch_size": self.batch_size, "world_size": self.world_size, "num_workers": self._workers,
                "split": self._split.kind}
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            shown = ", ".join(f"{k} {old!r} then, {new!r} now" for k, (old, new) in differ.items())
            raise ValueError(
                f"this stream position was saved by a loader that split the stream otherwise ({shown}); a stream "
                f"resumes exactly only with the same batch size, ranks and loader workers (max(num_workers, 1)). "
                f"Build the loader as it was, or start the epoch over (skip load_state_dict)"
            )
        self.epoch = int(state["epoch"])
        self._resume = (int(state["items"]), {int(q): int(n) for q, n in state["ends"]}, bool(state["done"]))
        self._iterator_now = None

    def _batches_per_rank(self) -> list[int] | None:
        """Every rank's number of batches per epoch where the stream's length tells it, else None."""
        if self._lengths is not False:
            return self._lengths
        size, split = self.batch_size or 1, self._split

        def batches(n: int) -> int:
            return n // size if self.drop_last else -(-n // size)

        try:
            if split.kind == "interleave":
                n = len(self.stream)
                out = [batches(len(range(r, n, self.world_size))) for r in range(self.world_size)]
            elif split.kind == "rank-shards":
                out = [batches(len(split.source(self.stream, r, 0))) for r in range(self.world_size)]
            elif split.kind == "shards":
                out = [sum(batches(len(split.source(self.stream, r, w))) for w in range(self._workers))
                       for r in range(self.world_size)]
            else:
                out = None  # a Hugging Face stream splits itself among the workers: no count per reader
        except TypeError:
            out = None
        self._lengths = out
        return out

    @property
    def has_length(self) -> bool:
        """Whether ``len(loader)`` is known before the epoch is read (the stream has ``__len__``)."""
        return self._batches_per_rank() is not None

    def __len__(self) -> int:
        """Items every rank yields per epoch (the whole epoch, not what a resume leaves).

        Raises:
            TypeError: the stream has no length; check :attr:`has_length` first.
        """
        counts = self._batches_per_rank()
        if counts is None:
            raise TypeError(
                f"dptrain.StreamLoader: the stream ({type(self.stream).__name__}) has no length, so the number of "
                f"batches per epoch is known only when the epoch ends; check loader.has_length, or count steps "
                f"(max_steps) instead of epochs"
            )
        if not self._synced():
            return counts[self.rank]
        if self.uneven == "drop" or min(counts) == 0:
            return min(counts)
        return max(counts)


def shard_stream_loader(loader: tud.DataLoader, *, uneven: str = "join", seed: int = 0, **kwargs: Any) -> StreamLoader:
    """Rebuild a plain ``DataLoader`` over an ``IterableDataset`` as a :class:`StreamLoader` for this rank.

    Keeps its batch size, ``drop_last``, collate function, workers, pinning, timeout,
    ``worker_init_fn``, multiprocessing context, persistent workers and prefetch factor. A
    :class:`StreamLoader` is returned as it is.

    Args:
        loader: ``DataLoader(iterable_dataset, batch_size=..., num_workers=...)``.
        uneven: see :class:`StreamLoader`. Default ``"join"``.
        seed: worker seeds. Default 0.
        **kwargs: more :class:`StreamLoader` arguments (``mode``, ``num_replicas``, ``rank``).

    Raises:
        TypeError: ``loader`` is not a DataLoader over an ``IterableDataset``.

    Example:
        >>> loader = shard_stream_loader(DataLoader(stream, batch_size=32, num_workers=2))
    """
    if isinstance(loader, StreamLoader):
        return loader
    if not isinstance(loader, tud.DataLoader) or not isinstance(loader.dataset, tud.IterableDataset):
        got = type(loader.dataset).__name__ if isinstance(loader, tud.DataLoader) else type(loader).__name__
        raise TypeError(f"shard_stream_loader rebuilds a DataLoader over an IterableDataset, got {got}")
    carried = {k: getattr(loader, k) for k in ("timeout", "worker_init_fn", "pin_memory_device") if hasattr(loader, k)}
    if carried.get("pin_memory_device") == "":
        carried.pop("pin_memory_device")  # the default; newer torch warns when it is passed at all
    if loader.num_workers > 0:
        carried.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                       multiprocessing_context=loader.multiprocessing_context)
    return StreamLoader(
        loader.dataset, loader.batch_size, num_workers=loader.num_workers, drop_last=loader.drop_last, uneven=uneven,
        seed=seed, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, **carried, **kwargs,
    )  # fmt: skip
