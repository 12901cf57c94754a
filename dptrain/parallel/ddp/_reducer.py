"""The gradient reducer behind :class:`dptrain.DistributedDataParallel`.

Parameters that require a gradient are packed into flat *buckets* (see
:mod:`dptrain.parallel.ddp._buckets`). Each parameter carries one post-accumulate-grad hook that
marks its gradient ready for its slot of the bucket; when every gradient of a bucket is in,
they are copied in together, scaled by ``1 / world_size``, and an asynchronous all-reduce of
the bucket is launched, so communication overlaps the rest of backward. Buckets are launched strictly in order, the
same on every rank. A callback queued on the autograd engine runs once backward is over: it
waits for the buckets and writes the averaged gradients back into ``param.grad``.

[Note: bitwise parity with PyTorch]
PyTorch's C++ reducer scales each gradient by ``1 / world_size`` *before* the sum
(``mul_out(bucket_view, grad, 1/div)``, or ``bucket_view.div_(div)`` when the gradient
already is a bucket view), then all-reduces with SUM and copies the result out. We do the
same operations with the same scalars, so on two ranks the results are bitwise equal; the
bucket layout does not matter for an elementwise two-term sum. With three or more ranks
gloo's ring order depends on the chunk an element falls in, so results agree to fp32
rounding.

[Note: a bucket at a time]
PyTorch's reducer does that work per gradient, in C++. Done per gradient in Python it costs a
few microseconds of interpreter and dispatch for every parameter, and on a GPU, where the
kernels themselves are asynchronous, that time is the step's. So a hook only queues its
parameter; when the bucket is full, its gradients go in with one ``_foreach_copy_`` and are
scaled with one ``mul_(1 / div)`` over the whole bucket (or ``div_(div)`` where the gradients
already are the bucket's views, ``gradient_as_bucket_view``). The numbers stay PyTorch's,
bit for bit: the copy is exact, so copy-then-multiply is ``mul_out``'s one rounding per
element, and an elementwise op gives the same bits over a bucket as over each view. A
bucket that mixes the two kinds scales each with one foreach call; a gradient that carries
a graph or has another dtype than its bucket is scaled on arrival, as before.
(``batched_grad_copy=True`` is PyTorch's own batched variant: one ``div_`` of the bucket.)

A large gradient is scaled on arrival too, into its view with one ``mul(out=)``, as PyTorch
does: copy-then-scale reads and writes it twice, and past a size the second pass over
memory costs more than the call saved (ResNet-18 on one CPU thread: 6.0 ms for its 11 M
gradients in two passes, 4.3 ms with those of 64 Ki elements or more in one). On a GPU a
call is dearer (a kernel launch), so the size is larger there (``ONE_PASS_MIN_NUMEL``).

[Note: bucket rebuild]
Once, after the first backward, the buckets are rebuilt in the order gradients became ready,
as PyTorch does; :mod:`dptrain.parallel.ddp._rebuild` says when and with whose order.

[Note: the status slot]
The last bucket carries extra elements. The first is 1 on a rank whose backward left
parameters without a gradient (it then launches its remaining buckets with zeros, so nobody
hangs); after the all-reduce every rank knows how many ranks failed, and every rank raises
at its next forward, not only the one that holds the unused parameter. The second is the
bucket rebuild's vote.

[Note: observers of a backward]
Two optional attributes let DistributedDataParallel's extensions follow a synced backward
without the reducer knowing what they do. ``observer`` (``compression="auto"``) is told when
backward starts, when each bucket is launched and when the backward is over (also on a
rank that has joined), so it can time computation against communication.
``on_bucket_reduced(params)`` (``overlap_optimizer``) is called with a bucket's parameters as
soon as that bucket's averaged gradients are in ``.grad``, while later buckets are still on
the wire.

[Note: which backward is ours]
Only a backward that accumulates into ``.grad`` starts a reduction, not
``torch.autograd.grad`` through the outputs (see :mod:`dptrain.parallel.ddp._sink`).
"""

from __future__ import annotations

import enum
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from dptrain import comm
from dptrain.runtime import heartbeat as _heartbeat, interrupt as _interrupt
from dptrain._shm import ShmGroup
from dptrain.parallel.ddp import _reducer_errors as errors
from dptrain.parallel.ddp._buckets import (
    DEFAULT_FIRST_BUCKET_BYTES,
    GradBucket,
    _Bucket,
    _views_of,
    bucket_size_limits,
    compute_bucket_assignment,
    reached_params,
)
from dptrain.parallel.ddp._hook_pipeline import flush_hook_state
from dptrain.parallel.ddp._profiling import collective_event, profiling, record_span
from dptrain.parallel.ddp._rebuild import BucketRebuild
from dptrain.parallel.ddp._sink import new_anchor

__all__ = ["Reducer", "BackwardPhase", "GradBucket", "compute_bucket_assignment", "bucket_size_limits",
           "DEFAULT_FIRST_BUCKET_BYTES"]

#: Elements from which a gradient is copied and scaled in one pass on arrival rather than
#: with its bucket (see [Note: a bucket at a time]); per device type, ``None`` for the others.
ONE_PASS_MIN_NUMEL = {"cpu": 1 << 16, None: 1 << 20}

_STRIDED = torch.strided
_PENDING = _interrupt.PENDING  # read once per gradient: a list, so no call and no attribute lookup


class BackwardPhase(enum.Enum):
    """Where the reducer stands in a synced backward; the gradient hooks act on it."""

    IDLE = "idle"  # no synced backward armed (no_sync, eval, between steps): hooks only accumulate
    ARMED = "armed"  # a training forward armed the hooks; the backward has not started yet
    RUNNING = "running"  # the backward started: gradients are marked ready and buckets launched


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
        bucket_cap_mb_list: one size in MiB per bucket (the last repeats); overrides
            ``bucket_cap_mb``.
        skip_all_reduce_unused_params: do not all-reduce a bucket whose parameters are all
            unused this iteration (the unused set must be the same on every rank).
        batched_grad_copy: scale a full bucket with one division (PyTorch's batched
            numerics) instead of PyTorch's per-gradient multiplication by ``1 / world_size``.
        grad_dtype: dtype the gradients arrive in (mixed precision); default: the
            parameters' dtype.
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
        *,
        bucket_cap_mb_list: Sequence[float] | None = None,
        skip_all_reduce_unused_params: bool = False,
        batched_grad_copy: bool = False,
        grad_dtype: torch.dtype | None = None,
        shm: ShmGroup | None = None,
    ) -> None:
        self.params = list(params)
        self.shm = shm
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters and not static_graph
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.grad_dtype = grad_dtype
        self.bucket_limits = bucket_size_limits(bucket_cap_mb, bucket_cap_mb_list)
        self.initial_bucket_limits = list(self.bucket_limits)
        self._new_limits: list[int] | None = None  # see set_bucket_limits
        self._sizes = [p.numel() * p.element_size() for p in self.params]
        self._keys = [(p.dtype, p.device) for p in self.params]
        self._init_buckets(self._initial_assignment())
        self.comm_hook: Callable | None = None
        self.comm_hook_state: Any = None
        # Optional, set by DistributedDataParallel (see [Note: observers of a backward]).
        self.observer: Any = None
        self.on_bucket_reduced: Callable[[list[torch.nn.Parameter]], None] | None = None
        self.num_iterations = 0  # synced backward passes so far
        self._rebuild = BucketRebuild(len(self.params), never=self.find_unused_parameters)
        self._init_backward_state()
        # See [Note: the learnt state]: what it was when the latest synced backward was armed,
        # and whether that backward has not completed here (in flight, failed or never run).
        self._armed_state: tuple | None = None
        self._in_flight = False

        # See [Note: which backward is ours]: the sink's input that tells a training backward.
        self.anchor, self.anchor_node = new_anchor(self.params[0].device)

        self_ref = weakref.ref(self)
        self._handles = [
            p.register_post_accumulate_grad_hook(_make_hook(self_ref, i)) for i, p in enumerate(self.params)
        ]

    def _initial_assignment(self) -> list[list[int]]:
        """The buckets before any backward: reverse registration order, as PyTorch's."""
        if self.find_unused_parameters:
            # Never rebuilt (see [Note: bucket rebuild]): PyTorch's layout for this case, filled
            # in registration order so that the small first-limit bucket holds the first
            # layers, whose gradients come last, and launched from the last layers on.
            order = range(len(self.params))
            return compute_bucket_assignment(self._sizes, self._keys, self.bucket_limits, order)[::-1]
        return compute_bucket_assignment(self._sizes, self._keys, self.bucket_limits)

    def _init_backward_state(self) -> None:
        """The per-backward fields (reset by prepare_for_backward) and what is learnt across them."""
        self.phase = BackwardPhase.IDLE
        self._plain_backward = False  # a backward that needs no per-gradient bookkeeping (see _on_grad_ready)
        self._pending: list[int] = []
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        self._works: list[Any] = []
        self._deferred: list[list[int]] = []  # per bucket: gradients waiting for its one copy
        self._scaled_early: list[bool] = []  # per bucket: holds a gradient scaled on arrival
        self._irregular: list[bool] = []  # per bucket: a gradient was missing or carried a graph
        self._direct: list[bool] = []  # per bucket: its hook read and wrote .grad itself (see [Note: a hook ...])
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

    def __del__(self) -> None:
        for h in getattr(self, "_handles", ()):
            h.remove()

    def close(self) -> None:
        """Retire this reducer: its gradient hooks go, a backward in flight is forgotten.

        For DistributedDataParallel._rejoin, after the process group was re-formed: the
        collectives in flight belong to the destroyed group and are never waited for; a
        backward that still reaches these parameters only accumulates into ``.grad``.
        """
        for h in self._handles:
            h.remove()
        self._handles = []
        self.phase = BackwardPhase.IDLE
        self._plain_backward = False
        self._works = [None] * len(self.buckets)
        self._div_work = None
        self._status_event = None
        self.observer = None
        self.on_bucket_reduced = None

    # ------------------------------------------------------------------ recovery
    # [Note: the learnt state]
    # Across backwards the reducer learns: the bucket layout (rebuilt once in gradient-ready
    # order, or re-limited by compression="auto"), whether that rebuild is behind it or which
    # order it agreed on, the number of synced backwards, and with a static graph the hook
    # counts and the unused set of its first backward. A reducer built from scratch with this
    # state reduces exactly like the original from the next forward on (read and adopted by
    # _recovery.py for DistributedDataParallel._recovery_layout / _rejoin). A synced backward
    # changes it only in its last steps (_finalize_backward), which may fail half-way when a
    # peer dies; so the state as it was when that backward was armed is kept (a tuple of
    # references: the fields are replaced, never changed in place), and stands for this rank
    # until the backward completes.
    def _learnt(self) -> tuple:
        return (self.buckets, self.bucket_limits, self._new_limits, self._rebuild.done, self._rebuild.agreed,
                self.num_iterations, self._static_counts, self._global_unused if self.static_graph else None)

    def _init_buckets(self, assignment: list[list[int]]) -> None:
        """Allocate the buckets of ``assignment``; with bucket views, move existing grads into them."""
        if self.shm is not None and getattr(self, "buckets", None):
            # A rebuild reuses the shared region (every rank at the same forward): gradients that
            # are views of the old buckets are saved first, as the new buckets overwrite them.
            for p in self.params:
                if p.grad is not None and self.gradient_as_bucket_view:
                    p.grad = p.grad.clone()
            self.shm.release_all()
        self.buckets = [
            _Bucket(b, idx, self.params, b == len(assignment) - 1, self.grad_dtype, self.shm)
            for b, idx in enumerate(assignment)
        ]
        self._bucket_of = [0] * len(self.params)
        self._views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):
                self._bucket_of[i] = bucket.index
                self._views[i] = view
        self._bucket_count = [len(b.indices) for b in self.buckets]
        self._one_pass = [v.numel() >= ONE_PASS_MIN_NUMEL.get(v.device.type, ONE_PASS_MIN_NUMEL[None])
                          for v in self._views]
        self._view_dtypes = [v.dtype for v in self._views]  # read by the hooks' common case (_on_grad_ready)
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for p, view in zip(self.params, self._views):
                    if p.grad is not None and not p.grad.requires_grad and p.grad.dtype == view.dtype:
                        view.copy_(p.grad)
                        p.grad = view

    @property
    def assignment(self) -> list[list[int]]:
        """Parameter indices of each bucket, in launch order."""
        return [list(b.indices) for b in self.buckets]

    def set_static_graph(self) -> None:
        """Switch to static-graph mode; only before the first backward (PyTorch's rule)."""
        if self.num_iterations > 0 or self._static_counts is not None:
            raise RuntimeError(
                "_set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed (PyTorch's wording): this DDP has trained already; pass "
                "static_graph=True to the constructor instead"
            )
        self.static_graph = True
        self.find_unused_parameters = False
        self._rebuild = BucketRebuild(len(self.params), never=False)

    # ------------------------------------------------------------------ forward side
    def check_prior_reduction(self) -> None:
        """Raise the error recorded by the previous backward (parameters that got no grad)."""
        if self._status_event is not None:
            self._status_event.synchronize()
            self._status_event = None
            if self._error is None and self._status_host.item() > 0:
                self._error = errors.other_ranks_failed(int(self._status_host.item()))
        if self._error is not None:
            msg, self._error = self._error, None
            raise RuntimeError(msg)

    def set_divisor_work(self, work: Any, use_static_world_size: bool) -> None:
        """Join: the all-reduce counting the ranks that have not joined; used as divisor unless static."""
        self._div_work = None if use_static_world_size else work

    def rebuild_buckets(self) -> bool:
        """Rebuild the buckets in gradient-ready order, once, at a forward (see [Note: bucket rebuild]).

        Every rank calls it at the same point; returns whether the layout changed.
        """
        order = self._rebuild.exchange(self.process_group, self.params[0].device)
        if order is None and self._new_limits is not None:
            order = [i for bucket in self.assignment for i in bucket]  # the current launch order
        self.bucket_limits = self._new_limits or self.bucket_limits
        self._new_limits = None
        if order is None:
            return False
        assignment = compute_bucket_assignment(self._sizes, self._keys, self.bucket_limits, order)
        if assignment == self.assignment:
            return False
        self._init_buckets(assignment)
        return True

    def set_bucket_limits(self, limits: Sequence[int]) -> None:
        """New bucket byte limits, applied at the next forward's :meth:`rebuild_buckets`.

        Called on every rank at the same point of training (``compression="auto"`` does it
        when it decides), so every rank re-buckets at the same forward.
        """
        self._new_limits = list(limits)

    @property
    def has_rebuilt_buckets(self) -> bool:
        """Whether the one rebuild is behind us (done, or found to change nothing)."""
        return self._rebuild.done

    def prepare_for_backward(self, outputs: Any = None) -> None:
        """Arm the hooks for the next backward; with find_unused, find unreachable parameters."""
        self._armed_state, self._in_flight = self._learnt(), True  # see [Note: the learnt state]
        self.phase = BackwardPhase.ARMED
        self._pending = list(self._bucket_count)
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        self._works = [None] * len(self.buckets)
        self._deferred = [[] for _ in self.buckets]
        self._scaled_early = [False] * len(self.buckets)
        self._irregular = [False] * len(self.buckets)
        self._direct = [False] * len(self.buckets)
        self._div = None
        self._rebuild.start_backward(self._static_first_iteration)
        self._plain_backward = not (self.static_graph or self.find_unused_parameters or self._rebuild.recording)
        if self.find_unused_parameters:
            if profiling():
                with record_span("torch.distributed.ddp.reducer::search_unused_parameters"):  # PyTorch's name
                    reached = reached_params(outputs)
            else:
                reached = reached_params(outputs)
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
        if self.phase is not BackwardPhase.ARMED:
            return
        self.phase = BackwardPhase.RUNNING
        Variable._execution_engine.queue_callback(self._finalize_backward)
        if self.observer is not None:
            self.observer.backward_started()
        if self._static_first_iteration:
            self._hook_counts = [0] * len(self.params)
        for j in self._unused_now:
            self._mark_ready(j)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        # The hot path: one call per parameter per backward, whose Python is the step's on a GPU
        # (see [Note: a bucket at a time]). The common case (a running backward of plain
        # settings, a dense gradient of its bucket's dtype, queued for the bucket's one copy)
        # is done here inline; anything else goes the general way.
        if _PENDING[0]:  # the launcher said a peer died (see [Note: stopping a step at once] in runtime.interrupt)
            _interrupt.check()
        if self.shm is not None and self.shm.broken is not None:
            self._fail_fast()
        if self._plain_backward and self.phase is BackwardPhase.RUNNING:
            g = param.grad
            if (g is not None and not self._one_pass[i] and not self._ready[i] and not g.requires_grad
                    and g.layout is _STRIDED and g.dtype is self._view_dtypes[i]):
                self._ready[i] = 1
                b = self._bucket_of[i]
                self._deferred[b].append(i)
                self._pending[b] -= 1
                if self._pending[b] == 0 and b == self._next_bucket:
                    self._launch_ready()
                return
        self._on_grad_ready_general(i)

    def _fail_fast(self) -> None:
        """A shared-memory all-reduce of this backward failed (a peer died or stalled): raise its
        error now, from the gradient hook, instead of computing the rest of the backward first.

        The backward ends there; every gradient of it is discarded by whoever handles the error
        (in-place recovery starts as soon as the survivors stop, so the replacement does not
        wait for a backward whose result is thrown away). Until the worker has finished the
        failed all-reduce there is nothing to raise yet, and the backward goes on.
        """
        for bucket, work in zip(self.buckets, self._works):
            if work is not None and getattr(work, "failed", None) is not None and work.failed():
                self._wait(bucket, work)  # raises the guarded error that names the peer

    def _on_grad_ready_general(self, i: int) -> None:
        if (self.static_graph or self.find_unused_parameters) and self._tracks_used:
            if self.params[i].grad is not None:
                self._local_used[i] = 1  # also under no_sync: reduced at the next synced backward
        phase = self.phase
        if phase is BackwardPhase.IDLE:
            return  # no_sync / eval forward: plain local accumulation
        if phase is BackwardPhase.ARMED:
            self.backward_started()
        if self.static_graph:
            if self._static_counts is None:  # first iteration: count, reduce everything at the end
                self._hook_counts[i] += 1
                return
            self._static_remaining[i] -= 1
            if self._static_remaining[i] > 0:
                return
            if self._static_remaining[i] < 0:
                raise RuntimeError(errors.static_graph_changed(self.names[i], i, self._static_counts[i]))
        if self._ready[i]:
            raise RuntimeError(errors.gradient_twice(self.names[i], i))
        if self._rebuild.recording:
            self._rebuild.order.append(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = 1
        if self._div is None:
            self._divisor()
        self._copy_in(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0 and b == self._next_bucket:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the buckets whose gradients are all in, in order from the next one."""
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            bucket = self.buckets[self._next_bucket]
            if not self._skips(bucket):
                direct = self._direct[bucket.index] = self._goes_direct(bucket)
                if not direct:
                    self._flush_deferred(bucket)
                if bucket.index == len(self.buckets) - 1:
                    self._cast_vote(bucket)
                self._launch(bucket)
            self._next_bucket += 1

    # [Note: a hook that reads the gradients itself]
    # A communication hook gets the bucket's gradients copied into its flat buffer, and the reducer
    # copies the buffer back into .grad once the hook's future is done: two passes over every
    # gradient. dptrain's PowerSGD with error feedback reads each gradient once (adding it into its
    # error buffer) and writes each averaged gradient once (decompressing), so given the gradients
    # themselves it needs neither copy: compression="auto" on the MLP 8x1024 across a 1 Gbit/s link
    # took 0.89 of PyTorch's fp32 CPU time per step instead of 1.04 (benchmarks/compare.py). The
    # 16-bit hooks likewise cast from .grad and back into it (bf16 there: 0.95 instead of 1.00). A hook
    # says so with a ``reads_gradients(state)`` attribute, asked as each bucket launches. Only a
    # plain backward's bucket whose gradients all arrived dense, contiguous, in the bucket's dtype,
    # without a graph and not already its views goes that way: the hook's GradBucket then has
    # ``direct_gradients()`` (the .grad tensors), the buffer is left as it was, and the reducer
    # writes nothing back for that bucket. The values are the same, bit for bit: the same operations
    # on the same numbers (PowerSGD's matrix products read its error buffer either way), only read
    # from and written to other memory. One visible difference: after a backward whose missing
    # gradients raise at the next forward, such a bucket's .grad holds the average where the
    # reducer would leave the local gradient.
    def _goes_direct(self, bucket: _Bucket) -> bool:
        reads = getattr(self.comm_hook, "reads_gradients", None)
        b = bucket.index
        if (reads is None or not self._plain_backward or self.gradient_as_bucket_view or self._irregular[b]
                or self._scaled_early[b] or len(self._deferred[b]) != len(bucket.indices)
                or not reads(self.comm_hook_state)):
            return False
        for i in bucket.indices:
            g = self.params[i].grad
            if (g is None or g.requires_grad or g.layout is not _STRIDED or g.dtype is not self._view_dtypes[i]
                    or not g.is_contiguous() or g.data_ptr() == self._views[i].data_ptr()):
                return False
        return True

    def _skips(self, bucket: _Bucket) -> bool:
        """skip_all_reduce_unused_params: a bucket of parameters unused this iteration stays local."""
        if not self.skip_all_reduce_unused_params or not self._unused_now:
            return False
        unused = set(self._unused_now)
        return all(i in unused for i in bucket.indices)

    def _cast_vote(self, last: _Bucket) -> None:
        # Every gradient is in when the last bucket launches: in the recording backward, vote
        # on whether this rank's order gives other buckets (see [Note: bucket rebuild]).
        differs = False
        if self._rebuild.recording:
            order = self._rebuild.complete(self._unused_now)
            if order is not None:
                assignment = compute_bucket_assignment(self._sizes, self._keys, self.bucket_limits, order)
                differs = assignment != self.assignment
        last.flat[last.numel + 1] = float(differs)

    def _divisor(self) -> int:
        if self._div is None:
            self._div = self.world_size
            if self._div_work is not None:
                comm.wait(self._div_work, "DDP join (count of ranks still training)", self.process_group)
                self._div = int(self._div_work.get_future().value()[0].item())
                self._div_work = None
            self._inv = 1.0 / self._div
        return self._div

    def _copy_in(self, i: int) -> None:
        """Take parameter ``i``'s gradient into its bucket: most are queued for the bucket's
        one copy when it is full (see [Note: a bucket at a time])."""
        p, view = self.params[i], self._views[i]
        g = p.grad
        if g is None:
            self._irregular[self._bucket_of[i]] = True
            view.zero_()  # unused here: contribute zeros
            return
        if g.layout != torch.strided:
            raise RuntimeError(
                f"DistributedDataParallel on rank {dist.get_rank()}: parameter '{self.names[i]}' has a "
                f"{g.layout} gradient; dptrain's reducer averages dense gradients only. Build the layer "
                "with sparse=False (e.g. nn.Embedding(..., sparse=False))."
            )
        divide = self.comm_hook is None and not self.batched_grad_copy
        if g.requires_grad:
            self._scaled_early[self._bucket_of[i]] = True
            self._irregular[self._bucket_of[i]] = True
            self._copy_in_graph_grad(g, view, divide)
        elif divide and (g.dtype != view.dtype or (self._one_pass[i] and g.data_ptr() != view.data_ptr())):
            # Another dtype than its bucket, or large (and not already the bucket's view):
            # copied and scaled now, in one pass, in the gradient's precision (PyTorch's mul_out).
            self._scaled_early[self._bucket_of[i]] = True
            torch.mul(g, self._inv, out=view)
            if self.gradient_as_bucket_view:
                p.grad = view
        else:
            self._deferred[self._bucket_of[i]].append(i)

    def _copy_in_graph_grad(self, g: torch.Tensor, view: torch.Tensor, divide: bool) -> None:
        # backward(create_graph=True): the gradient carries a graph. Its value is averaged like
        # any other, without recording the copy (PyTorch's behaviour: the higher-order graph
        # stops at the all-reduce, which is not differentiated). Python warns once per place.
        warnings.warn(
            "DistributedDataParallel with backward(create_graph=True): gradients are averaged across ranks, but "
            "the averaged .grad is not differentiable through the all-reduce (as in PyTorch's DDP): a loss built "
            "from p.grad gets no higher-order gradient through the other ranks. For gradient penalties use "
            "torch.autograd.grad(..., create_graph=True), which DDP does not intercept.",
            stacklevel=2,
        )
        with torch.no_grad():
            if divide:
                torch.mul(g, self._inv, out=view)
            else:
                view.copy_(g)

    def _flush_deferred(self, bucket: _Bucket) -> None:
        """The bucket's queued gradients in with one copy, then scaled (see [Note: a bucket at a time])."""
        params, views = self.params, self._views
        self._divisor()  # the hooks' common case leaves it to here
        copied: list[int] = []  # gradients to copy into the bucket
        aliased: list[torch.Tensor] = []  # gradients that already are the bucket's views
        grads: list[torch.Tensor] = []
        for i in self._deferred[bucket.index]:
            g = params[i].grad
            if g is None:  # dropped since its hook, by a hook of the user's: zeros, as PyTorch sends
                views[i].zero_()
                self._irregular[bucket.index] = True
            elif g.data_ptr() == views[i].data_ptr():
                aliased.append(views[i])
            else:
                copied.append(i)
                grads.append(g)
        targets = [views[i] for i in copied]
        if copied:
            torch._foreach_copy_(targets, grads)
            if self.gradient_as_bucket_view:
                for i, view in zip(copied, targets):
                    params[i].grad = view
        if self.comm_hook is not None:
            return  # a hook divides by itself (PyTorch's contract)
        if self.batched_grad_copy:
            bucket.buffer.div_(self._divisor())  # PyTorch's batched numerics: one division
            return
        if not self._scaled_early[bucket.index] and not (copied and aliased):
            # One kind of gradient in the whole bucket (and zeros, which scale to zeros).
            if aliased:
                bucket.buffer.div_(self._divisor())
            else:
                bucket.buffer.mul_(self._inv)
            return
        if targets:
            torch._foreach_mul_(targets, self._inv)
        if aliased:
            torch._foreach_div_(aliased, self._divisor())

    def _launch(self, bucket: _Bucket) -> None:
        if self.observer is not None:
            self.observer.bucket_launched(bucket.index)
        if self.comm_hook is None:
            if bucket.flat.numel() > bucket.numel:
                bucket.flat[bucket.numel] = float(self._error is not None)
            self._works[bucket.index] = self._all_reduce(bucket.flat, bucket.index)
        else:
            self._works[bucket.index] = self._run_hook(bucket, bucket.buffer, self._direct[bucket.index])

    def _all_reduce(self, flat: torch.Tensor, index: int) -> Any:
        """Sum one bucket across ranks, asynchronously: in shared memory on one node, else gloo/NCCL.

        In shared memory a bucket's bytes meet at the bucket's own place on every rank, also
        when a joined rank all-reduces zeros (``flat`` is then not the bucket itself).
        """
        if self.shm is not None:
            # gloo records its own event; see dptrain.parallel.ddp._profiling
            end = collective_event(f"{dist.get_backend(self.process_group)}:all_reduce") if profiling() else None
            return self.shm.all_reduce(flat, tag=f"bucket {index}", slot=self.buckets[index].flat, then=end)
        return dist.all_reduce(flat, group=self.process_group, async_op=True)

    def _run_hook(self, bucket: _Bucket, buffer: torch.Tensor, direct: bool = False) -> Any:
        is_last = bucket.index == len(self.buckets) - 1
        views = bucket.views if buffer is bucket.buffer else _views_of(buffer, bucket.params)
        grads = [p.grad for p in bucket.params] if direct else None  # see [Note: a hook that reads ...]
        grad_bucket = GradBucket(bucket.index, buffer, views, bucket.params, is_last, grads)
        fut = self.comm_hook(self.comm_hook_state, grad_bucket)
        if not callable(getattr(fut, "wait", None)):  # torch.futures.Future or torch._C.Future
            raise TypeError(
                f"communication hook {getattr(self.comm_hook, '__qualname__', self.comm_hook)} returned "
                f"{type(fut).__name__}; it must return a torch.futures.Future holding the bucket's tensor"
            )
        return fut

    def _finalize_backward(self) -> None:
        """Runs once per synced backward, after autograd finished: wait, then write back."""
        self.phase = BackwardPhase.IDLE
        self.num_iterations += 1
        track_used = self._tracks_used
        recording = self._rebuild.recording
        if self._static_first_iteration:
            # First static-graph iteration: everything reduced now, unused params included.
            self._static_counts = list(self._hook_counts)
            for i in range(len(self.params)):
                self._mark_ready(i)
        write_back = self._complete_missing()
        flush_hook_state(self.comm_hook_state)  # before the used map: collectives stay in order
        self._reduce_used_map(track_used)
        # Copy each bucket out as soon as its own all-reduce is done, overlapping the copies
        # with the buckets still on the wire (PyTorch does the same).
        for bucket, work in zip(self.buckets, self._works):
            if work is not None:  # None: skip_all_reduce_unused_params left it local, .grad untouched
                source = self._wait(bucket, work)
                if write_back and not self._direct[bucket.index]:  # a direct hook wrote .grad itself
                    self._write_back(bucket, source)
            if write_back and self.on_bucket_reduced is not None:
                self.on_bucket_reduced(bucket.params)
        self._read_status()
        if recording and write_back and self._error is None and self._works[-1] is not None:
            self._rebuild.decide(self._rebuild_votes(self.buckets[-1].flat))
        if self.observer is not None:
            self.observer.backward_finished(joined=False)
        self._in_flight = False  # the learnt state is this backward's now (see [Note: the learnt state])
        _heartbeat.note_ddp_step(self.num_iterations)  # stall reports count a plain loop's steps

    def _complete_missing(self) -> bool:
        """Launch the buckets that still wait for gradients; False if this backward was faulty."""
        if self.find_unused_parameters and self._next_bucket < len(self.buckets):
            # Reachable from the outputs but no gradient arrived (e.g. an output left out of the
            # loss): with find_unused_parameters that is just one more unused parameter.
            for i in range(len(self.params)):
                if not self._ready[i]:
                    self._mark_ready(i)
        if self._next_bucket == len(self.buckets):
            return True
        missing = [i for i in range(len(self.params)) if not self._ready[i]]
        self._error = errors.missing_gradients(self.names, missing, self.static_graph)
        # Launch the rest anyway (zeros for the missing) so that ranks stay matched and none hangs;
        # gradients stay local, as PyTorch leaves them, and the error is raised at the next forward.
        for i in missing:
            self._mark_ready(i)
        return False

    def _rebuild_votes(self, last_flat: torch.Tensor) -> float | None:
        """The summed rebuild votes of the reduced last bucket; None without a status slot."""
        last = self.buckets[-1]
        if self.comm_hook is not None or last.flat.numel() == last.numel:
            return None
        return last_flat[last.numel + 1].item()

    def _reduce_used_map(self, track_used: bool) -> None:
        if track_used:
            used = self._used_map(self.params[0].device)
            used.copy_(torch.tensor(list(self._local_used), dtype=torch.int32))
            comm.wait(dist.all_reduce(used, group=self.process_group, async_op=True), "DDP used-parameter all-reduce", self.process_group)
            self._global_unused = [u == 0 for u in used.tolist()]
            self._local_used = bytearray(len(self.params))
        elif not self.static_graph:
            self._global_unused = None

    def _read_status(self) -> None:
        """The status slot of the last bucket: how many ranks left parameters without gradient."""
        last = self.buckets[-1]
        if self.comm_hook is not None or self._error is not None or last.flat.numel() == last.numel:
            return
        if self._works[last.index] is None:
            return  # the last bucket was skipped: it carried no status this time
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
            self._error = errors.other_ranks_failed(int(status.item()))

    def _wait(self, bucket: _Bucket, work: Any) -> list[torch.Tensor]:
        """Wait for a bucket's reduction; return the views to copy the averaged gradients from.

        The wait is guarded: a peer that died or stalled past the timeout is named."""
        value = comm.wait(work, f"DDP gradient all-reduce (bucket {bucket.index})", self.process_group)
        if self.comm_hook is None:
            return bucket.views
        if isinstance(value, (list, tuple)):
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel:
            raise TypeError(
                f"communication hook returned a future holding {type(value).__name__}"
                f"{' of ' + str(value.numel()) + ' elements' if isinstance(value, torch.Tensor) else ''}; "
                f"bucket {bucket.index} needs a tensor of {bucket.numel} elements"
            )
        if value.dtype != bucket.buffer.dtype:
            return _views_of(value.reshape(-1), bucket.params)  # e.g. reduced in another precision
        if value.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(value.reshape(-1))
        return bucket.views

    def _write_back(self, bucket: _Bucket, source: list[torch.Tensor]) -> None:
        unused = self._global_unused
        if unused is None and source is bucket.views and not self._irregular[bucket.index]:
            # The common case: every gradient of the bucket arrived, dense and without a graph.
            if self.gradient_as_bucket_view:
                # The copy-in left every .grad as its view (_copy_in, _flush_deferred), unless a
                # hook of the user's has reassigned one since.
                if bucket.same_dtype and all(p.grad is v for p, v in zip(bucket.params, bucket.views)):
                    return
            else:
                try:
                    torch._foreach_copy_([p.grad for p in bucket.params], source)
                    return
                except TypeError:
                    pass  # a .grad set to None since its hook (by a hook of the user's): the loop below
        copy_to, copy_from = [], []
        for i, p, view in zip(bucket.indices, bucket.params, source):
            if unused is not None and unused[i]:
                continue  # unused on every rank: leave .grad as it was (None stays None)
            g = p.grad
            if g is not None and g.requires_grad:
                # create_graph=True: PyTorch copies the average into autograd's gradient with
                # grad mode on, so .grad keeps requiring grad (its history ends at the copy).
                with torch.enable_grad():
                    g.copy_(view)
            elif self.gradient_as_bucket_view and view.dtype == p.dtype:
                if g is None or g.data_ptr() != view.data_ptr():
                    p.grad = view
            elif g is None:
                same = view.dtype == p.dtype and p.is_contiguous()
                p.grad = view.clone() if same else torch.empty_like(p).copy_(view)
            else:
                copy_to.append(g)
                copy_from.append(view)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)

    def _used_map(self, device: torch.device) -> torch.Tensor:
        if self._used_reduced is None:
            self._used_reduced = torch.zeros(len(self.params), dtype=torch.int32, device=device)
        return self._used_reduced


def _make_hook(reducer_ref: "weakref.ref[Reducer]", index: int) -> Callable[[torch.Tensor], None]:
    # A weak reference: the hooks live on the parameters, which may outlive the DDP wrapper.
    def hook(param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(index, param)

    return hook
