"""Who am I: the rank, world size and local rank of this process, and its process group.

The world is one validated value (:class:`World`) built here from what the launch
environment says (:mod:`dptrain.environments`: torchrun's variables, Slurm's, or none at
all -- a single process); ``init`` creates the process group, hands the store and the
timeout down to the diagnostics, and starts the heartbeat.

[Note: who hosts the rendezvous store]
Under ``torchrun`` and ``dptrain run`` the launcher hosts the TCP store and every rank,
rank 0 included, connects as a client (``TORCHELASTIC_USE_AGENT_STORE=True``). Then the
store outlives a crashed rank 0, so the others get a clean error instead of a reset
connection, and the launcher can read the ranks' heartbeats from it. Under ``srun``
(or a hand-written environment) there is no agent, so rank 0 hosts the store.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import warnings
from contextlib import nullcontext, suppress
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from dptrain import environments
from dptrain.runtime import (diagnostics as _diagnostics, heartbeat as _heartbeat, join as _join, regroup as _regroup,
    settings as _settings)
from dptrain.runtime import exit as _exit  # also registers the wait for gloo's workers at exit (see its note)
from dptrain.runtime.heartbeat import DEFAULT_TIMEOUT_S
from dptrain.environments import expand_nodelist

__all__ = [
    "World",
    "world_from_environ",
    "expand_nodelist",
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "is_main_process",
    "device",
    "get_world",
]



@dataclasses.dataclass(frozen=True)
class World:
    """Where this process stands in the job.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: rank among the processes of this node (selects the GPU).
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        master_addr: host of the rendezvous store (``None`` for a single process).
        master_port: port of the rendezvous store (``None`` for a single process).
        source: ``"torchrun"`` (torchrun's or dptrain's launcher variables), ``"slurm"``,
            ``"single"`` or ``"external"`` (a process group someone else created).
        use_agent_store: the launcher hosts the store; rank 0 connects as a client.
        restart_count: how many times this job ran before: restarts by the launcher
            (``TORCHELASTIC_RESTART_COUNT``) plus requeues by Slurm (``SLURM_RESTART_COUNT``).
            A Trainer resumes by itself when it is above 0.
        launch_attempt: the launcher's own restart count, which separates one attempt's keys
            in the rendezvous store from the next one's.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "single"
    use_agent_store: bool = False
    restart_count: int = 0
    launch_attempt: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside the world of {self.world_size} processes "
                f"(0 <= rank < {self.world_size}); give each process a distinct rank below the world size"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise ValueError(
                f"local rank {self.local_rank} is outside the {self.local_world_size} processes of this node"
            )

    @property
    def is_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    # `with dptrain.init() as world:` shuts the process group down on exit.
    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        shutdown()


def world_from_environ(environ: Mapping[str, str] | None = None) -> World:
    """Read the world from launcher variables, without creating any process group.

    Precedence: torchrun's variables (``RANK``/``WORLD_SIZE``, also set by ``dptrain run``),
    then Slurm's (``SLURM_PROCID``/``SLURM_NTASKS`` under ``srun``), else a single process.

    Args:
        environ: the mapping to read; defaults to ``os.environ``.

    Raises:
        ValueError: a variable is missing or malformed; the message names it, its value
            and the fix.

    Example:
        >>> world_from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        ...                     "MASTER_PORT": "29500"}).rank
        1
    """
    return World(**environments.detect(environ))


@dataclasses.dataclass
class _State:
    world: World | None = None
    backend: str | None = None
    store: dist.Store | None = None  # prefixed store for dptrain's own keys (debug, heartbeats)
    timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    owns_group: bool = False
    base_store: dist.Store | None = None  # the job's store itself, unprefixed (in-place recovery re-forms groups on it)
    generation: int = 0  # the process group's generation: see dptrain.runtime.regroup


_STATE = _State()


def _timeout_from(timeout) -> datetime.timedelta:
    if timeout is None:
        timeout = _settings.get("DPTRAIN_TIMEOUT")  # DEFAULT_TIMEOUT_S when unset
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=float(timeout))
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timeout


def _default_backend(world: World) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world.local_world_size:
        return "nccl"
    return "gloo"


def _hosts_store(world: World) -> bool:
    """Whether this rank's process hosts the job's store (rank 0, unless a launcher hosts it)."""
    return world.rank == 0 and not world.use_agent_store


def _make_store(world: World, timeout: datetime.timedelta) -> dist.Store:
    is_master = _hosts_store(world)
    return dist.TCPStore(
        world.master_addr,
        world.master_port,
        world.world_size if is_master else None,
        is_master,
        timeout=timeout,
        wait_for_workers=False,
    )


def _open_store_warning(world: World) -> str | None:
    """What rank 0 says when it hosts the job's store for ranks on other nodes (srun, one task per
    rank): torch's ``TCPStore`` listens on every interface and cannot ask for a secret, so anything
    that reaches the port can read the job's keys or join it as a rank. None otherwise: ``dptrain
    run`` hosts the store itself (and says so across nodes without a secret), torchrun is torch's.
    """
    if world.source != "slurm" or world.world_size <= world.local_world_size:
        return None
    return (f"rank 0 hosts this job's rendezvous store at {world.master_addr}:{world.master_port} with torch's "
            f"TCPStore, which cannot ask for a secret: anything that can reach that port can read the job's keys "
            f"or join it as a rank. To let only the job in, run `dptrain run` on each node with a secret: "
            f"`dptrain slurm-script --nodes N` (without --per-task) writes that sbatch file")


def _prefixed(base: dist.Store, world: World, part: str) -> dist.Store:
    # See _heartbeat's [Note: the store's key layout]: one prefix per launch attempt, then the
    # process group's keys ("pg") apart from dptrain's own ("dp", which the launcher reads too).
    return _regroup.prefixed(base, world.launch_attempt, part)


def _job_finished_while_joining(exc: "_regroup.JobFinished", keys: dist.Store) -> None:
    """A process started to join a running job found its training over: end it (raises SystemExit).

    A node let in too late has nothing left to do: exit 0. A replacement of a rank that died
    after its own ``fit`` returned but before rank 0's had (a race of the two ranks' ends) must
    not end quietly: the dead rank's code after ``fit`` (its final save, its evaluation) never
    ran, and a job ending with code 0 would look complete. It asks its launcher to restart the
    whole job (``recovery/fallback``, exit ``FALLBACK_EXIT``), which resumes from the newest
    checkpoint, finds the training done, and runs every rank's code after ``fit``.
    """
    if exc.newcomer:
        print(f"dptrain: {exc}; exiting", file=sys.stderr, flush=True)
        raise SystemExit(0) from None
    message = (f"in-place recovery is not possible: {exc} (its training ended while this rank was replaced); "
               f"restarting the whole job from its newest checkpoint, so that every rank's code after fit runs")
    with suppress(Exception):
        keys.set(_regroup.FALLBACK, message)
    print(f"dptrain: {message}", file=sys.stderr, flush=True)
    raise SystemExit(_regroup.FALLBACK_EXIT) from None


def _join_job(world: World, backend: str, td: datetime.timedelta) -> dist.Store:
    """Connect to the store and create the process group, saying what it waits for if it waits."""
    generation = _settings.get("DPTRAIN_GENERATION")
    if generation:
        # A replacement started by in-place recovery: the other ranks are not in init() but
        # re-forming the group of that generation (see dptrain.runtime.regroup).
        base = _make_store(world, td)
        keys = _prefixed(base, world, _heartbeat.DPTRAIN_PART)
        _STATE.base_store = base
        try:
            _STATE.generation, here = _regroup.form(base, keys, world, backend, td, generation, since=generation)
        except _regroup.JobFinished as exc:
            _job_finished_while_joining(exc, keys)
        if here != world:  # a resize came between the launcher's start of this process and now
            _set_world_environ(here)
            _STATE.world = here  # init() takes it from here
        return keys
    again = _init_suffix()  # see [Note: init again in the same process]

    def open_reader() -> dist.Store:
        reader = dist.TCPStore(world.master_addr, world.master_port, None, False,
                               timeout=datetime.timedelta(seconds=5))
        return _prefixed(reader, world, _heartbeat.DPTRAIN_PART + again)

    watch = _join.JoinWatch(world, td.total_seconds(), open_reader)
    try:
        base = _make_store(world, td)
        watch.connected = True
        keys = _prefixed(base, world, _heartbeat.DPTRAIN_PART)
        if again:
            # Back in the job: the note this rank wrote as it left the last one (left/<rank>, in the
            # keys every init shares) is not news. A peer whose collective fails in this job would
            # read it and name this rank as one that shut down, not as one that did not arrive; and
            # the progress it publishes starts again. Deleted before this rank joins, so before any
            # collective of the new group can fail.
            _heartbeat.reset_progress()
            with suppress(Exception):
                keys.delete_key(_heartbeat.key("left", world.rank))
        _STATE.base_store = base
        join_keys = _prefixed(base, world, _heartbeat.DPTRAIN_PART + again)
        join_keys.append("joined", f"{world.rank},")
        with _regroup.recording_connections(0) if _in_place() else nullcontext():
            group_keys = _prefixed(base, world, _heartbeat.PROCESS_GROUP_PART + again)
            # A failed init leaves torch's group numbering as it was: an init again in this process
            # meets its peers' (see [Note: a group that failed to form] in dptrain.runtime.regroup).
            _regroup.init_group(backend, group_keys, world.rank, world.world_size, td)
        _join.wait_until_all_ready(join_keys, world.world_size, td, hosts_store=_hosts_store(world))
    except Exception as exc:  # noqa: BLE001 - every failure to join gets what it waited for
        raise watch.failure(exc) from exc
    finally:
        watch.stop()
    _INITS[0] += 1
    return keys


# [Note: init again in the same process]
# A script may call init() again after shutdown() (a notebook, a test that runs several jobs, a
# sweep in one process). Under a launcher the store outlives the first process group, and with
# it that group's keys: torch's gloo rendezvous then read the peers' addresses of the first
# group (ports long closed: "Gloo connectFullMesh failed ... Connection refused", or a wait
# until the timeout), and the ``ready`` count was already complete. So the n-th init of a
# process (n >= 1) makes its group and its join keys under "init<n>" (as a generation's group is
# made under "pg/gen<g>", see dptrain.runtime.regroup.form); every rank of a job calls init the same
# number of times, so the n-th inits of all ranks meet there. The first init keeps the plain
# layout, which the launcher and the in-place recovery's generations share.
_INITS = [0]  # inits that completed in this process


def _init_suffix(n: int | None = None) -> str:
    """What init number ``n`` of this process (default: the next one) adds to its keys' parts."""
    n = _INITS[0] if n is None else n
    return f"/init{n}" if n > 0 else ""


def _threads_as_if_fresh() -> None:
    """Give a process that imported torch before its script ran the thread count a fresh one has.

    A hot spare and a child of the warm template (``dptrain.launcher.spare``, ``.template``)
    imported torch under the launcher's environment; OpenMP read ``OMP_NUM_THREADS`` then. A
    script that sets it itself before its ``import torch`` gets that count in a fresh process,
    and a replacement must compute with as many threads as the rank it replaces: a CPU result
    can depend on it, and in-place recovery promises the bits of an uninterrupted run. So
    where the variable now differs from what the import saw, the count is set as the import
    would have set it (unset: one thread per core this process may use).
    """
    spare = sys.modules.get("dptrain.launcher.spare")
    seen = getattr(spare, "OMP_AT_IMPORT", None)
    now = os.environ.get("OMP_NUM_THREADS")
    if seen is None or seen[0] == now:
        return
    if now is None:
        torch.set_num_threads(environments.usable_cores())
        return
    try:
        count = int(now.split(",")[0])  # OpenMP's list form: the outermost level's count
    except ValueError:  # OpenMP ignores a value it cannot read, and so does this
        return
    if count > 0:
        torch.set_num_threads(count)


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> World:
    """Join the job: build the process group from the launcher's environment.

    Reads torchrun's variables (also set by ``dptrain run`` and ``dptrain.spawn``), or
    Slurm's under ``srun``; with neither, this is a single process (world size 1) and no
    process group is created -- every dptrain collective then works locally, and
    ``dptrain.DDP`` is the plain module. Under a launcher, a world of one still gets its
    process group (``torchrun --nproc-per-node 1``, ``dptrain.spawn(fn, 1)``), as
    ``init_process_group`` would create it: a script that builds PyTorch's DDP or calls
    ``torch.distributed`` runs there unchanged. Calling
    ``init`` again is a no-op that returns the same world; after :func:`shutdown` it joins the
    job anew, as often as the script likes, every rank the same number of times (each such
    group gets keys of its own in the store). A process group created by
    the user with ``torch.distributed.init_process_group`` is adopted as it is.

    ``init`` returns once every rank of the job has joined. While it waits, local rank 0
    of each node says on stderr what for -- the rendezvous address, whether it answers,
    how many ranks joined and which are missing -- after ``DPTRAIN_WAIT_REPORT_S`` seconds
    (default 30) and again as often.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (default): NCCL when CUDA is available
            with a device for every local rank, otherwise gloo.
        timeout: seconds (or a timedelta) any collective may wait before it fails the job.
            Default: ``DPTRAIN_TIMEOUT`` (set by ``dptrain run --timeout``), else 600 s.

    Returns:
        The :class:`World`; use it as a context manager to shut down on exit.

    Raises:
        ValueError: a launcher variable is missing or malformed, a ``DPTRAIN_*`` variable holds a
            value it cannot take (see :mod:`dptrain.runtime.settings`), or ``backend`` is unknown.
        RuntimeError: the job could not be joined within the timeout; the message names
            the rank, the address and the ranks that never arrived.

    Example:
        >>> import dptrain
        >>> with dptrain.init() as world:          # doctest: +SKIP
        ...     print(world.rank, world.world_size)
    """
    if _STATE.world is not None:
        return _STATE.world
    _settings.check_all()  # a bad DPTRAIN_* value fails here, in one line, not at its first use
    _threads_as_if_fresh()
    if backend is not None and backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ValueError(f"unknown backend {backend!r}; use 'gloo' (CPU), 'nccl' (CUDA) or None to choose")
    td = _timeout_from(timeout)
    if dist.is_available() and dist.is_initialized():
        world = World(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            source="external",
        )
        _STATE.world, _STATE.backend, _STATE.timeout = world, dist.get_backend(), td
        _diagnostics.configure(None, td)
        return world
    world = world_from_environ()
    chosen = backend or _default_backend(world)
    if chosen == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, which is not available here; use backend='gloo'")
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    # A launcher's world of one (torchrun --nproc-per-node 1, dptrain run, dptrain.spawn(fn, 1))
    # gets its process group too, as init_process_group gives it there: PyTorch's DDP and
    # torch.distributed calls in the script then work unchanged, and our DDP runs the same
    # reducer path as at N ranks. A plain `python script.py` makes none (nothing to join).
    if world.is_distributed or (world.source == "torchrun" and world.master_addr is not None):
        _STATE.store = _join_job(world, chosen, td)
        world = _STATE.world or world  # a replacement renumbered by a resize while it started
        _STATE.owns_group = True
        open_store = _open_store_warning(world)
        if open_store:
            _warn_once_main(open_store)
        # What the guarded collectives need to explain a failure; an init after the first counts
        # its collectives apart from the first's (see [Note: init again in the same process]).
        _diagnostics.configure(_STATE.store, td, namespace=_init_suffix(_INITS[0] - 1).lstrip("/"))
        if _STATE.generation:
            _diagnostics.new_generation(_STATE.generation)  # a replacement counts collectives as the survivors do
        _start_heartbeat(world.rank)
        # A script that never calls shutdown() must still exit cleanly: a heartbeat thread or
        # process group torn down by the interpreter's exit aborts the process instead.
        # (Registered on every init; unregister first so repeated init/shutdown cycles keep one.)
        atexit.unregister(shutdown)
        atexit.register(shutdown)
    else:
        _diagnostics.configure(None, td)
    _STATE.world, _STATE.backend, _STATE.timeout = world, chosen, td
    return world


def _in_place() -> bool:
    return _settings.get("DPTRAIN_RECOVERY") == "in-place"


def _start_heartbeat(rank: int) -> None:
    """The rank's heartbeat; under in-place recovery it also leaves a group that a silent node broke
    (see [Note: a peer that goes silent] in :mod:`dptrain.runtime.regroup`)."""
    keys = _STATE.store
    also = (lambda: _regroup.leave_if_broken(keys, _STATE.generation)) if _in_place() else None
    _heartbeat.start(keys, rank, also=also)


def _reform(generation: int) -> int:
    """In-place recovery, a survivor's side: leave the broken process group, form ``generation``'s.

    Returns the generation formed (a newer one when it was announced meanwhile; see [Note:
    generations] in :mod:`dptrain.runtime.regroup`). Collectives count from 0 again, as the
    replacement's do, so the launcher and the debug cross-check compare like with like.
    """
    for release in list(_AT_SHUTDOWN):  # the shared-memory groups over the broken group
        release()
    _regroup.cut_connections()  # see [Note: cutting a broken group's connections]
    if dist.is_initialized():
        if _STATE.backend == "nccl":
            # A communicator with a dead peer can hang its destruction: abort it first (gloo needs
            # no abort once its connections are cut). Not run here: no GPU in this project's CI.
            abort = getattr(dist.group.WORLD, "abort", None)
            if abort is not None:
                try:
                    abort()
                except RuntimeError:
                    pass
        _exit.settle_before_destroy()
        dist.destroy_process_group()
    old = _STATE.world
    g, world = _regroup.form(_STATE.base_store, _STATE.store, old, _STATE.backend, _STATE.timeout, generation,
                             since=_STATE.generation)
    _STATE.generation = g
    _diagnostics.new_generation(g)
    if world != old:  # the job went on without a node: this rank's number or the world size changed
        _STATE.world = world
        _set_world_environ(world)
        _start_heartbeat(world.rank)  # the launcher reads it by rank number
    return g


def _set_world_environ(world: World) -> None:
    """The launcher's variables as they are after a resize, for code that reads them (``RANK``, ...)."""
    os.environ.update(RANK=str(world.rank), ROLE_RANK=str(world.rank), GROUP_RANK=str(world.node_rank),
                      WORLD_SIZE=str(world.world_size), ROLE_WORLD_SIZE=str(world.world_size))


# What layers above this one hold per process group and must let go of before the group
# is destroyed (the shared-memory groups' worker threads): they register here when they
# load, so that this module needs to know nothing of them.
_AT_SHUTDOWN: list[Callable[[], None]] = []


def at_shutdown(release: Callable[[], None]) -> None:
    """Have :func:`shutdown` call ``release()`` before it destroys the process group.

    For modules that keep resources tied to the process group; each registers once, when it
    is loaded (a second registration of the same function is ignored).
    """
    if release not in _AT_SHUTDOWN:
        _AT_SHUTDOWN.append(release)


def shutdown() -> None:
    """Leave the job: destroy the process group that :func:`init` created.

    Safe to call more than once, and when ``init`` was never called. A process group that
    the user created (and ``init`` adopted) is left alone.

    Example:
        >>> dptrain.shutdown()   # doctest: +SKIP
    """
    _diagnostics.reset()
    for release in list(_AT_SHUTDOWN):
        release()
    if _STATE.owns_group and dist.is_initialized():
        _exit.settle_before_destroy()  # the group may be dropped later, holding the GIL (see dptrain.runtime.exit)
        dist.destroy_process_group()
    _STATE.world = None
    _STATE.backend = None
    _STATE.store = None
    _STATE.base_store = None
    _STATE.generation = 0
    _STATE.owns_group = False


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _STATE.world is not None


def get_world() -> World:
    """The current world: the one ``init`` built, else the one the environment describes."""
    return _STATE.world if _STATE.world is not None else world_from_environ()


def rank() -> int:
    """Global rank of this process (0 when not distributed)."""
    return get_world().rank


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    return get_world().world_size


def local_rank() -> int:
    """Rank of this process on its node (0 when not distributed)."""
    return get_world().local_rank


def is_main_process() -> bool:
    """True on global rank 0: the process that logs, prints and writes checkpoints."""
    return get_world().rank == 0


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<local_rank>`` with NCCL or CUDA, else CPU."""
    world = get_world()
    if (_STATE.backend or _default_backend(world)) == "nccl":
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def timeout() -> datetime.timedelta:
    """How long a collective may wait in this job (``init(timeout=)``, ``DPTRAIN_TIMEOUT``, else 600 s)."""
    return _STATE.timeout


# Where each launch environment's world size comes from, for the message of check_joined.
_WORLD_SOURCE = {"torchrun": "WORLD_SIZE={n} from dptrain run / torchrun", "slurm": "SLURM_NTASKS={n} from srun"}


def check_joined(what: str, alternative: str = "") -> None:
    """Refuse to act as a world of one where the launcher says the world is larger.

    Whatever shards or communicates (DDP, FSDP, ZeRO, the sampler, the loader, evaluation,
    the collectives) calls this when it finds no process group. A plain ``python script.py``
    passes: it is a world of one and works without :func:`init`. Under ``dptrain run``,
    ``torchrun`` or ``srun`` a forgotten ``dptrain.init()`` would leave every rank training
    alone, each on its shard, to different weights and a clean exit; this raises instead, as
    PyTorch's DDP does ("Default process group has not been initialized").

    Args:
        what: the public name that needs the process group, for the message.
        alternative: another fix the caller offers, appended to the message. Default none.

    Raises:
        RuntimeError: the environment describes more than one process and none has joined
            a process group; the message names this rank, the variable and the fix.
        ValueError: a launcher variable is malformed (see :func:`world_from_environ`).

    Example:
        >>> check_joined("dptrain.DistributedDataParallel")   # no launcher: returns
    """
    if dist.is_available() and dist.is_initialized():
        return
    world = get_world()
    if not world.is_distributed:
        return
    source = _WORLD_SOURCE.get(world.source, "world size {n}").format(n=world.world_size)
    raise RuntimeError(
        f"{what}: the environment says this is rank {world.rank} of {world.world_size} ({source}) but no process "
        f"group is initialized; call dptrain.init() at the start of the script, before building DDP, FSDP, "
        f"the sampler or the loader{' ' + alternative if alternative else ''}"
    )


_WARNED: set[str] = set()


def _warn_once_main(message: str, category=UserWarning) -> None:
    """Warn once per process, and only on rank 0, for settings that silently do nothing."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    if get_world().rank == 0:
        warnings.warn(message, category, stacklevel=3)
