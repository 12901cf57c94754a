"""Walking nested batches: move every tensor of a (named) tuple / list / dict to a device.

One implementation for DDP's ``device_ids`` input move and the Trainer's batch move, so a
batch of any shape PyTorch's collate produces (namedtuples included) survives both.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["move_to_device"]


def move_to_device(obj: Any, device: torch.device | str, non_blocking: bool = True) -> Any:
    """Return ``obj`` with every tensor inside it moved to ``device``.

    Containers are rebuilt with their own type: tuples, namedtuples (field by field), lists,
    dicts and other mappings whose constructor takes an iterable of pairs. Anything else is
    returned unchanged.

    Example:
        >>> move_to_device({"x": torch.ones(2), "n": 3}, "cpu")
        {'x': tensor([1., 1.]), 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional fields
        return type(obj)(*(move_to_device(x, device, non_blocking) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(x, device, non_blocking) for x in obj)
    if isinstance(obj, Mapping):
        moved = ((k, move_to_device(v, device, non_blocking)) for k, v in obj.items())
        try:
            return type(obj)(moved)
        except TypeError:  # a mapping type that cannot be rebuilt from pairs: a plain dict
            return dict((k, move_to_device(v, device, non_blocking)) for k, v in obj.items())
    return obj
