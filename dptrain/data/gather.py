"""Exact distributed evaluation: every sample's result exactly once, in dataset order.

Evaluate with ``prepare_dataloader(..., mode="eval")`` (uneven shards, no repeated sample),
keep each rank's outputs in a list, and call :func:`gather_results` once after the loop.
Nothing communicates inside the loop, so ranks with one batch fewer than their peers never
wait on them; the single gather at the end is where the ranks meet.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dptrain import comm, env

__all__ = ["gather_results"]


def _as_values(values: Any) -> torch.Tensor | None:
    if isinstance(values, torch.Tensor):
        return values if values.dim() > 0 else values.reshape(1)
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat([v if v.dim() > 0 else v.reshape(1) for v in values])
    if isinstance(values, (list, tuple)) and not values:
        return None  # this rank evaluated nothing; shape and dtype come from the peers
    return torch.as_tensor(values)


def _as_indices(indices: Any) -> torch.Tensor:
    if isinstance(indices, (list, tuple)) and indices and all(isinstance(i, torch.Tensor) for i in indices):
        indices = torch.cat([i.reshape(-1) for i in indices])
    out = torch.as_tensor(indices, dtype=torch.int64).reshape(-1) if len(indices) else torch.zeros(0, dtype=torch.int64)
    return out


def gather_results(
    values: torch.Tensor | Sequence[torch.Tensor],
    indices: Any,
    dst: int | None = None,
    *,
    num_samples: int | None = None,
) -> torch.Tensor | None:
    """Collect every rank's per-sample results into one tensor in dataset order.

    Each rank passes its results and the dataset indices they belong to; the result holds,
    for every distinct index in ascending order, its value -- so a metric over it equals
    the metric of a single process over the whole dataset, bit for bit. An index seen more
    than once (the padding repeats of a ``pad=True`` sampler) is kept once: the first
    occurrence in rank order. Works without a process group (world of one).

    Args:
        values: this rank's results, first dimension = samples: a tensor, or a list of
            per-batch tensors (concatenated), or an empty list when the rank had no samples.
            Other dimensions and the dtype must agree across ranks.
        indices: the dataset index of each row of ``values`` (a tensor, a list of ints or of
            per-batch tensors), e.g. ``loader.sampler.indices()``.
        dst: ``None`` (default): every rank gets the result. A rank number: only that rank
            does; the others return ``None``.
        num_samples: if given, check that the indices cover exactly ``0 .. num_samples - 1``
            (e.g. ``len(dataset)``) and raise otherwise -- a guard against lost samples.

    Returns:
        A tensor of shape ``(number of distinct indices, *values.shape[1:])``, or ``None``
        on ranks other than ``dst``.

    Raises:
        ValueError: ``values`` and ``indices`` differ in length, a negative index, ranks
            disagree on the trailing shape or dtype, ``dst`` is not a rank, or the indices do
            not cover ``num_samples`` exactly.
        CollectiveError: a peer failed or timed out.

    Example:
        >>> loader = dptrain.prepare_dataloader(val_set, batch_size=256, mode="eval")
        >>> scores = [model(x).sigmoid() for x, _ in loader]
        >>> all_scores = dptrain.gather_results(scores, loader.sampler.indices())
        >>> auc = roc_auc_score(labels, all_scores)   # the single-process value exactly
    """
    world = env.get_world()
    me, size = (world.rank, world.world_size) if comm.is_distributed() else (0, 1)
    if dst is not None and not 0 <= dst < size:
        raise ValueError(f"dst={dst} is not a rank of this world of {size}; use 0 <= dst < {size} or None")
    vals = _as_values(values)
    idx = _as_indices(indices)
    count = 0 if vals is None else vals.shape[0]
    if idx.numel() != count:
        raise ValueError(
            f"rank {me}: gather_results got {count} values but {idx.numel()} indices; pass one index per row of values"
        )
    if count and int(idx.min()) < 0:
        raise ValueError(f"rank {me}: gather_results got a negative index {int(idx.min())}; indices are dataset positions")
    meta = None if vals is None else (tuple(vals.shape[1:]), str(vals.dtype))
    gathered = comm.all_gather_object((count, meta))
    total = sum(c for c, _ in gathered)
    metas = [m for _, m in gathered]
    known = {m for m in metas if m is not None}
    if len(known) > 1:
        listing = ", ".join(f"rank {r}: {m}" for r, m in enumerate(metas) if m is not None)
        raise ValueError(
            f"rank {me}: gather_results needs the same trailing shape and dtype on every rank; got {listing}"
        )
    if not known:
        raise ValueError(
            "gather_results got no values on any rank (all passed empty lists); pass a tensor with 0 rows to give the shape"
        )
    trailing, dtype_name = known.pop()
    if vals is None:
        vals = torch.empty((0, *trailing), dtype=getattr(torch, dtype_name.split(".")[-1]), device=env.device())
    idx = idx.to(vals.device)
    if size > 1 and total > 0:  # (zero-size collectives are skipped: nothing to move)
        all_vals = torch.cat(comm.all_gather_uneven(vals))
        all_idx = torch.cat(comm.all_gather_uneven(idx))
    else:
        all_vals, all_idx = vals, idx
    if dst is not None and me != dst:
        return None
    order = torch.sort(all_idx, stable=True).indices
    sorted_idx = all_idx[order]
    keep = torch.ones_like(sorted_idx, dtype=torch.bool)
    keep[1:] = sorted_idx[1:] != sorted_idx[:-1]  # first occurrence (in rank order) of each index
    result = all_vals[order[keep]]
    if num_samples is not None:
        present = sorted_idx[keep]
        expected = torch.arange(num_samples, device=present.device)
        if present.numel() != num_samples or not torch.equal(present, expected):
            missing = sorted(set(range(num_samples)) - set(present.tolist()))
            extra = sorted(set(present.tolist()) - set(range(num_samples)))
            raise ValueError(
                f"gather_results: the ranks' indices do not cover 0..{num_samples - 1} exactly: "
                f"{len(missing)} missing (first {missing[:5]}), {len(extra)} outside (first {extra[:5]}); "
                f"evaluate with prepare_dataloader(..., mode='eval') and pass loader.sampler.indices()"
            )
    return result
