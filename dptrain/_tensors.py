"""Walking nested batches: apply a function to, or move, every tensor of a (named) tuple / list / dict.

One implementation for DDP's input move and casts (``device_ids``, mixed precision) and the
Trainer's batch move, so a batch of any shape PyTorch's collate produces (namedtuples
included) survives all of them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

__all__ = ["map_tensors", "move_to_device"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside it.

    Containers are rebuilt with their own type: tuples, namedtuples (field by field), lists,
    dicts and other mappings whose constructor takes an iterable of pairs (else a plain
    dict). Anything else is returned unchanged.

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional fields
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, Mapping):
        pairs = [(k, map_tensors(v, fn)) for k, v in obj.items()]
        try:
            return type(obj)(pairs)
        except TypeError:  # a mapping type that cannot be rebuilt from pairs
            return dict(pairs)
    return obj


def move_to_device(obj: Any, device: torch.device | str, non_blocking: bool = True) -> Any:
    """Return ``obj`` with every tensor inside it moved to ``device`` (see :func:`map_tensors`).

    Example:
        >>> move_to_device({"x": torch.ones(2), "n": 3}, "cpu")
        {'x': tensor([1., 1.]), 'n': 3}
    """
    return map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))
