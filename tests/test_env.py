"""Who am I: parsing launcher variables, and init() from torchrun's, Slurm's or no environment."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import dptrain
from dptrain.runtime.env import World, expand_nodelist, world_from_environ
from dptrain.launcher import free_port
from tests._dist import run_ranks

# Fresh ranks for every call (tests/_dist.py): init is what is tested here: the first join of a
# fresh process.
FRESH_RANKS = True

TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "GROUP_RANK": "1"}


def test_no_launcher_is_a_single_process():
    assert world_from_environ({}) == World()
    w = world_from_environ({"PATH": "/bin"})
    assert (w.rank, w.world_size, w.local_rank, w.is_distributed) == (0, 1, 0, False)


def test_torchrun_variables():
    w = world_from_environ(TORCHRUN)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank) == (2, 4, 0, 2, 1)
    assert (w.master_addr, w.master_port, w.source) == ("10.1.2.3", 29500, "torchrun")


def test_hand_written_environment_without_local_variables():
    w = world_from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "12355"})
    assert (w.local_rank, w.local_world_size) == (1, 2)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"RANK": "abc"}, ["RANK='abc'", "not an integer", "dptrain run"]),
        ({"RANK": "4"}, ["RANK=4", "WORLD_SIZE=4"]),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", ">= 1"]),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT='http'"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "TCP port"]),
        ({"LOCAL_RANK": "5"}, ["LOCAL_RANK=5", "LOCAL_WORLD_SIZE=2"]),
        ({"RANK": None}, ["RANK is not set"]),
        ({"MASTER_ADDR": None}, ["MASTER_ADDR is not set"]),
    ],
)
def test_malformed_torchrun_variables_name_the_variable_and_fix(change, words):
    env = dict(TORCHRUN)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ValueError) as info:
        world_from_environ(env)
    for w in words:
        assert w in str(info.value)


def test_local_rank_alone_is_an_error():
    with pytest.raises(ValueError, match="LOCAL_RANK='0' is set but RANK and WORLD_SIZE are not"):
        world_from_environ({"LOCAL_RANK": "0"})


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu[07-08],cpu1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "4242"}


def test_slurm_variables():
    w = world_from_environ(SLURM)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank) == (5, 8, 1, 4, 1)
    assert w.master_addr == "gpu07" and w.source == "slurm"
    assert w.master_port == 15000 + 4242 % 20000
    assert world_from_environ({**SLURM, "MASTER_PORT": "1234", "MASTER_ADDR": "head"}).master_port == 1234


def test_torchrun_variables_win_over_slurm():
    assert world_from_environ({**SLURM, **TORCHRUN}).source == "torchrun"


def test_slurm_single_task_is_a_single_process():
    assert world_from_environ({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == World()


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu-a100-[3,5]", ["gpu-a100-3", "gpu-a100-5"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node1-2]", "node[a-b]", "node[3-1]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="Slurm node list"):
        expand_nodelist(bad)


def test_init_without_launcher_is_world_of_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert dptrain.rank() == 0 and dptrain.world_size() == 1 and dptrain.is_main_process()
    with dptrain.init() as world:
        assert world.world_size == 1 and not dist.is_initialized()
        assert dptrain.init() is world  # idempotent
        assert dptrain.device().type in ("cpu", "cuda")
    assert not dptrain.is_initialized()


def test_init_rejects_unknown_backend_and_bad_timeout():
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        dptrain.init(backend="tcp")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        dptrain.init(timeout=-1)


def _whoami(rank):
    w = dptrain.get_world()
    return (rank, dptrain.rank(), dptrain.world_size(), dptrain.local_rank(), dist.is_initialized(),
            dist.get_world_size(), w.source, dptrain.is_main_process())


def test_init_from_torchrun_environment():
    out = run_ranks(_whoami, 3)
    assert out == [(r, r, 3, r, True, 3, "torchrun", r == 0) for r in range(3)]


def _torch_ddp_in_a_world_of_one(rank):
    # What benchmarks/gpu_step.py does on one GPU: PyTorch's DDP beside ours, in a world of one.
    torch.manual_seed(0)
    theirs = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    torch.manual_seed(0)
    ours = dptrain.DDP(torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    for model in (theirs, ours):
        model(x).sum().backward()
    return (dist.is_initialized(), dist.get_world_size(), dptrain.get_world().source, ours.reducer is not None,
            torch.equal(theirs.module.weight.grad, ours.module.weight.grad))


def test_a_launchers_world_of_one_has_a_process_group_for_pytorchs_ddp():
    # torchrun --nproc-per-node 1 / dptrain.spawn(fn, 1): the default process group exists, as
    # init_process_group makes it there; our DDP reduces through it as at N ranks.
    assert run_ranks(_torch_ddp_in_a_world_of_one, 1) == [(True, 1, "torchrun", True, True)]


_SLURM_CHILD = r"""
import json, dptrain, torch
from dptrain import comm
w = dptrain.init(timeout=30)
t = torch.tensor([float(w.rank)])
comm.all_reduce(t)
print(json.dumps([w.rank, w.world_size, w.local_rank, w.source, w.master_addr, t.item()]))
dptrain.shutdown()
"""


def test_init_from_slurm_environment_without_torchrun():
    port = free_port()
    procs = []
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    for r in range(2):
        env = dict(base, SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_NODEID="0",
                   SLURM_JOB_NODELIST="localhost", SLURM_TASKS_PER_NODE="2", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _SLURM_CHILD], env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    import json

    rows = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert rows == [[r, 2, r, "slurm", "localhost", 1.0] for r in range(2)]


def test_rank_0_of_a_slurm_job_across_nodes_says_its_store_is_open():
    # srun, one task per rank: rank 0 hosts torch's TCPStore, which nothing can guard (issue 31, point 12).
    across = World(rank=0, world_size=8, local_world_size=4, master_addr="gpu07", master_port=15042, source="slurm")
    said = dptrain.runtime.env._open_store_warning(across)
    assert "gpu07:15042" in said and "without --per-task" in said
    one_node = World(rank=0, world_size=4, local_world_size=4, master_addr="gpu07", master_port=1, source="slurm")
    torchrun = World(rank=0, world_size=8, local_world_size=4, master_addr="a", master_port=1, source="torchrun")
    warning = dptrain.runtime.env._open_store_warning
    assert warning(one_node) is None and warning(torchrun) is None


def _init_alone(extra: dict) -> subprocess.CompletedProcess:
    """One process that runs dptrain.init() in a world where nobody else ever shows up."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "TORCHELASTIC_", "GROUP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    # torch 2.4's client gives up connecting about 1 s before its timeout: 5 s leaves two reports
    env.update(DPTRAIN_WAIT_REPORT_S="1", DPTRAIN_TIMEOUT="5", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(extra)
    return subprocess.run([sys.executable, "-c", "import dptrain; dptrain.init()"], capture_output=True,
                          text=True, timeout=120, env=env)


def test_a_rank_that_cannot_reach_the_master_says_what_it_waits_for():
    out = _init_alone({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_PORT": "9"})  # nothing listens on the discard port
    reports = [line for line in out.stderr.splitlines() if line.startswith("dptrain.init: rank 1 of 2 has waited")]
    assert len(reports) >= 2, out.stderr  # said within the report delay, then again
    assert ("to reach the rendezvous store at 127.0.0.1:9 (MASTER_ADDR:MASTER_PORT): nothing listens there "
            "yet (connection refused)") in reports[0]
    assert out.returncode != 0
    assert "RuntimeError: dptrain.init failed (DistNetworkError" in out.stderr


def test_the_rank_hosting_the_store_leaves_init_after_every_peer_saw_it_complete():
    # A script whose rank 0 ends right after init() takes the store with it: a peer still waiting
    # for "ready/all" then failed init with "Connection reset by peer" (seen in CI, 2 of 300 short
    # jobs under load). The host, last to arrive here, must wait until the slow peer has seen it.
    import datetime
    import threading
    import time

    from dptrain.runtime import join as _join

    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    host = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    seen_at = {}

    class SlowPeer:  # the peer's store: its wait for "ready/all" returns 0.3 s late
        def __init__(self):
            self.store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)

        def add(self, key, n):
            if key == "ready/seen":
                seen_at["peer"] = time.monotonic()
            return self.store.add(key, n)

        def set(self, key, value):
            self.store.set(key, value)

        def wait(self, keys, t):
            self.store.wait(keys, t)
            time.sleep(0.3)

    peer = threading.Thread(target=_join.wait_until_all_ready, args=(SlowPeer(), 2, timeout))
    peer.start()
    while int(host.add("ready", 0)) < 1:  # the peer waits for "ready/all"; the host comes last
        time.sleep(0.01)
    _join.wait_until_all_ready(host, 2, timeout, hosts_store=True)
    host_done = time.monotonic()
    peer.join(timeout=30)
    assert not peer.is_alive()
    assert host_done >= seen_at["peer"]
    assert int(host.add("ready/seen", 0)) == 2  # both counted themselves out


def test_plain_python_under_slurm_names_the_missing_ranks_and_srun():
    out = _init_alone({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                       "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "42"})
    reports = [line for line in out.stderr.splitlines() if line.startswith("dptrain.init: rank 0 of 4 has waited")]
    assert len(reports) >= 2, out.stderr
    assert "1 of 4 ranks have joined (missing: 1, 2, 3)" in reports[0]
    assert "start every task with srun" in reports[0]
    assert out.returncode != 0
    assert "RuntimeError: dptrain.init failed" in out.stderr and "(missing: 1, 2, 3)" in out.stderr.splitlines()[-1]


# ---- a forgotten dptrain.init() under a launcher (issue 30) --------------------------------

# One process, three worlds in turn, each set in os.environ as its launcher would: a world of
# one (everything works without init), `dptrain run` / torchrun's rank 1 of 2, Slurm's rank 3
# of 4. Prints, for every part that shards or communicates, "ok" or the error it raised.
_FORGOT_INIT_CHILD = r"""
import json, os, pickle, torch, dptrain
from dptrain import comm

def attempt(fn):
    try:
        fn()
        return "ok"
    except RuntimeError as exc:
        return str(exc)

data = list(range(10))
tried = {
    "dptrain.DistributedDataParallel": lambda: dptrain.DDP(torch.nn.Linear(2, 2)),
    "dptrain.FullyShardedDataParallel": lambda: dptrain.FSDP(torch.nn.Linear(2, 2)),
    "dptrain.ZeroRedundancyOptimizer": lambda: dptrain.ZeroRedundancyOptimizer(
        torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1),
    "dptrain.DistributedSampler": lambda: dptrain.DistributedSampler(data),
    "dptrain.prepare_dataloader": lambda: dptrain.prepare_dataloader(data, batch_size=2),
    "dptrain.gather_results": lambda: dptrain.gather_results(torch.zeros(2), [0, 1]),
    "dptrain.main_process_first": lambda: dptrain.main_process_first().__enter__(),
    "dptrain.comm.all_reduce": lambda: comm.all_reduce(torch.zeros(1)),
    "dptrain.comm.barrier": lambda: comm.barrier(),
}
os.environ.update(RANK="0", WORLD_SIZE="1")
alone = {name: attempt(fn) for name, fn in tried.items()}
pickled = pickle.dumps(dptrain.DDP(torch.nn.Linear(2, 2)))

os.environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
torchrun = {name: attempt(fn) for name, fn in tried.items()}
torchrun["explicit sampler"] = attempt(lambda: list(dptrain.DistributedSampler(data, num_replicas=2, rank=1)))
torchrun["unpickled DDP"] = attempt(lambda: pickle.loads(pickled))

for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
    del os.environ[name]
os.environ.update(SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_LOCALID="3", SLURM_JOB_NODELIST="localhost",
                  SLURM_JOB_ID="42")
slurm = {"dptrain.comm.broadcast": attempt(lambda: comm.broadcast(torch.zeros(1)))}
print(json.dumps([alone, torchrun, slurm]))
"""


def test_a_forgotten_init_under_a_launcher_is_refused_naming_dptrain_init():
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "TORCHELASTIC_", "GROUP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", _FORGOT_INIT_CHILD], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    alone, torchrun, slurm = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(alone.values()) == {"ok"}, alone  # a world of one needs no init, as before
    fix = ("but no process group is initialized; call dptrain.init() at the start of the script, before building "
           "DDP, FSDP, the sampler or the loader")
    for name in alone:
        assert torchrun[name].startswith(f"{name}: the environment says this is rank 1 of 2 (WORLD_SIZE=2 from "
                                         f"dptrain run / torchrun) {fix}"), torchrun[name]
    assert torchrun["dptrain.DistributedSampler"].endswith("(or pass num_replicas= and rank= explicitly)")
    assert torchrun["explicit sampler"] == "ok"  # as in PyTorch: given rank and world, no group is needed
    assert torchrun["unpickled DDP"].startswith("dptrain.DistributedDataParallel: the environment says this is rank 1")
    assert slurm["dptrain.comm.broadcast"] == (
        f"dptrain.comm.broadcast: the environment says this is rank 3 of 4 (SLURM_NTASKS=4 from srun) {fix}")


@pytest.mark.parametrize("launcher", ["dptrain run", "torchrun"])
def test_init_again_after_shutdown_under_a_launcher_meets_the_peers_second_init(launcher):
    # The launcher's store outlives each process group. A second init used to find the first
    # group's keys there: gloo dialled the peers' closed ports ("Gloo connectFullMesh failed ...
    # Connection refused") or init waited until the timeout (3 of 3 jobs with rank 1 late), and
    # the debug cross-check compared a collective with the first group's collective of that number.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(DPTRAIN_DEBUG="1", DPTRAIN_TIMEOUT="60")  # the debug cross-check counts each init's collectives apart
    start = ([sys.executable, "-m", "dptrain", "run"] if launcher == "dptrain run"
             else [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port())])
    out = subprocess.run(start + ["--nproc-per-node", "2", os.path.join(root, "tests", "scripts", "init_again.py")],
                         capture_output=True, text=True, timeout=180, cwd=root, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    for cycle in range(3):
        total = [3.0 + 20 * cycle] * (2 + cycle)  # (1 + 10c) + (2 + 10c), in 2 + c elements
        for rank in (0, 1):
            assert f"cycle {cycle} rank {rank} of 2: {total} grad {[total]}" in out.stdout, out.stdout


def test_a_peer_stalled_in_a_second_init_is_not_named_as_one_that_shut_down():
    # After init -> shutdown -> init, the note each rank wrote as it left the first job
    # (left/<rank>) stayed in the store the jobs share: a collective that failed in the second job
    # named rank 1, which was alive and stalled, as "shut down 2s ago (it returned or called
    # dptrain.shutdown())" instead of as the rank that did not arrive.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(DPTRAIN_TIMEOUT="4", STALL_S="30")
    out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2",
                          os.path.join(root, "tests", "scripts", "init_again_stall.py")],
                         capture_output=True, text=True, timeout=120, cwd=root, env=env)
    told = next((line for line in out.stdout.splitlines() if "rank 0 was told:" in line), None)
    assert told is not None, out.stdout + out.stderr[-3000:]
    assert "shut down" not in told and "rank 1 did not arrive" in told, told


def test_dptrain_run_of_a_script_without_init_fails_naming_dptrain_init():
    # Issue 30: this job used to exit 0, its two ranks holding different weights.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2",
                          os.path.join(root, "tests", "scripts", "forgot_init.py")],
                         capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "weight sum" not in out.stdout
    # whichever rank fails first is reported; the launcher may stop the other before it prints
    assert re.search(r"RuntimeError: dptrain\.DistributedDataParallel: the environment says this is rank [01] of 2 "
                     r"\(WORLD_SIZE=2 from dptrain run / torchrun\) but no process group is initialized; "
                     r"call dptrain\.init\(\)", out.stderr), out.stderr
