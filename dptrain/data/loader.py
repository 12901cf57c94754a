"""The DataLoader that knows its place in the epoch, and data preparation on one rank first.

:func:`prepare_dataloader` builds a ``torch.utils.data.DataLoader`` (the subclass
:class:`DistributedDataLoader`) over a :class:`~dptrain.data.DistributedSampler`. The loader
counts the samples of every batch it hands to the training loop and tells the sampler
(whose own count of the indices it yielded it turns off), so ``loader.state_dict()`` is the
position as the loop saw it -- not as the workers, which fetch ``prefetch_factor *
num_workers`` batches ahead, saw it. A plain ``DataLoader`` over the sampler is exact only
with ``num_workers=0`` (see the sampler's Note "what counts as consumed").

[Note: worker seeds]
PyTorch seeds each worker's ``torch``, ``random`` and ``numpy`` from a base seed drawn from
``loader.generator`` when the iterator starts (base + worker id). Left alone, that base
comes from the global RNG and differs from run to run. Here the generator is re-seeded
before every iteration from ``(seed, rank, epoch)``, so the random augmentations of a
worker are the same in every run, different on every rank and worker, and different each
epoch. With ``persistent_workers=True`` the workers are seeded once, at the first
iteration, and their streams run on across epochs (still the same in every run).
A :class:`~dptrain.data.StreamLoader` (for a stream) seeds its workers the same way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.utils.data

from dptrain import comm
from dptrain.runtime import env
from dptrain.data._seeds import derive_seed as _derive_seed
from dptrain.data.sampler import DistributedSampler
from dptrain.data.stream import StreamLoader

__all__ = ["DistributedDataLoader", "prepare_dataloader", "main_process_first"]


class _CountingIterator:
    """Wraps a DataLoader iterator; each batch it hands out advances the sampler."""

    def __init__(self, inner: Iterator, sampler: DistributedSampler, batch_size: int | None, total: int) -> None:
        self._inner = inner
        self._sampler = sampler
        self._batch_size = batch_size
        self._left = total  # samples of this iteration not yet handed out

    def __iter__(self) -> "_CountingIterator":
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self) -> Any:
        batch = next(self._inner)
        # Batches come in sampler order, full ones first: batch k holds min(batch_size, left)
        # samples. A dropped last batch (drop_last=True) is never handed out, never counted.
        n = 1 if self._batch_size is None else min(self._batch_size, self._left)
        self._left -= n
        self._sampler.advance(n)
        return batch


class DistributedDataLoader(torch.utils.data.DataLoader):
    """A DataLoader over a :class:`DistributedSampler` whose position can be saved.

    Build it with :func:`prepare_dataloader`. Beyond ``DataLoader`` it has
    :meth:`set_epoch`, :meth:`state_dict` and :meth:`load_state_dict`; the saved position
    counts the samples of the batches this loader has handed out. The loader takes over the
    counting from its sampler (it sets ``sampler.count_yields = False``).
    """

    def __init__(self, dataset: Any, *, sampler: DistributedSampler, seed: int = 0, **kwargs: Any) -> None:
        if not isinstance(sampler, DistributedSampler):
            raise TypeError(f"DistributedDataLoader needs a dptrain DistributedSampler, got {type(sampler).__name__}")
        super().__init__(dataset, sampler=sampler, **kwargs)
        # This loader counts the batches it hands out; the sampler's own count of what it
        # yielded would include the workers' prefetch.
        sampler.count_yields = False
        self.seed = seed

    def __iter__(self) -> Iterator[Any]:
        sampler: DistributedSampler = self.sampler
        # Enter the iteration now (not lazily at the first batch): a state saved between
        # iter(loader) and the first batch must describe this iteration.
        sampler._prepared = sampler._start_iteration()
        total = len(sampler._prepared)
        g = torch.Generator()
        g.manual_seed(_derive_seed(self.seed, sampler.rank, sampler.epoch))
        self.generator = g
        return _CountingIterator(super().__iter__(), sampler, self.batch_size, total)

    def set_epoch(self, epoch: int) -> None:
        """Set the sampler's epoch (shuffle order and worker seeds); see :meth:`DistributedSampler.set_epoch`."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch as the loop saw it: ``{"sampler": sampler.state_dict()}``."""
        return {"sampler": self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or a bare or merged sampler state) at the next iteration.

        The batch size may differ from the saved one: the rest of the epoch is regrouped.

        Raises:
            ValueError: as :meth:`DistributedSampler.load_state_dict`.
        """
        if isinstance(state, dict) and "sampler" in state:
            state = state["sampler"]
        self.sampler.load_state_dict(state)


def prepare_dataloader(
    dataset: Any,
    batch_size: int | None,
    shuffle: bool | str | None = None,
    num_workers: int = 0,
    drop_last: bool = False,
    mode: str = "train",
    seed: int = 0,
    persistent_workers: bool = False,
    pin_memory: bool | None = None,
    collate_fn: Callable | None = None,
    uneven: str = "join",
    **kw: Any,
) -> DistributedDataLoader | StreamLoader:
    """Build the DataLoader for this rank: distributed sampler, seeds, pinning, resumable.

    A stream (a ``torch.utils.data.IterableDataset``: Hugging Face ``datasets`` streaming,
    webdataset, a generator over files) gets a :class:`~dptrain.data.StreamLoader` instead:
    each sample read by one rank and one worker, the same number of items on every rank
    (``uneven``), a position that resumes mid-epoch (see :mod:`dptrain.data.stream`).

    Args:
        dataset: a map-style dataset, or a stream (``IterableDataset``).
        batch_size: samples per batch on this rank (the global batch is
            ``batch_size * world_size``); ``None`` yields single samples.
        shuffle: shuffle each epoch (``mode="train"`` only): ``True`` (PyTorch's order),
            ``False``, or ``"lazy"`` (an order computed index by index, whose cost does not
            grow with the data set; not PyTorch's order -- see
            :class:`~dptrain.data.DistributedSampler`). Default: True for a map-style data
            set; a stream keeps its own order (shuffle inside it, e.g. Hugging Face's
            ``ds.shuffle(seed=..., buffer_size=...)``; ``set_epoch`` reaches it).
        num_workers: DataLoader worker processes. Default 0 (load in this process).
        drop_last: drop the incomplete last batch *and* let the sampler cut the dataset to
            a multiple of the world size instead of padding (``mode="train"`` only).
            Default False.
        mode: ``"train"``: PyTorch's padded partition, equal shards for lockstep DDP.
            ``"eval"``: the exact-evaluation partition (``pad=False``, no shuffle, no
            drop): uneven shards, every sample exactly once; combine the outputs with
            :func:`dptrain.gather_results`. Default ``"train"``.
        seed: seeds the shuffle and, with ``rank`` and ``epoch``, the workers (see the
            module Note). Default 0.
        persistent_workers: keep workers alive between epochs (needs ``num_workers > 0``).
            Default False.
        pin_memory: page-locked batches for fast copies to the GPU. Default: True when
            this rank computes on a GPU (:func:`dptrain.device` is CUDA: an NCCL job, or
            CUDA present and ``init`` not told ``backend="gloo"``), else False.
        collate_fn: merges samples into a batch. Default: PyTorch's default collate.
        uneven: a stream only: ``"join"`` (a rank whose share ran out yields
            :class:`~dptrain.data.ShadowBatch` stand-ins until every rank is done) or
            ``"drop"`` (every rank stops when one runs out). Default ``"join"``.
        **kw: ``num_replicas`` and ``rank`` go to the sampler (default: the current
            world); everything else (``prefetch_factor``, ``worker_init_fn``, ``timeout``,
            ``multiprocessing_context``, ...) to ``DataLoader``.

    Returns:
        A :class:`DistributedDataLoader`; ``loader.sampler`` is its
        :class:`DistributedSampler`. For a stream, a :class:`~dptrain.data.StreamLoader`.

    Raises:
        ValueError: unknown ``mode``; ``drop_last=True`` in eval mode; a ``sampler`` or
            ``batch_sampler`` in ``kw``; ``persistent_workers`` without workers; and the
            sampler's errors (``rank`` outside the world). An empty dataset, or fewer
            samples than ranks, is no error: the ranks without samples get an empty loader
            (``len(loader) == 0``), as with PyTorch's sampler. For a stream: a bad
            ``uneven``, ``shuffle``/``sampler`` arguments that a stream cannot honour (see
            :class:`~dptrain.data.StreamLoader`); ``uneven="drop"`` for a map-style data set.
        RuntimeError: the launcher says the world is larger but no process group exists
            (``dptrain.init()`` not called) and ``num_replicas``/``rank`` are not given.

    Example:
        >>> loader = dptrain.prepare_dataloader(train_set, batch_size=64, num_workers=2)
        >>> for epoch in range(epochs):
        ...     loader.set_epoch(epoch)
        ...     for x, y in loader:
        ...         ...
        ...     torch.save({"data": loader.state_dict(), ...}, path)
    """
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return _prepare_stream(dataset, batch_size, shuffle, num_workers, drop_last, mode, seed, persistent_workers,
                               pin_memory, collate_fn, uneven, kw)
    if uneven != "join":
        raise ValueError(
            f"uneven={uneven!r} applies to a stream (an IterableDataset); a map-style data set is padded to equal "
            f"shards by its sampler: use drop_last=True to cut it to a multiple of the world size instead"
        )
    if shuffle is None:
        shuffle = True
    for bad in ("sampler", "batch_sampler", "shuffle_sampler"):
        if bad in kw:
            raise ValueError(
                f"prepare_dataloader builds its own distributed sampler; drop {bad}= (or build a "
                f"torch DataLoader yourself with sampler=dptrain.DistributedSampler(...))"
            )
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers > 0; set num_workers or drop persistent_workers")
    num_replicas = kw.pop("num_replicas", None)
    rank = kw.pop("rank", None)
    if num_replicas is None or rank is None:
        env.check_joined("dptrain.prepare_dataloader", "(or pass num_replicas= and rank= explicitly)")
    if mode == "eval":
        if drop_last:
            raise ValueError(
                "drop_last=True in eval mode would leave samples out of the evaluation; "
                "use drop_last=False (the default) for exact evaluation"
            )
        sampler = DistributedSampler(dataset, num_replicas, rank, shuffle=False, seed=seed, drop_last=False, pad=False)
    else:
        sampler = DistributedSampler(dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    if pin_memory is None:  # the device follows the job's settings, not merely CUDA's presence
        pin_memory = env.device().type == "cuda"
    return DistributedDataLoader(
        dataset,
        sampler=sampler,
        seed=seed,
        batch_size=batch_size,
        num_workers=num_workers,
        drop_last=drop_last,
        persistent_workers=persistent_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        **kw,
    )


def _prepare_stream(dataset, batch_size, shuffle, num_workers, drop_last, mode, seed, persistent_workers, pin_memory,
                    collate_fn, uneven, kw) -> StreamLoader:
    """prepare_dataloader for a stream: the same defaults (pinning, eval's rule), a StreamLoader."""
    if shuffle:
        env._warn_once_main(
            f"prepare_dataloader(shuffle={shuffle!r}) does nothing for a stream ({type(dataset).__name__}): it is read "
            f"in its own order. Shuffle inside the stream (Hugging Face: ds.shuffle(seed=..., buffer_size=...)); "
            f"loader.set_epoch(epoch) passes the epoch on to it"
        )
    if mode == "eval" and drop_last:
        raise ValueError(
            "drop_last=True in eval mode would leave samples out of the evaluation; "
            "use drop_last=False (the default) for exact evaluation"
        )
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers > 0; set num_workers or drop persistent_workers")
    if pin_memory is None:  # the device follows the job's settings, not merely CUDA's presence
        pin_memory = env.device().type == "cuda"
    return StreamLoader(
        dataset, batch_size, num_workers=num_workers, drop_last=drop_last, uneven=uneven, mode=mode, seed=seed,
        collate_fn=collate_fn, pin_memory=pin_memory, persistent_workers=persistent_workers, **kw,
    )  # fmt: skip


@contextlib.contextmanager
def main_process_first(local: bool = False):
    """Run the body on rank 0 first (downloads, caches), then on every other rank.

    Rank 0 (with ``local=True``: local rank 0 of every node) runs the body while the others
    wait; then the others run it, and find the files ready. In a single process without a
    process group the body just runs.

    If the body raises on a leading rank, that rank tells the waiting ranks and re-raises
    its error; each waiting rank then raises ``RuntimeError`` naming the failed rank instead
    of running the body, so nobody waits for a timeout. The body must not itself run
    collectives (the ranks run it at different times). A leader that dies outright (killed,
    ``KeyboardInterrupt``) leaves the others waiting until the launcher stops the job or the
    process group's timeout passes.

    Args:
        local: lead with local rank 0 of each node (node-local disks) instead of global
            rank 0 (a shared filesystem). Default False.

    Raises:
        RuntimeError: on a waiting rank, when the body failed on a leading rank; on every
            rank, when the launcher says the world is larger but ``dptrain.init()`` was not
            called (the ranks would all run the body at once).

    Example:
        >>> with dptrain.main_process_first():
        ...     train_set = torchvision.datasets.CIFAR10("data", download=True)
    """
    if not comm.is_distributed():
        env.check_joined("dptrain.main_process_first")
        yield
        return
    world = env.get_world()
    leader = world.local_rank == 0 if local else world.rank == 0
    if not leader:
        statuses = comm.all_gather_object(None)
        failed = [(r, msg) for r, msg in enumerate(statuses) if msg is not None]
        if failed:
            r, msg = failed[0]
            raise RuntimeError(
                f"rank {world.rank}: not running the main_process_first body because it failed on rank {r}: {msg}"
            )
        yield
        return
    try:
        yield
    except Exception as exc:
        # One gather that every rank enters once: the waiting ranks learn of the failure.
        comm.all_gather_object(f"{type(exc).__name__}: {exc}")
        raise
    comm.all_gather_object(None)
