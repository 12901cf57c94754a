"""What the Trainer does about data that is not split among the ranks, and parameters that are not the model's.

A loader handed to the Trainer on several ranks must give each rank its own share, with the
same number of batches everywhere: DDP's ranks step together, so a rank with more batches
waits in a gradient all-reduce for peers that have finished. Three cases:

* a *plain* loader (PyTorch's default sequential or random sampler, its default batch
  sampler) is rebuilt over a :class:`~dptrain.data.DistributedSampler` with the same batch
  size, shuffle, ``drop_last``, collate function and workers (as Lightning and Accelerate
  do), once, said from rank 0; ``TrainerConfig(use_distributed_sampler=False)`` keeps it;
* a loader with a sampler of the user's own is kept as it is, with one warning: it cannot be
  split without knowing what the sampler means;
* whatever the loader, the ranks compare their numbers of batches when an epoch starts, and a
  difference is refused at once with the counts (an evaluation-style loader, hand-made shards)
  instead of a hang in the first all-reduce the short rank never reaches.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import data as tud

from dptrain import comm
from dptrain.data import StreamLoader, prepare_dataloader, shard_stream_loader
from dptrain.runtime.env import _warn_once_main

__all__ = ["check_equal_batches", "check_optimizer_params", "shard_train_loader"]

# DataLoader arguments carried over to the rebuilt loader as they were (the sampler, the batch
# sampler and the generator are the ones replaced: the distributed sampler and its seeds).
_CARRIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
            "persistent_workers", "pin_memory_device", "in_order")


def _is_plain(loader: tud.DataLoader) -> bool:
    """PyTorch's own sampling of the whole data set: what a distributed sampler replaces exactly."""
    sampler = loader.sampler
    if type(sampler) is tud.RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            return False  # a different number of draws, or with replacement: not a permutation
    elif type(sampler) is not tud.SequentialSampler:
        return False
    batches = loader.batch_sampler
    return batches is None or type(batches) is tud.BatchSampler


def _is_distributed(loader: Any) -> bool:
    sampler = getattr(loader, "sampler", None)
    batches = getattr(loader, "batch_sampler", None)
    return isinstance(sampler, tud.DistributedSampler) or isinstance(batches, tud.DistributedSampler)


def shard_train_loader(loader: Any, world_size: int, seed: int, enabled: bool, uneven: str = "join") -> Any:
    """The train loader the Trainer uses on ``world_size`` ranks: ``loader``, or its sharded rebuild.

    Args:
        loader: what the user passed as ``train_data`` (a DataLoader here).
        world_size: ranks in the job; nothing changes on one.
        seed: the distributed sampler's shuffle seed (``TrainerConfig.seed``).
        enabled: ``TrainerConfig.use_distributed_sampler``.
        uneven: ``TrainerConfig.uneven``, for a loader over a stream.

    A plain loader over a stream (an ``IterableDataset``) is rebuilt as a
    :class:`dptrain.data.StreamLoader` -- on one process too, whose position then resumes
    without reading the epoch again -- unless ``enabled`` is False (the stream splits itself).
    """
    if isinstance(loader, tud.DataLoader) and isinstance(loader.dataset, tud.IterableDataset):
        if not enabled or isinstance(loader, StreamLoader):
            return loader
        rebuilt = shard_stream_loader(loader, uneven=uneven, seed=seed)
        if world_size > 1:
            _warn_once_main(
                f"Trainer: the train loader reads a stream (an IterableDataset), which every rank would read whole; "
                f"it is rebuilt as a dptrain.data.StreamLoader with the same batch size, collate_fn and workers: each "
                f"sample goes to one of the {world_size} ranks and one worker, every rank takes the same number of "
                f"steps (uneven={uneven!r}), and its position resumes mid-epoch. If the stream already yields "
                f"only this rank's share (its __iter__ reads dptrain.rank() or torch.distributed.get_rank()), it "
                f"would now be split twice: pass TrainerConfig(use_distributed_sampler=False) to keep the loader "
                f"as it is, or better, give it the whole stream"
            )
        return rebuilt
    if world_size == 1 or not isinstance(loader, tud.DataLoader) or _is_distributed(loader):
        return loader
    name = type(loader.sampler).__name__
    if not enabled:
        return loader
    if not _is_plain(loader):
        _warn_once_main(
            f"Trainer: the train loader's sampler ({name}, or its batch sampler) is not a DistributedSampler and not "
            f"PyTorch's default one, so the Trainer leaves it as it is: every rank draws from the whole data set. "
            f"Give it this rank's share yourself, or use dptrain.prepare_dataloader(dataset, batch_size=...)"
        )
        return loader
    carried = {k: getattr(loader, k) for k in _CARRIED if hasattr(loader, k)}
    if carried.get("num_workers", 0) > 0:
        carried["prefetch_factor"] = loader.prefetch_factor
    else:  # DataLoader refuses these without workers
        carried.pop("persistent_workers", None)
        carried.pop("multiprocessing_context", None)
    if carried.get("pin_memory_device") == "":
        carried.pop("pin_memory_device")  # the default; newer torch warns when it is passed at all
    shuffle = type(loader.sampler) is tud.RandomSampler
    sharded = prepare_dataloader(
        loader.dataset, batch_size=loader.batch_size, shuffle=shuffle, drop_last=loader.drop_last, mode="train",
        seed=seed, **carried,
    )  # fmt: skip
    _warn_once_main(
        f"Trainer: the train loader has no DistributedSampler, so every rank would train on the whole data set; "
        f"it is rebuilt over dptrain.DistributedSampler(shuffle={shuffle}, seed={seed}) with the same batch size "
        f"({loader.batch_size}), drop_last, collate_fn and workers: each of the {world_size} ranks gets "
        f"{len(sharded)} batches of its own share per epoch. TrainerConfig(use_distributed_sampler=False) keeps "
        f"the loader as it is"
    )
    return sharded


def check_equal_batches(num_batches: int, start: int, epoch: int, world: Any, device: torch.device) -> None:
    """Refuse, on every rank alike, an epoch in which the ranks would train different numbers of batches.

    One small all-gather per epoch. ``num_batches`` and ``start`` are this rank's batches in
    the epoch and the batch it resumes at; ``world`` the :class:`dptrain.runtime.env.World`.

    Raises:
        RuntimeError: the counts differ; names each rank's count and the fix.
    """
    if world.world_size == 1 or not comm.is_distributed():
        return
    mine = torch.tensor([num_batches - start], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(world.world_size)]
    comm.all_gather(counts, mine)
    left = [int(c) for c in counts]
    if len(set(left)) == 1:
        return
    shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(left))
    raise RuntimeError(
        f"rank {world.rank}: the train loader yields different numbers of batches on different ranks in epoch {epoch + 1} "
        f"({shown}); with DDP every rank must step the same number of times, or the ranks with more batches wait "
        f"for the others until the timeout. Build the train loader with dptrain.prepare_dataloader(dataset, "
        f"batch_size=...) (mode='train' pads to equal shards; mode='eval' is for evaluation only) or over "
        f"dptrain.DistributedSampler, not from hand-made shards"
    )


def check_optimizer_params(optimizer: Any, model: nn.Module, loss_fn: Any) -> None:
    """Refuse an optimizer that holds parameters which are neither the model's nor the loss function's.

    An optimizer built on a copy of the model, or on another model, steps tensors the loop
    never trains: the loss stays where it is, epoch after epoch, and nothing fails.

    Raises:
        ValueError: names how many parameters are foreign, their shapes and the fix.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, Iterable):
        return
    ours = {id(p) for p in model.parameters()}
    if isinstance(loss_fn, nn.Module):  # a learnable loss (a temperature, class weights) may be optimized too
        ours.update(id(p) for p in loss_fn.parameters())
    held = [p for g in groups for p in g.get("params", ()) if isinstance(p, torch.Tensor)]
    foreign = [p for p in held if id(p) not in ours]
    if not foreign:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    what = "none of them is" if len(foreign) == len(held) else f"{len(foreign)} of them are not"
    raise ValueError(
        f"the optimizer holds {len(held)} parameter(s) and {what} the model's (e.g. shapes {shapes}): it would step "
        f"tensors the Trainer never trains, and the loss would not move. Build it on the parameters of the model "
        f"you pass to the Trainer, e.g. torch.optim.SGD(model.parameters(), lr=...), after any copy of the model, "
        f"or pass a callable: optimizer=lambda params: torch.optim.SGD(params, lr=...)"
    )
