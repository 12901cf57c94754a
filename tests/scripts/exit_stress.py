"""Start and finish many short 2-rank jobs; every rank must exit with code 0.

    python exit_stress.py JOBS PARALLEL

Each rank is forked from this process (torch is imported once, so a job costs a fraction
of a second), joins its job, runs the heartbeat as fast as it can -- so that it is inside a store
write whenever the process ends --, all-reduces (or not: it leaves right after init, as
a hello-world does), takes a DDP step (or not: its buckets are summed on a worker thread)
and then leaves the way scripts do: half of the jobs call
``dptrain.shutdown()``, half leave it to ``atexit``. Either way
the rank ends through the interpreter's normal exit, where a thread still inside a C++
call aborts the process ("terminate called without an active exception"). Ranks of
PARALLEL jobs run at once, which loads the machine. Prints "ok JOBS" or one line per
failed rank, and exits 1 on any failure.
"""
import gc
import os
import sys
import traceback

import torch

import dptrain
from dptrain import _heartbeat, comm, env
from dptrain._rendezvous import describe_exit as _describe_exit, free_port


def rank_main(rank: int, port: int, kind: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DPTRAIN_TIMEOUT="60")
    dptrain.init(backend="gloo")
    _heartbeat.start(env._STATE.store, rank, interval=0.002)
    if kind & 1:  # else: leave right after init, as a script that only prints its rank does
        t = torch.ones(4)
        comm.all_reduce(t)
        assert t[0].item() == 2.0, t
    if kind & 4:  # a DDP step: its buckets are summed by the shared-memory worker thread
        model = dptrain.DDP(torch.nn.Linear(64, 64))
        model(torch.randn(8, 64)).sum().backward()
    if kind & 2:
        dptrain.shutdown()


def fork_rank(rank: int, port: int, kind: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        rank_main(rank, port, kind)
    except BaseException:  # noqa: BLE001 - report and leave without the normal exit
        traceback.print_exc()
        os._exit(1)
    raise SystemExit(0)  # unwinds to the top: the interpreter's normal exit, atexit included


def main() -> int:
    jobs, parallel = int(sys.argv[1]), int(sys.argv[2])
    # Objects that exist now are never collected in the children: their exit then costs a
    # fraction of a second instead of a full collection of torch's objects.
    gc.freeze()
    running: dict[int, tuple[int, int]] = {}
    failures = []
    started = 0
    while started < jobs or running:
        while started < jobs and len(running) < 2 * parallel:
            port = free_port()
            for rank in (0, 1):
                running[fork_rank(rank, port, kind=started % 8)] = (started, rank)
            started += 1
        pid, status = os.wait()
        job, rank = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures.append(f"job {job} rank {rank} {_describe_exit(code)}")
    print("\n".join(failures) if failures else f"ok {jobs}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
