"""PowerSGD gradient compression (Vogels et al., 2019), pipelined and safe on gloo.

PyTorch's hook, same state, arguments and algorithm; three things differ.

[Note: PowerSGD order of collectives]
Each bucket's work is a job of :mod:`dptrain.parallel.ddp._hook_pipeline`: it issues one
all-reduce of ``P`` and the uncompressed tensors together (PyTorch issues two), yields;
computes ``Q``, issues its all-reduce, yields; then decompresses. Jobs are advanced by the hook calls in a fixed order,
so every rank issues the same collectives in the same order (PyTorch issues ``Q`` from a
callback and can abort on gloo), and a bucket's all-reduces overlap the backward of the
next buckets instead of blocking it.

[Note: PowerSGD arithmetic]
Per compressed ``n x m`` gradient ``M`` with rank ``r``, the work is three reads of ``M`` and
one write (``P = M Q``, ``Q^T = P^T M``, ``M = P Q^T``) and, with error feedback, one
add and one subtract. Three choices keep it there:

- ``Q`` is kept transposed (``r x m``): ``P^T M`` reads ``M`` row by row, where PyTorch's
  ``M^T P`` walks it by columns (measured 20-30x slower on a CPU for ``r <= 4``).
- The error buffer holds the corrected gradient ``M + e`` while the bucket is compressed
  and becomes ``(M + e) - P Q^T`` in place afterwards: no per-step copy or allocation of
  bucket-sized tensors (PyTorch clones the bucket and allocates a new error every step,
  two page-faulting allocations of the gradient's size).
- ``P Q^T`` for ``r <= 4`` is a sum of ``r`` outer products written by elementwise kernels
  (bitwise the same on every rank): measured 0.3 ms for a 1024 x 1024 matrix at rank 4,
  against 0.9 ms for the matrix product, whose inner dimension is too small for BLAS to be
  efficient; larger ranks use the matrix product. ``P`` and ``Q`` of same-shaped gradients lie next to each other, so each
  group is orthogonalised by one batched Gram-Schmidt (or QR for ``r > 2``, as PyTorch).

The values are PyTorch's up to fp32 rounding: the same random ``Q`` (same seeds), the same
orthogonalisation, the same division of ``Q`` and of the uncompressed tensors by the world
size after their all-reduce.
"""

# No `from __future__ import annotations`: PyTorch's DDP checks the hook's annotations
# (bucket: dist.GradBucket, return Future[Tensor]) and rejects string annotations.

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dptrain.parallel.ddp._buckets import _views_of, direct_gradients_of
from dptrain.parallel.ddp._hook_pipeline import HookPipeline, Job, allreduce_mean_future, issue_all_reduce

__all__ = ["PowerSGDState", "powerSGD_hook"]

logger = logging.getLogger(__name__)


class PowerSGDState:
    """State of :func:`powerSGD_hook`, kept across iterations (PyTorch's arguments and defaults).

    Args:
        process_group: group to average over; None means the world.
        matrix_approximation_rank: rank ``r`` of the approximation ``P @ Q.T``: lower
            compresses more; 1-4 is usual. Default 1.
        start_powerSGD_iter: iterations of plain all-reduce before compression starts (the
            early, fast-changing gradients go through uncompressed; PyTorch suggests about
            10 % of training). Default 1000.
        min_compression_rate: compress an ``n x m`` gradient only when
            ``(n + m) * r * min_compression_rate < n * m``; the others are averaged
            uncompressed, as are vectors (biases, norms). Default 2.
        use_error_feedback: add what compression lost last time to the gradient before
            compressing (needed for convergence). Default True.
        warm_start: start from last iteration's ``Q`` instead of a fresh random one. Default True.
        orthogonalization_epsilon: added to column norms when orthogonalising; 0 keeps an
            all-zero column zero (PyTorch would produce NaN there). Default 0.
        random_seed: seed of the random ``Q`` (the same on every rank). Default 0.
        compression_stats_logging_frequency: iterations between compression-rate log
            records (``logging`` at INFO). Default 10000.
        batch_tensors_with_same_shape: accepted for PyTorch compatibility; same-shaped
            gradients are always orthogonalised together here. Default False.

    Raises:
        ValueError: a rank below 1, a negative ``start_powerSGD_iter`` or a
            ``min_compression_rate`` below 1.

    Bucket layouts may change (DDP rebuilds its buckets after the first iteration): the
    error and ``Q`` of a bucket whose parameters changed start afresh, so unlike PyTorch a
    ``start_powerSGD_iter`` of 0 or 1 is allowed.

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
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = np.random.RandomState(random_seed)  # seeds of the random Q, in the same order on every rank
        self.error_dict: dict[int, torch.Tensor] = {}  # bucket index -> corrected gradient / local error
        self.p_memory_dict: dict[int, torch.Tensor] = {}  # bucket index -> every P of the bucket, flat (a view)
        self.q_memory_dict: dict[int, torch.Tensor] = {}  # bucket index -> every Q (transposed), flat
        self.iter = 0  # synced backward passes seen (counted on the last bucket)
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self._plans: dict[int, _BucketPlan] = {}
        self._pipeline: HookPipeline | None = None

    def maybe_increase_iter(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after), summed over compressed iterations."""
        after = self.total_numel_after_compression
        before = self.total_numel_before_compression
        return (before / after if after else 0.0), before, after

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for transient in ("process_group", "_pipeline", "_plans"):
            state.pop(transient, None)  # process groups do not pickle; plans hold views of live buckets
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = None
        self._pipeline = None
        self._plans = {}


class _BucketPlan:
    """Which gradients of a bucket are compressed, and where their P and Q live.

    Matrices are grouped by shape in first-seen order (PyTorch's order, which fixes the
    order in which random ``Q`` are drawn); each group's ``P`` (``B x n x r``) and ``Q^T``
    (``B x r x m``) are contiguous slices of the bucket's flat P and Q memories.
    """

    def __init__(self, state: PowerSGDState, bucket: Any, buffer: torch.Tensor, grads: list[torch.Tensor]) -> None:
        self.signature = _signature(bucket, buffer, grads)
        self.numel_before = sum(g.numel() for g in grads)
        groups: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
        self.vectors: list[int] = []  # the places in the bucket of the gradients sent uncompressed
        compressed = 0
        for i, g in enumerate(grads):
            n = g.shape[0] if g.dim() > 0 else 1
            m = g.numel() // n if n else 0
            r = min(n, m, state.matrix_approximation_rank)
            if g.dim() > 1 and (n + m) * r * state.min_compression_rate < n * m:
                groups.setdefault((n, m), []).append(i)
                compressed += (n + m) * r
            else:
                self.vectors.append(i)
                compressed += g.numel()
        self.numel_after = compressed
        self.vector_sizes = [grads[i].numel() for i in self.vectors]
        self.vector_numel = sum(self.vector_sizes)
        # (place in the bucket, n, m) per compressed matrix, in group order.
        self.matrices: list[tuple[int, int, int]] = []
        self.groups: list[tuple[int, int, int, int]] = []  # (n, m, r, count)
        for (n, m), members in groups.items():
            r = min(n, m, state.matrix_approximation_rank)
            self.groups.append((n, m, r, len(members)))
            self.matrices.extend((i, n, m) for i in members)
        self.p_numel = sum(b * n * r for n, _, r, b in self.groups)
        self.q_numel = sum(b * m * r for _, m, r, b in self.groups)
        self.first = buffer.new_empty(self.p_numel + self.vector_numel)  # P, then the uncompressed

    def views(self, p_mem: torch.Tensor, q_mem: torch.Tensor) -> tuple[list, list, list, list]:
        """Per group (B,n,r) P and (B,r,m) Q^T; per matrix (n,r) P and (r,m) Q^T."""
        p_groups, q_groups, ps, qts = [], [], [], []
        p_off = q_off = 0
        for n, m, r, b in self.groups:
            pg = p_mem[p_off : p_off + b * n * r].view(b, n, r)
            qg = q_mem[q_off : q_off + b * m * r].view(b, r, m)
            p_off += b * n * r
            q_off += b * m * r
            p_groups.append(pg)
            q_groups.append(qg)
            ps.extend(pg.unbind(0))
            qts.extend(qg.unbind(0))
        return p_groups, q_groups, ps, qts


def _signature(bucket: Any, buffer: torch.Tensor, grads: list[torch.Tensor]) -> tuple:
    # A bucket is "the same" while it holds the same parameters in the same places: after a
    # bucket rebuild, index k may hold other parameters and its error must not be reused.
    params = tuple(p.data_ptr() for p in bucket.parameters())
    shapes = tuple(tuple(g.shape) for g in grads)
    return (buffer.numel(), buffer.dtype, buffer.device, params, shapes)


def _orthonormalize_rows_(x: torch.Tensor, epsilon: float) -> None:
    """Orthonormalise the ``r`` rows of each matrix of ``x`` (``B x r x L``), in place.

    PyTorch's choice: Gram-Schmidt for ``r <= 2`` or 16-bit types, else QR. With
    ``epsilon == 0`` an all-zero row stays zero (PyTorch divides by zero there).
    """
    r = x.shape[1]
    if r > 2 and x.dtype not in (torch.float16, torch.bfloat16):
        q, _ = torch.linalg.qr(x.transpose(1, 2))
        x.copy_(q.transpose(1, 2))
        return
    for i in range(r):
        row = x[:, i : i + 1, :]
        norm = torch.linalg.vector_norm(row, dim=2, keepdim=True)
        if epsilon == 0:
            norm = torch.where(norm == 0, torch.ones_like(norm), norm)
        else:
            norm = norm + epsilon
        row.div_(norm)
        if i + 1 < r:
            rest = x[:, i + 1 :, :]
            rest.sub_((row * rest).sum(dim=2, keepdim=True) * row)


def _decompress(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
    """``out = p @ qt`` (see [Note: PowerSGD arithmetic] for why outer products for r <= 4)."""
    r = p.shape[1]
    if r > 4:
        torch.mm(p, qt, out=out)
        return
    torch.mul(p[:, 0:1], qt[0:1], out=out)
    for j in range(1, r):
        out.addcmul_(p[:, j : j + 1], qt[j : j + 1])


def _random_q(state: PowerSGDState, plan: _BucketPlan, q_groups: list, qts: list) -> None:
    # PyTorch's draw: a seed from the state's RNG, then one standard normal (1, m, r) per
    # matrix in group order, on the CPU with the global RNG forked (nothing else changes).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(state.rng.randint(1_000_000_000))
        for qt in qts:
            m, r = qt.shape[1], qt.shape[0]
            qt.copy_(torch.randn(1, m, r, device="cpu", dtype=qt.dtype)[0].t())
    for qg in q_groups:
        _orthonormalize_rows_(qg, state.orthogonalization_epsilon)


def _plan_for(state: PowerSGDState, bucket: Any, buffer: torch.Tensor,
              grads: list[torch.Tensor]) -> tuple[_BucketPlan, bool]:
    """The bucket's plan, and whether its Q must be drawn afresh (new layout, or no warm start).
    ``grads``: the bucket's ``gradients()``."""
    index = bucket.index()
    plan = state._plans.get(index)
    fresh = plan is None or plan.signature != _signature(bucket, buffer, grads)
    if fresh:
        plan = _BucketPlan(state, bucket, buffer, grads)
        state._plans[index] = plan
        state.error_dict.pop(index, None)
        state.q_memory_dict[index] = buffer.new_empty(plan.q_numel)
    elif index not in state.q_memory_dict:  # no warm start: cleared after every iteration
        state.q_memory_dict[index] = buffer.new_empty(plan.q_numel)
        fresh = True
    return plan, fresh


def _compress_bucket(state: PowerSGDState, bucket: Any, group: Any, world_size: int) -> Job:
    """One bucket's job: see [Note: PowerSGD order of collectives]."""
    buffer = bucket.buffer()
    index = bucket.index()
    layout = bucket.gradients()  # the buffer's views, shaped as the gradients (PyTorch's GradBucket too)
    plan, fresh = _plan_for(state, bucket, buffer, layout)
    # Each gradient's input and output: the buffer's views, or with dptrain's reducer the .grad
    # tensors themselves, neither copied into the buffer nor copied back (see [Note: a hook that
    # reads the gradients itself] in dptrain/parallel/ddp/_reducer.py). Same operations either way.
    grads = direct_gradients_of(bucket)
    outs = layout if grads is None else grads
    ins = outs
    if state.use_error_feedback:
        error = state.error_dict.get(index)
        if error is None:
            error = state.error_dict[index] = torch.zeros_like(buffer)
        # Now the corrected gradient; the error again after decompression.
        ins = _views_of(error, layout)
        if grads is None:
            error.add_(buffer)
        else:
            torch._foreach_add_(ins, outs)
    state.total_numel_before_compression += plan.numel_before
    state.total_numel_after_compression += plan.numel_after
    _report_stats(state, bucket)

    # P and the uncompressed gradients travel in one all-reduce: one round trip fewer per bucket.
    first = plan.first
    p_mem, q_mem = first[: plan.p_numel], state.q_memory_dict[index]
    state.p_memory_dict[index] = p_mem
    vectors = first[plan.p_numel :]
    if plan.vectors:
        torch.cat([ins[k].view(-1) for k in plan.vectors], out=vectors)
    if plan.matrices:
        p_groups, q_groups, ps, qts = plan.views(p_mem, q_mem)
        mats = [ins[k].view(n, m) for k, n, m in plan.matrices]
        if fresh:
            _random_q(state, plan, q_groups, qts)
        else:
            for qg in q_groups:
                _orthonormalize_rows_(qg, state.orthogonalization_epsilon)
        for mat, p, qt in zip(mats, ps, qts):
            torch.mm(mat, qt.t(), out=p)
    # P is orthonormalised next, so its sum needs no division by the world size.
    yield issue_all_reduce(first, group), "PowerSGD all-reduce of P and uncompressed gradients"

    if plan.vectors:
        vectors.div_(world_size)
        torch._foreach_copy_([outs[k].view(-1) for k in plan.vectors], list(vectors.split(plan.vector_sizes)))
    if plan.matrices:
        for pg in p_groups:
            _orthonormalize_rows_(pg.transpose(1, 2), state.orthogonalization_epsilon)
        for mat, p, qt in zip(mats, ps, qts):
            torch.mm(p.t(), mat, out=qt)
        yield issue_all_reduce(q_mem, group), "PowerSGD all-reduce of Q"

        q_mem.div_(world_size)
        for (k, n, m), p, qt in zip(plan.matrices, ps, qts):
            _decompress(p, qt, outs[k].view(n, m))
    if state.use_error_feedback:
        if grads is None:
            error.sub_(buffer)
        else:
            torch._foreach_sub_(ins, outs)
    if not state.warm_start:
        state.p_memory_dict.pop(index, None)
        state.q_memory_dict.pop(index, None)
    state.maybe_increase_iter(bucket)
    return buffer


def _report_stats(state: PowerSGDState, bucket: Any) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info("Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
                    state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _reads_gradients(state: PowerSGDState) -> bool:
    """Whether the hook's next bucket may come with its ``.grad`` tensors instead of copies (dptrain's
    reducer asks; see [Note: a hook that reads the gradients itself] there): once it compresses with
    error feedback. The matrix products then read the error buffer, laid out as the bucket is, either
    way; without error feedback they would read ``.grad`` instead of the bucket's views, and BLAS may
    round a product differently at another memory alignment (measured: 1 ulp-sized differences)."""
    return state.use_error_feedback and state.iter >= state.start_powerSGD_iter


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Low-rank gradient compression: all-reduce ``P`` and ``Q`` instead of each ``n x m`` matrix.

    For every matrix-shaped gradient ``M`` worth compressing (see ``min_compression_rate``),
    with error feedback ``M += error``: ``P = M @ Q``, all-reduce ``P``, orthogonalise it,
    ``Q = M.T @ P``, all-reduce ``Q`` and divide by the world size, and ``M ~ P @ Q.T``.
    Vectors (biases, norms) and small matrices are averaged uncompressed. Before
    ``state.start_powerSGD_iter`` every bucket is plainly all-reduced.

    The collectives of all buckets are issued in one fixed order on every rank and overlap
    backward (see [Note: PowerSGD order of collectives]); the future of each bucket is
    complete once the last bucket's hook returns. Works with dptrain's and PyTorch's DDP.

    Example:
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, powerSGD_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_mean_future(group, bucket.buffer())
    if state._pipeline is None:
        state._pipeline = HookPipeline(group)
    job = _compress_bucket(state, bucket, group, dist.get_world_size(group))
    return state._pipeline.submit(job, bucket.index(), bucket.is_last())


powerSGD_hook.reads_gradients = _reads_gradients
