"""Gradient buckets of the DDP reducer: how parameters are grouped, and the flat buffers.

[Note: bucket layout]
Buckets are filled in the order gradients are expected to become ready, and closed when
they reach a byte limit. The limits advance one per closed bucket and then stay at the last
one, so PyTorch's default ``[1 MiB, 25 MiB]`` gives a small first bucket whose all-reduce
starts early. Until the reducer has seen one backward, the expected order is reverse
registration order (layers defined first usually run first in forward, so their gradients
come last); after it, the reducer rebuilds the buckets once in the order it observed.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dptrain._shm import ShmGroup

__all__ = ["compute_bucket_assignment", "bucket_size_limits", "GradBucket", "DEFAULT_FIRST_BUCKET_BYTES"]

MIB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_CAP_MB = 25
_SLOT_ALIGN = 1024  # elements; see _Bucket


def bucket_size_limits(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None = None) -> list[int]:
    """Byte limits of successive buckets, from DDP's ``bucket_cap_mb`` / ``bucket_cap_mb_list``.

    PyTorch's rules: a non-empty ``bucket_cap_mb_list`` gives one limit per bucket (the last
    repeats) and overrides ``bucket_cap_mb``; no argument gives ``[1 MiB, 25 MiB]``;
    ``bucket_cap_mb=c`` gives ``[c MiB]`` for every bucket.

    Raises:
        ValueError: a size that is not positive.

    Example:
        >>> bucket_size_limits(None)
        [1048576, 26214400]
        >>> bucket_size_limits(4, [1, 8])
        [1048576, 8388608]
    """
    if bucket_cap_mb_list:
        bad = [c for c in bucket_cap_mb_list if not c > 0]
        if bad:
            raise ValueError(f"bucket_cap_mb_list must hold positive sizes in MiB, got {list(bucket_cap_mb_list)}")
        return [max(1, int(c * MIB)) for c in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB]
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}; the default is 25")
    return [max(1, int(bucket_cap_mb * MIB))]


def compute_bucket_assignment(
    sizes: Sequence[int], keys: Sequence[Any], limits: Sequence[int], order: Sequence[int] | None = None
) -> list[list[int]]:
    """Group tensor indices into buckets of at most about ``limits`` bytes each.

    Tensors are visited in ``order`` (default: reverse index order, which approximates the
    order backward produces gradients). Tensors with different ``keys`` (dtype, device)
    never share a bucket. A bucket is closed as soon as its size reaches the current limit;
    the limits advance one per closed bucket of that key and then stay at the last one
    (PyTorch uses ``[1 MiB, bucket_cap]`` so the first, earliest bucket launches early).

    Args:
        sizes: bytes of each tensor.
        keys: a hashable per tensor; only equal keys share a bucket.
        limits: bucket byte limits, in the order buckets are closed.
        order: visiting order of the indices. Default: ``reversed(range(len(sizes)))``.

    Returns:
        The buckets as lists of indices, in the order they were closed (launch order).

    Example:
        >>> compute_bucket_assignment([4, 4, 4], ["f"] * 3, [8])
        [[2, 1], [0]]
    """
    if not limits or any(lim <= 0 for lim in limits):
        raise ValueError(f"bucket limits must be positive byte counts, got {list(limits)}")
    if order is None:
        order = range(len(sizes) - 1, -1, -1)
    open_buckets: dict[Any, list] = {}  # key -> [indices, bytes, limit position]
    result: list[list[int]] = []
    for i in order:
        acc = open_buckets.setdefault(keys[i], [[], 0, 0])
        acc[0].append(i)
        acc[1] += sizes[i]
        if acc[1] >= limits[acc[2]]:
            result.append(acc[0])
            acc[0], acc[1], acc[2] = [], 0, min(acc[2] + 1, len(limits) - 1)
    result.extend(acc[0] for acc in open_buckets.values() if acc[0])
    return result


class GradBucket:
    """What a communication hook receives: the methods of ``torch.distributed.GradBucket``.

    ``buffer()`` is the flat tensor of the bucket's gradients (not divided by the world
    size); ``gradients()`` are views of it shaped like ``parameters()``.
    """

    def __init__(self, index: int, buffer: torch.Tensor, views: list, params: list, is_last: bool,
                 direct: list | None = None) -> None:
        self._index, self._buffer, self._views, self._params, self._is_last = index, buffer, views, params, is_last
        self._direct = direct  # see [Note: a hook that reads the gradients itself] in the reducer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def direct_gradients(self) -> list[torch.Tensor] | None:
        """dptrain's reducer only: the parameters' own ``.grad`` where this bucket's gradients were
        not copied into ``buffer()``, and the hook must write the averaged ones there (see [Note: a
        hook that reads the gradients itself] in the reducer); None otherwise."""
        return self._direct

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents; a tensor of another dtype replaces the buffer itself."""
        if tensor.dtype == self._buffer.dtype:
            self._buffer.copy_(tensor)
        else:  # e.g. a hook that casts the bucket to its reduction dtype (PyTorch allows it)
            self._buffer = tensor
            self._views = _views_of(tensor, self._params)


def _views_of(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, back to back."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def direct_gradients_of(bucket: Any) -> list[torch.Tensor] | None:
    """What a hook's ``bucket`` says of ``direct_gradients()`` (the ``.grad`` tensors, where dptrain's
    reducer handed them over instead of copies); None for a copied bucket and for PyTorch's
    GradBucket, which has no such method."""
    direct = getattr(bucket, "direct_gradients", None)
    return direct() if direct is not None else None


class _Bucket:
    """One flat buffer and the parameters packed into it."""

    __slots__ = ("index", "indices", "params", "flat", "buffer", "views", "numel", "same_dtype")

    def __init__(
        self,
        index: int,
        indices: list[int],
        params: list[torch.nn.Parameter],
        status_slot: bool,
        dtype: torch.dtype | None = None,
        shm: ShmGroup | None = None,
    ) -> None:
        self.index = index
        self.indices = indices
        self.params = [params[i] for i in indices]
        first = self.params[0]
        self.numel = sum(p.numel() for p in self.params)
        # The last bucket carries two extra elements, summed over the ranks with the gradients:
        # the number of ranks whose backward left parameters without gradient, and of ranks
        # whose observed gradient order calls for other buckets (see the reducer's notes).
        # Padded to a whole number of 1024 elements: an odd-sized buffer splits into unaligned
        # chunks in gloo's ring all-reduce, which measurably slows the sum.
        padded = -(-(self.numel + 2) // _SLOT_ALIGN) * _SLOT_ALIGN if status_slot else self.numel
        if shm is None:
            self.flat = torch.zeros(padded, dtype=dtype or first.dtype, device=first.device)
        else:  # in shared memory: backward writes the gradients where every rank reads them
            self.flat = shm.zeros(padded, dtype or first.dtype, first.device)
        self.buffer = self.flat[: self.numel]
        self.views = _views_of(self.buffer, self.params)
        self.same_dtype = self.flat.dtype == first.dtype  # False: reduced in a grad_dtype of its own


def find_tensors(obj: Any, out: list) -> list:
    """Every tensor inside ``obj`` (nested lists, tuples, dicts, dataclass-like objects)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            find_tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            find_tensors(x, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            find_tensors(getattr(obj, name), out)
    return out


def reached_params(outputs: Any) -> set[int]:
    """ids of the leaf tensors whose AccumulateGrad nodes backward from ``outputs`` can reach."""
    reached: set[int] = set()
    stack, seen = [], set()
    for t in find_tensors(outputs, []):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return reached
