"""The state from a live rank to the others, for in-place recovery (see [Note: in-place recovery]
in :mod:`dptrain.train.recovery`): packed into one buffer, sent over the process group or, on one
node, through a file in ``/dev/shm``, and unpacked; packed on a thread while the replacement starts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.runtime import tensors as _tensors

__all__ = ["STATE_FILE_PREFIX", "transfer_device", "pack_state", "map_state_file", "PackedEarly", "remove",
           "broadcast_state", "release_later"]


def transfer_device() -> torch.device:
    """Where the state travels: the rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def pack_state(state: dict, directory: str | None = None, device: torch.device | None = None) -> tuple:
    """``state`` ready to send: itself, its structure with slots for its tensors, those tensors'
    bytes in one buffer (see ``dptrain.runtime.tensors``; pickled whole, the weights and optimizer state
    took 5x as long to send), and the path of the file in ``directory`` that the buffer is
    (see [Note: the state through /dev/shm]), or None. ``device``: where it travels (default:
    :func:`transfer_device`, which asks the process group)."""
    device = device if device is not None else transfer_device()
    skeleton, tensors = _tensors.split_tensors(state)
    made: list = []
    allocate = (lambda nbytes: state_file(nbytes, directory, made)) if device.type == "cpu" else None
    buffer, meta = _tensors.pack(tensors, device, allocate)
    return state, skeleton, meta, buffer, made[0] if made else None


# [Note: the state through /dev/shm]
# On one node the state need not cross the process group's sockets. The source packs it into a
# file in the launcher's recovery folder on /dev/shm (memory; 0700; removed by the launcher
# however the job ends) -- while it waits for the replacement, when it packs ahead -- and, when
# every member is on its node, sends only the file's name with the state's structure. A member
# maps the file privately (copy-on-write: nothing it does reaches the file or another member):
# the weights are copied from there into its parameters, and the rest (optimizer state and
# the like, which live on) into memory of its own. Over gloo the same 28 MB took 40-50 ms on
# two CPU ranks, most of it faulting in the receiving buffer. Then every member says whether it
# could map the file, and where any could not, the buffer goes over the process group as
# before. The name is removed by every member once all have mapped it; a failure on the way
# leaves it to the source's next recovery, or to the launcher.
STATE_FILE_PREFIX = "state-"


def state_file(nbytes: int, directory: str | None, made: list) -> torch.Tensor | None:
    """A writable buffer of ``nbytes`` that is a new file in ``directory`` when that is on /dev/shm
    (its path appended to ``made``), or None."""
    from dptrain import _shm

    prefix = f"{STATE_FILE_PREFIX}{os.getpid()}-"
    if directory:
        for old in glob.glob(os.path.join(directory, prefix + "*")):
            remove(old)  # an earlier recovery's that a failure left behind
    file = _shm.memory_file(directory, prefix, nbytes, populate=False)  # packing writes every page anyway
    if file is None:  # the process group carries the state instead
        return None
    path, fd, mm = file
    os.close(fd)  # the mapping keeps the file
    made.append(path)
    return torch.frombuffer(mm, dtype=torch.uint8)


def map_state_file(path: str, nbytes: int) -> torch.Tensor | None:
    """The source's file, mapped copy-on-write; None when it cannot be (then the process group carries it)."""
    import mmap

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


class PackedEarly:
    """The likely source's state packed on a thread while the replacement still starts.

    A survivor stops its step as soon as its launcher signals the failure (see [Note: stopping a
    step at once] in :mod:`dptrain.runtime.interrupt`) and re-forms the group while the replacement
    starts; the replacement then runs its script up to the Trainer (data, model: 45 ms for the
    benchmark's job, seconds for a large one) while the survivor waits in the exchange. Packing
    the state and making the new reducer's shared memory (30-50 ms for a model of 14 MiB on a
    2-core machine, most of it the kernel handing out fresh pages) fits in that wait, on a thread
    started once the group is formed. Not earlier: packing during the re-forming took the GIL and
    a core from the group's rendezvous, which is what the replacement's ``dptrain.init`` waits
    for (the group formed 15-25 ms later, and everything after it with it).

    The thread reads only what the main thread leaves alone until :meth:`take`: the weights and
    optimizer state at the last commit (the failed step's leftovers were undone by ``_let_go``)
    and plain attributes. It asks nothing of the process group, in which the main thread
    exchanges (``device`` and ``world_size`` are given). An error leaves the packing to the main
    thread of the source, as before.
    """

    def __init__(self, shared_state: Callable[[], dict], directory: str | None, device: torch.device, model: Any,
                 world_size: int) -> None:
        self._packed: tuple | None = None
        self._thread = threading.Thread(target=self._run, args=(shared_state, directory, device, model, world_size),
                                        name="dptrain-pack-state", daemon=True)
        self._thread.start()

    def _run(self, shared_state: Callable[[], dict], directory: str | None, device: torch.device, model: Any,
             world_size: int) -> None:
        with contextlib.suppress(Exception):
            self._packed = pack_state(shared_state(), directory, device)
            model._prepare_rejoin(directory, world_size)

    def take(self) -> tuple | None:
        """What :func:`pack_state` returned (None when it failed); waits for the thread."""
        self._thread.join()
        packed, self._packed = self._packed, None
        return packed

    def discard(self) -> None:
        """Not used after all (the recovery starts over): its file goes."""
        packed = self.take()
        if packed is not None:
            remove(packed[4])


def release_later(holder: list) -> None:
    """Let ``holder``'s items go on a thread: the received weights, views of the source's file.

    Their mapping is the last one of that file, whose name is gone, so unmapping it frees its
    pages: 6 ms for 14 MiB, on the path from the failure to the next step. The thread does it
    while the step starts (``munmap`` runs without the GIL). The caller keeps only ``holder``
    (a list, emptied by the thread), so that the last reference dies on the thread.
    """
    threading.Thread(target=holder.clear, name="dptrain-let-go", daemon=True).start()


def remove(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)


def broadcast_state(packed: tuple | None, src: int, me: int, one_node: bool) -> tuple[dict, str]:
    """The state that rank ``src`` packed (:func:`pack_state`; None on the others), on every rank, and
    how it came ("through /dev/shm" or "over the process group"); ``one_node``: every member is on the
    source's node (see [Note: the state through /dev/shm])."""
    buffer = None
    if me == src:
        state, skeleton, meta, buffer, path = packed
        path = path if one_node else None
        comm.broadcast_object((skeleton, meta, path), src=src)
    else:
        skeleton, meta, path = comm.broadcast_object(None, src=src)
    try:
        if path is not None:
            if me != src:
                buffer = map_state_file(path, _tensors.packed_nbytes(meta))
            ok = torch.tensor([int(buffer is not None)], dtype=torch.int32)
            comm.all_reduce(ok, op="min")
            if not ok.item():
                path = None
        if path is None:
            if me != src:
                buffer = _tensors.empty_for(meta, transfer_device())
            comm.broadcast(buffer, src=src)
    finally:
        remove(path)  # every member has it mapped by now (or it was not used)
        if me == src:
            remove(packed[4])
    how = "over the process group" if path is None else "through /dev/shm"
    if me == src:
        return state, how
    shared = _tensors.join_tensors(skeleton, _tensors.unpack(buffer, meta))
    if path is not None:
        # Only the weights are copied out at once (into the parameters); what else lives on gets
        # memory of its own instead of copy-on-write pages of the mapping (see the Note).
        shared = {k: v if k == "model" else _tensors.map_tensors(v, torch.clone) for k, v in shared.items()}
    return shared, how
