"""The multi-rank test harness: run a function on N ranks (processes, gloo) with a hard timeout.

Every multi-process test goes through :func:`run_ranks`. Each call runs ``fn(rank, *args)`` on
N ranks inside a process group of its own (``dptrain.init`` before, ``dptrain.shutdown``
after) and returns each rank's value; a rank that raises has its traceback re-raised here
tagged with its rank, and a rank that hangs is killed when the timeout passes, failing the
test instead of CI.

Where the ranks come from:

* **Pooled (the default).** The ranks of a world kept for the whole test run
  (:mod:`tests._pool`): started once per (ranks, ``env``, threads), each call's body is
  sent to them. A body that fails, hangs, kills a rank or leaves anything changed behind
  (environment, signal handlers, a monkeypatched attribute, threads, child processes...)
  gets the world discarded, and the next call a new one. A call costs a group, not processes.
* **Fresh** (``run_ranks(..., fresh=True)``, or ``FRESH_RANKS = True`` at the top of a test
  module for all of its calls): new processes for this call only, forked from a fork server
  that has already imported torch and dptrain, as ``dptrain.spawn`` starts them. Use it where
  the test is about the process itself: its start, its peak memory, its exit, a signal that
  reaches it, ``init`` on a world that never joined before, a group it destroys by design.

A new test needs nothing more than a module-level ``fn``::

    def _work(rank, n):
        t = torch.full((n,), float(rank))
        dptrain.comm.all_reduce(t)
        return t.tolist()

    def test_sum():
        assert run_ranks(_work, 2, 3) == [[1.0] * 3] * 2

``DPTRAIN_TEST_POOL=0`` turns the pool off for a run (every call fresh), to tell whether a
failure has to do with the pool; ``DPTRAIN_TEST_POOL_LOG=<file>`` appends there why each
discarded world was discarded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import dptrain

from tests import _pool

DEFAULT_TIMEOUT_S = float(os.environ.get("DPTRAIN_TEST_TIMEOUT", "90"))

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["tests._forkserver"])  # torch and dptrain, frozen out of the collector


def _rank_main(rank: int, fn, args, backend: str, threads: int):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    dptrain.init(backend=backend)
    return fn(rank, *args)


def run_ranks(fn, nprocs: int, *args, timeout: float = DEFAULT_TIMEOUT_S, backend: str = "gloo", env=None,
              threads: int = 1, fresh: bool | None = None):
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks after ``dptrain.init``; return results in rank order.

    Args:
        fn: a module-level function of a test module (it is pickled by reference).
        nprocs: the number of ranks.
        *args: extra positional arguments for ``fn``; they are pickled.
        timeout: seconds before every rank is killed and ``TimeoutError`` raised. Default
            ``DPTRAIN_TEST_TIMEOUT`` or 90.
        backend: the process group's backend. Default ``"gloo"``; ``"nccl"`` always runs fresh.
        env: extra environment variables of the ranks (read by ``dptrain.init``). Default None.
        threads: ``torch.set_num_threads`` of each rank. Default 1.
        fresh: True starts new rank processes for this call; False takes a pooled world; None
            (default) takes the pool unless ``fn``'s module says ``FRESH_RANKS = True`` (see the
            module docstring for what a pooled body can rely on).

    Raises ``dptrain.RankFailedError`` (naming the rank, with its traceback) or ``TimeoutError``.
    """
    if fresh is None:
        fresh = bool(getattr(sys.modules.get(getattr(fn, "__module__", "")), "FRESH_RANKS", False))
    if not fresh and backend == "gloo" and _pool.enabled():
        return _pool.get_pool(_ctx).run(fn, nprocs, args, timeout=timeout, backend=backend, env=env,
                                        threads=threads)
    return dptrain.spawn(
        _rank_main,
        nprocs,
        args=(fn, args, backend, threads),
        timeout=timeout,
        start_method="forkserver",
        env=env,
    )


def set_event(path) -> None:
    """Make the event file ``path`` appear (atomically) for :func:`wait_event` in another process."""
    path = os.fspath(path)
    with open(path + ".part", "w"):
        pass
    os.replace(path + ".part", path)


def wait_event(path, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Block until the event file ``path`` exists: synchronisation on what happened, not on a sleep.

    The timeout only keeps a test whose event never comes from hanging; raises TimeoutError.
    """
    path = os.fspath(path)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the event {path!r} did not happen within {timeout:.0f}s")
        time.sleep(0.01)


def left_in_tmpdir(path) -> list[str]:
    """What a job run with ``TMPDIR=path`` left there, less torch's own compile cache folder
    (``torchinductor_<user>``, made by importing ``torch._dynamo``, as the warm template does ahead
    for every rank): the launcher's temporary folders must all be gone."""
    return sorted(p.name for p in path.iterdir() if not p.name.startswith("torchinductor_"))
