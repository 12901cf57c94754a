"""What ``dptrain run`` refuses before it starts a rank: bad settings, and more ranks than can start.

A ``DPTRAIN_*`` variable that holds a value it cannot take would fail every rank (see
[Note: one place for the settings] in ``dptrain.runtime.settings``); it is refused here, once, in one line.

[Note: ranks this machine can start]
Each rank is a process and, in ``dptrain run``, two threads of the launcher that relay its
stdout and stderr through two pipes whose ends the launcher holds; node 0's launcher also
holds a store connection for every rank of the job, and one for each node's launcher. A
number of ranks past what the machine allows started until it hit the limit -- thousands of
processes -- and ended in "can't start new thread" or "Too many open files", with a
traceback. So before anything starts, the least that many ranks need is compared with:

* tasks (processes and threads): the kernel's pid_max and threads-max, less the tasks that
  run already; a cgroup's pids.max (a container's limit), less its pids.current; and
  ``ulimit -u`` (RLIMIT_NPROC, every task of the user; root is exempt);
* open files: ``ulimit -n`` (RLIMIT_NOFILE), first raised to its hard limit -- the store
  raised it too, but only once the ranks had started;
* memory: each rank is a Python interpreter, :data:`MIB_PER_RANK` of its own at the least (a
  bare one takes 4.7 MiB), against the machine's memory and swap, and a cgroup's memory limit.

Each need is a lower bound (a rank that imports torch takes far more), so a refused number
can never start, and one that passes may still run short later, where that rank's own error
names it. The refusal names the limit, its value and the most ranks that fit.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from dptrain.runtime import settings as _settings
from dptrain.launcher.store import raise_open_files_limit
from dptrain.launcher.store_values import MAX_NPROC_PER_NODE, MAX_WORLD_SIZE, PID_MAX_LIMIT

__all__ = ["preflight", "check_settings", "check_size", "check_capacity"]

#: Tasks one rank needs at the least: its process, and the launcher's two relay threads.
TASKS_PER_RANK = 3
#: Open files one rank takes in its launcher: the read ends of its stdout and stderr pipes.
FILES_PER_RANK = 2
#: MiB of memory of its own that a Python interpreter takes at the least.
MIB_PER_RANK = 4
#: Open files the launcher needs beside its ranks' (its listening socket, the janitor's pipe, log files).
SPARE_FILES = 32
#: Variables ``dptrain run`` sets for every rank itself (see ``job.base_environ``, ``workers.process_environ``),
#: by the flag that sets it (None: always).
SET_BY_FLAGS = {"DPTRAIN_TIMEOUT": "timeout", "DPTRAIN_DEBUG": "debug", "DPTRAIN_PROFILE": "profile",
                "DPTRAIN_PROGRESS": None,
                # --recovery: set for in-place recovery, removed otherwise (see inplace.rank_settings)
                "DPTRAIN_RECOVERY": None, "DPTRAIN_RECOVERY_DIR": None, "DPTRAIN_GENERATION": None}


def preflight(config: Any) -> None:
    """Refuse what would fail every rank, or cannot start, before a rank starts (ValueError, one line).

    ``config`` is the job's ``LaunchConfig`` (not imported: ``job`` imports this module).
    """
    check_settings(config)
    check_size(config.nproc_per_node, config.nnodes)
    check_capacity(config.nproc_per_node, config.nnodes, hosts_store=config.node_rank == 0,
                   tunneled=config.nnodes > 1 and getattr(config, "secret", None) is not None)


def check_settings(config: Any) -> None:
    """Every ``DPTRAIN_*`` variable the ranks and this launcher read, but those a flag of ``config`` replaces."""
    environ = {name: value for name, value in os.environ.items()
               if not (name in SET_BY_FLAGS and (SET_BY_FLAGS[name] is None or getattr(config, SET_BY_FLAGS[name])))}
    _settings.check_all(environ)


def check_size(nproc_per_node: int, nnodes: int) -> None:
    """Raise ValueError for a job of more ranks than any job can have: the bound its launchers hold
    the store's values to (see [Note: counts past what a job can have] in ``store_values``), so a
    job that starts never has its own values refused."""
    world = nproc_per_node * nnodes
    if world > MAX_WORLD_SIZE:
        raise ValueError(f"--nproc-per-node {nproc_per_node} --nnodes {nnodes}: a job of {world} ranks is more than "
                         f"the {MAX_WORLD_SIZE} dptrain runs (node 0's store holds a connection for each); "
                         f"give fewer nodes or ranks per node")


def check_capacity(nproc_per_node: int, nnodes: int = 1, hosts_store: bool = True, tunneled: bool = False) -> None:
    """Raise ValueError when this machine cannot start ``nproc_per_node`` ranks (see [Note: ranks this machine can start]).

    ``nnodes`` (the most nodes of the job) and ``hosts_store`` (this is node 0) count the
    store's connections; ``tunneled`` (a job with a secret) the two ends of each one that node 0's
    gate or another node's forwarder pipes (see ``tunnel``). Raises the soft limit on open files
    to the hard one as it goes.
    """
    n = nproc_per_node
    refusals = []  # (the most ranks that fit, why not n)
    if n > MAX_NPROC_PER_NODE:  # said even where the limits below cannot be read
        refusals.append((MAX_NPROC_PER_NODE, f"no machine can: Linux runs at most {PID_MAX_LIMIT} tasks (the ceiling "
                                             f"of pid_max) and each rank takes {TASKS_PER_RANK}"))
    tasks = TASKS_PER_RANK * n
    for free, limit in _task_room():
        if tasks > free:
            refusals.append((free // TASKS_PER_RANK, f"they need at least {tasks} tasks ({TASKS_PER_RANK} per rank: "
                                                     f"its process, and 2 threads of dptrain run relaying its output), "
                                                     f"but {limit}"))
    # Node 0 holds the store: a connection for every rank of the job (n on each node) and every launcher.
    per_rank = FILES_PER_RANK + (nnodes if hosts_store else 0)
    if tunneled:  # the gate: two per rank of every other node; a forwarder: two per rank of its own
        per_rank += 2 * (nnodes - 1) if hosts_store else 2
    held = _open_files() + SPARE_FILES + (nnodes if hosts_store else 1)
    files, limit = per_rank * n + held, raise_open_files_limit()
    if files > limit:
        store = f" and {nnodes} store connection(s)" if hosts_store else ""
        store += " and the ends of its piped store connections" if tunneled else ""
        refusals.append(((limit - held) // per_rank, f"dptrain run needs at least {files} open files ({per_rank} per "
                                                     f"rank: the 2 pipes of its output{store}; {held} more of its "
                                                     f"own), but `ulimit -n` allows {limit} (raise the hard limit, "
                                                     f"e.g. in /etc/security/limits.conf)"))
    memory, each = n * (MIB_PER_RANK << 20), MIB_PER_RANK << 20
    for have, where in _memory_room():
        if memory > have:
            refusals.append((have // each, f"they need at least {memory / 2**30:.1f} GiB of memory ({MIB_PER_RANK} "
                                           f"MiB for each Python interpreter alone), but {where} "
                                           f"{have / 2**30:.1f} GiB with swap"))
    if refusals:
        most, why = min(refusals)
        asked = f"--nproc-per-node {n}" + (f" --nnodes {nnodes}" if nnodes > 1 else "")
        raise ValueError(f"{asked}: this machine cannot start {n} ranks: {why}; at most {max(most, 0)} fit on this node")


def _task_room() -> list[tuple[int, str]]:
    """(tasks that may still start, the limit in words) for every limit on tasks found."""
    room = []
    running = _read_int("/proc/loadavg", field=lambda text: text.split()[3].split("/")[1])
    for name in ("pid_max", "threads-max"):
        limit = _read_int(f"/proc/sys/kernel/{name}")
        if limit is not None and running is not None:
            room.append((limit - running, f"the kernel's {name} is {limit} and {running} tasks run already"))
    for folder in _cgroup_dirs("pids"):
        limit, used = _read_int(os.path.join(folder, "pids.max")), _read_int(os.path.join(folder, "pids.current"))
        if limit is not None and used is not None:
            room.append((limit - used, f"{folder}/pids.max is {limit} and {used} tasks of it run already"))
    nproc = _rlimit("RLIMIT_NPROC")
    if nproc is not None and hasattr(os, "geteuid") and os.geteuid() != 0:  # root is exempt
        room.append((nproc, f"`ulimit -u` allows this user {nproc} (every process and thread counts)"))
    return room


def _memory_room() -> list[tuple[int, str]]:
    """(bytes of memory and swap, where that limit is said) for the machine and each cgroup that limits it."""
    meminfo = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                meminfo[key] = int(rest.split()[0]) << 10  # kB
    except (OSError, ValueError, IndexError):
        return []
    swap = meminfo.get("SwapTotal", 0)
    room = [(meminfo["MemTotal"] + swap, "this machine has")] if "MemTotal" in meminfo else []
    for folder in _cgroup_dirs("memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            limit = _read_int(os.path.join(folder, name))
            if limit is not None and limit < 1 << 60:  # cgroup v1 says "no limit" with a number near 2**63
                room.append((limit + swap, f"{folder}/{name} allows"))
    return room


def _read_int(path: str, field: Callable[[str], str] = lambda text: text) -> int | None:
    """The number in a /proc or /sys file; None where it is absent or says "max"."""
    try:
        with open(path) as fh:
            return int(field(fh.read()).strip())
    except (OSError, ValueError, IndexError):
        return None


def _rlimit(name: str) -> int | None:
    """A soft resource limit of this process; None where it is unlimited or unknown."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft = resource.getrlimit(getattr(resource, name))[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def _cgroup_dirs(controller: str) -> list[str]:
    """The cgroup folders of this process and its ancestors that may limit ``controller`` (v1 or v2)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, names, path = line.split(":", 2)
        if not names:  # cgroup v2: one hierarchy for every controller
            unified = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
            base = "/sys/fs/cgroup" if unified else "/sys/fs/cgroup/unified"
        elif controller in names.split(","):
            base = os.path.join("/sys/fs/cgroup", names)
        else:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [os.path.join(base, *parts[:k]) for k in range(len(parts), -1, -1)]
    return dirs
