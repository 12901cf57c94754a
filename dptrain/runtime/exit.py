"""A clean end for a rank: no gloo worker thread may still need the GIL once the interpreter ends.

[Note: a gloo worker at the interpreter's exit]
A gloo worker thread (PyTorch names it ``pt_gloo_runloop``) marks a collective done, which
lets the waiting rank go on, and only then drops its own reference to the work. When that is
the last reference to a tensor whose Python object the script has already dropped (any
``dist.all_reduce(torch.ones(n))``), letting go of it takes the GIL. If the interpreter is
finalizing by then, Python ends the thread with ``pthread_exit``, whose unwinding meets a
``noexcept`` C++ frame: "terminate called without an active exception", SIGABRT, after the
script's work is done, and the job fails. It takes a process group still alive at exit (a
model, an optimizer or a reference cycle holds it) and a worker thread that the rank it
woke has pushed off the CPU; with both ranks of a job on one busy CPU, plain PyTorch aborts
so in three to five exits of ten (``tests/test_clean_exit.py``).

So before the interpreter finalizes (``atexit`` runs first), :func:`settle_gloo_workers`
waits with the GIL released until every gloo worker thread sleeps and has not run for a few
milliseconds: idle, waiting for work (a thread that wanted the GIL got it while we slept).
It is registered when this module loads, which every module that runs collectives does
(``dptrain.comm``, ``dptrain.runtime.env``), so a script that makes its own group and never calls
``dptrain.shutdown`` is covered too. Registered before ``init`` registers
``dptrain.shutdown``, it runs after it (``atexit`` runs the last registered first), once the
group is destroyed. It reads ``/proc`` (Linux); elsewhere it returns at once. No torch here:
the ground floor.

[Note: older torch]
PyTorch names its gloo workers ``pt_gloo_runloop`` from 2.11 on (2.13 and 2.14 too). Before,
they carry the name of the thread that made them (``pt_main_thread`` on 2.4, ``python`` on
2.8), so there the wait takes every thread that Python did not start, other than the caller:
idle native threads sleep too, and a busy one only costs the wait its limit. And before 2.8,
``destroy_process_group`` holds the GIL while it waits for the group's workers, one of which
may need the GIL to drop a tensor: the rank hangs in ``dptrain.shutdown`` (7 of 10 pinned
2-rank jobs on torch 2.4.1; PyTorch's fix is pytorch/pytorch#154976).
:func:`settle_before_destroy` waits for the workers first there.

[Note: a group outlives its destroy]
On every torch the group object itself lives on after ``destroy_process_group`` while anything
holds it: PyTorch's DDP, a subgroup, a reference cycle. Where that last holder goes (a model
dropped, the garbage collector run by any allocation) the group's destructor joins its workers
holding the GIL, and a worker still letting go of the last collective waits for the GIL: the
rank hangs, its script done (seen in the test pool: a collection in the bodies' bookkeeping after
``shutdown``, 1 body in ~20 under load, torch 2.13). So :func:`settle_before_destroy` waits for
the workers on every torch, not only on those whose destroy holds the GIL: once idle, a worker
needs the GIL no more.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from dptrain.runtime import torch_version as _torch_version

__all__ = ["settle_gloo_workers", "settle_before_destroy", "SETTLE_LIMIT_S"]

#: The longest :func:`settle_gloo_workers` waits, in seconds (a worker busy with a
#: collective nobody waits for would otherwise hold the exit).
SETTLE_LIMIT_S = 2.0
_GLOO_WORKER = "pt_gloo_runloop"  # the name PyTorch gives a gloo process group's worker threads
_NAMED_FROM = (2, 11)  # the first torch that names them so (see [Note: older torch])
_TASKS = "/proc/self/task"


def settle_gloo_workers(limit_s: float = SETTLE_LIMIT_S, quiet_s: float = 0.005) -> bool:
    """Wait until this process's gloo worker threads are idle (see the module's note).

    Args:
        limit_s: give up after this many seconds. Default :data:`SETTLE_LIMIT_S`.
        quiet_s: how long each must have slept without running. Default 5 ms.

    Returns:
        True if the workers were seen idle (or there are none), False if ``limit_s`` passed.

    Example:
        >>> settle_gloo_workers()
        True
    """
    deadline = time.monotonic() + limit_s
    before = None
    unnamed = _torch_version.older_than(_NAMED_FROM)
    while True:
        now = _gloo_workers(unnamed)
        if not now or (now == before and all(state == "S" for state, _ in now.values())):
            return True
        if time.monotonic() > deadline:
            return False
        before = now
        time.sleep(quiet_s)  # the GIL is free meanwhile


def settle_before_destroy() -> None:
    """Wait for the gloo workers before a group is destroyed, so that none still needs the GIL
    when the group's destructor joins them (see [Note: a group outlives its destroy]).

    Costs a few milliseconds where the workers are idle, at most :data:`SETTLE_LIMIT_S`.

    Example:
        >>> settle_before_destroy(); dist.destroy_process_group()   # doctest: +SKIP
    """
    settle_gloo_workers()


def _gloo_workers(unnamed: bool = False) -> dict[str, tuple[str, str]]:
    """{thread id: (scheduler state, time slices run)} of this process's gloo worker threads;
    ``unnamed``: of every thread that Python did not start, but the caller (older torch)."""
    out: dict[str, tuple[str, str]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    python_threads = {str(t.native_id) for t in threading.enumerate()} | {str(threading.get_native_id())}
    for tid in tids:
        try:
            if unnamed:
                if tid in python_threads:
                    continue
            else:
                with open(f"{_TASKS}/{tid}/comm") as f:
                    if f.read().strip() != _GLOO_WORKER:
                        continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                runs = f.read().split()[-1]  # moves whenever the thread is scheduled
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        out[tid] = (stat[stat.rindex(")") + 2], runs)
    return out


atexit.register(settle_gloo_workers)
