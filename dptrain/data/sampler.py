"""DistributedSampler: PyTorch's index order, plus a resumable mid-epoch position.

Every rank reads the same global order for an epoch and takes every ``num_replicas``-th
position of it, starting at its rank -- exactly the arithmetic of
``torch.utils.data.DistributedSampler``, so a run switched to dptrain sees the same samples
in the same order. On top of that the sampler knows how far this rank got through the
epoch, so a job can stop mid-epoch and continue -- on the same or on a different number of
ranks -- without repeating or skipping samples.

[Note: the global order of an epoch]
``base`` is ``torch.randperm(len(dataset))`` from a generator seeded with ``seed + epoch``
(``shuffle=True``), ``range(len(dataset))`` (``shuffle=False``), or a keyed bijection of
``[0, len(dataset))`` (``shuffle="lazy"``, see ``dptrain.data.order``). It is then made
divisible by the world size W:

- ``pad=True, drop_last=False`` (PyTorch's default): ``base`` is extended by repeating it
  from its start (several times over when the dataset is smaller than W) up to
  ``ceil(n / W) * W`` entries.
- ``drop_last=True``: the tail is cut to ``floor(n / W) * W`` entries.
- ``pad=False`` (exact evaluation): left as it is; ranks get ``ceil((n - r) / W)``
  samples, which differ by at most one, and no sample is repeated.

Rank r takes positions r, r + W, r + 2W, ... of that order. As in PyTorch, an empty
dataset, or ``drop_last=True`` with fewer samples than ranks, gives every rank an empty
shard (``len() == 0``, the iteration yields nothing); so does ``pad=False`` for the ranks
beyond the end of a dataset smaller than the world.

[Note: memory]
No Python list of the epoch is built. With ``shuffle=True`` the permutation exists as one
tensor (int32 below 2**31 samples) while this rank's share is read out of it; then only
the share is kept (a tensor of ``len(dataset) / W`` entries), and its Python ints are made
a chunk at a time as the loader asks. ``shuffle=False`` and ``shuffle="lazy"`` hold nothing
the size of the data set: the index at a position is computed when it is read. A resume
keeps the rest of the epoch as a range plus the positions where ranks stopped unevenly
(``dptrain.data.order``), not as the materialized order.

[Note: what counts as consumed]
The position saved by ``state_dict()`` is ``consumed``, the number of this rank's samples
used so far in the epoch. Who counts depends on how the sampler is driven:

- A plain ``DataLoader(dataset, batch_size=b, sampler=sampler)`` (PyTorch's tutorial
  pattern): the sampler counts every index it yields (``count_yields=True``, the
  default). With ``num_workers=0`` the DataLoader draws a batch's indices just before it
  builds that batch, so after j batches ``consumed == j * b``: exact. With workers the
  DataLoader sends indices to the workers ahead of the loop (``prefetch_factor *
  num_workers`` batches), and they count when sent: a state saved then is ahead of what
  the loop has seen, and a resume skips those fetched-but-unused samples for the rest of
  that epoch.
- :func:`dptrain.prepare_dataloader`: its loader turns the sampler's own counting off
  (``count_yields=False``) and calls :meth:`DistributedSampler.advance` for each batch it
  hands to the loop, so the count is exact with any number of workers. Use it (or
  ``count_yields=False`` and your own ``advance`` calls) when you load with workers and
  resume mid-epoch.

[Note: resuming, and the rule for a different world size]
A rank's state records the epoch, the seed and ``consumed`` (see the Note above).
Consumed samples of rank r are positions r, r + W, ..., r + (consumed - 1) W.

- Same world size: rank r skips its first ``consumed`` samples and continues with exactly
  the samples it would have seen next (padding repeats included), so the resumed part
  concatenated to the part before the stop is the uninterrupted epoch.
- Different world size W': the *remainder* of the epoch is the global order with the
  consumed positions removed, then with every sample that was already consumed or already
  appears earlier in the remainder removed (padding repeats are dropped, never shown twice
  because of the resume). The remainder R is then arranged for W' ranks as a fresh epoch
  would be: ``pad=True`` repeats R from its start up to a multiple of W' (at most W' - 1
  repeats, needed so every rank runs the same number of steps); ``drop_last=True`` cuts R
  to a multiple of W' (at most W' - 1 unseen samples are left for the next epoch);
  ``pad=False`` leaves it uneven. Rank r' takes positions r', r' + W', ... of R.
  So every sample of the epoch not yet consumed is seen exactly once after the resume,
  apart from those at most W' - 1 padding repeats (or cuts with ``drop_last``).
- Resuming again (to yet another size) applies the same rule to the remainder; the state
  keeps the chain in ``history``.

Which counts: a single rank's state stands for every rank -- under DDP every rank takes
one batch per step from shards of equal length, so all counts are equal. When counts may
differ (ranks that stopped at different points, ``pad=False`` shards), gather every rank's
state and merge them: ``DistributedSampler.merge_states(comm.all_gather_object(s.state_dict()))``.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.utils.data

from dptrain.runtime import env
from dptrain.data.order import (Segment, Shard, arranged_size, index_dtype, keyed_permutation, materialize,
                                remainder, shard)

__all__ = ["DistributedSampler"]

_STATE_VERSION = 1
# Keys a sampler state must carry; a merged state has a list for "consumed" and rank None.
_STATE_KEYS = ("version", "epoch", "seed", "shuffle", "drop_last", "pad", "dataset_len",
               "num_replicas", "rank", "consumed", "history")


def _default_world() -> tuple[int, int]:
    # A process group created with torch.distributed directly (without dptrain.init) is the
    # world a torch script expects the sampler to see.
    if not env.is_initialized() and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    # Sharding by the launcher's RANK and WORLD_SIZE while DDP, finding no process group,
    # trains each rank alone would end the ranks with different weights: refuse instead.
    env.check_joined("dptrain.DistributedSampler", "(or pass num_replicas= and rank= explicitly)")
    world = env.get_world()
    return world.world_size, world.rank


def _as_int(name: str, value: Any, fix: str) -> int:
    # Whatever works as a list index works, as in torch's sampler, which slices with the rank:
    # numpy integers and one-element integer tensors. A bool is refused although torch takes
    # it: ``rank=dptrain.is_main_process()`` would silently give ranks the wrong shards.
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}); {fix}")


def _dataset_len(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(
            f"DistributedSampler needs a dataset with len(); got {type(dataset).__name__}, which has none "
            "(an IterableDataset must shard itself, e.g. by torch.utils.data.get_worker_info() and dptrain.rank())"
        ) from None


def _shard_len(total: int, world: int, rank: int) -> int:
    return len(range(rank, total, world))


class DistributedSampler(torch.utils.data.DistributedSampler):
    """Restrict a DataLoader to this rank's part of the dataset, as PyTorch does, resumably.

    For every combination of arguments (``pad=True``) this yields the same indices, and has
    the same ``len()``, as ``torch.utils.data.DistributedSampler``. It is a subclass of it,
    so code that checks ``isinstance(sampler, DistributedSampler)`` keeps working. In
    addition it can save and restore its position in the epoch (:meth:`state_dict`), also
    onto a different number of ranks, and ``pad=False`` gives the exact-evaluation
    partition: uneven shards in which every sample appears exactly once.

    The position counts the indices this sampler has yielded: exact under a plain
    ``DataLoader`` with ``num_workers=0``; with workers it runs ahead of the loop by the
    batches they prefetched, and :func:`dptrain.prepare_dataloader` (which counts handed-out
    batches instead) gives the exact position. The rules (global order, padding, what is
    counted, what a resume on another world size sees) are in the module's Notes,
    ``dptrain.data.sampler``.

    Args:
        dataset: a map-style dataset (anything with ``len()``), of constant size.
        num_replicas: number of ranks sharing the dataset. Default: the current world size
            (``dptrain.world_size()``; 1 in a single process without a process group).
            Under a launcher the defaults need the process group of ``dptrain.init()``;
            given explicitly, ``num_replicas`` and ``rank`` need none (as in PyTorch).
        rank: this rank, ``0 <= rank < num_replicas``; any integer type (a numpy integer,
            a one-element integer tensor) is accepted. Default: ``dptrain.rank()``.
        shuffle: ``True``: PyTorch's shuffle, ``torch.randperm`` seeded by ``seed + epoch``
            (built once per epoch as a tensor, of which this rank keeps only its share).
            ``False``: dataset order. ``"lazy"``: a different shuffle whose cost does not
            grow with the data set -- a bijection of ``[0, len(dataset))`` keyed by
            ``(seed, epoch)``, computed index by index as the loader reads, so an epoch of
            10^9 samples starts at once in O(1) memory. It is *not* PyTorch's order (the
            same seed gives other batches than ``shuffle=True``), but it has the same
            padding, ``drop_last``, resume and evaluation rules, and every sample still
            comes exactly once per epoch across the ranks. Default True.
        seed: shuffling seed; must be the same on every rank. Default 0.
        drop_last: cut the tail so every rank gets ``floor(n / num_replicas)`` samples,
            instead of padding by repeats. Default False.
        pad: with ``drop_last=False``, repeat samples so that every rank gets
            ``ceil(n / num_replicas)`` (PyTorch's behaviour, needed for lockstep DDP
            training). ``pad=False`` gives ranks ``ceil((n - rank) / num_replicas)``
            samples with no repeats -- use it for evaluation with
            :func:`dptrain.gather_results`. Default True.
        count_yields: count every yielded index as consumed (see above). ``False`` leaves
            the counting to :meth:`advance`; the loader of :func:`dptrain.prepare_dataloader`
            sets that itself. Default True.

    Raises:
        ValueError: ``num_replicas < 1``; ``rank`` outside ``[0, num_replicas)``;
            ``pad=False`` together with ``drop_last=True``; ``shuffle`` a string other
            than ``"lazy"``.
        RuntimeError: ``num_replicas`` or ``rank`` left to its default while the launcher
            says the world is larger and no process group exists (``dptrain.init()`` not
            called): every rank would shard while training alone.
        TypeError: ``num_replicas`` or ``rank`` is not an integer (a float, a string, a
            bool); the dataset has no ``len()``.

    Example:
        >>> sampler = dptrain.DistributedSampler(dataset, shuffle=True, seed=0)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)   # num_workers=0
        >>> if resuming:
        ...     sampler.load_state_dict(ckpt["sampler"])
        >>> for epoch in range(start_epoch, epochs):
        ...     sampler.set_epoch(epoch)   # the restored epoch keeps the restored position
        ...     for batch in loader:
        ...         ...
        ...         ckpt["sampler"] = sampler.state_dict()   # counts the batches drawn so far
    """

    # torch's __init__ is not called: it would ask torch.distributed for defaults (and fail
    # without a process group) and it knows nothing of ``pad``; every attribute it sets is
    # set here with the same name and meaning.
    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool | str = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        *,
        count_yields: bool = True,
    ) -> None:
        if num_replicas is None or rank is None:
            default_world, default_rank = _default_world()
            num_replicas = default_world if num_replicas is None else num_replicas
            rank = default_rank if rank is None else rank
        num_replicas = _as_int("num_replicas", num_replicas, "pass the number of ranks")
        rank = _as_int("rank", rank, "pass rank=dptrain.rank() (or leave rank=None)")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}; pass the number of ranks")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank {rank!r} is outside [0, {num_replicas - 1}] for num_replicas={num_replicas}; "
                f"pass rank=dptrain.rank() (or leave rank=None)"
            )
        if isinstance(shuffle, str) and shuffle != "lazy":
            raise ValueError(
                f"shuffle must be True, False or \"lazy\", got {shuffle!r}; use shuffle=True for PyTorch's order "
                f"or shuffle=\"lazy\" for an order computed index by index (no per-epoch cost in the data set's size)"
            )
        if pad is False and drop_last:
            raise ValueError(
                "pad=False (uneven shards, no repeats) and drop_last=True (cut the tail) contradict each "
                "other; use pad=False for exact evaluation or drop_last=True for training"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.count_yields = count_yields  # False: only advance() moves the position
        self._sizes()
        self._history: list[tuple[int, list[int]]] = []  # earlier segments of this epoch
        self._consumed = 0  # samples of the current segment handed out on this rank
        self._resume_pending = False  # the next __iter__ continues from _history/_consumed
        self._prepared: Shard | None = None  # indices handed to the next __iter__
        self._current: Shard | None = None  # what the running iteration yields
        self._iteration = 0  # numbers iterations; a replaced one no longer counts its yields
        self._shard_cache: tuple[Any, Shard] | None = None  # this rank's share of one segment
        self._epoch_set = False  # set_epoch was called since the last pass started
        self._warned_repeat = False  # the repeated-order warning was given (once per sampler)

    def _sizes(self) -> None:
        """``num_samples`` and ``total_size`` of a fresh epoch, as PyTorch's sampler has them."""
        n = _dataset_len(self.dataset)
        if self.pad:
            self.num_samples = (n // self.num_replicas) if self.drop_last else math.ceil(n / self.num_replicas)
            self.total_size = self.num_samples * self.num_replicas
        else:
            self.num_samples = _shard_len(n, self.num_replicas, self.rank)
            self.total_size = n

    def _move(self, num_replicas: int, rank: int) -> dict[str, Any]:
        """In-place recovery went on without a node: this sampler now serves ``rank`` of
        ``num_replicas``. Returns the position before the move; loading it (:meth:`load_state_dict`)
        shares the rest of the epoch out among the new ranks (see [Note: resuming, and the rule
        for a different world size]). The caller loads the position every rank agrees on."""
        before = self.state_dict()
        self.num_replicas, self.rank = num_replicas, rank
        self._sizes()
        self._history, self._consumed = [], 0
        self._resume_pending, self._prepared, self._current, self._shard_cache = False, None, None, None
        self._iteration += 1  # an iteration still running no longer counts its yields
        return before

    # ---- the order --------------------------------------------------------------------

    def _order(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Base position -> dataset index for this epoch (see ``dptrain.data.order``)."""
        n, seed, epoch = len(self.dataset), self.seed, self.epoch
        if self.shuffle == "lazy":
            return lambda pos: keyed_permutation(pos, n, seed, epoch)
        if not self.shuffle:
            return lambda pos: pos
        g = torch.Generator()
        g.manual_seed(seed + epoch)  # PyTorch's choice: one stream per (seed + epoch)
        # As a tensor (int32 where it fits: randperm draws the same values for either dtype),
        # never as a list: 4-8 bytes an index instead of ~36.
        perm = torch.randperm(n, generator=g, dtype=index_dtype(n))
        return lambda pos: perm[pos]

    def _segment(self, history: Sequence[tuple[int, Sequence[int]]]) -> Segment:
        """The base positions of the segment that follows ``history`` (the whole epoch if none)."""
        seg = Segment(torch.zeros(0, dtype=torch.int64), 0, len(self.dataset))
        for world, consumed in history:
            seg = remainder(seg, world, consumed, self.drop_last, self.pad)
        return seg

    def _shard(self, history: Sequence[tuple[int, Sequence[int]]]) -> Shard:
        """This rank's whole share of the segment after ``history``, for this world size."""
        key = (len(self.dataset), self.seed, self.epoch, self.shuffle, self.drop_last, self.pad,
               self.num_replicas, self.rank, tuple((w, tuple(c)) for w, c in history))
        if self._shard_cache is not None and self._shard_cache[0] == key:
            return self._shard_cache[1]
        self._shard_cache = None  # let the last share go before the next is built
        share = shard(self._segment(history), self.num_replicas, self.rank, self.drop_last, self.pad, self._order())
        if self.shuffle and self.shuffle != "lazy":
            # PyTorch's order: read this rank's share out of the permutation once; the
            # permutation is dropped with the lazy share when this returns.
            share = materialize(share, index_dtype(len(self.dataset)))
        self._shard_cache = (key, share)
        return share

    def _start_iteration(self) -> Shard:
        """Enter the next iteration: the resumed remainder once after a load, else the epoch."""
        self._iteration += 1
        if self._resume_pending:
            self._resume_pending = False
            skip = self._consumed
        else:
            self._warn_if_repeated()
            self._history, self._consumed, skip = [], 0, 0
        self._epoch_set = False
        self._current = None
        self._current = self._shard(self._history)[skip:]
        return self._current

    def _warn_if_repeated(self) -> None:
        """Warn once, from rank 0, when a fresh pass would repeat the last pass's shuffled order.

        That is a pass of this epoch that handed out samples (what ``_consumed`` or a resume
        chain still records: set_epoch with another epoch and every fresh pass reset them),
        and no set_epoch call since -- or a set_epoch call that kept the epoch of a pass the loop
        took to its end (``set_epoch(0)`` every epoch). A set_epoch call after a pass left
        unfinished (a look at the first batch, the Trainer re-entering a stopped epoch) is the
        loop keeping its epochs, and does not warn. Without shuffling, or in the
        exact-evaluation partition (``pad=False``), the order does not matter.
        """
        if self._warned_repeat or not (self.shuffle and self.pad):
            return
        if self._consumed == 0 and not self._history:
            return
        if self._epoch_set and self._consumed < self._segment_len(self.rank):
            return
        self._warned_repeat = True
        env._warn_once_main(
            f"DistributedSampler: a new pass over the data starts in epoch {self.epoch} again, so it repeats the "
            f"previous pass's shuffled order; call sampler.set_epoch(epoch) (or loader.set_epoch(epoch)) at the "
            f"start of each epoch: for epoch in range(epochs): sampler.set_epoch(epoch); for batch in loader: ..."
        )

    def __iter__(self) -> Iterator[int]:
        indices = self._prepared if self._prepared is not None else self._start_iteration()
        self._prepared = None
        if not self.count_yields:
            return iter(indices)
        return self._yield_counted(indices, self._iteration)

    def _yield_counted(self, indices: Shard, iteration: int) -> Iterator[int]:
        for index in indices:
            # Counted before it is handed over, so a state saved after k items says k. After
            # set_epoch, load_state_dict or a newer iteration, this one no longer owns the count.
            if iteration == self._iteration:
                self._consumed += 1
            yield index

    def __len__(self) -> int:
        """Samples the current (or next) iteration yields on this rank.

        ``num_samples`` normally; after :meth:`load_state_dict`, the rest of the resumed
        epoch, until the next :meth:`set_epoch` or the iteration after the resumed one.
        """
        if self._prepared is not None:
            return len(self._prepared)
        if self._resume_pending:
            return self._segment_len(self.rank) - self._consumed
        if self._current is not None and (self._history or len(self._current) != self.num_samples):
            return len(self._current)
        return self.num_samples

    def _segment_len(self, rank: int, history=None, world: int | None = None) -> int:
        history = self._history if history is None else history
        world = self.num_replicas if world is None else world
        return _shard_len(arranged_size(len(self._segment(history)), world, self.drop_last, self.pad), world, rank)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the shuffle (``seed + epoch``).

        Call it before each epoch, as with PyTorch's sampler. Setting a different epoch
        discards a position restored by :meth:`load_state_dict`; setting the restored
        epoch again keeps it, so ``load_state_dict(s); set_epoch(s["epoch"])`` resumes.
        A shuffling sampler that starts another pass of an epoch without a ``set_epoch``
        call since its last pass handed out samples, or after ``set_epoch`` with the epoch of
        a pass that ran to its end, warns once (from rank 0): every epoch would see the same
        order.

        Args:
            epoch: the epoch number.
        """
        if epoch != self.epoch:
            self._iteration += 1
            self._history, self._consumed = [], 0
            self._resume_pending = False
            self._prepared = None
            self._current = None
        self.epoch = epoch
        self._epoch_set = True

    def indices(self) -> Shard:
        """The dataset indices the current (or next) iteration yields on this rank, in order.

        Unlike ``list(sampler)`` this does not start an iteration (which would discard a
        restored position). The result is a read-only sequence of Python ints that is
        computed as it is read rather than held as a list: it compares equal to the list of
        the same indices, and ``torch.as_tensor``, ``np.asarray`` and ``.tolist()`` convert
        it. Use it to pair evaluation outputs with their samples::

            preds = torch.cat([model(x) for x, _ in loader])
            dptrain.gather_results(preds, loader.sampler.indices())
        """
        if self._prepared is not None:
            return self._prepared
        if self._resume_pending:
            return self._shard(self._history)[self._consumed :]
        if self._current is not None:
            return self._current
        return self._shard([])

    # ---- the position -----------------------------------------------------------------

    def advance(self, num_samples: int) -> None:
        """Record that ``num_samples`` more samples of this rank were handed to the loop.

        Only for a sampler built with ``count_yields=False``: the loader from
        :func:`dptrain.prepare_dataloader` calls this for every batch it yields. Call it
        yourself when you drive such a sampler with your own DataLoader and workers, and
        want the position to count what reached your loop rather than what the workers
        fetched.

        Raises:
            RuntimeError: the sampler counts its yields itself (``count_yields=True``).
            ValueError: ``num_samples`` is negative or goes past the end of this rank's part.

        Example:
            >>> sampler = dptrain.DistributedSampler(dataset, count_yields=False)
            >>> for x, y in DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4):
            ...     ...
            ...     sampler.advance(len(x))
        """
        if self.count_yields:
            raise RuntimeError(
                f"rank {self.rank}: advance() on a sampler that counts the indices it yields itself would count "
                f"them twice; drop the advance() calls, or build it with DistributedSampler(..., count_yields=False)"
            )
        limit = self._segment_len(self.rank)
        if num_samples < 0 or self._consumed + num_samples > limit:
            raise ValueError(
                f"rank {self.rank}: advance({num_samples}) after {self._consumed} consumed samples goes outside "
                f"this rank's {limit} samples of epoch {self.epoch}; count each yielded sample once"
            )
        self._consumed += num_samples

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: epoch, seed, consumed samples, and the resume chain.

        The values are plain ints, bools and lists, so the state saves with
        ``torch.save`` and loads with ``weights_only=True``.

        Example:
            >>> ckpt["sampler"] = sampler.state_dict()
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
            "dataset_len": len(self.dataset),
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "consumed": self._consumed,
            "history": [[w, list(c)] for w, c in self._history],
        }

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Combine the states of all ranks of one job into one state that any rank can load.

        Needed only when ranks may have consumed different counts; otherwise any single
        rank's state will do (see the module Note).

        Args:
            states: one :meth:`state_dict` per rank, in any order, e.g. from
                ``comm.all_gather_object(sampler.state_dict())``.

        Returns:
            A state whose ``consumed`` is the list of per-rank counts and ``rank`` is None.

        Raises:
            ValueError: the states are not from one epoch of one job, or a rank is
                missing or given twice.

        Example:
            >>> merged = DistributedSampler.merge_states(comm.all_gather_object(sampler.state_dict()))
        """
        if not states:
            raise ValueError("merge_states needs the state of every rank, got an empty list")
        for s in states:
            _check_state_keys(s)
        shared = ("epoch", "seed", "shuffle", "drop_last", "pad", "dataset_len", "num_replicas", "history")
        first = states[0]
        for s in states[1:]:
            for key in shared:
                if s[key] != first[key]:
                    raise ValueError(
                        f"merge_states: rank {s['rank']} has {key}={s[key]!r} but rank {first['rank']} has "
                        f"{first[key]!r}; merge states saved at the same step of one job"
                    )
        world = first["num_replicas"]
        ranks = sorted(s["rank"] for s in states)
        if ranks != list(range(world)):
            raise ValueError(
                f"merge_states needs exactly one state for each of the {world} ranks, got ranks {ranks}"
            )
        merged = dict(first)
        merged["rank"] = None
        merged["consumed"] = [s["consumed"] for s in sorted(states, key=lambda s: s["rank"])]
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: the next iteration yields the rest of that epoch.

        ``state`` is this or another rank's :meth:`state_dict`, or the result of
        :meth:`merge_states`. On the same number of ranks every rank continues exactly where
        it stopped; on a different number the unseen rest of the epoch is shared out anew
        (the rule is in the module Note). The state's epoch and seed replace this sampler's.
        Only the next iteration is affected; calling :meth:`set_epoch` with another epoch
        first discards the position.

        Raises:
            ValueError: the state is malformed, was saved for a dataset of another length or
                with other ``shuffle``/``drop_last``/``pad``, or counts more consumed
                samples than a rank has.

        Example:
            >>> sampler.load_state_dict(ckpt["sampler"])
            >>> sampler.set_epoch(ckpt["sampler"]["epoch"])   # keeps the position
        """
        _check_state_keys(state)
        n = len(self.dataset)
        if state["dataset_len"] != n:
            raise ValueError(
                f"the sampler state was saved for a dataset of {state['dataset_len']} samples but this dataset "
                f"has {n}; load it with the same dataset"
            )
        for key in ("shuffle", "drop_last", "pad"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the sampler state was saved with {key}={state[key]} but this sampler has "
                    f"{key}={getattr(self, key)}; build the sampler with {key}={state[key]} to resume"
                )
        world = state["num_replicas"]
        history = [(int(w), [int(c) for c in counts]) for w, counts in state["history"]]
        consumed = state["consumed"]
        counts = [int(consumed)] * world if isinstance(consumed, int) else [int(c) for c in consumed]
        if len(counts) != world:
            raise ValueError(f"the sampler state has {len(counts)} consumed counts for {world} ranks")

        previous = (self.epoch, self.seed)
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])
        total = arranged_size(len(self._segment(history)), world, self.drop_last, self.pad)
        for r, count in enumerate(counts):
            limit = _shard_len(total, world, r)
            if not 0 <= count <= limit:
                self.epoch, self.seed = previous  # a rejected state leaves the sampler as it was
                raise ValueError(
                    f"the sampler state says rank {r} consumed {count} samples, but it has {limit} in "
                    f"epoch {state['epoch']}; the state does not belong to this dataset or settings"
                )
        if world == self.num_replicas:
            self._history, self._consumed = history, counts[self.rank]
        else:
            self._history, self._consumed = history + [(world, counts)], 0
        self._iteration += 1
        self._resume_pending = True
        self._prepared = None
        self._current = None


def _check_state_keys(state: Any) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"a sampler state is a dict from DistributedSampler.state_dict(), got {type(state).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"the sampler state lacks {missing}; pass the dict from DistributedSampler.state_dict() "
            f"(or DataLoader.state_dict()['sampler'])"
        )
    if state["version"] != _STATE_VERSION:
        raise ValueError(f"sampler state version {state['version']} is not supported (this is version {_STATE_VERSION})")
