"""Walking nested batches: apply a function to, or move, every tensor of a (named) tuple / list / dict.

One implementation for DDP's input move and casts (``device_ids``, mixed precision) and the
Trainer's batch move, so a batch of any shape PyTorch's collate produces (namedtuples
included) survives all of them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

__all__ = ["map_tensors", "move_to_device", "split_tensors", "join_tensors", "pack", "unpack", "empty_for"]


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
    if isinstance(obj, (list, tuple, Mapping)):
        return _rebuild(obj, lambda x: map_tensors(x, fn))
    return obj


def _rebuild(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """The container ``obj`` (a (named) tuple, list or mapping) of the same type with ``fn`` applied to
    each element (each value of a mapping)."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional fields
        return type(obj)(*(fn(x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(x) for x in obj)
    pairs = [(k, fn(v)) for k, v in obj.items()]
    try:
        return type(obj)(pairs)
    except TypeError:  # a mapping type that cannot be rebuilt from pairs
        return dict(pairs)


def move_to_device(obj: Any, device: torch.device | str, non_blocking: bool = True) -> Any:
    """Return ``obj`` with every tensor inside it moved to ``device`` (see :func:`map_tensors`).

    Example:
        >>> move_to_device({"x": torch.ones(2), "n": 3}, "cpu")
        {'x': tensor([1., 1.]), 'n': 3}
    """
    return map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))


# -- sending a nested state as one buffer ------------------------------------------------------
# Pickling a state dict for a broadcast copies every tensor into a byte string and back, which
# took in-place recovery's state transfer (weights and optimizer state, tens of MB) a quarter
# of a second. Split instead: the structure with a numbered slot in place of each dense tensor
# (small: pickled), and the tensors' bytes packed into one uint8 buffer, sent as it is. Each
# tensor starts at a multiple of ``_ALIGN`` bytes so that its slice can be viewed as its dtype.
_ALIGN = 16


class _Slot(int):
    """Where tensor number ``int(self)`` of :func:`split_tensors`'s list goes back."""


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized \
        and t.device.type != "meta"


def split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` with each dense tensor replaced by a slot, and those tensors in slot order.

    A tensor that appears twice (tied weights) has one slot. Other tensors (sparse, quantized,
    subclasses) stay in the structure.

    Example:
        >>> skeleton, tensors = split_tensors({"w": torch.ones(2), "n": 3})
        >>> join_tensors(skeleton, tensors)
        {'w': tensor([1., 1.]), 'n': 3}
    """
    tensors: list[torch.Tensor] = []
    seen: dict[int, _Slot] = {}

    def slot(t: torch.Tensor) -> Any:
        if not _plain(t):
            return t
        if id(t) not in seen:
            seen[id(t)] = _Slot(len(tensors))
            tensors.append(t)
        return seen[id(t)]

    return map_tensors(obj, slot), tensors


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Put ``tensors`` back into the slots of ``skeleton`` (see :func:`split_tensors`)."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton]
    if isinstance(skeleton, torch.Tensor):
        return skeleton
    if isinstance(skeleton, (list, tuple, Mapping)):
        return _rebuild(skeleton, lambda x: join_tensors(x, tensors))
    return skeleton


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _layout(meta: list[tuple[torch.dtype, tuple[int, ...], str]]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for dtype, shape, _ in meta:
        offsets.append(end)
        end += -(-_nbytes(dtype, shape) // _ALIGN) * _ALIGN
    return offsets, end


def pack(tensors: list[torch.Tensor], device: torch.device,
         allocate: Callable[[int], torch.Tensor | None] | None = None) -> tuple[torch.Tensor, list]:
    """The bytes of ``tensors`` in one uint8 buffer on ``device``, and what :func:`unpack` needs.

    ``allocate(nbytes)``, when given, may supply that buffer (a uint8 tensor of ``nbytes`` on
    ``device``); when it returns None, a new one is made."""
    meta = [(t.dtype, tuple(t.shape), t.device.type) for t in tensors]
    offsets, total = _layout(meta)
    buffer = allocate(total) if allocate is not None else None
    if buffer is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for t, start in zip(tensors, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[start:start + raw.numel()].copy_(raw)
    return buffer, meta


def unpack(buffer: torch.Tensor, meta: list) -> list[torch.Tensor]:
    """The tensors :func:`pack` packed (views of ``buffer``); those that were on the CPU go back to it."""
    offsets, total = _layout(meta)
    if buffer.numel() != total:
        raise ValueError(f"a packed buffer of {buffer.numel()} bytes does not hold tensors of {total}")
    out = []
    for (dtype, shape, device_type), start in zip(meta, offsets):
        t = buffer[start:start + _nbytes(dtype, shape)].view(dtype).view(shape)
        out.append(t.cpu() if device_type == "cpu" else t)
    return out


def packed_nbytes(meta: list) -> int:
    """The size of the buffer :func:`pack` packed for ``meta``."""
    return _layout(meta)[1]


def empty_for(meta: list, device: torch.device) -> torch.Tensor:
    """A buffer to receive what :func:`pack` packed for ``meta``."""
    return torch.empty(packed_nbytes(meta), dtype=torch.uint8, device=device)
