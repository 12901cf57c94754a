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

from typing import Any

import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: PyTorch's DDP inspects a hook's annotations
# (bucket: dist.GradBucket, return Future[Tensor]) and rejects string annotations.

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


def allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
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


def fp16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in float16 (half the bytes), then cast back.

    The gradients are divided by the world size *before* the cast, so the sum does not
    overflow float16's range of about 65504 for gradients that fit it per rank.

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


class PowerSGDState:
    """State of :func:`powerSGD_hook`, kept across iterations (PyTorch's arguments and defaults).

    Args:
        process_group: group to average over; None means the world.
        matrix_approximation_rank: rank ``r`` of the approximation ``P @ Q.T``. Default 1.
        start_powerSGD_iter: iterations of plain all-reduce before compression starts (let the
            early, fast-changing gradients through uncompressed). Default 1000.
        min_compression_rate: compress a ``n x m`` gradient only when
            ``n * m > min_compression_rate * r * (n + m)``. Default 2.
        use_error_feedback: add the previous iteration's local compression error to the
            gradient before compressing (keeps the method unbiased over time). Default True.
        warm_start: reuse last iteration's ``Q`` instead of a fresh random one. Default True.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt. Default 0.
        random_seed: seed of the initial ``Q`` (the same on every rank). Default 0.
        compression_stats_logging_frequency: accepted for compatibility. Default 10000.
        batch_tensors_with_same_shape: accepted for compatibility. Default False.

    Raises:
        ValueError: a rank below 1, a negative ``start_powerSGD_iter`` or a
            ``min_compression_rate`` below 1.

    Example:
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, powerSGD_hook)
    """

    def __init__(
        self,
        process_group: Any = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        if start_powerSGD_iter < 0:
            raise ValueError(f"start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}")
        if min_compression_rate < 1:
            raise ValueError(
                f"min_compression_rate must be >= 1 (compress only when it saves bytes), got {min_compression_rate}"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.compression_stats_logging_frequency = compression_stats_logging_frequency
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.iter = 0  # synced backward passes seen (counted on the last bucket)
        self.error_dict: dict[int, torch.Tensor] = {}  # bucket index -> local compression error
        self.q_memory_dict: dict[int, list[torch.Tensor]] = {}  # bucket index -> Q per matrix (warm start)
        self._generator = torch.Generator().manual_seed(random_seed)
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after) summed over compressed buckets."""
        after = self.total_numel_after_compression
        before = self.total_numel_before_compression
        return (before / after if after else 0.0), before, after

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("process_group", None)  # process groups do not pickle; re-set after loading
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = None


def _orthogonalize_(matrix: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``matrix``, in place (r is small: a loop is cheapest)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        norm = col.norm()
        if epsilon == 0 and norm == 0:
            col.zero_()  # an all-zero column stays zero instead of becoming NaN
        else:
            col.div_(norm + epsilon)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Low-rank gradient compression: all-reduce ``P`` and ``Q`` instead of each ``n x m`` matrix.

    For every matrix-shaped gradient ``M`` worth compressing (see ``min_compression_rate``),
    with error feedback ``M += error``: ``P = M @ Q``, all-reduce ``P``, orthogonalise it,
    ``Q = M.T @ P``, all-reduce ``Q`` and divide by the world size, and ``M ≈ P @ Q.T``.
    Vectors (biases, norms) and small matrices are averaged uncompressed. Before
    ``state.start_powerSGD_iter`` every bucket is plainly all-reduced.

    Example:
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1)
        >>> model.register_comm_hook(state, powerSGD_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_mean_future(group, buffer)

    index = bucket.index()
    # DDP rebuilds its buckets once, after its first iterations: state kept for a bucket of
    # the old layout does not fit the new one, so it starts afresh.
    if index in state.error_dict and state.error_dict[index].shape != buffer.shape:
        del state.error_dict[index]
        state.q_memory_dict.pop(index, None)
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(buffer)
        local_copy = buffer.clone()

    rank = state.matrix_approximation_rank
    matrices, vectors = [], []
    for grad in bucket.gradients():
        m = grad.view(grad.shape[0], -1) if grad.dim() > 1 else None
        if m is not None and m.shape[0] * m.shape[1] > state.min_compression_rate * min(rank, *m.shape) * sum(m.shape):
            matrices.append(m)
        else:
            vectors.append(grad)
    state.total_numel_before_compression += sum(m.numel() for m in matrices)
    state.total_numel_after_compression += sum(min(rank, *m.shape) * sum(m.shape) for m in matrices)

    fits = [q.shape[0] for q in state.q_memory_dict.get(index, [])] == [m.shape[1] for m in matrices]
    if index not in state.q_memory_dict or not state.warm_start or not fits:
        qs = []
        for m in matrices:
            q = torch.randn(m.shape[1], min(rank, *m.shape), generator=state._generator).to(m.device, m.dtype)
            _orthogonalize_(q, state.orthogonalization_epsilon)
            qs.append(q)
        state.q_memory_dict[index] = qs
    qs = state.q_memory_dict[index]

    flat_vectors = torch.cat([v.reshape(-1) for v in vectors]) if vectors else buffer.new_zeros(0)
    flat_vectors.div_(world_size)
    ps = [m @ q for m, q in zip(matrices, qs)]
    flat_ps = torch.cat([p.reshape(-1) for p in ps]) if ps else buffer.new_zeros(0)
    # [Note: PowerSGD runs its collectives inline]
    # The Q all-reduce depends on the P all-reduce. Issuing it from a future callback (a
    # communication thread) could order it differently from the next bucket's all-reduce on
    # different ranks, and gloo matches collectives by order. So the three collectives are
    # issued here, in the caller's thread, and the hook returns a completed future.
    vec_work = dist.all_reduce(flat_vectors, group=group, async_op=True)
    p_work = dist.all_reduce(flat_ps, group=group, async_op=True)
    p_work.wait()
    offset, new_qs = 0, []
    for m, p in zip(matrices, ps):
        p.copy_(flat_ps[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
        _orthogonalize_(p, state.orthogonalization_epsilon)
        new_qs.append(m.t() @ p)
    flat_qs = torch.cat([q.reshape(-1) for q in new_qs]) if new_qs else buffer.new_zeros(0)
    dist.all_reduce(flat_qs, group=group)
    flat_qs.div_(world_size)
    offset = 0
    for q_mem, q in zip(qs, new_qs):
        q_mem.copy_(flat_qs[offset : offset + q.numel()].view_as(q))
        offset += q.numel()
    # Decompress: matrices from P @ Q.T, vectors from their plain average.
    for m, p, q in zip(matrices, ps, qs):
        torch.matmul(p, q.t(), out=m)
    vec_work.wait()
    offset = 0
    for v in vectors:
        v.copy_(flat_vectors[offset : offset + v.numel()].view_as(v))
        offset += v.numel()
    if state.use_error_feedback:
        state.error_dict[index] = local_copy - buffer
    state.maybe_increase_iter(bucket)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut
