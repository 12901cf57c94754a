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
  feedback and warm start (Vogels et al., 2019); see :mod:`dptrain.parallel.ddp._powersgd`.

Every hook here issues its collectives from the hook call itself, never from a future's
callback, so all ranks issue them in the same order (gloo pairs collectives by order).
"""

import weakref
from typing import Any

import torch
import torch.distributed as dist

from dptrain.parallel.ddp._buckets import _views_of, direct_gradients_of
from dptrain.parallel.ddp._hook_pipeline import allreduce_mean_future, future_of, issue_all_reduce
from dptrain.parallel.ddp._powersgd import PowerSGDState, powerSGD_hook

# No `from __future__ import annotations` here: PyTorch's DDP inspects a hook's annotations
# (bucket: dist.GradBucket, return Future[Tensor]) and rejects string annotations.

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "PowerSGDState",
    "powerSGD_hook",
]


def allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one all-reduce: divide by the world size, then sum.

    Args:
        process_group: the group to average over (the ``state``); None means the world.
        bucket: the gradient bucket.

    Example:
        >>> model.register_comm_hook(None, allreduce_hook)
    """
    return allreduce_mean_future(process_group, bucket.buffer())


# Low-precision copies of buckets, reused across iterations: a fresh bucket-sized tensor
# every step costs page faults (about as much as the cast itself on a CPU). Keyed by the
# bucket tensor's identity and dropped with it; dptrain's DDP passes the same bucket tensor
# every step, PyTorch's a new one (then nothing is reused, as in PyTorch's own hook).
_scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _low_precision(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    key = (id(buffer), dtype)
    out = _scratch.get(key)
    if out is None or out.shape != buffer.shape or out.device != buffer.device:
        out = torch.empty(buffer.shape, dtype=dtype, device=buffer.device)
        if key not in _scratch:
            weakref.finalize(buffer, _scratch.pop, key, None)
        _scratch[key] = out
    return out


def _compress_hook(process_group: Any, bucket: Any, dtype: torch.dtype) -> torch.futures.Future:
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = _low_precision(buffer, dtype)
    # With dptrain's reducer the gradients are cast straight from .grad and the average cast
    # straight back into it, without the copies through the bucket (see [Note: a hook that reads
    # the gradients itself] in dptrain/parallel/ddp/_reducer.py); the same casts either way.
    grads = direct_gradients_of(bucket)
    if grads is None:
        compressed.copy_(buffer)
    else:
        parts = _views_of(compressed, grads)
        torch._foreach_copy_(parts, grads)
    compressed.div_(dist.get_world_size(group))
    work = issue_all_reduce(compressed, group)

    def decompress(_fut: Any) -> torch.Tensor:
        # Cast back to the bucket's dtype; no collective here.
        if grads is None:
            buffer.copy_(compressed)
        else:
            torch._foreach_copy_(grads, parts)
        return buffer

    if work is None:  # a group of one
        return future_of(None, decompress(None))
    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in float16 (half the bytes), then cast back.

    As PyTorch's hook: cast to float16, divide by the world size, sum. The average does
    not overflow float16's range (about 65504) when every rank's gradients fit it; smaller
    gradients than about 6e-8 become zero (use bf16 for gradients of very different scales).

    Example:
        >>> model.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16 (half the bytes, float32's range, 8 bits of mantissa).

    Example:
        >>> model.register_comm_hook(None, bf16_compress_hook)
    """
    return _compress_hook(process_group, bucket, torch.bfloat16)


# dptrain's reducer may hand the 16-bit hooks the gradients themselves (see _compress_hook).
fp16_compress_hook.reads_gradients = bf16_compress_hook.reads_gradients = lambda _state: True
