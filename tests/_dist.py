"""The multi-rank test harness: run a function on N ranks (processes, gloo) with a hard timeout.

Every multi-process test goes through :func:`run_ranks`. Each rank joins a fresh process
group on a free port (the harness hosts the store), runs ``fn(rank, *args)`` and returns
its value; a rank that raises has its traceback re-raised here tagged with its rank, and a
rank that hangs is killed when the timeout passes, failing the test instead of CI.

Ranks start from a fork server that has already imported torch and dptrain, so a rank
starts in a fraction of a second instead of re-importing torch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import dptrain

DEFAULT_TIMEOUT_S = float(os.environ.get("DPTRAIN_TEST_TIMEOUT", "90"))

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "dptrain", "dptrain.runtime.env", "dptrain.comm",
                             "dptrain.parallel", "dptrain.train"])


def _rank_main(rank: int, fn, args, backend: str, threads: int):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    dptrain.init(backend=backend)
    return fn(rank, *args)


def run_ranks(fn, nprocs: int, *args, timeout: float = DEFAULT_TIMEOUT_S, backend: str = "gloo", env=None, threads: int = 1):
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks after ``dptrain.init``; return results in rank order.

    ``fn`` must be a module-level function of a test module. Raises
    ``dptrain.RankFailedError`` (naming the rank, with its traceback) or ``TimeoutError``.
    """
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
