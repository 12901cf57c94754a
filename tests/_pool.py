"""Long-lived rank worlds shared by a test run: a test body runs in ranks that are already up.

Most multi-process tests need N ranks in one process group, not N new processes: starting
them (a fork from the fork server, the test module's imports, a store, the group) costs
more CPU than many test bodies do. :func:`tests._dist.run_ranks` therefore sends the body,
``fn`` pickled by reference, to a world of N ranks kept for the whole run, as PyTorch's
``MultiProcContinuousTest`` keeps its ranks for a class of tests.

What a test still gets, as with fresh ranks:

* **A process group and a store of its own.** Each body runs between ``dptrain.init`` and
  ``dptrain.shutdown``, with ``torch.manual_seed(0)`` and its thread count set first. Its
  store is new (the harness hosts one per call, as ``dptrain.spawn`` does) and the ranks'
  count of earlier inits is set back to 0, so the keys a body sees are laid out as in a
  fresh process, and no key an earlier body left (a heartbeat, a "left" note) is there.
* **The same failures.** A rank that raises, dies or hangs past the timeout gives the
  ``RankFailedError`` or ``TimeoutError`` that :func:`dptrain.spawn` gives (the same
  watcher reads the ranks), and the world is discarded: the next test gets a new one.
  A rank that died while its world waited between bodies (killed from outside: a process
  killed by a test beside it, the OOM killer) is not a test's failure: that world is
  replaced before the body is handed to it, and a rank found gone as the body is sent
  (its pipe broken) has the body sent once more, to a new world. A rank past the timeout
  first writes where each of its threads is (``faulthandler``), and the ``TimeoutError``
  carries it: a hang that shows once in many runs is named by the run it showed in.
* **No state left by an earlier body.** After every body each rank compares what a body
  could leave behind with what it was before: ``os.environ``, the working directory,
  signal handlers, the attributes of every ``dptrain``, ``torch.distributed`` and test module
  and of their classes (a monkeypatch, a flag flipped, a cache filled), warning filters,
  torch's global modes, Python threads and child processes still running, resource limits,
  and its memory. Any difference and the world is discarded after that test; the body's
  result still counts, since it ran as it would have in fresh ranks.

A world is kept per (number of ranks, extra environment, threads): the environment is read
by ``init``, so two tests with different ``env=`` never share ranks. At most
``MAX_RANKS_ALIVE`` ranks are kept (the least recently used world goes first).
``DPTRAIN_TEST_POOL=0`` turns the pool off: every call starts fresh ranks;
``DPTRAIN_TEST_POOL_LOG=<file>`` appends a line there for every world discarded, saying why.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import resource
import signal
import sys
import threading
import time
import warnings
from collections import OrderedDict

MAX_RANKS_ALIVE = 9
MAX_RSS_BYTES = 1536 * 2**20  # a rank that grew past this is retired, so a long run does not swap
START_TIMEOUT_S = 120.0  # for the world's own start, apart from the test's timeout
# A stalled rank's threads are dumped on this signal (one no test or library here uses) into
# a file of its own; the harness reads it into the TimeoutError.
_DUMP_SIGNAL = signal.SIGRTMIN + 7
_DUMP_WAIT_S = 2.0

# What the ranks compare between bodies: modules whose names start with these.
_WATCHED_MODULES = ("dptrain", "torch.distributed", "tests")
_WATCHED_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                                signal.SIGALRM, signal.SIGCHLD, signal.SIGPIPE)]
_WATCHED_LIMITS = [resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_NOFILE, resource.RLIMIT_CORE]


def enabled() -> bool:
    return os.environ.get("DPTRAIN_TEST_POOL", "1") != "0"


# ------------------------------------------------------------------------ inside a rank --


def _value_key(value):
    # Identity catches a rebinding (a monkeypatch, a flag set); the length of a container catches
    # one filled or emptied in place (a warn-once set, a registry, a cache).
    if issubclass(type(value), (dict, list, set)):  # type(), not isinstance: no lazy __class__ runs
        return id(value), len(value)
    return id(value)


def _snapshot() -> dict:
    """What a test body could change in this process and leave behind for the next one."""
    import torch

    attrs = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_WATCHED_MODULES):
            continue
        for attr, value in list(vars(module).items()):
            attrs[(name, attr)] = _value_key(value)
            if issubclass(type(value), type) and vars(value).get("__module__") == name:
                for cattr, cvalue in list(vars(value).items()):
                    attrs[(name, attr, cattr)] = _value_key(cvalue)
    return {
        "attrs": attrs,
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "signals": {s: signal.getsignal(s) for s in _WATCHED_SIGNALS},
        "limits": {r: resource.getrlimit(r) for r in _WATCHED_LIMITS},
        "warnings": list(warnings.filters),
        "hooks": (sys.excepthook, threading.excepthook, sys.stdout, sys.stderr, sys.getrecursionlimit()),
        "path": list(sys.path),
        "torch": (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
                  torch.is_anomaly_enabled(), torch.get_num_interop_threads()),
        "threads": {t.ident for t in threading.enumerate()},
    }


def _children() -> list[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _torch_sigchld_only(before: dict, after: dict) -> bool:
    """Whether the only change is SIGCHLD now being torch's DataLoader handler: torch installs it
    at the first iterator with workers, once per process and for good (chaining the one before),
    so every process that ever loaded with workers has it; not a body's leftover."""
    differ = [s for s in before if before[s] != after[s]]
    return differ == [signal.SIGCHLD] and "_set_SIGCHLD_handler" in getattr(after[signal.SIGCHLD], "__qualname__", "")


def _what_changed(before: dict, after: dict) -> str | None:
    """The first thing a body left changed (a few words for the log), or None."""
    for key in ("environ", "cwd", "signals", "limits", "warnings", "hooks", "path", "torch"):
        if key == "signals" and _torch_sigchld_only(before[key], after[key]):
            continue
        if before[key] != after[key]:
            return key
    gone_or_new = after["threads"] - before["threads"]
    if gone_or_new:
        return f"{len(gone_or_new)} thread(s) still running"
    for key, value in after["attrs"].items():
        if key in before["attrs"] and before["attrs"][key] != value:
            return "attribute " + ".".join(map(str, key))
    return None


def _pool_rank(rank, nprocs, port, conn, extra_env, backend, threads) -> None:
    """A pooled rank: join a job once (``port``: its store), then run bodies until told to stop."""
    import faulthandler

    from dptrain.launcher.spawn import result_payload, send_failure
    from dptrain.launcher.workers import rank_environ

    faulthandler.register(_DUMP_SIGNAL, file=open(_stacks_path(os.getpid()), "w"), all_threads=True)

    os.environ.update(rank_environ(rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs,
                                   node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=port,
                                   run_id="pool"))
    os.environ.update(extra_env)
    # A forkserver child inherits "forkserver" as its start method; a rank under dptrain run or
    # torchrun has the platform's default (fork on Linux before Python 3.14), and so its
    # DataLoader's workers are forked, not started through a fork server of their own (its
    # first start alone took 2-3 s of each test that loads with workers).
    mp.set_start_method(None, force=True)
    import torch

    import dptrain
    from dptrain.runtime import env

    # One join and leave first, so that what the bodies are compared against is the state a
    # shutdown leaves (torch.distributed keeps a few globals of the last group), not the
    # state before any group.
    hook = sys.excepthook
    dptrain.init(backend=backend)
    env.shutdown()
    sys.excepthook = hook
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the harness has gone
        try:
            port, fn, args = pickle.loads(task)  # imports the test module the first time
            os.environ["MASTER_PORT"] = str(port)  # this call's own store
            env._INITS[0] = 0  # so its keys are laid out as a fresh process lays them out
            before = _snapshot()
            children_before = set(_children())
            torch.manual_seed(0)
            torch.set_num_threads(threads)
            dptrain.init(backend=backend)
            result = fn(rank, *args)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the harness
            send_failure(conn, exc)
            os._exit(1)  # as a fresh rank does; the world is discarded
        try:
            env.shutdown()
            if getattr(sys.excepthook, "__qualname__", "").startswith("init_process_group.<locals>"):
                # torch's init_process_group wraps sys.excepthook anew at every call; a fresh
                # rank has only the one of its own init.
                sys.excepthook = before["hooks"][0]
        except Exception as exc:  # noqa: BLE001 - the result stands; these ranks do not
            dirty = f"shutdown failed: {exc!r}"
        else:
            dirty = _what_changed(before, _snapshot())
        if dirty is None and set(_children()) - children_before:
            dirty = "child processes still running"
        if dirty is None and _rss_bytes() > MAX_RSS_BYTES:
            dirty = f"{_rss_bytes() >> 20} MiB resident"
        conn.send_bytes(result_payload(rank, (result, dirty)))


# ---------------------------------------------------------------------- in the harness --


def _stacks_path(pid: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"dptrain-pool-stacks-{pid}")


class WorldGone(RuntimeError):
    """A pooled rank had exited before a body was handed to it (see the module docstring)."""


class World:
    """``nprocs`` pooled ranks, their store and their pipes."""

    def __init__(self, ctx, nprocs: int, env: dict, backend: str, threads: int):
        from dptrain.launcher.rendezvous import RendezvousServer, loopback_ifname

        self.nprocs = nprocs
        self.procs, self.conns = [], []
        self.server = RendezvousServer("127.0.0.1", 0, nprocs, timeout_s=START_TIMEOUT_S)
        self.server.serve()
        extra_env = dict(env)
        if "GLOO_SOCKET_IFNAME" not in os.environ and loopback_ifname():
            extra_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
        try:
            for rank in range(nprocs):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_pool_rank, name=f"dptrain-pool-rank{rank}",
                                args=(rank, nprocs, self.server.port, child_end, extra_env, backend, threads))
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)
        except BaseException:
            self.close()
            raise

    def run(self, fn, args, timeout: float | None) -> tuple[list, str | None]:
        """Each rank's result of ``fn(rank, *args)``, and what a body left changed (None: nothing).

        Raises what :func:`dptrain.spawn` raises; the caller discards the world then.
        """
        from dptrain.runtime.heartbeat import OomRecord
        from dptrain.launcher.spawn import _watch_spawned

        from dptrain.launcher.rendezvous import RendezvousServer, wait_s

        server = RendezvousServer("127.0.0.1", 0, self.nprocs, timeout_s=wait_s(timeout))
        server.serve()
        try:
            task = pickle.dumps((server.port, fn, tuple(args)))
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(task)
                except OSError as exc:  # BrokenPipeError: the rank is gone, the body was never run by it
                    raise WorldGone(f"pooled rank {rank} was gone ({self.procs[rank].exitcode=})") from exc
            try:
                replies = _watch_spawned(self.procs, self.conns, timeout, OomRecord())
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}\n\n{self._stacks()}") from None
        finally:
            server.close()
        dirty = next((d for _, d in replies if d is not None), None)
        return [r for r, _ in replies], dirty

    def _stacks(self) -> str:
        """Where every thread of each rank still running is (read after a timeout)."""
        alive = [(rank, p) for rank, p in enumerate(self.procs) if p.is_alive()]
        for _, p in alive:
            try:
                os.kill(p.pid, _DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        time.sleep(_DUMP_WAIT_S)  # a rank writes its dump within milliseconds, even a busy one
        parts = []
        for rank, p in alive:
            try:
                with open(_stacks_path(p.pid)) as f:
                    parts.append(f"--- threads of rank {rank} (pid {p.pid}) ---\n{f.read()}")
            except OSError as exc:
                parts.append(f"--- rank {rank}: no dump ({exc}) ---")
        return "\n".join(parts)

    def gone(self) -> str | None:
        """Why this world cannot run a body (a rank process ended while it waited), or None."""
        ended = [(rank, p.exitcode) for rank, p in enumerate(self.procs) if not p.is_alive()]
        return ", ".join(f"rank {r} exited with code {code}" for r, code in ended) or None

    def close(self) -> None:
        from dptrain.launcher.spawn import _Rank
        from dptrain.launcher.workers import stop_processes

        for conn in self.conns:
            conn.close()  # an idle rank reads EOF and leaves
        stop_processes([_Rank(p) for p in self.procs])
        self.server.close()
        for p in self.procs:
            try:
                os.remove(_stacks_path(p.pid))
            except OSError:
                pass


class Pool:
    """The worlds of one test run, by (ranks, environment, backend, threads); see the module docstring."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.worlds: OrderedDict[tuple, World] = OrderedDict()
        self.lock = threading.Lock()
        self.started = self.discarded = 0
        self.last_discard: str | None = None  # why the last world went (for debugging the pool)

    def run(self, fn, nprocs: int, args, *, timeout, backend: str, env: dict | None, threads: int) -> list:
        key = (nprocs, tuple(sorted((env or {}).items())), backend, threads)
        with self.lock:
            world = self.worlds.pop(key, None)
            if world is not None and world.gone():
                self._discard(world, f"before {getattr(fn, '__qualname__', fn)}: {world.gone()}")
                world = None
            while True:
                reused = world is not None
                if world is None:
                    self._make_room(nprocs)
                    world = World(self.ctx, nprocs, dict(env or {}), backend, threads)
                    self.started += 1
                try:
                    results, dirty = world.run(fn, args, timeout)
                except WorldGone as exc:
                    self._discard(world, f"before {getattr(fn, '__qualname__', fn)}: {exc}")
                    if not reused:
                        raise  # a world just started lost a rank: not the pool's to hide
                    world = None  # a rank of a kept world died at the last moment: the body goes to a new one
                    continue
                except BaseException as exc:
                    self._discard(world, f"{type(exc).__name__} in {getattr(fn, '__qualname__', fn)}")
                    raise
                break
            if dirty is None:
                self.worlds[key] = world  # the most recently used go last
            else:
                self._discard(world, f"{getattr(fn, '__qualname__', fn)} left {dirty}")
            return results

    def _make_room(self, nprocs: int) -> None:
        while self.worlds and sum(w.nprocs for w in self.worlds.values()) + nprocs > MAX_RANKS_ALIVE:
            _, oldest = self.worlds.popitem(last=False)
            oldest.close()

    def _discard(self, world: World, why: str) -> None:
        self.discarded += 1
        self.last_discard = why
        log = os.environ.get("DPTRAIN_TEST_POOL_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"world of {world.nprocs} discarded: {why}\n")
        world.close()

    def close(self) -> None:
        with self.lock:
            while self.worlds:
                self.worlds.popitem()[1].close()


_POOL: Pool | None = None


def get_pool(ctx) -> Pool:
    """The run's pool, made on first use; its ranks are stopped when the test process exits."""
    global _POOL
    if _POOL is None:
        _POOL = Pool(ctx)
        atexit.register(_POOL.close)
    return _POOL


def close_pool() -> None:
    if _POOL is not None:
        _POOL.close()
