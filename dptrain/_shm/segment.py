"""The shared segment behind :class:`dptrain._shm.ShmGroup`: the file, its mapping, and the
barriers and collectives that run on it.

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
there removes it, and only the death of *every* rank inside that window could leave it. (A
segment made ahead for in-place recovery exists longer, in the launcher's recovery folder,
which the launcher removes: see [Note: a segment made ahead].)

Layout: a header page with one cache line per rank -- its 32-bit arrival counter and a
descriptor of the collective it entered, which every rank compares after the first
barrier, so that mismatched collectives fail naming each rank's call instead of adding
unrelated bytes -- then one region of equal size per rank. Buffers are placed at the same offset in
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
``FUTEX_WAIT`` (through ``ctypes``; it releases the GIL) in slices of 100 ms (5 ms under
in-place recovery), so a waiting rank sleeps in the kernel and burns no core. After each
slice it checks the deadline (dptrain's collective timeout) and whether the missing rank
still lives: each rank holds a POSIX record lock on one byte of the segment, which the
kernel drops when the process dies, so a dead rank is noticed within a slice even across
PID namespaces, and the error names it. Within one PID namespace a rank that the kernel is
still ending (killed: its lock goes only tens of ms later) counts as dead already (see
[Note: a process that is dying] in :mod:`dptrain.runtime.proc`). A POSIX lock is owned by the process, not
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
import secrets
import socket
import sys
import time
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.runtime import diagnostics as _diagnostics, proc as _proc, settings as _settings, env

__all__ = ["ShmPeerError", "open_segment", "shm_disabled_by_env", "SEGMENT_PREFIX", "make_ahead", "discard_ahead",
           "in_shared_memory", "memory_file"]

SEGMENT_PREFIX = "dptrain-"
_SHM_DIR = "/dev/shm"
_ALIGN = 64  # bytes: chunk and buffer alignment (a cache line)
_PAGE = 4096
# Longest sleep between deadline / liveness checks: a survivor waiting in an all-reduce with a rank
# that died notices it within a slice. Under in-place recovery (dptrain run --recovery in-place) the
# recovery starts from there, so the slice is short; a look costs about 30 us (a lock test,
# /proc/PID/stat): every 5 ms, under 1% of a waiting core. Without it a death ends the whole job
# anyway and the long slice keeps a waiting worker from waking (and taking a core from the compute
# of a busy node) 200 times a second for nothing. See [Note: the wait's cost].
_WAIT_SLICE_S = 0.1
_WAIT_SLICE_RECOVERY_S = 0.005
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
    :func:`dptrain.runtime.diagnostics.explain_failure`, which adds this rank, the operation and
    what the heartbeats say about the missing rank, as for every other collective.
    """


# ------------------------------------------------------------------------------ eligibility
def shm_disabled_by_env() -> bool:
    """True when ``DPTRAIN_SHM`` is set to 0 / false / no / off."""
    return not _settings.get("DPTRAIN_SHM")


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


class _Segment:
    """The mapping, the counters and the protocol. Owned by one ShmGroup and its worker."""

    def __init__(self, fd: int, nbytes: int, header: int, region: int, rank: int, ranks: list[int], what: str,
                 mm: mmap.mmap | None = None) -> None:
        self.fd, self.header, self.region = fd, header, region
        self.rank, self.ranks, self.n, self.what = rank, ranks, len(ranks), what
        self.mm = mm if mm is not None else _map(fd, nbytes)  # mm: mapped already (see make_ahead)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        # Per rank, one cache line: the arrival counter, then what it is about to do (see _check).
        self.counters = [ctypes.c_uint32.from_buffer(self.mm, _ALIGN * j) for j in range(self.n)]
        self.descs = [(ctypes.c_uint64 * 3).from_buffer(self.mm, _ALIGN * j + 8) for j in range(self.n)]
        self.addrs = [base + _ALIGN * j for j in range(self.n)]
        self.base = base
        self.seq = 0  # barriers passed by this rank
        self.reads_pending: int | None = None  # all_gather: the barrier meaning "all have read"
        self.timeout_s = env.timeout().total_seconds()
        self.broken: str | None = None
        self.aborted: str | None = None  # set from another thread by abort(): waits give up
        self.count = 0  # collectives issued, for messages
        self.closed = False
        self.path = ""
        self.processes: list[tuple[int, int | None] | None] = [None] * self.n  # (pid, start time) where visible
        in_place = _settings.get("DPTRAIN_RECOVERY") == "in-place"
        self.slice_s = _WAIT_SLICE_RECOVERY_S if in_place else _WAIT_SLICE_S  # see _WAIT_SLICE_S

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
                # Rank j still holds its lock; a rank killed holds it until the kernel has ended it,
                # tens of ms later, but in its PID namespace that shows at once (see dptrain.runtime.proc).
                seen = self.processes[j]
                return seen is None or _proc.dying(*seen) is None
            raise
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, j, os.SEEK_SET)
        return False

    # ---- barrier
    def barrier(self, op: str, desc: tuple[int, int, int] | None = None) -> None:
        """Arrive, then wait for every rank; with ``desc``, also check they all do the same."""
        if desc is not None:
            self.descs[self.rank][:] = desc
        self.wait_all(self.arrive(op), op)
        if desc is not None:
            self._check(op, [tuple(d) for d in self.descs])

    def arrive(self, op: str) -> int:
        """Publish that this rank reached the next barrier; returns its number."""
        if self.broken:
            raise ShmPeerError(f"{op} not started: {self.broken}")
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        _fence()
        self.counters[self.rank].value = self.seq
        _futex_wake(self.addrs[self.rank])
        return self.seq

    def wait_all(self, target: int, op: str) -> None:
        """Wait until every other rank arrived at barrier ``target``."""
        deadline = time.monotonic() + self.timeout_s
        for j in range(self.n):
            if j != self.rank:
                self._wait_for(j, target, deadline, op)
        _fence()

    def _check(self, op: str, descs: list[tuple]) -> None:
        """Every rank published what it is doing before arriving: the same thing, or an error.

        Mismatched collectives would otherwise silently add unrelated bytes; this costs a
        few reads per collective, so it is always on (unlike DPTRAIN_DEBUG's store check).
        """
        if all(d == descs[0] for d in descs):
            return
        names = {1: "all_reduce", 2: "all_gather", 3: "reduce_scatter"}

        def fmt(d: tuple) -> str:
            kind, a, b = d
            if kind & 0xFF in (1, 3):
                return f"{names[kind & 0xFF]} of {b} bytes at offset {a}"
            return f"{names.get(kind & 0xFF, 'unknown')} of {a} tensors, {b} bytes"

        listing = "; ".join(f"rank {r}: {fmt(d)}" for r, d in zip(self.ranks, descs))
        self.broken = "an earlier shared-memory collective differed between ranks"
        raise _diagnostics.CollectiveMismatchError(
            f"rank {self.ranks[self.rank]}: {op}: the ranks called different shared-memory collectives -- "
            f"{listing}. Every rank must issue the same collectives in the same order with the same sizes"
        )

    def _wait_for(self, j: int, target: int, deadline: float, op: str) -> None:
        counter = self.counters[j]

        def arrived() -> bool:  # counters wrap around: compare modulo 2**32
            return ((counter.value - target) & 0xFFFFFFFF) < 0x80000000

        for _ in range(_SPIN_READS):
            if arrived():
                return
        # [Note: the wait's cost]
        # Most waits end with the peer's wake-up within the first sleep: its liveness is looked at
        # only once a whole slice passed without it (a look reads /proc), and the slice is long
        # unless in-place recovery needs a death seen at once. Both were paid on every wait of
        # every bucket before (a look before the first sleep, a 5 ms slice for every job).
        look = False
        while True:
            seen = counter.value
            if arrived():
                return
            if self.aborted is not None:
                self.broken = f"the shared-memory group was aborted ({self.aborted})"
                raise ShmPeerError(f"shared memory: {op} abandoned: {self.aborted}")
            now = time.monotonic()
            if now >= deadline or (look and not self.alive(j)):
                if arrived():  # it arrived, then finished and exited, just now
                    return
                self._fail(j, op, timed_out=now >= deadline)
            look = True
            _futex_wait(self.addrs[j], seen, min(self.slice_s, max(deadline - now, 0.001)))

    def _fail(self, j: int, op: str, timed_out: bool) -> None:
        who = self.ranks[j]
        if timed_out:
            why = f"rank {who} did not arrive within the {self.timeout_s:.0f}s timeout (its process is alive)"
        else:
            why = f"rank {who} did not arrive: its process exited"
        self.broken = f"an earlier shared-memory collective failed ({why})"
        raise ShmPeerError(f"shared memory: {why}")

    def abort(self, reason: str) -> None:
        """Make the collective in progress and every later one fail at once (from any thread).

        For a group whose process group is gone (in-place recovery): a peer that is alive but
        will never issue the collective this rank waits in would otherwise hold the worker
        until the collective timeout. The waiter sleeps in slices of ``slice_s`` and
        checks the flag after each; the wake-up below cuts the slice short.
        """
        self.aborted = reason
        self.broken = self.broken or f"the shared-memory group was aborted ({reason})"
        if not self.closed:
            for addr in self.addrs:  # the waiter sleeps on a peer's counter: wake it to look
                _futex_wake(addr)

    def settle(self, op: str) -> None:
        """Before overwriting this rank's free space: wait until the ranks read the last all_gather."""
        if self.reads_pending is not None:
            self.wait_all(self.reads_pending, op)
            self.reads_pending = None

    # ---- collectives (run on the worker thread, in issue order)
    def all_reduce_at(self, offset: int, numel: int, dtype: torch.dtype, op: str,
                      between: Callable[[torch.Tensor], None] | None = None) -> None:
        """Sum the buffer at ``offset`` of every region into all of them (see the protocol note).

        ``between(chunk)``, when given, completes this rank's chunk of the sum in place before
        it is copied out (across nodes: the all-reduce with the other nodes, see dptrain._shm.nodes).
        """
        self.barrier(op, (1 | zlib.crc32(str(dtype).encode()) << 8, offset, numel * dtype.itemsize))
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
            if between is not None:
                between(acc)
            for part in parts[1:]:
                part.copy_(acc)
        self.barrier(op)

    def reduce_scatter_at(self, offset: int, rows: torch.Tensor, out: torch.Tensor, op: str) -> None:
        """Sum ``rows`` (n x k: row j goes to rank j) over the ranks; row ``rank`` of the sum into ``out``.

        ``rows`` is published at ``offset`` of this region; rank r then sums row r of every
        region in rank order ``((x0 + x1) + x2) + ...`` straight into ``out``. Only reads of
        other regions, so "done reading" is announced lazily, as in :meth:`all_gather_at`.
        """
        self.settle(op)
        k, dtype = rows.shape[1], rows.dtype
        self.view(self.rank, offset, rows.numel(), dtype).view(rows.shape).copy_(rows)
        self.barrier(op, (3 | zlib.crc32(str(dtype).encode()) << 8, offset, rows.numel() * dtype.itemsize))
        parts = [self.view(j, offset + self.rank * k * dtype.itemsize, k, dtype) for j in range(self.n)]
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        self.reads_pending = self.arrive(op)

    def all_gather_at(self, layouts: list[list[tuple[int, torch.Tensor]]], op: str) -> None:
        """Publish ``layouts[rank]`` (offset, tensor) in this region, then read every other rank's.

        One meeting per call: "done reading" is announced without waiting, and awaited only
        before this rank next overwrites its region -- by then, normally long since true.
        """
        self.settle(op)
        for off, t in layouts[self.rank]:
            self.view(self.rank, off, t.numel(), t.dtype).copy_(t.reshape(-1))
        sizes = [t.numel() * t.element_size() for layout in layouts for _, t in layout]
        self.barrier(op, (2, len(sizes), sum(sizes)))
        for j, layout in enumerate(layouts):
            if j != self.rank:
                for off, t in layout:
                    t.copy_(self.view(j, off, t.numel(), t.dtype).view(t.shape))
        self.reads_pending = self.arrive(op)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.counters, self.descs = [], []
        self.bytes = None  # type: ignore[assignment]
        # Not self.mm.close(): torch.frombuffer keeps a reference to the mapping but no buffer
        # export, so close() would unmap memory that tensor views of it (a reducer's buckets)
        # still point at, and their next touch (a backward after dptrain.shutdown()) would be a
        # SIGSEGV instead of an error. The mapping goes with its last reference instead.
        self.mm = None  # type: ignore[assignment]
        try:
            os.close(self.fd)
        except OSError:
            pass


def _aligned(nbytes: int, to: int = _ALIGN) -> int:
    return -(-nbytes // to) * to


def open_segment(
    group: Any, nbytes: int, what: str, want: bool | None, devices: Sequence[torch.device]
) -> "_Segment | None":
    """Agree with the other ranks on whether to share memory, and map the segment if so.

    Collective; the arguments are those of :meth:`dptrain._shm.ShmGroup.create`. Returns
    None on every rank when any rank cannot or will not take part. A segment this rank made
    ahead (:func:`make_ahead`) is used when it has the size the group needs, else removed.
    """
    try:
        return _open_segment(group, nbytes, what, want, devices)
    finally:
        discard_ahead()  # taken by _attach when it was used: nothing left to remove then


def _open_segment(
    group: Any, nbytes: int, what: str, want: bool | None, devices: Sequence[torch.device]
) -> "_Segment | None":
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    if str(dist.get_backend(group)) == "nccl":  # CUDA tensors on every rank: nothing to ask the others
        if want:
            raise ValueError(f"{what}: shm=True needs CPU tensors, but the process group is NCCL's (GPUs)")
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
        "ahead": None if _ahead is None else (_ahead["path"], _ahead["nbytes"]),  # see make_ahead
        "process": _proc.identity(),  # see _Segment.alive
    }
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
    nbytes = header + n * region
    # A segment of exactly this size made ahead by one of the ranks (the same choice on every rank).
    maker = next((j for j, i in enumerate(infos) if i["ahead"] is not None and i["ahead"][1] == nbytes), None)
    if maker is not None:
        path = infos[maker]["ahead"][0]
    else:
        path = os.path.join(_SHM_DIR, SEGMENT_PREFIX + infos[0]["token"])
    seg, reason = _attach(group, me, ranks, path, nbytes, header, region, what, maker)
    if seg is None:
        if any(i["wish"] is True for i in infos):
            raise ValueError(f"rank {ranks[me]}: {what}: shared memory was required (shm=True) but {reason}")
        env._warn_once_main(f"{what}: shared memory is off, falling back to gloo: {reason}")
        return None
    here = mine["process"][0]
    seg.processes = [tuple(i["process"][1:]) if here is not None and i["process"][0] == here else None
                     for i in infos]
    return seg


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


def _attach(group: Any, me: int, ranks: list[int], path: str, nbytes: int, header: int, region: int, what: str,
            maker: int | None = None):
    """Create (first rank), open (the others), map and lock the segment; unlink its name.

    Three exchanges through the process group: the token (done by the caller), "created",
    "attached". Any failure on any rank makes every rank return None (or raise, when a
    peer died), and whichever ranks get that far remove the name. ``maker``: the rank that
    made the segment ahead (:func:`make_ahead`); it exists already, so "created" is skipped.
    """
    global _ahead
    fd, seg, problem, problems, mm = -1, None, None, [], None
    try:
        if maker is not None:
            if me == maker:
                fd, mm, _ahead = _ahead["fd"], _ahead["mm"], None
            else:
                fd, problem = _open_existing(path, nbytes)
        else:
            if me == 0:
                fd, problem = _create(path, nbytes)
            if any(comm.all_gather_object(problem, group=group)):
                problem = problem or "did not attach: the first rank could not create the segment"
            elif me != 0:
                fd, problem = _open_existing(path, nbytes)
        if problem is None:
            try:
                seg = _Segment(fd, nbytes, header, region, me, ranks, what, mm)
                seg.path = path  # for messages and tests; the name is gone after construction
                seg.lock_own_byte()
            except (OSError, ValueError) as exc:
                problem = f"cannot map {path}: {exc}"
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


def _map(fd: int, nbytes: int, populate: bool = True) -> mmap.mmap:
    """The segment's mapping, its pages mapped now (not at the first touch inside a collective)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


# [Note: a segment made ahead]
# In-place recovery re-forms the process group and DDP's rejoin makes a new segment: the
# first rank reserves its pages, every rank maps them, and one more exchange comes between --
# about 35 ms for a model of 14 MiB on two ranks, on the path from a failure to the next step,
# right after a survivor has waited idle for the replacement to start. So the survivor that
# most likely sends the state makes the segment in that wait (make_ahead): created with a
# random name in the launcher's recovery folder (on /dev/shm, 0700, and removed by the
# launcher however the job ends, so a survivor killed in the wait leaves nothing behind),
# reserved and mapped. open_segment names it in the exchange it does anyway; when its size
# is the one the group needs, the other ranks open it and the maker keeps its mapping, and
# from there on it is an ordinary segment (the name unlinked once all have it). Otherwise,
# and whatever happens, it is removed at the end of that open_segment (discard_ahead).
_ahead: dict | None = None


def make_ahead(directory: str | None, nbytes: int, world_size: int) -> bool:
    """Make, reserve and map the segment a group of ``world_size`` ranks with regions of ``nbytes``
    will need, in ``directory`` (only one on /dev/shm); the next :func:`open_segment` of this
    process uses it or removes it. True when made; False (nothing made) when it cannot be
    (no such folder, ``DPTRAIN_SHM=0``, /dev/shm full): the group is then made as usual."""
    global _ahead
    discard_ahead()
    total = _aligned(_ALIGN * world_size, _PAGE) + world_size * _aligned(nbytes, _PAGE)
    made = memory_file(directory, SEGMENT_PREFIX, total)
    if made is None:
        return False
    path, fd, mm = made
    _ahead = {"path": path, "fd": fd, "mm": mm, "nbytes": total}
    return True


def memory_file(directory: str | None, prefix: str, nbytes: int, populate: bool = True):
    """A new file of ``nbytes`` in ``directory`` when that is on /dev/shm and shared memory is on,
    named ``prefix`` and a random token, private to this user, its pages reserved and mapped
    shared (``populate``: mapped now, not at first touch): ``(path, fd, mapping)``, or None when it
    cannot be (nothing is left behind then)."""
    if not directory or not nbytes or shm_disabled_by_env() or _local_obstacle([torch.device("cpu")]) is not None:
        return None
    if not in_shared_memory(directory):
        return None
    path = os.path.join(directory, prefix + secrets.token_hex(16))
    fd, problem = _create(path, nbytes)
    if problem is not None:
        return None
    try:
        mm = _map(fd, nbytes, populate)
    except (OSError, ValueError):
        os.close(fd)
        _unlink(path)
        return None
    return path, fd, mm


def in_shared_memory(path: str) -> bool:
    """Whether ``path`` lies under /dev/shm (its files are memory, not disk)."""
    return os.path.realpath(path).startswith(os.path.realpath(_SHM_DIR) + os.sep)


def discard_ahead() -> None:
    """Remove the segment :func:`make_ahead` made, unless an :func:`open_segment` took it."""
    global _ahead
    made, _ahead = _ahead, None
    if made is None:
        return
    _unlink(made["path"])
    made["mm"].close()  # nothing views it yet
    os.close(made["fd"])


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


