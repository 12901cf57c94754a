"""A rank that has finished exits with code 0 -- never "terminate called without an active
exception" and SIGABRT from a thread still inside a C++ call when the interpreter ends."""

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def test_shutdown_waits_for_a_heartbeat_caught_in_a_slow_store_write():
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "slow_heartbeat.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert "terminate called" not in out.stderr
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "stopped\n"


def test_every_exit_path_of_many_short_jobs_ends_without_an_abort():
    # 42 jobs of 2 ranks, 3 jobs at a time on a machine with few cores: every way a process
    # ends (shutdown(), nothing, destroy_process_group() only, sys.exit, an exception,
    # os._exit, SIGTERM) with groups made by dptrain.init and by the user's own
    # init_process_group, several DDPs in shared memory alive at the end (see exit_stress.py).
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "exit_stress.py"), "42", "3"],
                         capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert "terminate called" not in out.stderr, out.stdout + out.stderr[-3000:]
    assert out.returncode == 0 and out.stdout.strip() == "ok 42", out.stdout + out.stderr[-3000:]




def _pinned_job(how: str, cpu: int) -> subprocess.Popen:
    """A gloo_exit.py job of 2 ranks, both on CPU ``cpu``: its two processes."""
    from dptrain.launcher.rendezvous import free_port

    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", DPTRAIN_SHM="0")
    return [subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "gloo_exit.py"), how], cwd=ROOT,
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"),
                             preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in (0, 1)]


def test_a_gloo_worker_still_letting_go_of_a_collective_does_not_abort_the_exit():
    # With both ranks on one CPU, the gloo worker thread that completes a collective is
    # preempted by the rank's main thread it woke, and lets go of the work (and of the last
    # reference to a dropped tensor, which takes the GIL) only later: if the interpreter is
    # finalizing by then, the process aborts ("terminate called without an active
    # exception", SIGABRT) after its work is done. Before dptrain waited for the workers at
    # exit, 3 to 5 of 10 such "torch" jobs aborted, and 2 of 3 runs of this test failed. Five rounds of one job per CPU (two CPUs
    # at most), each job alone on its CPU: more processes there would shorten the main
    # thread's time slices and hide the race.
    #
    # "shutdown" jobs end with dptrain.shutdown(): before torch 2.8, destroy_process_group held
    # the GIL while a gloo worker waited for it to drop a tensor, and 7 of 10 such jobs hung
    # there on torch 2.4.1 before dptrain waited for the workers first (dptrain.runtime.exit).
    cpus = sorted(os.sched_getaffinity(0))[:2]
    bad = []
    for how in ("torch", "dptrain", "shutdown", "torch", "dptrain"):
        jobs = [(how, p) for cpu in cpus for p in _pinned_job(how, cpu)]
        for kind, p in jobs:
            try:
                code, err = p.wait(timeout=60), p.stderr.read()
            except subprocess.TimeoutExpired:
                p.kill()
                code, err = "none: it hung for 60 s", p.stderr.read()
            if code != 0 or "terminate called" in err:
                bad.append(f"{kind}: exit code {code}\n{err[-1500:]}")
    assert not bad, "\n".join(bad)


def test_the_exit_wait_sees_gloo_workers_and_returns_once_they_are_idle():
    # The wait at exit finds gloo's worker threads by the name PyTorch gives them: if a torch
    # release renamed them, the wait would silently find nothing, and this says so.
    code = (
        "import os, time, torch, torch.distributed as dist\n"
        "from dptrain.runtime import exit as _exit, torch_version as _torch_version\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "dist.all_reduce(torch.ones(8))\n"
        "t = time.monotonic(); ok = _exit.settle_gloo_workers(); took = time.monotonic() - t\n"
        "workers = _exit._gloo_workers(_torch_version.older_than(_exit._NAMED_FROM))\n"
        "print(len(workers), ok, sorted({s for s, _ in workers.values()}), round(took, 3))\n"
        "dist.destroy_process_group()\n"
    )
    from dptrain.launcher.rendezvous import free_port

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PORT=str(free_port())))
    assert out.returncode == 0, out.stderr[-2000:]
    count, ok, states, took = out.stdout.splitlines()[-1].split(maxsplit=3)  # torch 2.8's gloo prints a line first
    # From torch 2.11 on by their name, pt_gloo_runloop; before, as the threads Python did not start.
    assert int(count) >= 1, f"no gloo worker thread found in a process with a gloo group: {out.stdout}"
    assert ok == "True" and states == "['S']", out.stdout
    assert float(took) < 1.0, out.stdout



def _settled_at_shutdown(rank):
    import torch
    import torch.distributed as dist

    import dptrain
    from dptrain.runtime import exit as _exit

    dist.all_reduce(torch.ones(4))
    calls, real = [], _exit.settle_gloo_workers
    _exit.settle_gloo_workers = lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    try:
        dptrain.shutdown()
    finally:
        _exit.settle_gloo_workers = real
    return calls


def test_shutdown_waits_for_the_gloo_workers_on_every_torch():
    # The group object outlives destroy_process_group while PyTorch's DDP or a cycle holds it;
    # its destructor, run later under the GIL (a model dropped, a garbage collection), joins
    # workers that may still need the GIL to let go of the last collective: a hang (a pooled
    # rank of test_ddp_mixed_precision, in the collection after shutdown). Workers seen idle
    # before the destroy need it no more (dptrain.runtime.exit).
    from tests._dist import run_ranks

    assert run_ranks(_settled_at_shutdown, 2) == [[True], [True]]
