"""Who am I: the rank, world size and local rank of this process, and its process group.

The world is one validated value (:class:`World`) built here from the environment that a
launcher left behind -- torchrun's variables, Slurm's, or none at all (a single process) --
and nowhere else in the package is ``os.environ`` read for it.

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
import re
import warnings
from typing import Mapping

import torch
import torch.distributed as dist

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

#: Seconds a collective may wait before the job is failed, when neither ``init(timeout=)``
#: nor ``DPTRAIN_TIMEOUT`` says otherwise. Long enough for a slow checkpoint on rank 0,
#: short enough that a stalled job does not burn a night of GPU time.
DEFAULT_TIMEOUT_S = 600.0

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
        restart_count: how many times the launcher restarted the job.
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


def _int_var(env: Mapping[str, str], name: str, *, minimum: int = 0, hint: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"environment variable {name} is not set; {hint}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; {hint}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}; {hint}")
    return value


_TORCHRUN_HINT = (
    "launch with `dptrain run --nproc-per-node N script.py` or `torchrun --nproc-per-node N script.py`, "
    "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process"
)


def _world_from_torchrun(env: Mapping[str, str]) -> World:
    world = _int_var(env, "WORLD_SIZE", minimum=1, hint=_TORCHRUN_HINT)
    rank = _int_var(env, "RANK", hint=_TORCHRUN_HINT)
    if rank >= world:
        raise ValueError(
            f"environment variable RANK={rank} is not below WORLD_SIZE={world}; "
            f"ranks run from 0 to {world - 1}: {_TORCHRUN_HINT}"
        )
    # A hand-written environment (seed 000's setup()) often has no LOCAL_* variables:
    # then every process is taken to be on one node.
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", minimum=1, hint=_TORCHRUN_HINT) if "LOCAL_WORLD_SIZE" in env else world
    local = _int_var(env, "LOCAL_RANK", hint=_TORCHRUN_HINT) if "LOCAL_RANK" in env else rank % local_world
    if local >= local_world:
        raise ValueError(
            f"environment variable LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}; {_TORCHRUN_HINT}"
        )
    addr = port = None
    if world > 1:
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise ValueError(f"environment variable MASTER_ADDR is not set (WORLD_SIZE={world}); {_TORCHRUN_HINT}")
        port = _int_var(env, "MASTER_PORT", minimum=1, hint=_TORCHRUN_HINT)
        if port > 65535:
            raise ValueError(f"environment variable MASTER_PORT={port} is not a TCP port (1..65535)")
    node_rank = int(env["GROUP_RANK"]) if env.get("GROUP_RANK", "").isdigit() else rank // local_world
    restarts = int(env["TORCHELASTIC_RESTART_COUNT"]) if env.get("TORCHELASTIC_RESTART_COUNT", "").isdigit() else 0
    return World(
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        source="torchrun",
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        restart_count=restarts,
    )


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm node list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm node list {text!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_range(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"bad range {item!r} in Slurm node list {whole!r}")
            width = len(lo)  # node[01-04] keeps its zero padding
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            out.append(item)
        else:
            raise ValueError(f"bad element {item!r} in Slurm node list {whole!r}")
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list expression into host names, in order.

    Args:
        nodelist: a value of ``SLURM_JOB_NODELIST`` such as ``"node[01-04,07],gpu-a"`` or
            ``"rack[1-2]-n[1-2]"``.

    Returns:
        The host names, e.g. ``["node01", "node02", "node03", "node04", "node07", "gpu-a"]``.

    Raises:
        ValueError: on unbalanced brackets or malformed ranges.

    Example:
        >>> expand_nodelist("node[01-02,07]")
        ['node01', 'node02', 'node07']
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        expansions = [""]
        for match in re.finditer(r"([^\[]+)|\[([^\]]*)\]", part):
            literal, bracket = match.groups()
            pieces = [literal] if literal is not None else _expand_range(bracket, nodelist)
            expansions = [prefix + piece for prefix in expansions for piece in pieces]
        hosts.extend(expansions)
    return hosts


def _slurm_local_world(env: Mapping[str, str], node_rank: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": 4 tasks on each of two nodes, then 3.
    raw = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if not raw:
        return 1
    counts: list[int] = []
    for item in raw.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"environment variable SLURM_TASKS_PER_NODE={raw!r} is not understood")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_rank, len(counts) - 1)]


def _world_from_slurm(env: Mapping[str, str]) -> World:
    hint = "run the script with `srun` inside an allocation (see `dptrain slurm-script`)"
    world = _int_var(env, "SLURM_NTASKS", minimum=1, hint=hint)
    rank = _int_var(env, "SLURM_PROCID", hint=hint)
    if rank >= world:
        raise ValueError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world}; {hint}")
    local = _int_var(env, "SLURM_LOCALID", hint=hint) if "SLURM_LOCALID" in env else 0
    node_rank = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else 0
    local_world = _slurm_local_world(env, node_rank)
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError(f"neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; {hint}")
        addr = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" in env:
        port = _int_var(env, "MASTER_PORT", minimum=1, hint=hint)
    else:
        # Every task of a job must agree on the port without talking: derive it from the job
        # id, away from the ephemeral range, so two jobs sharing a node rarely collide.
        job = int(env["SLURM_JOB_ID"]) if env.get("SLURM_JOB_ID", "").isdigit() else 0
        port = 15000 + job % 20000
    return World(
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=max(local_world, local + 1),
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        source="slurm",
    )


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
    env = os.environ if environ is None else environ
    if any(name in env for name in ("RANK", "WORLD_SIZE")):
        return _world_from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and env.get("SLURM_NTASKS") != "1":
        return _world_from_slurm(env)
    if "LOCAL_RANK" in env:
        raise ValueError(
            f"LOCAL_RANK={env['LOCAL_RANK']!r} is set but RANK and WORLD_SIZE are not; {_TORCHRUN_HINT}"
        )
    return World()


@dataclasses.dataclass
class _State:
    world: World | None = None
    backend: str | None = None
    store: dist.Store | None = None  # prefixed store for dptrain's own keys (debug, heartbeats)
    timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    owns_group: bool = False


_STATE = _State()


def _timeout_from(timeout) -> datetime.timedelta:
    if timeout is None:
        raw = os.environ.get("DPTRAIN_TIMEOUT")
        if raw:
            try:
                timeout = float(raw)
            except ValueError:
                raise ValueError(f"DPTRAIN_TIMEOUT={raw!r} is not a number of seconds") from None
        else:
            timeout = DEFAULT_TIMEOUT_S
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=float(timeout))
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timeout


def _default_backend(world: World) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world.local_world_size:
        return "nccl"
    return "gloo"


def _make_store(world: World, timeout: datetime.timedelta) -> dist.Store:
    is_master = world.rank == 0 and not world.use_agent_store
    return dist.TCPStore(
        world.master_addr,
        world.master_port,
        world.world_size if is_master else None,
        is_master,
        timeout=timeout,
        wait_for_workers=False,
    )


def _prefixed(base: dist.Store, world: World, part: str) -> dist.Store:
    # Keys of one launch attempt never collide with a restarted attempt's; "dp" keeps
    # dptrain's own keys (heartbeats, join counts, debug checks) apart from the process
    # group's ("pg"). The launcher reads and writes the same "dp" keys (launch.dist_prefix).
    return dist.PrefixStore(part, dist.PrefixStore(f"dptrain/attempt{world.restart_count}", base))


def _join_job(world: World, backend: str, td: datetime.timedelta) -> dist.Store:
    """Connect to the store and create the process group, saying what it waits for if it waits."""
    from dptrain import _join

    def open_reader() -> dist.Store:
        reader = dist.TCPStore(world.master_addr, world.master_port, None, False,
                               timeout=datetime.timedelta(seconds=5))
        return _prefixed(reader, world, "dp")

    watch = _join.JoinWatch(world, td.total_seconds(), open_reader)
    try:
        base = _make_store(world, td)
        watch.connected = True
        keys = _prefixed(base, world, "dp")
        keys.append("joined", f"{world.rank},")
        dist.init_process_group(backend, store=_prefixed(base, world, "pg"), rank=world.rank,
                                world_size=world.world_size, timeout=td)
        _join.wait_until_all_ready(keys, world.world_size, td)
    except Exception as exc:  # noqa: BLE001 - every failure to join gets what it waited for
        raise watch.failure(exc) from exc
    finally:
        watch.stop()
    return keys


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> World:
    """Join the job: build the process group from the launcher's environment.

    Reads torchrun's variables (also set by ``dptrain run`` and ``dptrain.spawn``), or
    Slurm's under ``srun``; with neither, this is a single process (world size 1) and no
    process group is created -- every dptrain collective then works locally. Calling
    ``init`` again is a no-op that returns the same world. A process group created by
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
        ValueError: a launcher variable is missing or malformed, or ``backend`` is unknown.
        RuntimeError: the job could not be joined within the timeout; the message names
            the rank, the address and the ranks that never arrived.

    Example:
        >>> import dptrain
        >>> with dptrain.init() as world:          # doctest: +SKIP
        ...     print(world.rank, world.world_size)
    """
    if _STATE.world is not None:
        return _STATE.world
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
        return world
    world = world_from_environ()
    chosen = backend or _default_backend(world)
    if chosen == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, which is not available here; use backend='gloo'")
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    if world.is_distributed:
        _STATE.store = _join_job(world, chosen, td)
        _STATE.owns_group = True
        from dptrain import _diagnostics

        _diagnostics.start_heartbeat(_STATE.store, world.rank)
        # A script that never calls shutdown() must still exit cleanly: a heartbeat thread or
        # process group torn down by the interpreter's exit aborts the process instead.
        # (Registered on every init; unregister first so repeated init/shutdown cycles keep one.)
        atexit.unregister(shutdown)
        atexit.register(shutdown)
    _STATE.world, _STATE.backend, _STATE.timeout = world, chosen, td
    return world


def shutdown() -> None:
    """Leave the job: destroy the process group that :func:`init` created.

    Safe to call more than once, and when ``init`` was never called. A process group that
    the user created (and ``init`` adopted) is left alone.

    Example:
        >>> dptrain.shutdown()   # doctest: +SKIP
    """
    from dptrain import _diagnostics

    _diagnostics.reset()
    if _STATE.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.world = None
    _STATE.backend = None
    _STATE.store = None
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


def _backend() -> str | None:
    return _STATE.backend


def _store() -> dist.Store | None:
    return _STATE.store


def _timeout() -> datetime.timedelta:
    return _STATE.timeout


_WARNED: set[str] = set()


def _warn_once_main(message: str, category=UserWarning) -> None:
    """Warn once per process, and only on rank 0, for settings that silently do nothing."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    if get_world().rank == 0:
        warnings.warn(message, category, stacklevel=3)
