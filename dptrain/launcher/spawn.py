"""``dptrain.spawn``: run a function on N ranks in new processes (notebooks and tests).

The in-process form of ``dptrain run``: each process gets torchrun's environment and a
store hosted by the caller; a rank that raises or dies stops the others, and its error is
re-raised in the caller naming the rank.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import time
import traceback
from typing import Any, Callable, Sequence

from dptrain._errors import RankFailedError
from dptrain._heartbeat import describe_exit
from dptrain.launcher.rendezvous import RendezvousServer, loopback_ifname, wait_s
from dptrain.launcher.workers import rank_environ, stop_processes

__all__ = ["spawn"]


# ---------------------------------------------------------------------------------------


def _spawn_entry(fn, rank, nprocs, port, args, conn, extra_env) -> None:
    os.environ.update(
        rank_environ(
            rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs, node_rank=0,
            num_nodes=1, master_addr="127.0.0.1", master_port=port, run_id="spawn",
        )
    )
    os.environ.update(extra_env)
    # Imported here, in the child only: dptrain.env imports torch, which no module of the
    # launcher may do at import (the caller's process never needs it). The child leaves with
    # os._exit, past atexit, so the job is left here.
    from dptrain import env

    # Results travel as plain pickles (bytes): multiprocessing's own pickler would share tensors
    # through file descriptors that vanish when this process exits.
    try:
        result = fn(rank, *args)
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as exc:  # noqa: BLE001 - an unpicklable return value is the caller's bug
            payload = pickle.dumps(("error", f"rank {rank} returned a value that cannot be sent back: {exc!r}", ""))
        conn.send_bytes(payload)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", tb)))
        except Exception:  # noqa: BLE001
            pass
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
    start_method: str = "spawn",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and return their results.

    The in-process form of ``dptrain run`` for notebooks and tests, shaped like
    ``torch.multiprocessing.spawn``. Each process gets torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, a free MASTER_PORT, ...), so ``dptrain.init()``
    inside ``fn`` joins the job; the process group is shut down when ``fn`` returns.

    Args:
        fn: a picklable (module-level) function; called as ``fn(rank, *args)``.
        nprocs: number of ranks, >= 1.
        args: extra positional arguments for ``fn``. Default ``()``.
        timeout: seconds after which every rank still running is killed and
            ``TimeoutError`` is raised. Default None (no limit).
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``.
        env: extra environment variables for the ranks.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        ValueError: ``nprocs < 1``.
        RankFailedError: a rank raised or died; names the rank and carries its traceback.
            The other ranks are stopped first.
        TimeoutError: ``timeout`` passed; names the ranks still running.

    Example:
        >>> def work(rank):
        ...     dptrain.init()
        ...     return dptrain.world_size()
        >>> dptrain.spawn(work, nprocs=2)   # doctest: +SKIP
        [2, 2]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn needs nprocs >= 1, got {nprocs!r}")
    ctx = mp.get_context(start_method)
    server = RendezvousServer("127.0.0.1", 0, nprocs, timeout_s=wait_s(timeout))
    server.serve()
    extra_env = dict(env or {})
    if "GLOO_SOCKET_IFNAME" not in os.environ and loopback_ifname():
        extra_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    procs, conns = [], []
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
        return _watch_spawned(procs, conns, timeout)
    finally:
        stop_processes([_Rank(p) for p in procs])
        for c in conns:
            c.close()
        server.close()


def _watch_spawned(procs, conns, timeout) -> list[Any]:
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
                raise RankFailedError(f"rank {rank} of {n} {describe_exit(p.exitcode)}", rank, p.exitcode)
        if deadline is not None and time.monotonic() >= deadline:
            running = [r for r in range(n) if not done[r]]
            raise TimeoutError(
                f"rank(s) {running} of {n} still running after the {timeout:.0f}s timeout; they were killed "
                f"(a stalled collective or an endless loop?)"
            )
    return results
