"""``dptrain.spawn``: run a function on N ranks in new processes (notebooks and tests).

The in-process form of ``dptrain run``: each process gets torchrun's environment and a
store hosted by the caller; a rank that raises or dies stops the others, and its error is
re-raised in the caller naming the rank.

[Note: how the ranks start when no start method is given]
``spawn`` (a fresh interpreter per rank) is the safe default: nothing of the caller's state is
copied, CUDA may already be in use, and it works on every platform. But a fresh interpreter
finds ``fn`` by name: multiprocessing pickles it as ``__main__.work`` and re-creates
``__main__`` in the child by importing or re-running its file. A Jupyter kernel, ``python -c``
and the REPL have no such file: the child's ``__main__`` is empty and the rank dies with
"Can't get attribute 'work' on <module '__main__'>". ``python -`` is worse: its ``__main__``
names the file ``<stdin>``, which the child tries to run, so no rank starts whatever ``fn`` is.

So when ``start_method`` is left at None, :func:`_choose_start_method` forks instead in
exactly those cases (what Accelerate's ``notebook_launcher`` and Lightning's ``ddp_notebook``
do): ``__main__`` cannot be re-created, and ``fn`` or ``args`` need it (pickling them names
something in ``__main__``, or they cannot be pickled at all: a lambda, a closure). A
function imported from a file still gets fresh processes, from a notebook too. Forking, each
rank is a copy of the caller, so everything the notebook defined is there: functions,
classes, globals, closures. We chose this over pickling functions by value (cloudpickle's
way), which would need a second pickler for code objects, closures and classes defined in
the notebook, for less than a fork gives.

Fork has two caveats. CUDA cannot be used in a forked child of a process that has
initialized it ("Cannot re-initialize CUDA in forked subprocess"), and each rank would only
find that out after the fork: :func:`_choose_start_method` checks ``torch.cuda.is_initialized()``
first (without importing torch) and raises with the two ways out. And only the forking
thread lives on in the child: a lock another thread held at that moment (a Jupyter kernel has
several threads) stays held there. Python re-initializes its own (imports, logging,
threading) after a fork, and ipykernel its output streams, which is why notebooks fork in
practice; the risk left, a library's private lock taken by another thread at that instant,
is the one Accelerate and Lightning accept too. An explicit ``start_method`` is always used
as given.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
import types
from typing import Any, Callable, Sequence

from dptrain.runtime import settings as _settings
from dptrain.runtime.errors import RankFailedError
from dptrain.runtime.heartbeat import OomRecord, describe_exit
from dptrain.launcher.rendezvous import RendezvousServer, loopback_ifname, wait_s
from dptrain.launcher.workers import rank_environ, stop_processes

__all__ = ["spawn"]


# ---------------------------------------------------------------------------------------


def result_payload(rank: int, result: Any) -> bytes:
    """What a spawned (or pooled) rank sends its parent for ``result``: the pickle ("ok", result), or
    an error naming the rank where the value cannot be pickled (the caller's bug, said as such)."""
    try:
        return pickle.dumps(("ok", result))
    except Exception as exc:  # noqa: BLE001 - an unpicklable return value is the caller's bug
        return pickle.dumps(("error", f"rank {rank} returned a value that cannot be sent back: {exc!r}", ""))


def send_failure(conn: Any, exc: BaseException) -> None:
    """Tell the parent, over ``conn``, that the body failed with ``exc`` (inside its ``except``:
    the traceback is the one being handled); a parent that is gone is not an error here."""
    tb = traceback.format_exc()
    try:
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", tb)))
    except Exception:  # noqa: BLE001
        pass


def _spawn_entry(fn, rank, nprocs, port, args, conn, extra_env) -> None:
    os.environ.update(
        rank_environ(
            rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs, node_rank=0,
            num_nodes=1, master_addr="127.0.0.1", master_port=port, run_id="spawn",
        )
    )
    os.environ.update(extra_env)
    # Imported here, in the child only: dptrain.runtime.env imports torch, which no module of the
    # launcher may do at import (the caller's process never needs it). The child leaves with
    # os._exit, past atexit, so the job is left here.
    from dptrain.runtime import env

    # Results travel as plain pickles (bytes): multiprocessing's own pickler would share tensors
    # through file descriptors that vanish when this process exits.
    try:
        conn.send_bytes(result_payload(rank, fn(rank, *args)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        send_failure(conn, exc)
        conn.close()
        os._exit(1)
    finally:
        try:
            env.shutdown()
        except Exception:  # noqa: BLE001 - the result is already on its way
            pass
    conn.close()


class _Rank:
    """A spawned rank, as :func:`dptrain.launcher.workers.stop_processes` asks for it."""

    def __init__(self, process: Any) -> None:
        self.process = process

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, sig: int) -> None:
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None) -> None:
        self.process.join(5 if timeout is None else timeout)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = None,
    start_method: str | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and return their results.

    The in-process form of ``dptrain run`` for notebooks and tests, shaped like
    ``torch.multiprocessing.spawn``. Each process gets torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, a free MASTER_PORT, ...), so ``dptrain.init()``
    inside ``fn`` joins the job; the process group is shut down when ``fn`` returns.

    In a script, put the call under ``if __name__ == "__main__":`` (each new process
    imports the script to find ``fn``). In a Jupyter notebook, ``python -c``, ``python -``
    or the REPL, a function defined right there works too: the ranks are then forked
    from the caller (see ``start_method``).

    Args:
        fn: the function each rank runs, called as ``fn(rank, *args)``: a module-level
            function, or, in a notebook or another ``__main__`` without a file, any function.
        nprocs: number of ranks, >= 1.
        args: extra positional arguments for ``fn``. Default ``()``.
        timeout: seconds after which every rank still running is killed and
            ``TimeoutError`` is raised. Default None (no limit).
        start_method: how the rank processes start: ``"spawn"``, ``"forkserver"`` or
            ``"fork"``, used as given. Default None: ``"spawn"`` (fresh interpreters),
            except where a fresh interpreter cannot find ``fn`` or ``args`` -- defined in a
            notebook, ``python -c``, ``python -`` or the REPL -- where it is ``"fork"``
            (each rank a copy of this process, as Accelerate's ``notebook_launcher`` does).
        env: extra environment variables for the ranks.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        ValueError: ``nprocs < 1``, or a ``DPTRAIN_*`` variable (of this process or ``env``)
            holds a value it cannot take: said here once rather than by every rank.
        RuntimeError: ``start_method`` is None, the ranks must be forked (see above), and
            CUDA is already initialized in this process, or this platform cannot fork.
            The message shows the fix: call ``spawn`` before anything uses CUDA, or
            move ``fn`` into a file and import it.
        RankFailedError: a rank raised or died; names the rank and carries its traceback.
            The other ranks are stopped first.
        TimeoutError: ``timeout`` passed; names the ranks still running.

    Example (a notebook cell; in a script, the last line goes under ``if __name__ == "__main__":``):
        >>> def work(rank):
        ...     dptrain.init()
        ...     t = torch.tensor([float(rank)])
        ...     dptrain.comm.all_reduce(t, op="avg")
        ...     return t.item()
        >>> dptrain.spawn(work, nprocs=2, timeout=60)   # doctest: +SKIP
        [0.5, 0.5]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn needs nprocs >= 1, got {nprocs!r}")
    _settings.check_all({**os.environ, **(env or {})})
    if start_method is None:
        start_method = _choose_start_method(fn, tuple(args), nprocs)
    ctx = mp.get_context(start_method)
    server = RendezvousServer("127.0.0.1", 0, nprocs, timeout_s=wait_s(timeout))
    server.serve()
    extra_env = dict(env or {})
    if "GLOO_SOCKET_IFNAME" not in os.environ and loopback_ifname():
        extra_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    procs, conns = [], []
    oom = OomRecord()  # what tells a rank killed for want of memory from one killed by hand
    try:
        for rank in range(nprocs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_spawn_entry,
                args=(fn, rank, nprocs, server.port, tuple(args), child_end, extra_env),
                name=f"dptrain-rank{rank}",
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _watch_spawned(procs, conns, timeout, oom)
    finally:
        stop_processes([_Rank(p) for p in procs])
        for c in conns:
            c.close()
        server.close()


# ---------------------------------------------------------------------------------------
# The default start method: see [Note: how the ranks start when no start method is given].


def _main_in_new_process() -> str:
    """What a freshly spawned interpreter makes of this process's ``__main__``.

    ``"file"``: it imports or runs the same file, so ``__main__``'s functions are found.
    ``"empty"``: it skips ``__main__`` (a Jupyter kernel, ``python -c``, the REPL,
    ``python -m pkg``). ``"broken"``: it tries to run a file that does not exist (``python -``
    names it ``<stdin>``) and dies. The cases are multiprocessing's own
    (``multiprocessing.spawn.get_preparation_data`` and ``_fixup_main_from_*``).
    """
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:
        return "empty" if spec_name == "__main__" or spec_name.endswith(".__main__") else "file"
    path = getattr(main, "__file__", None)
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return "empty"
    # multiprocessing resolves a relative path against the directory the caller started in.
    path = os.path.join(mp.process.ORIGINAL_DIR or "", path)
    return "file" if os.path.isfile(path) else "broken"


class _Discard:
    def write(self, data) -> int:
        return len(data)


class _MainNames(pickle.Pickler):
    """Pickles into nothing, collecting what a new process would have to find in ``__main__``."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.names: list[str] = []

    def persistent_id(self, obj: Any) -> Any:
        # Called for every object about to be pickled; a non-None answer stands in for it, so
        # neither what we have noted nor bulk data is walked through (or copied).
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.names.append(getattr(obj, "__qualname__", repr(obj)))
            return "__main__"
        if _is_bulk_data(obj):
            return "data"
        return None


def _is_bulk_data(obj: Any) -> bool:
    # Only libraries already imported can have made obj: nothing is imported here.
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if type(obj).__module__ == "__main__":
        return False
    if torch is not None and isinstance(obj, torch.Tensor):
        return True
    return numpy is not None and isinstance(obj, numpy.ndarray) and obj.dtype != object


def _needs_main(fn: Callable[..., Any], args: tuple) -> str | None:
    """Why a process that cannot re-create ``__main__`` cannot run ``fn(rank, *args)``; None if it can."""
    pickler = _MainNames()
    try:
        pickler.dump((fn, args))
    except Exception as exc:  # noqa: BLE001 - whatever stops pickle stops a spawned process too
        return f"it cannot be pickled ({type(exc).__name__}: {exc})"
    names = sorted(set(pickler.names))
    if names:
        return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} defined in __main__"
    return None


def _choose_start_method(fn: Callable[..., Any], args: tuple, nprocs: int) -> str:
    """``"spawn"``, or ``"fork"`` where a spawned process could not run ``fn(rank, *args)``.

    Raises RuntimeError where it must fork and cannot.
    """
    main = _main_in_new_process()
    if main == "file":
        return "spawn"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    example = name if name.isidentifier() else "work"  # a lambda's "<lambda>" cannot be imported
    if main == "broken":
        why = (f"this program was read from {getattr(sys.modules['__main__'], '__file__', '?')}, "
               f"which a new process cannot read again")
        move = "save the program in a file and run that (python train.py); its ranks then start as fresh processes"
    else:
        reason = _needs_main(fn, args)
        if reason is None:
            return "spawn"
        why = f"{reason}, and this __main__ (a notebook, python -c, the REPL) has no file a new process could import"
        move = (f"put {name} (and what it uses from the notebook) in a file, mywork.py, and import it; its "
                f"ranks then start as fresh processes:\n        from mywork import {example}\n        "
                f"dptrain.spawn({example}, {nprocs})")
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError(
            f"dptrain.spawn cannot start {name}: {why}, and this platform ({sys.platform}) cannot fork the "
            f"ranks from this process instead. Fix: {move}"
        )
    torch = sys.modules.get("torch")  # not imported here: a process without torch has no CUDA either
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            f"dptrain.spawn cannot start {name}: {why}, so its ranks must be forked from this process, "
            f"but this process has already initialized CUDA, which a forked process cannot use. "
            f"Fix it one of two ways:\n"
            f"  - restart the kernel (or interpreter) and call dptrain.spawn before anything initializes CUDA "
            f"(a tensor on the GPU: .cuda(), .to('cuda'); torch.cuda.set_device); each rank takes its own GPU "
            f"in dptrain.init()\n"
            f"  - {move}"
        )
    return "fork"


def _watch_spawned(procs, conns, timeout, oom: OomRecord | None = None) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    done = [False] * n
    deadline = None if timeout is None else time.monotonic() + timeout
    pending_conns = {c: r for r, c in enumerate(conns)}
    while not all(done):
        wait_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        sentinels = [p.sentinel for rank, p in enumerate(procs) if not done[rank]]
        ready = mp.connection.wait(list(pending_conns) + sentinels, wait_s)
        for obj in ready:
            if obj in pending_conns:
                rank = pending_conns.pop(obj)
                try:
                    msg = pickle.loads(obj.recv_bytes())
                except EOFError:
                    continue  # died without a word: the sentinel reports it
                if msg[0] == "ok":
                    results[rank] = msg[1]
                    done[rank] = True
                else:
                    _, summary, tb = msg
                    raise RankFailedError(
                        f"rank {rank} of {n} failed: {summary}\n\n--- traceback of rank {rank} ---\n{tb}",
                        rank, None, tb,
                    )
        for rank, p in enumerate(procs):
            if done[rank] or p.is_alive():
                continue
            p.join()
            conn = conns[rank]
            if conn in pending_conns and conn.poll():
                continue  # its message is waiting: read it on the next pass
            if p.exitcode == 0 and not done[rank]:
                raise RankFailedError(f"rank {rank} of {n} exited without returning a result", rank, 0)
            if p.exitcode != 0:
                raise RankFailedError(f"rank {rank} of {n} {describe_exit(p.exitcode, oom, p.pid)}", rank, p.exitcode)
        if deadline is not None and time.monotonic() >= deadline:
            running = [r for r in range(n) if not done[r]]
            raise TimeoutError(
                f"rank(s) {running} of {n} still running after the {timeout:.0f}s timeout; they were killed "
                f"(a stalled collective or an endless loop?)"
            )
    return results
