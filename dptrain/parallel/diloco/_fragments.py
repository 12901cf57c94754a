"""Streaming DiLoCo's fragments: which parameters sync together, and at which inner step.

[Note: the schedule]
The trainable parameters are cut, in the model's order, into ``num_fragments`` contiguous
fragments of about the same number of elements. Each fragment syncs once every
``sync_every`` (H) inner steps, the fragments staggered evenly over the round: fragment
``f`` of ``F`` at the steps ``s`` with ``s % H == ((f + 1) * H // F) % H``. With one fragment
that is every H-th step; with F fragments an exchange starts every H / F steps, so the link
carries a fragment at a time instead of the whole model at once. The exchange of a fragment
started at step ``s`` is applied at step ``s + tau`` (``fragment_sync_delay``), the inner
steps in between computing while the bytes travel.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["split", "offsets", "due"]


def split(params: Sequence[torch.Tensor], num_fragments: int) -> list[list[int]]:
    """Indices of ``params`` in each of ``num_fragments`` contiguous fragments of about equal size.

    Raises:
        ValueError: more fragments than parameters.
    """
    if num_fragments > len(params):
        raise ValueError(f"DiLoCo(num_fragments={num_fragments}) exceeds the model's {len(params)} trainable "
                         f"parameters; a fragment holds whole parameters, so use num_fragments <= {len(params)}")
    total = sum(p.numel() for p in params)
    fragments: list[list[int]] = [[]]
    seen = 0
    for i, p in enumerate(params):
        to_open = num_fragments - len(fragments)
        # Open the next fragment once this parameter's middle passes the current one's share,
        # or when every parameter left must start a fragment of its own.
        if fragments[-1] and to_open > 0 and (
                len(params) - i <= to_open or seen + p.numel() / 2 >= len(fragments) * total / num_fragments):
            fragments.append([])
        fragments[-1].append(i)
        seen += p.numel()
    return fragments


def offsets(sync_every: int, num_fragments: int) -> list[int]:
    """The step residue (mod ``sync_every``) at which each fragment's exchange starts."""
    return [((f + 1) * sync_every // num_fragments) % sync_every for f in range(num_fragments)]


def due(step: int, sync_every: int, fragment_offsets: Sequence[int]) -> list[int]:
    """The fragments whose exchange starts after inner step ``step`` (1-based)."""
    r = step % sync_every
    return [f for f, off in enumerate(fragment_offsets) if off == r]
