"""Exact distributed evaluation: every sample's result exactly once, in dataset order.

Evaluate with ``prepare_dataloader(..., mode="eval")`` (uneven shards, no repeated sample),
keep each rank's outputs in a list, and call :func:`gather_results` once after the loop.
Nothing communicates inside the loop, so ranks with one batch fewer than their peers never
wait on them; the single gather at the end is where the ranks meet.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dptrain import comm
from dptrain.runtime import env

__all__ = ["gather_results"]


def _as_values(values: Any) -> torch.Tensor | None:
    if isinstance(values, torch.Tensor):
        return values if values.dim() > 0 else values.reshape(1)
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat([v if v.dim() > 0 else v.reshape(1) for v in values])
    if isinstance(values, (list, tuple)) and not values:
        return None  # this rank evaluated nothing; shape and dtype come from the peers
    return torch.as_tensor(values)


# How firmly a rank's values fix the trailing shape and dtype of the result: rows do; a 0-row
# tensor of 2+ dimensions states a trailing shape; a 0-row 1-D tensor (``torch.empty(0)``, the
# usual "nothing here") only says something when no rank knows better; an empty list, nothing.
_ROWS, _SHAPED, _FLAT = 2, 1, 0


def _layout(vals: torch.Tensor | None) -> tuple[int, tuple[int, ...], str] | None:
    if vals is None:
        return None
    firmness = _ROWS if vals.shape[0] else (_SHAPED if vals.dim() > 1 else _FLAT)
    return firmness, tuple(vals.shape[1:]), str(vals.dtype).removeprefix("torch.")


def _agreed_layout(me: int, layouts: list) -> tuple[tuple[int, ...], torch.dtype]:
    """The trailing shape and dtype of the result, from the ranks that fix them most firmly."""
    given = [(r, lay) for r, lay in enumerate(layouts) if lay is not None]
    if not given:
        raise ValueError(
            f"rank {me}: gather_results got an empty list on every rank, so the result's trailing shape and dtype "
            f"are unknown; pass a tensor with 0 rows to give them, e.g. torch.empty(0, num_classes)"
        )
    top = max(lay[0] for _, lay in given)
    deciding = [(r, lay) for r, lay in given if lay[0] == top]
    # A stated shape must agree too, even without rows: it says what the rank would produce.
    stated = [(r, lay) for r, lay in given if lay[0] == _SHAPED and top == _ROWS]
    shapes_and_types = {lay[1:] for _, lay in deciding}
    shapes = {lay[1] for _, lay in deciding + stated}
    if len(shapes_and_types) > 1 or len(shapes) > 1:
        listing = ", ".join(f"rank {r}: ({lay[1]}, {lay[2]}{'' if lay[0] == _ROWS else ', 0 rows'})"
                            for r, lay in deciding + stated)
        raise ValueError(
            f"rank {me}: gather_results needs the same trailing shape and dtype on every rank; got {listing}. "
            f"A rank without results may pass an empty list or torch.empty(0)"
        )
    trailing, dtype_name = shapes_and_types.pop()
    return trailing, getattr(torch, dtype_name)


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
            per-batch tensors (concatenated). Other dimensions and the dtype must agree
            across the ranks that have rows. A rank with no samples passes an empty list or
            ``torch.empty(0)`` and takes trailing shape and dtype from its peers; a 0-row
            tensor of more dimensions (``torch.empty(0, num_classes)``) states its trailing
            shape, which must then agree, and which shapes the (empty) result when no
            rank has any row.
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
            disagree on the trailing shape or dtype, every rank passed an empty list (no
            shape to give the result), ``dst`` is not a rank, or the indices do not cover
            ``num_samples`` exactly.
        RuntimeError: the launcher says the world is larger but ``dptrain.init()`` was not
            called (each rank would return only its own results).
        CollectiveError: a peer failed or timed out.

    Example:
        >>> loader = dptrain.prepare_dataloader(val_set, batch_size=256, mode="eval")
        >>> scores = [model(x).sigmoid() for x, _ in loader]
        >>> all_scores = dptrain.gather_results(scores, loader.sampler.indices())
        >>> auc = roc_auc_score(labels, all_scores)   # the single-process value exactly
    """
    if not comm.is_distributed():
        env.check_joined("dptrain.gather_results")
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
    gathered = comm.all_gather_object((count, _layout(vals)))
    total = sum(c for c, _ in gathered)
    trailing, dtype = _agreed_layout(me, [m for _, m in gathered])
    if vals is None or (count == 0 and size > 1):
        # A rank without rows takes the layout of its peers (its placeholder holds no value)
        # and the collective's device (a CPU ``torch.empty(0)`` cannot join an NCCL gather).
        vals = torch.empty((0, *trailing), dtype=dtype, device=env.device())
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
