"""Shared-memory collectives for the ranks of one node (CPU tensors).

On one machine every rank's gradients already sit in the same RAM, yet gloo moves them
through TCP loopback: a copy into the kernel and a copy out, for every byte, both ways.
:class:`ShmGroup` maps one file of ``/dev/shm`` into every rank of a process group and
all-reduces in place there, synchronising through counters in the same mapping.
:class:`dptrain.DistributedDataParallel` uses it automatically when it can (see
:func:`for_parameters`); ``DPTRAIN_SHM=0`` or ``DistributedDataParallel(shm=False)`` turn
it off.

[Note: the worker thread]
Collectives of a group run one at a time on one background thread per group, in the
order they were issued (the same on every rank, as for any collective); ``all_reduce``
returns a :class:`Work` at once, so the reducer's buckets are summed while backward goes
on (torch's copy and add kernels release the GIL). The thread holds the segment, not the
group: when the group is garbage-collected (or closed) the thread finishes the queued
collectives, unmaps the segment and exits.

The segment itself -- its privacy and lifetime, the two-barrier protocol, the summation
order, waiting without spinning, and noticing a dead rank -- is described in
:mod:`dptrain._shm.segment`.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from dptrain.runtime import regroup as _regroup, env
from dptrain._shm.segment import (
    _ALIGN,
    SEGMENT_PREFIX,
    ShmPeerError,
    _aligned,
    _Segment,
    make_ahead,
    open_segment,
    shm_disabled_by_env,
)

__all__ = ["ShmGroup", "ShmPeerError", "Work", "abort_all", "ahead_for_parameters", "for_parameters",
           "shm_disabled_by_env", "SEGMENT_PREFIX"]


# ----------------------------------------------------------------------------- the worker
class Work:
    """Handle of an asynchronous shared-memory collective: ``wait()`` returns when it is done.

    ``wait`` raises :class:`ShmPeerError` when the collective failed (a rank that died or
    did not arrive in time), or when it is not done within the ``timeout`` given to ``wait``.
    """

    __slots__ = ("_done", "_error", "what", "_then")

    def __init__(self, what: str = "shared-memory collective") -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.what = what
        self._then: list[Callable[[], None]] = []

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once the collective is done, before any ``wait`` returns (on the worker
        thread; at once, on this thread, when it is done already). Exceptions are ignored."""
        with _THEN_LOCK:
            if not self._done.is_set():
                self._then.append(fn)
                return
        _quietly(fn)

    def _finish(self) -> None:
        """The worker's end of a collective: the ``then`` callbacks, then ``done``."""
        while True:
            with _THEN_LOCK:  # a callback added meanwhile runs too: none is left behind
                pending, self._then = self._then, []
                if not pending:
                    self._done.set()
                    return
            for fn in pending:
                _quietly(fn)

    def wait(self, timeout: Any = None) -> bool:
        """Block until done, at most ``timeout`` (a ``timedelta`` or seconds) when one is given.

        As torch's ``Work.wait``: no timeout, or a zero one, waits for the collective itself,
        which ends at the group's collective timeout (``dptrain.init(timeout=)``) or as soon as
        a missing rank is found dead.

        Raises:
            ShmPeerError: the collective failed, or ``timeout`` passed first (the message names
                the operation; the collective itself goes on in the group's worker).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._done.wait(seconds or None):
            raise ShmPeerError(f"{self.what}: not done within the {seconds:g}s given to Work.wait(timeout=)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        """Whether the collective is over and failed (``wait`` would raise its error at once)."""
        return self._done.is_set() and self._error is not None


_THEN_LOCK = threading.Lock()  # Work.then against the worker's finish (one for all: held for a moment)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a callback's failure is not the collective's
        pass


def _through_slot(seg: "_Segment", offset: int, slot: torch.Tensor, tensor: torch.Tensor, op: str,
                  between: Callable[[torch.Tensor], None] | None) -> None:
    kept = slot.clone()
    slot.copy_(tensor.reshape(-1))
    try:
        seg.all_reduce_at(offset, slot.numel(), slot.dtype, op, between)
        tensor.copy_(slot.view(tensor.shape))
    finally:
        slot.copy_(kept)


class _Runner:
    """The worker thread of one group: runs collectives one at a time, in issue order (the
    same on every rank), and unmaps the segment after the last one."""

    def __init__(self, seg: "_Segment") -> None:
        self.seg = seg
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        _RUNNERS.add(self)

    def submit(self, fn: Callable[[], None], what: str, then: Callable[[], None] | None = None) -> Work:
        work = Work(what)
        if then is not None:
            work.then(then)
        with self.lock:
            if self.seg.aborted is not None or self.seg.closed:
                work._finish()  # what waits for its end (a profiler event) is not left open
                if self.seg.aborted is not None:  # a peer's failure (in-place recovery tells it from this type)
                    raise ShmPeerError(f"{self.seg.what}: not started: {self.seg.broken}")
                raise RuntimeError(f"{self.seg.what}: the shared-memory group was closed (by dptrain.shutdown(), "
                                   f"or a failed collective); a DDP model cannot train after dptrain.shutdown(): "
                                   f"call it once training is over")
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, daemon=True, name="dptrain-shm")
                self.thread.start()
            self.jobs.put((fn, work))
        return work

    def _serve(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                self.seg.close()
                return
            fn, work = item
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                work._error = exc
            work._finish()

    def stop(self, wait: bool = False) -> None:
        with self.lock:
            thread = self.thread
            if thread is None:
                self.seg.close()
            elif not self.seg.closed:
                self.jobs.put(None)  # the worker closes the segment after the queued work
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def abort(self, reason: str, wait_s: float) -> bool:
        """Fail the collective in progress and the queued ones at once, then stop (see
        :meth:`ShmGroup.abort`); True when the worker ended within ``wait_s`` seconds."""
        self.seg.abort(reason)
        self.stop()
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(wait_s)
        return not thread.is_alive()


# Every live runner, so that the process can end their threads before it exits.
_RUNNERS: "weakref.WeakSet[_Runner]" = weakref.WeakSet()


def close_all() -> None:
    """End every group's worker thread, after its queued collectives; called by
    :func:`dptrain.shutdown` and at interpreter exit (registered below with ``atexit``).

    [Note: no worker thread at exit]
    The wait is the point: a worker still inside one of torch's calls when the interpreter
    finalizes is killed as it takes the GIL back, inside a ``noexcept`` C++ frame, and the
    whole process ends in SIGABRT ("terminate called without an active exception") after the
    script has finished. Even an idle worker gets there: closing its segment frees tensors,
    and freeing a tensor releases and retakes the GIL. So the hook is registered when this
    module is loaded, not by ``init``: a process group made by the user with
    ``init_process_group`` and ended with ``destroy_process_group()`` (or not at all), as
    in PyTorch's own tests, never calls ``dptrain.shutdown``. The groups' own
    ``weakref.finalize`` callbacks stay out of exit (``atexit=False``): they stop a worker
    without waiting for it. A queued collective ends by itself: it completes, or fails at
    the collective timeout or as soon as a missing rank is found dead.
    """
    for runner in list(_RUNNERS):
        runner.stop(wait=True)


def abort_all(reason: str = "the process group was re-formed", wait_s: float = 5.0) -> None:
    """Abandon every group's collectives and end the worker threads, without waiting for peers.

    For in-place recovery, before the broken process group is destroyed: unlike
    :func:`close_all`, a worker that waits in a collective which a live peer will never issue
    (the peer failed elsewhere first) gives up within a fraction of a second instead of at
    the collective timeout; whoever waits on such a collective gets :class:`ShmPeerError`.
    The groups cannot be used afterwards; build new ones over the new process group.
    Each worker is waited for at most ``wait_s`` seconds (it only has to notice the flag).
    """
    for runner in list(_RUNNERS):
        runner.abort(reason, wait_s)


atexit.register(close_all)
# The heartbeat thread abandons the groups over a process group that a silent node broke (see
# [Note: a peer that goes silent] in dptrain.runtime.regroup); it does not wait for the workers.
_regroup.on_leaving(lambda why: abort_all(why, wait_s=0.0))
env.at_shutdown(close_all)  # dptrain.shutdown() too, before it destroys the process group


class ShmGroup:
    """Shared-memory all-reduce and all-gather among the ranks of a process group on one node.

    Built collectively by :meth:`create` (every rank of ``group`` must call it); returns
    None on every rank when the ranks cannot share memory. Collectives run one at a time
    on a background thread, in the order they were issued, which must be the same on
    every rank (as for any collective).

    Example:
        >>> g = ShmGroup.create(None, nbytes=1 << 20, what="example")   # doctest: +SKIP
        >>> t = g.zeros(1000, torch.float32); t.fill_(dptrain.rank())
        >>> g.all_reduce(t).wait()                                     # t == 0 + 1 + ...
    """

    def __init__(self, segment: _Segment, group: Any) -> None:
        self._seg = segment
        self.group = group
        self.rank = segment.rank
        self.world_size = segment.n
        self.region_bytes = segment.region
        self._next = 0  # bump allocator inside this rank's region (same offsets on every rank)
        # Set on the node groups of a job across nodes (dptrain._shm.nodes): completes each
        # rank's chunk of a node's sum with the other nodes' before it is copied out.
        self.between: Callable[[torch.Tensor], None] | None = None
        self._runner = _Runner(segment)
        self._finalizer = weakref.finalize(self, self._runner.stop)
        self._finalizer.atexit = False  # close_all joins the worker at exit instead (see its note)

    @property
    def broken(self) -> str | None:
        """Why every collective of this group fails from now on (a peer died or did not arrive in
        time, the ranks called different collectives, or the group was aborted), or None."""
        return self._seg.broken

    # ---- construction
    @classmethod
    def create(
        cls,
        group: Any,
        nbytes: int,
        *,
        what: str = "shared-memory collective",
        want: bool | None = None,
        devices: Sequence[torch.device] = (torch.device("cpu"),),
    ) -> "ShmGroup | None":
        """Map one shared segment with a region of ``nbytes`` per rank; collective.

        Args:
            group: the process group (None: the whole world).
            nbytes: bytes each rank may place in its region (:meth:`zeros`, staging).
            what: the operation, as error messages should name it.
            want: None (default) -- use shared memory when every rank can and
                ``DPTRAIN_SHM`` is not 0; False -- do not; True -- require it.
            devices: where this rank's tensors live; any non-CPU device rules it out.

        Returns:
            The group, or None on every rank when any rank cannot or will not share memory
            (with a warning on rank 0 when it was possible in principle but failed).

        Raises:
            ValueError: ``want=True`` but shared memory cannot be used (names the reason).
            CollectiveError: a rank failed during construction.
        """
        seg = open_segment(group, nbytes, what, want, devices)
        return None if seg is None else cls(seg, group)

    # ---- memory
    def zeros(self, numel: int, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        """A zero-filled tensor in this rank's region, at the same offset on every rank.

        Every rank must make the same sequence of calls. Falls back to ordinary memory
        (``torch.zeros``) when the region is full; such a tensor is all-reduced through a
        staging copy.
        """
        nbytes = numel * dtype.itemsize
        if self._next + nbytes > self.region_bytes:
            return torch.zeros(numel, dtype=dtype, device=device)
        t = self._seg.view(self._seg.rank, self._next, numel, dtype)
        self._next = _aligned(self._next + nbytes)
        t.zero_()
        return t

    def release_all(self) -> None:
        """Forget every tensor :meth:`zeros` handed out: the next calls reuse the region from its
        start. Only when none of them is used any more, and on every rank at the same point
        (the reducer does it when it rebuilds its buckets)."""
        self._next = 0

    # ---- collectives
    def all_reduce(self, tensor: torch.Tensor, tag: str = "", slot: torch.Tensor | None = None,
                   then: Callable[[], None] | None = None) -> Work:
        """Sum ``tensor`` across the ranks, in place; returns a :class:`Work` to wait on.

        ``then`` (default None): called by the worker as the sum completes, before any wait on it
        returns (see :meth:`Work.then`).

        Where the bytes meet must be the same on every rank: ``slot``, a tensor from
        :meth:`zeros` (default: ``tensor`` itself). When ``tensor`` is the slot, the sum
        happens in place with no copy; otherwise ``tensor`` passes through the slot, whose
        content is kept (a rank that joined early all-reduces zeros through its bucket).
        A tensor in ordinary memory with no slot goes through the free space of the
        region, piece by piece: every rank must then do the same. Summation order:
        ``((x0 + x1) + x2) + ...`` in group-rank order, on every rank.

        Raises:
            ValueError: ``tensor`` is not on the CPU, or ``slot`` differs from it in size or dtype.
        """
        if tensor.device.type != "cpu":
            raise ValueError(f"shared-memory all_reduce needs a CPU tensor, got one on {tensor.device}")
        seg, op = self._seg, self._name(tag)
        place = tensor if slot is None else slot
        offset = seg.offset_of(place)
        if offset is None:
            fn = lambda: self._staged_all_reduce(tensor, op)  # noqa: E731
        elif place is tensor or (place.data_ptr() == tensor.data_ptr() and place.numel() == tensor.numel()):
            fn = lambda: seg.all_reduce_at(offset, tensor.numel(), tensor.dtype, op, self.between)  # noqa: E731
        elif place.numel() != tensor.numel() or place.dtype != tensor.dtype:
            raise ValueError(
                f"{op}: slot holds {place.numel()} {place.dtype} elements, tensor {tensor.numel()} {tensor.dtype}"
            )
        else:
            fn = lambda: _through_slot(seg, offset, place, tensor, op, self.between)  # noqa: E731
        return self._runner.submit(fn, op, then)

    def all_gather(self, per_rank: Sequence[Sequence[torch.Tensor]], tag: str = "") -> None:
        """Copy ``per_rank[j]`` of rank j into ``per_rank[j]`` of every other rank; blocking.

        ``per_rank[self.rank]`` is this rank's contribution; the tensors of the other ranks
        are overwritten. Every rank passes tensors of the same shapes and dtypes.

        Raises:
            ValueError: a rank's tensors do not fit in its region.
            ShmPeerError: a rank died or did not arrive in time.
        """
        layouts = []
        for j, tensors in enumerate(per_rank):
            offset, layout = self._next, []
            for t in tensors:
                layout.append((offset, t))
                offset = _aligned(offset + t.numel() * t.element_size())
            if offset > self.region_bytes:
                raise ValueError(
                    f"shared-memory all_gather: rank {j}'s tensors need {offset} bytes but the region holds "
                    f"{self.region_bytes}; create the ShmGroup with a larger nbytes"
                )
            layouts.append(layout)
        seg, op = self._seg, self._name(tag)
        self._runner.submit(lambda: seg.all_gather_at(layouts, op), op).wait()

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, tag: str = "") -> Work:
        """Gather every rank's equal ``shard`` into ``out`` (rank order, as torch's
        ``all_gather_into_tensor``); asynchronous. The shards meet in the region's free space,
        in pieces when they are larger."""
        n, flat = self.world_size, shard.reshape(-1)
        rows = out.reshape(-1).view(n, flat.numel())
        room = self._room(shard, "shared-memory all_gather", 1)
        seg, op, offset = self._seg, self._name(tag), self._next

        def run() -> None:
            for start in range(0, flat.numel(), room):
                end = min(start + room, flat.numel())
                layouts = [[(offset, flat[start:end] if j == self.rank else rows[j, start:end])] for j in range(n)]
                seg.all_gather_at(layouts, op)
            rows[self.rank].copy_(flat)

        return self._runner.submit(run, op)

    def reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, tag: str = "") -> Work:
        """Sum ``full`` over the ranks and leave this rank's chunk in ``out`` (as torch's
        ``reduce_scatter_tensor``); asynchronous, in pieces when ``full`` is larger than the
        region's free space. Summation order: ``((x0 + x1) + x2) + ...`` in group-rank order.

        Raises:
            ValueError: ``full`` is not ``world_size`` chunks of ``out``'s size, or not on the CPU.
        """
        n = self.world_size
        if out.numel() * n != full.numel():
            raise ValueError(f"shared-memory reduce_scatter: {full.numel()} elements do not split into "
                             f"{n} chunks of {out.numel()}")
        rows, flat_out = full.reshape(n, out.numel()), out.reshape(-1)
        room = self._room(full, "shared-memory reduce_scatter", n)
        seg, op, offset = self._seg, self._name(tag), self._next

        def run() -> None:
            for start in range(0, flat_out.numel(), room):
                end = min(start + room, flat_out.numel())
                seg.reduce_scatter_at(offset, rows[:, start:end], flat_out[start:end], op)

        return self._runner.submit(run, op)

    def _room(self, t: torch.Tensor, what: str, rows: int) -> int:
        """Elements per row that one piece of a collective on ``t`` can hold in the free space
        (collectives larger than that pass in pieces); ``what`` names it in errors."""
        if t.device.type != "cpu":
            raise ValueError(f"{what} needs CPU tensors, got one on {t.device}")
        room = (self.region_bytes - self._next) // (rows * t.element_size())
        if room < 1:
            raise ValueError(f"{what}: the shared-memory region has no free space; "
                             "create the ShmGroup with a larger nbytes")
        return room

    def _name(self, tag: str) -> str:
        seg = self._seg
        seg.count += 1
        return f"{seg.what} #{seg.count}{' (' + tag + ')' if tag else ''}"

    def _staged_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        seg, room = self._seg, self._room(tensor, f"{op} (staged)", 1)
        flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
        seg.settle(op)  # the staging area is where all_gather publishes
        for start in range(0, flat.numel(), room):
            piece = flat[start : start + room]
            stage = seg.view(seg.rank, self._next, piece.numel(), tensor.dtype)
            stage.copy_(piece)
            seg.all_reduce_at(self._next, piece.numel(), tensor.dtype, op, self.between)
            piece.copy_(stage)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))

    def close(self) -> None:
        """Stop the worker and unmap once queued collectives are done (the memory itself stays
        while tensors from :meth:`zeros` live). Also runs when the group is garbage-collected."""
        self._finalizer()

    def abort(self, reason: str = "the process group was re-formed", wait_s: float = 5.0) -> bool:
        """Abandon this group: the collective in progress and the queued ones fail at once
        (:class:`ShmPeerError` for whoever waits on them), then the worker unmaps and ends.

        For a group whose process group is gone (in-place recovery): :meth:`close` would let
        a collective that a live peer never issues wait until the collective timeout. Not a
        collective; the peers need not call it. Returns True when the worker ended within
        ``wait_s`` seconds (it only has to notice the flag, within one wait slice).
        """
        self._finalizer.detach()
        return self._runner.abort(reason, wait_s)


# --------------------------------------------------------------------------- for DDP
def for_parameters(params: Sequence[torch.Tensor], group: Any, want: bool | None, what: str) -> ShmGroup | None:
    """The group for a reducer whose buckets hold ``params``' gradients; collective.

    Each rank's region holds every bucket (the reducer allocates them with
    :meth:`ShmGroup.zeros`) plus room for padding and a staging area for other
    all-reduces of ordinary tensors, processed in pieces (the reducer itself never needs it).
    """
    nbytes, devices = region_for(params)
    return ShmGroup.create(group, nbytes, what=what, want=want, devices=devices)


def ahead_for_parameters(params: Sequence[torch.Tensor], world_size: int, directory: str | None) -> bool:
    """Make ahead the segment :func:`for_parameters` over ``world_size`` ranks will need, in
    ``directory`` (see [Note: a segment made ahead] in segment.py); no collective. True when made."""
    nbytes, devices = region_for(params)
    if any(torch.device(d).type != "cpu" for d in devices):
        return False
    return make_ahead(directory, nbytes, world_size)


def region_for(params: Sequence[torch.Tensor]) -> tuple[int, list[torch.device]]:
    """(bytes of each rank's region, the devices) for a reducer of ``params`` (see for_parameters)."""
    buckets = sum(_aligned(p.numel() * p.element_size()) for p in params)
    slack = 2048 * 8 + _ALIGN * (len(params) + 1)  # a bucket's status slot and 1024-element padding
    staging = min(buckets, 256 * 1024)
    return buckets + slack + staging, sorted({p.device for p in params}, key=str)

