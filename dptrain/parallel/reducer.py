"""The gradient reducer behind :class:`dptrain.DistributedDataParallel`.

Parameters that require a gradient are packed into flat *buckets*, in reverse registration
order (the order backward usually produces their gradients). Each parameter carries one
post-accumulate-grad hook that copies the gradient into its slot of the bucket (scaled by
``1 / world_size``); when every gradient of a bucket is in, an asynchronous all-reduce of
the bucket is launched, so communication
overlaps the rest of backward. Buckets are launched strictly in order, the same on every
rank. A callback queued on the autograd engine runs once backward is over: it waits for
the buckets and writes the averaged gradients back into ``param.grad``.

[Note: bitwise parity with PyTorch]
PyTorch's C++ reducer scales each gradient by ``1 / world_size`` *before* the sum
(``mul_out(bucket_view, grad, 1/div)``, or ``bucket_view.div_(div)`` when the gradient
already is a bucket view), then all-reduces with SUM and copies the result out. We do the
same operations with the same scalars, so on two ranks the results are bitwise equal; the
bucket layout does not matter for an elementwise two-term sum. With three or more ranks
gloo's ring order depends on the chunk an element falls in, so results agree to fp32
rounding.

[Note: no bucket rebuild]
PyTorch 2.13 starts with a single bucket and rebuilds the buckets in gradient-ready order
after the first iteration. We build the buckets once, in reverse registration order with
PyTorch's limits ([1 MiB, 25 MiB]); for ResNet-18 and MLPs this gives exactly PyTorch's
rebuilt bucket sizes, values are unaffected (see above), and every rank lays out the same
buckets without having to agree on an observed order.

[Note: the status slot]
The last bucket carries one extra element: 1 on a rank whose backward left parameters
without a gradient (it then launches its remaining buckets with zeros, so nobody hangs).
After the all-reduce every rank knows how many ranks failed, and every rank raises at its
next forward, not only the one that holds the unused parameter.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from dptrain import _diagnostics

__all__ = ["Reducer", "GradBucket", "compute_bucket_assignment", "DEFAULT_FIRST_BUCKET_BYTES"]

_MIB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * _MIB  # PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_CAP_MB = 25
_SLOT_ALIGN = 1024  # elements; see _Bucket


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

    def __init__(self, index: int, buffer: torch.Tensor, views: list, params: list, is_last: bool) -> None:
        self._index, self._buffer, self._views, self._params, self._is_last = index, buffer, views, params, is_last

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

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class _Bucket:
    """One flat buffer and the parameters packed into it."""

    __slots__ = ("index", "indices", "params", "flat", "buffer", "views", "numel")

    def __init__(
        self, index: int, indices: list[int], params: list[torch.nn.Parameter], status_slot: bool, shm: Any = None
    ) -> None:
        self.index = index
        self.indices = indices
        self.params = [params[i] for i in indices]
        first = self.params[0]
        self.numel = sum(p.numel() for p in self.params)
        # The last bucket carries one extra element, the number of ranks whose backward left
        # parameters without gradient, so that every rank learns of it (see _finalize_backward).
        # Padded to a whole number of 1024 elements: an odd-sized buffer splits into unaligned
        # chunks in gloo's ring all-reduce, which measurably slows the sum.
        padded = -(-(self.numel + 1) // _SLOT_ALIGN) * _SLOT_ALIGN if status_slot else self.numel
        if shm is None:
            self.flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        else:  # in shared memory: backward writes the gradients where every rank reads them
            self.flat = shm.zeros(padded, first.dtype, first.device)
        self.buffer = self.flat[: self.numel]
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()


def _find_tensors(obj: Any, out: list) -> list:
    """Every tensor inside ``obj`` (nested lists, tuples, dicts, dataclass-like objects)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _find_tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _find_tensors(x, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _find_tensors(getattr(obj, name), out)
    return out


def _reached_params(outputs: Any) -> set[int]:
    """ids of the leaf tensors whose AccumulateGrad nodes backward from ``outputs`` can reach."""
    reached: set[int] = set()
    stack, seen = [], set()
    for t in _find_tensors(outputs, []):
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


class Reducer:
    """Buckets, per-parameter hooks, async all-reduce and the write-back after backward.

    Built by :class:`dptrain.DistributedDataParallel`; users do not construct it.

    Args:
        params: parameters that require grad, each once (shared ones deduplicated).
        names: their qualified names, for error messages.
        process_group: the group to reduce over.
        bucket_cap_mb: bucket size in MiB; None means 25 with a 1 MiB first bucket.
        gradient_as_bucket_view: leave ``.grad`` as views into the bucket buffers.
        find_unused_parameters: walk the autograd graph each iteration and mark
            parameters it cannot reach as ready.
        static_graph: learn the used parameters and hook counts in the first iteration.
        shm: a :class:`dptrain._shm.ShmGroup` over ``process_group``: buckets live in shared
            memory and are all-reduced there instead of with ``dist.all_reduce``. Default None.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: Any,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        shm: Any = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters and not static_graph
        self.static_graph = static_graph
        if bucket_cap_mb is None:
            limits = [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * _MIB]
        else:
            if bucket_cap_mb <= 0:
                raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}; the default is 25")
            limits = [max(1, int(bucket_cap_mb * _MIB))]
        self.bucket_limits = limits
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        assignment = compute_bucket_assignment(sizes, keys, limits)
        self.shm = shm
        self.buckets = [
            _Bucket(b, idx, self.params, b == len(assignment) - 1, shm) for b, idx in enumerate(assignment)
        ]
        self._bucket_of = [0] * len(self.params)
        for bucket in self.buckets:
            for i in bucket.indices:
                self._bucket_of[i] = bucket.index
        self._bucket_count = [len(b.indices) for b in self.buckets]
        self._views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):
                self._views[i] = view
        self.comm_hook: Callable | None = None
        self.comm_hook_state: Any = None
        self.num_iterations = 0  # synced backward passes so far

        # Per-iteration state, reset by prepare_for_backward().
        self._expect_hooks = False
        self._pending: list[int] = []
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        self._works: list[Any] = []
        self._first_hook_seen = False
        self._unused_now: list[int] = []
        self._div: int | None = None
        self._inv = 1.0
        self._div_work: Any = None
        self._error: str | None = None
        self._status_event: Any = None  # CUDA: event after copying the last bucket's status slot
        self._status_host: torch.Tensor | None = None
        # Locally used parameters since the last synced backward (find_unused / static graph).
        self._local_used = bytearray(len(self.params))
        self._global_unused: list[bool] | None = None
        self._used_reduced: torch.Tensor | None = None  # the all-reduced used map, reused in place
        # static_graph: how many times each hook fires per backward, learnt in iteration 1.
        self._static_counts: list[int] | None = None
        self._static_remaining: list[int] = []
        self._hook_counts: list[int] = []

        self_ref = weakref.ref(self)
        self._handles = [
            p.register_post_accumulate_grad_hook(_make_hook(self_ref, i)) for i, p in enumerate(self.params)
        ]

    def __del__(self) -> None:
        for h in getattr(self, "_handles", ()):
            h.remove()

    # ------------------------------------------------------------------ forward side
    def _other_ranks_failed(self, count: int) -> str:
        return (
            f"DistributedDataParallel on rank {dist.get_rank()}: in the previous backward {count} other "
            "rank(s) produced no gradient for some parameters (their error names them). Pass "
            "find_unused_parameters=True to DistributedDataParallel(...) when the set of parameters used "
            "in forward can differ between ranks or iterations."
        )

    def check_prior_reduction(self) -> None:
        """Raise the error recorded by the previous backward (parameters that got no grad)."""
        if self._status_event is not None:
            self._status_event.synchronize()
            self._status_event = None
            if self._error is None and self._status_host.item() > 0:
                self._error = self._other_ranks_failed(int(self._status_host.item()))
        if self._error is not None:
            msg, self._error = self._error, None
            raise RuntimeError(msg)

    def set_divisor_work(self, work: Any, use_static_world_size: bool) -> None:
        """Join: the all-reduce counting the ranks that have not joined; used as divisor unless static."""
        self._div_work = None if use_static_world_size else work

    def prepare_for_backward(self, outputs: Any = None) -> None:
        """Arm the hooks for the next backward; with find_unused, find unreachable parameters."""
        self._expect_hooks = True
        self._pending = list(self._bucket_count)
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        self._works = [None] * len(self.buckets)
        self._first_hook_seen = False
        self._div = None
        if self.find_unused_parameters:
            reached = _reached_params(outputs)
            self._unused_now = [i for i, p in enumerate(self.params) if id(p) not in reached]
        elif self.static_graph and self._static_counts is not None:
            self._static_remaining = list(self._static_counts)
            self._unused_now = [i for i, c in enumerate(self._static_counts) if c == 0]
        else:
            self._unused_now = []

    @property
    def _static_first_iteration(self) -> bool:
        return self.static_graph and self._static_counts is None

    @property
    def _tracks_used(self) -> bool:
        return self.find_unused_parameters or self._static_first_iteration

    # ------------------------------------------------------------------ backward side
    def backward_started(self) -> None:
        """Start of a synced backward: queue the end-of-backward callback, mark unused params ready.

        Called by the sink that DistributedDataParallel puts on the forward outputs, so the
        callback belongs to the outer backward even when the first gradient hook fires inside
        a reentrant (checkpointed) backward; the first hook calls it when there is no sink.
        """
        if not self._expect_hooks or self._first_hook_seen:
            return
        self._first_hook_seen = True
        Variable._execution_engine.queue_callback(self._finalize_backward)
        if self._static_first_iteration:
            self._hook_counts = [0] * len(self.params)
        for j in self._unused_now:
            self._mark_ready(j)

    def _on_grad_ready(self, i: int) -> None:
        # The hot path: one call per parameter per backward; plain attributes only.
        if self.static_graph or self.find_unused_parameters:
            if self._tracks_used and self.params[i].grad is not None:
                self._local_used[i] = 1
            if self._expect_hooks and self._static_first_iteration:
                if not self._first_hook_seen:
                    self.backward_started()
                self._hook_counts[i] += 1  # reduction is delayed to the end of this backward
                return
        if not self._expect_hooks:
            return  # no_sync / eval forward: plain local accumulation
        if not self._first_hook_seen:
            self.backward_started()
        if self.static_graph:
            self._static_remaining[i] -= 1
            if self._static_remaining[i] > 0:
                return
        if self._ready[i]:
            raise RuntimeError(
                f"DistributedDataParallel on rank {dist.get_rank()}: parameter '{self.names[i]}' received its "
                "gradient twice in one backward (reentrant backward such as activation checkpointing, or a "
                "module called twice with a reentrant graph). Pass static_graph=True if the graph is the "
                "same every iteration."
            )
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = 1
        if self._div is None:
            self._divisor()
        self._copy_in(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0 and b == self._next_bucket:
            while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
                self._launch(self.buckets[self._next_bucket])
                self._next_bucket += 1

    def _divisor(self) -> int:
        if self._div is None:
            self._div = self.world_size
            if self._div_work is not None:
                self._div_work.wait()
                self._div = int(self._div_work.get_future().value()[0].item())
                self._div_work = None
            self._inv = 1.0 / self._div
        return self._div

    def _copy_in(self, i: int) -> None:
        """Copy parameter ``i``'s gradient into its bucket view as soon as it is ready.

        Copying on arrival (as PyTorch does) hides the copies inside backward; only the last
        gradient's copy stands between a full bucket and its all-reduce.
        """
        p, view = self.params[i], self._views[i]
        g = p.grad
        divide = self.comm_hook is None  # a hook divides by itself (PyTorch's contract)
        if g is None:
            view.zero_()  # unused here: contribute zeros
            return
        if g.layout != torch.strided:
            raise RuntimeError(
                f"DistributedDataParallel on rank {dist.get_rank()}: parameter '{self.names[i]}' has a "
                f"{g.layout} gradient; dptrain's reducer averages dense gradients only. Build the layer "
                "with sparse=False (e.g. nn.Embedding(..., sparse=False))."
            )
        if self.gradient_as_bucket_view and g.data_ptr() == view.data_ptr():
            if divide:
                view.div_(self._divisor())  # what PyTorch does to a gradient that is a bucket view
            return
        if divide:
            torch.mul(g, self._inv, out=view)  # scale while copying: PyTorch's mul_out(view, grad, 1/div)
        else:
            view.copy_(g)
        if self.gradient_as_bucket_view:
            p.grad = view

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.index == 0:
            # For stall reports: this rank is now inside the gradient all-reduce of this step.
            _diagnostics.enter("DDP gradient all-reduce")
        if self.comm_hook is None:
            if bucket.flat.numel() > bucket.numel:
                bucket.flat[bucket.numel] = float(self._error is not None)
            self._works[bucket.index] = self._all_reduce(bucket.flat, bucket.index)
        else:
            self._works[bucket.index] = self._run_hook(bucket, bucket.buffer)

    def _all_reduce(self, flat: torch.Tensor, index: int) -> Any:
        """Sum one bucket across ranks, asynchronously: in shared memory on one node, else gloo/NCCL.

        In shared memory a bucket's bytes meet at the bucket's own place on every rank, also
        when a joined rank all-reduces zeros (``flat`` is then not the bucket itself).
        """
        if self.shm is not None:
            return self.shm.all_reduce(flat, tag=f"bucket {index}", slot=self.buckets[index].flat)
        return dist.all_reduce(flat, group=self.process_group, async_op=True)

    def _run_hook(self, bucket: _Bucket, buffer: torch.Tensor) -> Any:
        is_last = bucket.index == len(self.buckets) - 1
        grad_bucket = GradBucket(bucket.index, buffer, bucket.views, bucket.params, is_last)
        if buffer is not bucket.buffer:
            offs, views = 0, []
            for p in bucket.params:
                views.append(buffer[offs : offs + p.numel()].view(p.shape))
                offs += p.numel()
            grad_bucket._views = views
        fut = self.comm_hook(self.comm_hook_state, grad_bucket)
        if not callable(getattr(fut, "wait", None)):  # torch.futures.Future or torch._C.Future
            raise TypeError(
                f"communication hook {getattr(self.comm_hook, '__qualname__', self.comm_hook)} returned "
                f"{type(fut).__name__}; it must return a torch.futures.Future holding the bucket's tensor"
            )
        return fut

    def _finalize_backward(self) -> None:
        """Runs once per synced backward, after autograd finished: wait, then write back."""
        self._expect_hooks = False
        self.num_iterations += 1
        track_used = self._tracks_used
        if self._static_first_iteration:
            # First static-graph iteration: everything reduced now, unused params included.
            self._static_counts = list(self._hook_counts)
            for i in range(len(self.params)):
                self._mark_ready(i)
        write_back = True
        if self.find_unused_parameters and self._next_bucket < len(self.buckets):
            # Reachable from the outputs but no gradient arrived (e.g. an output left out of the
            # loss): with find_unused_parameters that is just one more unused parameter.
            for i in range(len(self.params)):
                if not self._ready[i]:
                    self._mark_ready(i)
        if self._next_bucket < len(self.buckets):
            missing = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
            self._error = (
                f"DistributedDataParallel on rank {dist.get_rank()}: the previous backward produced no gradient "
                f"for {len(missing)} parameter(s): {', '.join(repr(n) for n in missing[:20])}"
                f"{' ...' if len(missing) > 20 else ''}. These parameters were not used to compute the loss, so "
                "their gradients could not be reduced. Fix: pass find_unused_parameters=True to "
                "DistributedDataParallel(...), or make sure every parameter takes part in the loss "
                "(or set requires_grad=False on the ones you do not train)."
            )
            # Launch the rest anyway (zeros for the missing) so that ranks stay matched and none hangs;
            # gradients stay local, as PyTorch leaves them, and the error is raised at the next forward.
            write_back = False
            for i in range(len(self.params)):
                if not self._ready[i]:
                    self._mark_ready(i)
        used_work = used = None
        if track_used:
            device = self.params[0].device
            used = self._used_map(device)
            used.copy_(torch.tensor(list(self._local_used), dtype=torch.int32))
            used_work = dist.all_reduce(used, group=self.process_group, async_op=True)
        if used_work is not None:
            used_work.wait()
            self._global_unused = [u == 0 for u in used.tolist()]
            self._local_used = bytearray(len(self.params))
        elif not self.static_graph:
            self._global_unused = None
        # Copy each bucket out as soon as its own all-reduce is done, overlapping the copies
        # with the buckets still on the wire (PyTorch does the same).
        for bucket, work in zip(self.buckets, self._works):
            try:
                self._wait(bucket, work)
            except RuntimeError as exc:  # a peer died or stalled past the timeout: say who
                raise _diagnostics.explain_failure(f"DDP gradient all-reduce (bucket {bucket.index})", exc) from exc
            if write_back:
                self._write_back(bucket)
        _diagnostics.leave()
        last = self.buckets[-1]
        if self.comm_hook is None and self._error is None and last.flat.numel() > last.numel:
            # The status slot of the last bucket: how many ranks left parameters without gradient.
            status = last.flat[last.numel : last.numel + 1]
            if status.is_cuda:
                # Read it at the next forward, through pinned memory and an event: an .item()
                # here would stall the host on every step.
                self._status_host = torch.empty(1, dtype=status.dtype, pin_memory=True)
                self._status_host.copy_(status, non_blocking=True)
                self._status_event = torch.cuda.Event()
                self._status_event.record()
            elif status.item() > 0:
                # The gradients were averaged with that rank's zeros; the error stops the step.
                self._error = self._other_ranks_failed(int(status.item()))

    def _wait(self, bucket: _Bucket, work: Any) -> None:
        if self.comm_hook is None:
            work.wait()
            return
        value = work.wait()
        if isinstance(value, (list, tuple)):
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel:
            raise TypeError(
                f"communication hook returned a future holding {type(value).__name__}"
                f"{' of ' + str(value.numel()) + ' elements' if isinstance(value, torch.Tensor) else ''}; "
                f"bucket {bucket.index} needs a tensor of {bucket.numel} elements"
            )
        if value.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(value.reshape(-1))

    def _write_back(self, bucket: _Bucket) -> None:
        unused = self._global_unused
        copy_to, copy_from = [], []
        for i, p, view in zip(bucket.indices, bucket.params, bucket.views):
            if unused is not None and unused[i]:
                continue  # unused on every rank: leave .grad as it was (None stays None)
            g = p.grad
            if self.gradient_as_bucket_view:
                if g is None or g.data_ptr() != view.data_ptr():
                    p.grad = view
            elif g is None:
                p.grad = view.clone() if p.is_contiguous() else torch.empty_like(p).copy_(view)
            else:
                copy_to.append(g)
                copy_from.append(view)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)

    def _used_map(self, device: torch.device) -> torch.Tensor:
        if self._used_reduced is None:
            self._used_reduced = torch.zeros(len(self.params), dtype=torch.int32, device=device)
        return self._used_reduced

    # ------------------------------------------------------------------ join
    def shadow_backward(self) -> None:
        """For a rank that has joined: run the collectives of one synced backward with zeros."""
        works = []
        for bucket in self.buckets:
            zeros = torch.zeros_like(bucket.flat if self.comm_hook is None else bucket.buffer)
            if self.comm_hook is None:
                works.append(self._all_reduce(zeros, bucket.index))
            else:
                works.append(self._run_hook(bucket, zeros))
        for w in works:
            w.wait()
        if self._tracks_used:
            # [Note: join and the used map] Like PyTorch, a joined rank contributes the map left
            # from its last reduction (reduced in place, so it only grows), not zeros: parameters
            # used before it joined count as used, and get zero gradients instead of None.
            dist.all_reduce(self._used_map(self.params[0].device), group=self.process_group)


def _make_hook(reducer_ref: "weakref.ref[Reducer]", index: int) -> Callable[[torch.Tensor], None]:
    # A weak reference: the hooks live on the parameters, which may outlive the DDP wrapper.
    def hook(_param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(index)

    return hook
