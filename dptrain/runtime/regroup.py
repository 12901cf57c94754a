"""In-place recovery's process groups: leave a broken one, form the next generation's.

[Note: generations]
Under ``dptrain run --recovery in-place`` a rank that dies does not end the job. Its node's
launcher announces the recovery as generation ``g`` (the key ``recovery/generation/<g>``
among dptrain's keys of the attempt, ``g`` = 1, 2, ...; its value says which rank died and
why) and then starts a replacement for that rank. Every member of the job -- each survivor
from the collective that failed, the replacement from ``dptrain.init()`` -- then forms
generation ``g``'s process group on the same store, under a prefix of its own (``pg/gen<g>``),
so that no key of a broken group is ever read again; the broken group is destroyed first
(gloo's and the shared-memory groups' connections to a dead peer fail at once, they do not
hang).

Before creating the group, the members count themselves in (``recovery/g<g>/arrived``):
``init_process_group`` would wait the whole collective timeout for a member that will never
come, whereas the count notices a newer generation -- a second rank died meanwhile -- and
moves every member on to that one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import threading
import time
from typing import Any, Iterator

import torch.distributed as dist

from dptrain.runtime import heartbeat as _heartbeat

__all__ = ["generation_key", "newest_generation", "failure_after", "wait_for_generation", "form", "world_at",
           "newcomers_ready", "JobFinished", "FINISHED", "FALLBACK_EXIT", "FALLBACK", "announcement", "prefixed",
           "recording_connections", "cut_connections", "leave_if_broken", "on_leaving", "init_group"]

#: Written (rank 0) when a job that lets nodes in has finished: a newcomer still waiting to join exits.
FINISHED = "recovery/finished"
#: Seconds the members of a new generation wait for each other at least (see ``form``).
ARRIVAL_WAIT_S = 120.0
_POLL_S = 0.01  # a store check is ~0.1 ms: polling this often costs nothing and keeps recovery prompt
# The members waiting for the others in ``form`` wake the moment the last one arrives (see [Note: waiting
# for the others, quietly]); every slice they look for a newer generation or the job's end. Longer than
# _POLL_S: each look is three requests to the store, from every waiting member.
_ARRIVAL_SLICE_S = 0.05
_ARRIVAL_MARGIN_S = 60.0  # how much longer than the member's own deadline its waiting thread's wait may last
_NO_DEADLINE_S = 7 * 24 * 3600.0  # the same for a rank of a node let in, which has no deadline of its own


# [Note: cutting a broken group's connections]
# gloo closes a group's connections only when its last reference goes, and a collective still
# running on one of its worker threads holds one. A survivor that leaves a broken group while a
# live peer waits for it in another collective -- a ring all-reduce that completed on the peer
# and failed here -- would leave that peer waiting for the whole collective timeout, and itself
# wait for the peer at the next generation's rendezvous. So the sockets the group opened are
# noted when it is created (the process's socket descriptors before and after), and shut down
# (not closed: gloo still owns the descriptors; its listening socket is left alone) before the
# group is destroyed; both sides' collectives then fail at once. A descriptor is shut down only
# while it still refers to the very socket noted (its inode), so a number reused since is never
# touched. Linux only (/proc). A descriptor gloo closed itself (it saw the peer's end) has nothing
# left to cut even when gloo did not fail the collective running on it: a wait for an asynchronous
# one is left by dptrain.runtime.abandon instead (see [Note: a wait that gloo never ends] there).
#
# [Note: a peer that goes silent]
# A node that freezes or drops off the network (a kernel hang, a cut cable, power lost) closes
# nothing: a survivor blocked with it in a gloo collective would wait the whole collective
# timeout (600 s by default). Node 0's launcher declares the node lost within seconds and
# announces a generation without it, so every rank's heartbeat thread looks for such an
# announcement (:func:`leave_if_broken`) and, when one came after the group it is in, cuts
# that group's connections and aborts its shared-memory groups (``on_leaving``): the
# collective in flight fails at once and the survivor recovers. A generation that only lets a
# node in breaks nothing and is left to the step boundary. ``_GROUP_LOCK`` makes the check and
# the cut one step against the main thread noting a newer group's sockets, so a group formed
# for that very generation is never cut.
_group_sockets: dict[int, str] = {}
_group_generation = [0]  # the generation of the group whose sockets are noted
_GROUP_LOCK = threading.Lock()
_on_leaving: list[Any] = []  # called with a reason, under _GROUP_LOCK, when the heartbeat thread cuts


def _sockets() -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(name)] = link
    return found


@contextlib.contextmanager
def recording_connections(generation: int = 0) -> Iterator[None]:
    """Note the sockets a process group (of ``generation``) opens while the block runs (see the note above)."""
    before = _sockets()
    yield
    with _GROUP_LOCK:
        _group_sockets.clear()
        _group_sockets.update({fd: link for fd, link in _sockets().items() if before.get(fd) != link})
        _group_generation[0] = generation


def on_leaving(fn: Any) -> None:
    """Register ``fn(reason)``: abandon what else runs over the group when the heartbeat thread
    cuts it (see [Note: a peer that goes silent]); it must not wait for the main thread."""
    if fn not in _on_leaving:
        _on_leaving.append(fn)


_while_waiting: list[Any] = []  # called once with the member's world, while it waits in form for the others


def while_waiting(fn: Any) -> None:
    """Register ``fn(world)``: work a member can do while it waits for the others in :func:`form`
    (called at most once per wait, on the waiting thread; an exception is ignored)."""
    if fn not in _while_waiting:
        _while_waiting.append(fn)


def failure_after(keys: Any, current: int) -> tuple[int, list[dict]] | None:
    """The newest generation announced after ``current`` and what was said of each since, when one of
    them is for a failure (a node lost, a rank dead); None when none is newer, or when they only let a
    node in (its ranks join at a step boundary, not mid-step)."""
    g = newest_generation(keys, current)
    if g == current:
        return None
    said = [announcement(keys, n) for n in range(current + 1, g + 1)]
    if all(entry.get("joining") for entry in said):
        return None
    return g, said


def leave_if_broken(keys: Any, current: int) -> bool:
    """The heartbeat thread's look (see [Note: a peer that goes silent]): when a generation after
    ``current`` is announced for a failure (a node lost, a rank dead), cut the group of an older
    generation; True when it did."""
    failure = failure_after(keys, current)
    if failure is None:
        return False
    g, said = failure
    with _GROUP_LOCK:
        if _group_generation[0] >= g:
            return False  # the main thread formed that generation's group already
        why = f"in-place recovery announced generation {g} ({said[-1].get('why') or 'a rank failed'})"
        for fn in list(_on_leaving):
            try:
                fn(why)
            except Exception:  # noqa: BLE001 - the cut below still makes the collective fail
                pass
        _cut_noted()
        _group_generation[0] = g  # cut once
    return True


def cut_connections() -> int:
    """Shut down the sockets of the group noted last; returns how many were shut down."""
    with _GROUP_LOCK:
        return _cut_noted()


def _cut_noted() -> int:
    cut = 0
    for fd, link in list(_group_sockets.items()):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            # gloo's listener stays: its accepting thread would abort the process on a shut-down socket.
            if sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only
    _group_sockets.clear()
    return cut


def prefixed(base: Any, attempt: int, part: str) -> Any:
    """``base`` seen under launch attempt ``attempt``'s ``part`` (see _heartbeat's [Note: the store's key layout])."""
    return dist.PrefixStore(part, dist.PrefixStore(_heartbeat.attempt_prefix(attempt), base))


class JobFinished(RuntimeError):
    """A rank arrived to join a running job after the job's training had finished (see :data:`FINISHED`).

    ``newcomer``: the rank is one of a node let in while the job ran, which has nothing left to
    do; otherwise it replaces a rank that died, whose own code after ``fit`` never ran.
    """

    def __init__(self, message: str, newcomer: bool) -> None:
        super().__init__(message)
        self.newcomer = newcomer


#: Exit code of a rank that cannot go on in place, after it wrote why under ``recovery/fallback``:
#: its launcher restarts the whole job instead (``dptrain.launcher.inplace`` has the same number).
FALLBACK_EXIT = 75
#: The store key (under the attempt's dptrain keys) of that "why": its launcher reads it as ``recovery/fallback``.
FALLBACK = "recovery/fallback"


def generation_key(generation: int) -> str:
    return f"recovery/generation/{generation}"


def newest_generation(keys: Any, after: int) -> int:
    """The newest generation the launcher has announced, ``after`` when none is newer."""
    g = after
    while keys.check([generation_key(g + 1)]):
        g += 1
    return g


def announcement(keys: Any, generation: int) -> dict:
    """What the launcher said about ``generation`` (which rank died, why); {} when unreadable."""
    try:
        value = json.loads(keys.get(generation_key(generation)).decode("utf-8", "replace"))
    except (ValueError, RuntimeError):
        return {}
    return value if isinstance(value, dict) else {}


def newcomers_ready(keys: Any, after: int) -> bool:
    """Whether the group must be re-formed at this step boundary: a generation after ``after`` is
    announced and, when it lets ranks of a node in (see [Note: a node coming back] in
    ``dptrain.launcher.resize``), they have all arrived -- the others then wait only for the state
    transfer, not for the newcomers' start."""
    g = newest_generation(keys, after)
    if g == after:
        return False
    joining = announcement(keys, g).get("joining") or []
    return not joining or int(keys.add(f"recovery/g{g}/arrived", 0)) >= len(joining)


def wait_for_generation(keys: Any, after: int, timeout_s: float) -> int:
    """Block until a generation after ``after`` is announced; return the newest one.

    Raises:
        TimeoutError: none within ``timeout_s`` (no launcher doing in-place recovery, or the
            failure was not a rank's death).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        g = newest_generation(keys, after)
        if g > after:
            return g
        if time.monotonic() > deadline:
            raise TimeoutError(f"no in-place recovery was announced within {timeout_s:.0f}s")
        time.sleep(_POLL_S)


# [Note: waiting for the others, quietly]
# The members of a new generation wait for each other in ``form``: seconds, when a replacement is a
# fresh interpreter importing torch. A member must go on the moment the last one arrives, and
# meanwhile notice a newer generation (a second failure), the job's end or its own deadline. A
# store wait in 50 ms slices did both, but every slice that passed was a timeout of torch's store
# client, which c10d logs as two warnings ("[c10d] waitForInput: socket ... timed out after
# 50ms"): 35 lines a second on the output of every rank that waited. Now no wait of the store is
# ended by its timeout:
#
# * The member waits once for ``recovery/g<g>/wake``, which the last member to arrive sets (the
#   store answers every waiter at once). The wait runs on a thread (:class:`_Arrivals`), over a
#   connection of its own: on the rank's store client it would hold that client (torch serializes
#   its calls) from the heartbeat thread, which writes through it; and on the main thread it would
#   hold off the script's signal handlers (Ctrl-C, SIGTERM) until it ended, since a store call
#   does not return for a signal. The main thread waits on a lock that the thread releases (its
#   wake-up costs about 0.1 ms more than the store's answer), and looks for a newer generation,
#   the job's end and its deadline between 50 ms slices, with ``check`` and ``add`` calls.
# * A member that leaves the generation without the others (a newer one, the job's end, its
#   deadline, an error) sets ``wake`` itself, which ends its own thread's wait and the others':
#   they look, find the newer generation or the end as well, or else look every slice from then
#   on. So no thread is left in a wait that could only time out; its timeout (past the deadline)
#   is a bound, never a signal.
#
# Where no connection of its own can be made (a store that is not a TCPStore), the member looks
# every slice from the start.


class _Arrivals:
    """A thread that waits, on a connection of its own to ``base``'s server, until ``key`` (among dptrain's
    keys of ``attempt``) is set, ``wait_s`` seconds at most; see [Note: waiting for the others, quietly]."""

    def __init__(self, base: Any, attempt: int, key: str, wait_s: float) -> None:
        self._set = threading.Lock()
        self._set.acquire()  # released by the thread when the key is set (a lock: the quickest wake-up)
        self._seen = False
        self._own: Any = None  # the connection, closed with this object (not on the way to the group)
        self._thread = threading.Thread(target=self._wait, args=(base, attempt, key, wait_s), daemon=True,
                                        name="dptrain-arrivals")

    def start(self) -> None:
        """Start the wait. Apart from the constructor: a signal's handler may raise while ``Thread.start``
        waits for the thread to run, and the caller must hold this object by then to end that thread."""
        self._thread.start()

    def _wait(self, base: Any, attempt: int, key: str, wait_s: float) -> None:
        timeout = datetime.timedelta(seconds=wait_s)
        try:
            self._own = dist.TCPStore(base.host, base.port, None, False, timeout=timeout, wait_for_workers=False)
            prefixed(self._own, attempt, _heartbeat.DPTRAIN_PART).wait([key], timeout)
        except Exception:  # noqa: BLE001 - not a TCPStore, or its server is gone: the caller looks every slice
            return
        self._set.release()

    def wait(self, slice_s: float) -> None:
        """Return when the key is set, or after ``slice_s`` seconds (signals are handled meanwhile)."""
        if self._seen:  # set and looked at already: the caller looks every slice from now on
            time.sleep(slice_s)
        else:
            self._seen = self._set.acquire(timeout=slice_s)

    def join(self, timeout_s: float = 5.0) -> None:
        """Wait until the thread, its key set, is out of the store's wait (``timeout_s`` at most: a store
        gone ends it too, but a connection still being made may take longer)."""
        until = time.monotonic() + timeout_s
        while True:
            try:
                self._thread.join(max(0.0, until - time.monotonic()))
                return
            except RuntimeError:  # ``start`` cut short by a signal: the thread is about to run
                if time.monotonic() >= until:
                    return
                time.sleep(0.01)


def world_at(keys: Any, world: Any, since: int, generation: int) -> Any:
    """``world`` (a :class:`dptrain.runtime.env.World` of generation ``since``) as generation ``generation``
    has it: a resize (the job going on without a node, see [Note: a node lost for good] in
    ``dptrain.launcher.resize``) renumbers the ranks and changes the world size. None when this
    rank is not in the job any more (its node was left out)."""
    for g in range(since + 1, generation + 1):
        said = announcement(keys, g)
        if said.get("kind") != "resize":
            continue
        try:
            renumber = {int(old): int(new) for old, new in said["renumber"]}
            sizes = [int(n["nproc"]) for n in said["nodes"]]
            size = int(said["world_size"])
        except (KeyError, TypeError, ValueError):
            raise RuntimeError(f"in-place recovery: generation {g}'s entry is not what dptrain's launcher writes: "
                               f"{str(said)[:200]}") from None
        if world.rank not in renumber:
            return None
        rank = renumber[world.rank]
        node, base = 0, 0
        while base + sizes[node] <= rank:  # the node whose ranks include the new number
            base += sizes[node]
            node += 1
        world = dataclasses.replace(world, rank=rank, world_size=size, node_rank=node)
    return world


def form(base: Any, keys: Any, world: Any, backend: str, timeout: datetime.timedelta, generation: int,
         since: int) -> tuple[int, Any]:
    """Create the process group of ``generation`` (or of a newer one announced meanwhile); return
    it and this rank's world in it (see :func:`world_at`; ``world`` is that of generation ``since``).

    Every member of the job calls this. See [Note: generations].

    Raises:
        RuntimeError: this rank was left out of the job by a resize.
        TimeoutError: not every member arrived within ``timeout`` (at least :data:`ARRIVAL_WAIT_S`).
        JobFinished: the job finished before this rank (let in while it ran) could join it.
    """
    # Not the collective timeout alone: the members wait here for a replacement's start (a Python
    # start, the torch import, the script up to its Trainer), seconds on a loaded machine however
    # short the timeout a job sets to catch stalls. A replacement that dies instead is announced
    # as a newer generation by its launcher, a lost node by node 0's, so the wait still ends.
    wait_s = max(timeout.total_seconds(), ARRIVAL_WAIT_S)
    deadline = time.monotonic() + wait_s
    idle = list(_while_waiting)  # a replacement, the first to arrive, has time to spare here
    g = newest_generation(keys, generation - 1)
    while True:
        here = world_at(keys, world, since, g)
        if here is None:
            raise RuntimeError(f"rank {world.rank} is not in the job any more: its node was left out when the job "
                               f"went on without a node (generation {g})")
        arrived, wake = f"recovery/g{g}/arrived", f"recovery/g{g}/wake"
        count = int(keys.add(arrived, 1))
        if count >= here.world_size:
            keys.set(wake, "1")  # ends the others' waits below at once
        newer = False
        # A rank of a node let in waits for the running ranks' next step boundary, however long their
        # steps take (see [Note: a node coming back] in dptrain.launcher.resize): no deadline of its own.
        newcomer = since == g and here.rank in (announcement(keys, g).get("joining") or [])
        waiting = None  # the thread waiting for ``wake`` (see [Note: waiting for the others, quietly])
        try:
            while count < here.world_size:
                if keys.check([generation_key(g + 1)]):
                    newer = True
                    break
                if keys.check([FINISHED]):
                    raise JobFinished(f"rank {here.rank}: the job finished before this rank could join it", newcomer)
                if time.monotonic() > deadline and not newcomer:
                    raise TimeoutError(
                        f"rank {here.rank}: only {count} of {here.world_size} ranks arrived for in-place recovery "
                        f"(generation {g}) within {wait_s:.0f}s"
                    )
                if waiting is None:
                    # Its wait outlasts this member's: ``wake`` ends it, never its timeout.
                    waiting = _Arrivals(base, here.launch_attempt, wake, _NO_DEADLINE_S if newcomer
                                        else deadline - time.monotonic() + _ARRIVAL_MARGIN_S)
                    waiting.start()
                if idle:
                    for fn in idle:
                        with contextlib.suppress(Exception):
                            fn(here)
                    idle = []
                else:
                    waiting.wait(_ARRIVAL_SLICE_S)
                count = int(keys.add(arrived, 0))
        finally:
            if waiting is not None and count < here.world_size:
                # Leaving without the others (a newer generation, the job's end, an error): end the waits of
                # the generation's members, this one's thread's included, so that none is left to time out.
                with contextlib.suppress(Exception):
                    keys.set(wake, "1")
                waiting.join()
        if newer:
            g = newest_generation(keys, g)
            continue
        store = prefixed(base, here.launch_attempt, f"{_heartbeat.PROCESS_GROUP_PART}/gen{g}")
        with recording_connections(g):
            init_group(backend, store, here.rank, here.world_size, timeout)
        return g, here


# [Note: a group that failed to form]
# torch names a default group by a counter that every init_process_group bumps and only the
# destruction of a default group resets. An init that fails -- a member dies while the group
# connects ("Gloo connectFullMesh failed ... Connection closed by peer") -- leaves no group to
# destroy and the counter one up: this rank's next group would be "1" where its peers' is "0",
# its keys under another prefix of the store, and every member of that generation would wait
# for the others in init_process_group until the collective timeout. (Seen once in the suite: a
# replacement that died right after its init, one survivor's init failed, and all three ranks
# of the next generation sat in init_process_group for 180 s.)
def init_group(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` that leaves torch's group numbering as it found it when it fails
    (see [Note: a group that failed to form])."""
    world = getattr(dist.distributed_c10d, "_world", None)
    count = getattr(world, "group_count", None)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        if count is not None and not dist.is_initialized():
            world.group_count = count
        raise
