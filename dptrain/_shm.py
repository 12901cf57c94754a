"""Shared-memory collectives for the ranks of one node (CPU tensors).

On one machine every rank's gradients already sit in the same RAM, yet gloo moves them
through TCP loopback: a copy into the kernel and a copy out, for every byte, both ways.
:class:`ShmGroup` maps one file of ``/dev/shm`` into every rank of a process group and
all-reduces in place there, synchronising through counters in the same mapping.
:class:`dptrain.DistributedDataParallel` uses it automatically when it can (see
:func:`for_parameters`); ``DPTRAIN_SHM=0`` or ``DistributedDataParallel(shm=False)`` turn
it off.

[Note: the segment]
One file per group, ``/dev/shm/dptrain-<128-bit random token>``, created by the group's
first rank with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (no other user can open
it), its pages reserved with ``posix_fallocate`` so that a full ``/dev/shm`` is an error
at construction and never a SIGBUS in the middle of training. The token travels through
the process group, so only the job's ranks learn the name. Once every rank has mapped the
file, its name is unlinked: from then on nothing in ``/dev/shm`` refers to it and the
kernel frees the memory when the last mapping goes -- on a normal exit, an exception, a
SIGTERM, or a SIGKILL from the launcher alike, with no cleanup code that could be skipped.
Only during construction (a few milliseconds) does the name exist; a rank that fails
there removes it, and only the death of *every* rank inside that window could leave it.

Layout: a header page with one 32-bit arrival counter per rank (each on its own cache
line), then one region of equal size per rank. Buffers are placed at the same offset in
every region, so "rank j's copy of buffer b" is ``region[j] + offset(b)``. The reducer
allocates its gradient buckets in this rank's region (:meth:`ShmGroup.zeros`): backward
writes the gradients straight into shared memory, and the all-reduce needs no copy in and
no copy out.

[Note: the all-reduce protocol]
For a buffer at offset ``o`` of ``n`` elements, split into one chunk per rank (64-byte
aligned so two ranks never write the same cache line):

1. barrier A -- every rank's buffer holds its contribution;
2. rank r sums chunk r over all regions, in rank order ``((x0 + x1) + x2) + ...``, and
   writes the sum into chunk r of *every* region;
3. barrier B -- every region holds the complete result.

Each rank reads and writes one buffer's worth of bytes, and two barriers suffice: a rank
writes into region j only between A and B, when rank j does not touch its buffer, and the
next time rank j writes its buffer (the next backward) comes after it passed B. The sum
of two ranks is ``x0 + x1`` in fp32, the same bits as gloo's (addition is commutative);
with more ranks the order above is fixed and identical on every rank and in every run,
since each element is summed once and copied to all.

[Note: waiting]
A barrier stores this rank's incremented counter and wakes its waiters (``FUTEX_WAKE``),
then waits for every other counter to reach the same value: a few reads, then
``FUTEX_WAIT`` (through ``ctypes``; it releases the GIL) in slices of
``_WAIT_SLICE_S``, so a waiting rank sleeps in the kernel and burns no core. After each
slice it checks the deadline (dptrain's collective timeout) and whether the missing rank
still lives: each rank holds a POSIX record lock on one byte of the segment, which the
kernel drops when the process dies, so a dead rank is noticed within a slice even across
PID namespaces, and the error names it. A POSIX lock is owned by the process, not
inherited by ``fork``, so a DataLoader worker does not keep a dead rank "alive".
Counters are written with plain aligned 32-bit stores: on x86-64 (TSO) stores become
visible in program order (glibc fences its non-temporal copies); elsewhere a system call
that runs a full memory barrier in the kernel is issued before publishing and after
observing a counter (:func:`_fence`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import queue
import secrets
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dptrain import env

__all__ = ["ShmGroup", "ShmPeerError", "for_parameters", "shm_disabled_by_env", "SEGMENT_PREFIX"]

SEGMENT_PREFIX = "dptrain-"
_SHM_DIR = "/dev/shm"
_ALIGN = 64  # bytes: chunk and buffer alignment (a cache line)
_PAGE = 4096
_WAIT_SLICE_S = 0.1  # longest sleep between deadline / liveness checks
_SPIN_READS = 32  # counter reads before sleeping in the kernel

# ---------------------------------------------------------------------------------- futex
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> tuple[Any, int | None]:
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None, None
    fn.restype = ctypes.c_long
    return fn, _SYS_FUTEX.get(platform.machine().lower())


_syscall, _SYS_futex = _load_syscall()
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_word = ctypes.c_uint32(0)


def _futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout_s``)."""
    if _SYS_futex is None:
        time.sleep(min(timeout_s, 0.001))  # no futex here: a short sleep, still no spinning
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    # EAGAIN (the word changed), ETIMEDOUT and EINTR all mean "look again".
    _syscall(_SYS_futex, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    if _SYS_futex is not None:
        _syscall(_SYS_futex, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _fence() -> None:
    """A full memory barrier where stores may be reordered (not x86-64): see [Note: waiting]."""
    if not _TSO:
        _futex_wake(ctypes.addressof(_fence_word))


class ShmPeerError(RuntimeError):
    """A peer died or did not arrive in a shared-memory collective.

    Raised by :meth:`Work.wait`; callers re-raise it through
    :func:`dptrain._diagnostics.explain_failure`, which adds this rank, the operation and
    what the heartbeats say about the missing rank, as for every other collective.
    """


# ------------------------------------------------------------------------------ eligibility
def shm_disabled_by_env() -> bool:
    """True when ``DPTRAIN_SHM`` is set to 0 / false / off / no."""
    return os.environ.get("DPTRAIN_SHM", "1").strip().lower() in ("0", "false", "off", "no")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _node_identity() -> tuple:
    """What ranks on one node share: the kernel (boot id), the host name and the network
    namespace (network namespaces are how this project's tests emulate several nodes)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = None
    return (socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), netns, os.getuid())


def _local_obstacle(devices: Sequence[torch.device]) -> str | None:
    """Why this rank cannot take part, or None."""
    if not sys.platform.startswith("linux"):
        return f"the platform is {sys.platform}, not Linux"
    if not os.path.isdir(_SHM_DIR) or not os.access(_SHM_DIR, os.W_OK):
        return f"{_SHM_DIR} is missing or not writable"
    bad = sorted({str(d) for d in devices if torch.device(d).type != "cpu"})
    if bad:
        return f"the tensors are on {', '.join(bad)}, not on the CPU"
    return None


# ----------------------------------------------------------------------------- the worker
class Work:
    """Handle of an asynchronous shared-memory collective: ``wait()`` returns when it is done.

    ``wait`` raises :class:`ShmPeerError` when the collective failed (a rank that died or
    did not arrive in time).
    """

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class _Runner:
    """The worker thread of one group: runs collectives one at a time, in issue order (the
    same on every rank), and unmaps the segment after the last one."""

    def __init__(self, seg: "_Segment") -> None:
        self.seg = seg
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> Work:
        work = Work()
        with self.lock:
            if self.seg.closed:
                raise RuntimeError(f"{self.seg.what}: the shared-memory group was closed")
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
            work._done.set()

    def stop(self) -> None:
        with self.lock:
            if self.thread is None:
                self.seg.close()
            elif not self.seg.closed:
                self.jobs.put(None)  # the worker closes the segment after the queued work


class _Segment:
    """The mapping, the counters and the protocol. Owned by one ShmGroup and its worker."""

    def __init__(self, fd: int, nbytes: int, header: int, region: int, rank: int, ranks: list[int], what: str) -> None:
        self.fd, self.header, self.region = fd, header, region
        self.rank, self.ranks, self.n, self.what = rank, ranks, len(ranks), what
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.counters = [ctypes.c_uint32.from_buffer(self.mm, _ALIGN * j) for j in range(self.n)]
        self.addrs = [base + _ALIGN * j for j in range(self.n)]
        self.base = base
        self.seq = 0  # barriers passed by this rank
        self.timeout_s = env._timeout().total_seconds()
        self.broken: str | None = None
        self.count = 0  # collectives issued, for messages
        self.closed = False
        self.path = ""

    # ---- addresses
    def view(self, j: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.header + j * self.region + offset
        return self.bytes[start : start + numel * dtype.itemsize].view(dtype)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Offset of ``t`` inside this rank's region, or None when it lives elsewhere."""
        lo = self.base + self.header + self.rank * self.region
        p = t.data_ptr()
        if t.is_contiguous() and lo <= p and p + t.numel() * t.element_size() <= lo + self.region:
            return p - lo
        return None

    # ---- liveness
    def lock_own_byte(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self.rank, os.SEEK_SET)

    def alive(self, j: int) -> bool:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, j, os.SEEK_SET)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return True  # rank j still holds its lock
            raise
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, j, os.SEEK_SET)
        return False

    # ---- barrier
    def barrier(self, op: str) -> None:
        if self.broken:
            raise ShmPeerError(f"{op} not started: {self.broken}")
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        target = self.seq
        _fence()
        self.counters[self.rank].value = target
        _futex_wake(self.addrs[self.rank])
        deadline = time.monotonic() + self.timeout_s
        for j in range(self.n):
            if j != self.rank:
                self._wait_for(j, target, deadline, op)
        _fence()

    def _wait_for(self, j: int, target: int, deadline: float, op: str) -> None:
        counter = self.counters[j]
        for _ in range(_SPIN_READS):
            if ((counter.value - target) & 0xFFFFFFFF) < 0x80000000:
                return
        while True:
            seen = counter.value
            if ((seen - target) & 0xFFFFFFFF) < 0x80000000:
                return
            now = time.monotonic()
            if now >= deadline or not self.alive(j):
                self._fail(j, op, timed_out=now >= deadline)
            _futex_wait(self.addrs[j], seen, min(_WAIT_SLICE_S, max(deadline - now, 0.001)))

    def _fail(self, j: int, op: str, timed_out: bool) -> None:
        who = self.ranks[j]
        if timed_out:
            why = f"rank {who} did not arrive within the {self.timeout_s:.0f}s timeout (its process is alive)"
        else:
            why = f"rank {who} did not arrive: its process exited"
        self.broken = f"an earlier shared-memory collective failed ({why})"
        raise ShmPeerError(f"shared memory: {why}")

    # ---- collectives (run on the worker thread, in issue order)
    def all_reduce_at(self, offset: int, numel: int, dtype: torch.dtype, op: str) -> None:
        """Sum the buffer at ``offset`` of every region into all of them (see the protocol note)."""
        self.barrier(op)
        per = -(-numel // self.n)
        per = -(-per * dtype.itemsize // _ALIGN) * _ALIGN // dtype.itemsize
        lo, hi = min(self.rank * per, numel), min((self.rank + 1) * per, numel)
        if hi > lo:
            off = offset + lo * dtype.itemsize
            parts = [self.view(j, off, hi - lo, dtype) for j in range(self.n)]
            acc = parts[0]
            torch.add(parts[0], parts[1], out=acc)
            for part in parts[2:]:
                acc.add_(part)
            for part in parts[1:]:
                part.copy_(acc)
        self.barrier(op)

    def all_gather_at(self, layouts: list[list[tuple[int, torch.Tensor]]], op: str) -> None:
        """Publish ``layouts[rank]`` (offset, tensor) in this region, then read every other rank's."""
        for off, t in layouts[self.rank]:
            self.view(self.rank, off, t.numel(), t.dtype).copy_(t.reshape(-1))
        self.barrier(op)
        for j, layout in enumerate(layouts):
            if j != self.rank:
                for off, t in layout:
                    t.copy_(self.view(j, off, t.numel(), t.dtype).view(t.shape))
        self.barrier(op)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.counters = []
        self.bytes = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # tensors still view it (a reducer's buckets): the mapping goes with them
        try:
            os.close(self.fd)
        except OSError:
            pass


# ------------------------------------------------------------------------------ the group
def _aligned(nbytes: int, to: int = _ALIGN) -> int:
    return -(-nbytes // to) * to


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
        self._runner = _Runner(segment)
        self._finalizer = weakref.finalize(self, self._runner.stop)

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
            The group, or None on every rank when any rank cannot or will not share memory.

        Raises:
            ValueError: ``want=True`` but shared memory cannot be used (names the reason).
            CollectiveError: a rank failed during construction.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return None
        me, n = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        wish = want if want is not None else (False if shm_disabled_by_env() else None)
        mine = {
            "wish": wish,
            "obstacle": None if wish is False else _local_obstacle(devices),
            "node": _node_identity(),
            "token": secrets.token_hex(16) if me == 0 else None,
            "nbytes": int(nbytes),
        }
        from dptrain import comm  # comm is below us; imported late only to keep this module light

        infos = comm.all_gather_object(mine, group=group)
        reason = _group_obstacle(infos, ranks)
        if reason is not None:
            if any(i["wish"] is True for i in infos):
                raise ValueError(
                    f"rank {ranks[me]}: {what}: shared memory was required (shm=True) but {reason}; "
                    "pass shm=None to fall back to gloo automatically"
                )
            return None
        header = _aligned(_ALIGN * n, _PAGE)
        region = _aligned(max(i["nbytes"] for i in infos), _PAGE)
        path = os.path.join(_SHM_DIR, SEGMENT_PREFIX + infos[0]["token"])
        seg, reason = _attach(group, me, ranks, path, header + n * region, header, region, what)
        if seg is None:
            if any(i["wish"] is True for i in infos):
                raise ValueError(f"rank {ranks[me]}: {what}: shared memory was required (shm=True) but {reason}")
            env._warn_once_main(f"{what}: shared memory is off, falling back to gloo: {reason}")
            return None
        return cls(seg, group)

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

    # ---- collectives
    def all_reduce(self, tensor: torch.Tensor, tag: str = "") -> Work:
        """Sum ``tensor`` across the ranks, in place; returns a :class:`Work` to wait on.

        In place with no copy when ``tensor`` came from :meth:`zeros` (a contiguous piece of
        this rank's region); otherwise through the region's free space, piece by piece.
        Summation order: ``((x0 + x1) + x2) + ...`` in group-rank order, on every rank.
        """
        if tensor.device.type != "cpu":
            raise ValueError(f"shared-memory all_reduce needs a CPU tensor, got one on {tensor.device}")
        seg = self._seg
        seg.count += 1
        op = f"{seg.what} #{seg.count}{' (' + tag + ')' if tag else ''}"
        offset = seg.offset_of(tensor)
        if offset is not None:
            fn = lambda: seg.all_reduce_at(offset, tensor.numel(), tensor.dtype, op)  # noqa: E731
        else:
            fn = lambda: self._staged_all_reduce(tensor, op)  # noqa: E731
        return self._runner.submit(fn)

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
        seg = self._seg
        seg.count += 1
        op = f"{seg.what} #{seg.count}{' (' + tag + ')' if tag else ''}"
        self._runner.submit(lambda: seg.all_gather_at(layouts, op)).wait()

    def _staged_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        seg, room = self._seg, (self.region_bytes - self._next) // tensor.element_size()
        if room < 1:
            raise ValueError(f"{op}: the shared-memory region has no free space for a staged all-reduce")
        flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
        for start in range(0, flat.numel(), room):
            piece = flat[start : start + room]
            stage = seg.view(seg.rank, self._next, piece.numel(), tensor.dtype)
            stage.copy_(piece)
            seg.all_reduce_at(self._next, piece.numel(), tensor.dtype, op)
            piece.copy_(stage)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))

    def close(self) -> None:
        """Stop the worker and unmap once queued collectives are done (the memory itself stays
        while tensors from :meth:`zeros` live). Also runs when the group is garbage-collected."""
        self._finalizer()


def _group_obstacle(infos: list[dict], ranks: list[int]) -> str | None:
    """Why the ranks cannot share memory (the first reason found), or None."""
    for r, info in zip(ranks, infos):
        if info["wish"] is False:
            return f"rank {r} turned it off (DPTRAIN_SHM=0 or shm=False)"
        if info["obstacle"]:
            return f"on rank {r} {info['obstacle']}"
    for r, info in zip(ranks, infos):
        if info["node"] != infos[0]["node"]:
            return f"rank {r} is on another node than rank {ranks[0]} ({info['node'][0]} vs {infos[0]['node'][0]})"
    return None


def _attach(group: Any, me: int, ranks: list[int], path: str, nbytes: int, header: int, region: int, what: str):
    """Create (first rank), open (the others), map and lock the segment; unlink its name.

    Three exchanges through the process group: the token (done by the caller), "created",
    "attached". Any failure on any rank makes every rank return None (or raise, when a
    peer died), and whichever ranks get that far remove the name.
    """
    from dptrain import comm

    fd, seg, problem, problems = -1, None, None, []
    try:
        if me == 0:
            fd, problem = _create(path, nbytes)
        if any(comm.all_gather_object(problem, group=group)):
            problem = problem or "did not attach: the first rank could not create the segment"
        elif me != 0:
            fd, problem = _open_existing(path, nbytes)
        if problem is None:
            try:
                seg = _Segment(fd, nbytes, header, region, me, ranks, what)
                seg.path = path  # for messages and tests; the name is gone after construction
                seg.lock_own_byte()
            except (OSError, ValueError) as exc:
                problem = f"cannot map {path} on rank {ranks[me]}: {exc}"
        problems = comm.all_gather_object(problem, group=group)
    finally:
        _unlink(path)  # every rank tries: the name must not outlive construction
        if not problems or any(problems):
            if seg is not None:
                seg.close()
            elif fd >= 0:
                os.close(fd)
    failed = [(r, p) for r, p in zip(ranks, problems) if p]
    if failed:
        return None, f"on rank {failed[0][0]} {failed[0][1]}"
    return seg, None


def _create(path: str, nbytes: int) -> tuple[int, str | None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return -1, f"cannot create {path}: {exc.strerror}"
    try:
        os.fchmod(fd, 0o600)  # whatever the umask: this user only
        os.posix_fallocate(fd, 0, nbytes)  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS later
    except OSError as exc:
        os.close(fd)
        _unlink(path)
        free = _free_bytes()
        return -1, (
            f"cannot reserve {nbytes / 2**20:.1f} MiB in {_SHM_DIR} ({exc.strerror}; {free / 2**20:.1f} MiB free); "
            "enlarge it (e.g. `docker run --shm-size=2g`) or set DPTRAIN_SHM=0"
        )
    return fd, None


def _open_existing(path: str, nbytes: int) -> tuple[int, str | None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return -1, f"cannot open {path} ({exc.strerror}): {_SHM_DIR} is not shared with the first rank"
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_size != nbytes or (st.st_mode & 0o077):
        os.close(fd)
        return -1, f"{path} is not the segment the first rank created (owner, size or mode differ)"
    return fd, None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _free_bytes() -> int:
    try:
        st = os.statvfs(_SHM_DIR)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


# --------------------------------------------------------------------------- for DDP
def for_parameters(params: Sequence[torch.Tensor], group: Any, want: bool | None, what: str) -> ShmGroup | None:
    """The group for a reducer whose buckets hold ``params``' gradients; collective.

    Each rank's region holds every bucket (the reducer allocates them with
    :meth:`ShmGroup.zeros`) plus room for padding and a staging area for other
    all-reduces (join's zero gradients), processed in pieces.
    """
    buckets = sum(_aligned(p.numel() * p.element_size()) for p in params)
    slack = 2048 * 8 + _ALIGN * (len(params) + 1)  # a bucket's status slot and 1024-element padding
    staging = min(buckets, 4 * 2**20)
    devices = sorted({p.device for p in params}, key=str)
    return ShmGroup.create(group, buckets + slack + staging, what=what, want=want, devices=devices)
