"""Start and finish many short 2-rank jobs through every way a process ends; count aborts.

    python exit_stress.py JOBS PARALLEL [CASE]

Each rank is forked from this process (torch is imported once, so a job costs a fraction
of a second). Job ``j`` picks, from ``j`` alone (so a failure names a reproducible case, and
with CASE every one of the JOBS jobs does what job CASE does, to repeat a failure):

* how the process group is made: by ``dptrain.init`` (its heartbeat writing as fast as it
  can, so that it is inside a store write whenever the process ends), or by the user with
  ``torch.distributed.init_process_group("gloo", init_method="env://")``, rank 0 hosting
  the store, as PyTorch's own tests and most PyTorch scripts do;
* what it builds: nothing, one all-reduce, or several DDPs in shared memory, built the ways
  PyTorch's DDP tests build them (``find_unused_parameters``, ``static_graph``, a comm hook,
  ``no_sync``), each of which owns a worker thread;
* how it leaves: ``dptrain.shutdown()``, nothing at all, ``destroy_process_group()`` only,
  ``sys.exit(0)``, an uncaught exception, ``os._exit(0)`` or SIGTERM;
* and rank 1 leaving after rank 0 (whose process hosts the store) has gone.

A rank that ends through the interpreter's normal exit while a thread of ours is inside a
C++ call aborts ("terminate called without an active exception", SIGABRT): that is what this
counts. Every other outcome is the one its exit path asks for (0, 1 for the exception,
SIGTERM's -15). Prints "ok JOBS" or one line per unexpected exit, and exits 1 on any.
"""
import gc
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import dptrain
import dptrain.parallel  # noqa: F401 - DDP's torch._dynamo (2 s of CPU), imported once here, not in each rank
from dptrain import comm
from dptrain.runtime import heartbeat as _heartbeat, env
from dptrain._shm import segment as _shm_segment
from dptrain.runtime.heartbeat import describe_exit as _describe_exit
from dptrain.launcher.rendezvous import free_port

EXITS = ("shutdown", "nothing", "destroy", "sys_exit", "exception", "os_exit", "sigterm")
WORK = ("none", "all_reduce", "ddps")
EXPECTED = {"exception": 1, "sigterm": -signal.SIGTERM}


def case(job: int) -> dict:
    """What job ``job`` does: every exit path meets every kind of work and both group makers."""
    return {
        "exit": EXITS[job % len(EXITS)],
        "work": WORK[(job // len(EXITS)) % len(WORK)],
        "external": (job // (len(EXITS) * len(WORK))) % 2 == 1,
        "late": job % 2 == 0,  # rank 1 leaves after rank 0 and its store are gone
    }


def build_ddps() -> list:
    """Several DDPs per process, as PyTorch's DDP tests build them; each trains two steps.

    They stay alive until the process ends (as a script's model does): their shared-memory
    worker threads are still there when the interpreter exits."""
    def net():
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def allreduce_hook(state, bucket):
        return dist.all_reduce(bucket.buffer().div_(2), async_op=True).get_future().then(lambda f: f.value()[0])

    models = [
        dptrain.DDP(net(), shm=True),
        dptrain.DDP(net(), shm=True, find_unused_parameters=True),
        dptrain.DDP(net(), shm=True, static_graph=True),
    ]
    hooked = dptrain.DDP(net(), shm=True)
    hooked.register_comm_hook(None, allreduce_hook)
    models.append(hooked)
    for model in models:
        with model.no_sync():
            model(torch.randn(4, 16)).sum().backward()
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
    return models


def slow_close(close):
    """A segment's close that first spends a few ms inside torch with the GIL released, as a
    starved worker thread on a loaded machine does: if the interpreter starts to exit then,
    the thread is killed inside a C++ frame and the process aborts."""
    def close_slowly(self):
        if not self.closed:
            torch.ones(1 << 22).cumsum(0)
        close(self)
    return close_slowly


_shm_segment._Segment.close = slow_close(_shm_segment._Segment.close)


KEPT: list = []  # what the script still holds when it ends


def rank_main(rank: int, port: int, how: dict) -> None:
    # The main thread hands the GIL over at every chance: a thread of ours that still has
    # work when the script ends runs during the interpreter's exit, as on a loaded machine.
    sys.setswitchinterval(1e-6)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DPTRAIN_TIMEOUT="60")
    if how["external"]:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
        dist.barrier()  # (else rank 0 may leave while rank 1 still connects to it: torch's own failure)
    else:
        dptrain.init(backend="gloo")
        _heartbeat.start(env._STATE.store, rank, interval=0.002)
    if how["work"] == "all_reduce":
        t = torch.ones(4)
        comm.all_reduce(t)
        assert t[0].item() == 2.0, t
    elif how["work"] == "ddps":
        KEPT.extend(build_ddps())
    if how["late"] and rank == 1:
        time.sleep(0.3)  # rank 0, and the store its process hosts, are gone or going
    leave = how["exit"]
    if leave == "shutdown":
        dptrain.shutdown()
    elif leave == "destroy":
        dist.destroy_process_group()
    elif leave == "sys_exit":
        dist.destroy_process_group()
        sys.exit(0)
    elif leave == "exception":
        raise RuntimeError("the script failed (on purpose)")
    elif leave == "os_exit":
        sys.stdout.flush()
        os._exit(0)
    elif leave == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # SIGTERM's default action ends the process before this does


def fork_rank(rank: int, port: int, how: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        rank_main(rank, port, how)
    except SystemExit:
        raise
    except RuntimeError as exc:
        if "on purpose" not in str(exc):
            traceback.print_exc()
            os._exit(3)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1)  # what an uncaught exception ends with, through the normal exit
    except BaseException:  # noqa: BLE001 - report and leave without the normal exit
        traceback.print_exc()
        os._exit(3)
    raise SystemExit(0)  # unwinds to the top: the interpreter's normal exit, atexit included


def main() -> int:
    jobs, parallel = int(sys.argv[1]), int(sys.argv[2])
    only = int(sys.argv[3]) if len(sys.argv) > 3 else None
    # Objects that exist now are never collected in the children: their exit then costs a
    # fraction of a second instead of a full collection of torch's objects.
    gc.freeze()
    running: dict[int, tuple[int, int]] = {}
    failures = []
    aborts = 0
    started = 0
    while started < jobs or running:
        while started < jobs and len(running) < 2 * parallel:
            port = free_port()
            for rank in (0, 1):
                running[fork_rank(rank, port, case(started if only is None else only))] = (started, rank)
            started += 1
        pid, status = os.wait()
        job, rank = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        how = case(job if only is None else only)
        if code == -signal.SIGABRT:
            aborts += 1
        if code != EXPECTED.get(how["exit"], 0):
            failures.append(f"job {job} rank {rank} {_describe_exit(code)} ({how})")
    print("\n".join(failures + [f"aborts {aborts}"]) if failures else f"ok {jobs}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
