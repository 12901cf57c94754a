"""``dptrain run --recovery in-place``, the launcher's side (issue 32; dptrain.launcher.inplace, .spare).

The ranks here are fakes that speak the store protocol of in-place recovery themselves (see
[Note: in-place recovery, the launcher's side] in ``dptrain.launcher.inplace``): they write
``recovery/capable/<rank>``, read ``recovery/generation/<g>``, write ``recovery/fallback``, and
kill or stop themselves on cue. They use dptrain's own store client, not torch's TCPStore: the
same wire protocol without a torch import (a second of CPU per process), so that the whole
file runs in seconds. What a Trainer does with a generation is tested with the Trainer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from dptrain.launcher import LaunchConfig
from tests.launcher.test_store import server  # noqa: F401 - the fixture: a store on a free port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: A fake rank. Its plan (JSON, the first argument): ``victim`` (the rank that fails, default
#: 1), ``how`` ("kill": SIGKILL itself; "stall": say in its heartbeat that it is outside any
#: collective while the others wait in one, then SIGSTOP itself), ``die_attempts`` and
#: ``die_gens`` (when it fails: attempt numbers and generations), ``incapable`` (ranks that do
#: not write ``capable``), ``fallback`` (rank 0 writes it, and exits 75, on seeing generation
#: 1 of attempt 0), ``wait_spare`` (the victim fails only once a hot spare has imported torch;
#: its replacement says which spares run (``JOINED``) before it writes ``recovery/done/<g>``),
#: ``kill_template`` (the victim SIGKILLs the launcher's warm template before it dies),
#: ``ballast_gb`` (the victim holds that much memory when it dies), ``capable`` (the value each
#: rank writes, "1" by default; "cuda": a rank that uses a GPU).
#: Every rank but the victim waits for the victim to finish (``test/done``).
FAKE_RANK = r'''
import os, sys, time
STARTED = time.time()
HAD_TORCH = "torch" in sys.modules  # before this script imports anything: a hot spare imported it


def _age():
    """Seconds this process had existed when the script started (from /proc: the kernel's clock)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as fh:
        start = int(fh.read().rsplit(")", 1)[1].split()[19]) / ticks
    with open("/proc/uptime") as fh:
        return float(fh.read().split()[0]) - start


AGE = _age()
import json, resource, signal, stat, threading


def _faults_of_14_mib():
    """Page faults that a new 14 MiB block costs this process (3584 when none of it was touched before)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(14 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


FAULTS = _faults_of_14_mib()

from dptrain.launcher.store_client import StoreClient

plan = json.loads(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
gen = int(os.environ.get("DPTRAIN_GENERATION", "0"))
keys = f"dptrain/attempt{attempt}/dp/"
store = StoreClient(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
victim = plan.get("victim", 1)
if gen:  # the process this one replaces, looked at first thing: still being ended by the kernel, or gone
    from dptrain.runtime import proc as _proc

    OLD = json.loads(store.get(keys + f"recovery/generation/{gen}"))["pid"]
    OLD = {"dying": _proc.dying(OLD), "gone": not os.path.exists(f"/proc/{OLD}")}
PARENT = os.getppid()  # the launcher, or the warm template that forked this process
with open(f"/proc/{PARENT}/cmdline", "rb") as fh:
    FORKED = b"dptrain.launcher.template" in fh.read()
with open(f"/proc/{PARENT}/stat") as fh:
    LAUNCHER = int(fh.read().rsplit(")", 1)[1].split()[1]) if FORKED else PARENT


def say(what, **kw):
    print(what, json.dumps(dict(rank=rank, gen=gen, attempt=attempt, pid=os.getpid(), **kw)), flush=True)


def _processes():
    """{pid: (parent pid, command line)} of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    out[int(name)] = (ppid, fh.read())
            except OSError:
                pass
    return out


def templates():
    """The launcher's warm templates (pids)."""
    return [pid for pid, (ppid, cmd) in _processes().items()
            if ppid == LAUNCHER and b"dptrain.launcher.template" in cmd]


def spares():
    """The launcher's hot spares, started by it or forked by its template (whose other children
    are ranks, which say so in the store): [(pid, imported torch)]."""
    found = []
    procs = _processes()
    forkers = set(templates())
    for pid, (ppid, cmd) in procs.items():
        if ((ppid == LAUNCHER and b"dptrain.launcher.spare" in cmd) or ppid in forkers) \
                and not store.check([keys + f"test/rank_pid/{pid}"]):
            try:
                with open(f"/proc/{pid}/maps") as fh:
                    found.append((pid, "libtorch" in fh.read()))
            except OSError:
                pass
    return found


folder = os.environ.get("DPTRAIN_RECOVERY_DIR")
store.set(keys + f"test/rank_pid/{os.getpid()}", "1")  # a rank, not a spare (see spares)
say("START", t=STARTED, age=AGE, torch=HAD_TORCH, faults=FAULTS, local_rank=int(os.environ["LOCAL_RANK"]), forked=FORKED,
    parent=PARENT, own_session=os.getsid(0) == os.getpid(), stdin=os.path.realpath("/proc/self/fd/0"),
    recovery=os.environ.get("DPTRAIN_RECOVERY"), folder=folder,
    mode=stat.S_IMODE(os.stat(folder).st_mode) if folder else None)
if rank not in plan.get("incapable", []):
    store.set(keys + f"recovery/capable/{rank}", plan.get("capable", "1"))
if gen:
    say("OLD", **OLD)


def heartbeat(op, seq):
    own = StoreClient(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))  # the other waits holding its lock

    def beat():
        while True:  # the same state each time, written anew: the launcher sees no progress, but a live rank
            own.set(keys + f"hb/{rank}", json.dumps({"seq": seq, "op": op, "ticks": 0, "ddp_steps": 0,
                                                        "failed": False, "t": time.time(), "pid": os.getpid()}))
            time.sleep(0.2)
    threading.Thread(target=beat, daemon=True).start()


stalls = plan.get("how") == "stall" and gen == 0
if rank == victim:
    if attempt in plan.get("die_attempts", [0]) and gen in plan.get("die_gens", [0]):
        store.wait([keys + f"recovery/capable/{r}" for r in range(world) if r not in plan.get("incapable", [])])
        if plan.get("kill_template"):
            (pid,) = templates()
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)  # its end is seen by the launcher's next poll
        if plan.get("wait_spare"):
            while not any(warm for _, warm in spares()):
                time.sleep(0.05)
            time.sleep(0.5)  # dptrain.train after torch
        if stalls:
            heartbeat("", 4)
            time.sleep(0.5)
            say("STALLING")
            os.kill(os.getpid(), signal.SIGSTOP)
        ballast = b"x" * (plan.get("ballast_gb", 0) << 30)  # memory the kernel frees after the kill
        say("DYING", t=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    if gen and plan.get("wait_spare"):
        # A replacement: until the recovery is said to be over (rank 0 of a real job writes
        # recovery/done/<g> once the state is restored), no new spare takes the CPU from it.
        time.sleep(1.5)  # more than one tick of the launcher's watch
        say("JOINED", spares=[pid for pid, _ in spares()])
        store.set(keys + f"recovery/done/{gen}", "1")
    say("END")
    store.set(keys + "test/done", "1")
    sys.exit(0)

if plan.get("how") == "stall":
    heartbeat("all_reduce", 5)
if plan.get("fallback") and rank == 0 and attempt == 0:
    store.wait([keys + "recovery/generation/1"])
    store.set(keys + "recovery/fallback", plan["fallback"])
    sys.exit(75)
store.wait([keys + "test/done"])
if plan.get("wait_spare"):
    # The spare started in the taken one's place, once the recovery was said to be over (the
    # replacement is a rank now: spares() leaves it out).
    deadline = time.time() + 10
    while not spares() and time.time() < deadline:
        time.sleep(0.05)
generations = []
g = 1
while store.check([keys + f"recovery/generation/{g}"]):
    generations.append(json.loads(store.get(keys + f"recovery/generation/{g}")))
    g += 1
say("END", generations=generations, spares=[pid for pid, _ in spares()])
'''

_LINE = re.compile(r"^\[rank(\d+)\] (START|END|DYING|STALLING|JOINED|OLD) (\{.*\})$")


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_rank.py"
    path.write_text(FAKE_RANK)
    return str(path)


def dptrain_run(*args, timeout=30, env=None):
    """``dptrain run ARGS`` as a subprocess, killed after ``timeout`` seconds (then the test fails).

    Without the warm template unless ``env`` asks for it: a template imports torch, seconds of
    CPU that the launcher's protocol, tested here with fakes, does not need."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", DPTRAIN_WARM_TEMPLATE="0")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dptrain", "run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=full_env)


def events(stdout: str) -> list[tuple[str, dict]]:
    """What the fake ranks said, in order: (word, fields)."""
    out = []
    for line in stdout.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((m.group(2), json.loads(m.group(3))))
    return out


def said(evts, word, **match) -> list[dict]:
    return [e for w, e in evts if w == word and all(e.get(k) == v for k, v in match.items())]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _replacement_line(stderr: str) -> re.Match:
    m = re.search(r"dptrain run: rank 1 \(local rank 1, pid (\d+)\) (.*?); in-place recovery: replacement pid (\d+)"
                  r"( \(a hot spare\))? joins generation (\d+) "
                  r"\(restart (\d+) of (\d+)\); the other ranks keep running"
                  r"( \(the replacement is forked from the warm template\))?\n",
                  stderr)
    assert m, stderr
    return m


# -- a rank dies: replaced, the others keep running ---------------------------------------------
def test_a_killed_rank_is_replaced_and_the_others_keep_running(fake):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "3", fake, "{}")
    assert out.returncode == 0, out.stderr
    evts = events(out.stdout)
    # Rank 0: started once, ended in the same process.
    (start0,), (end0,) = said(evts, "START", rank=0), said(evts, "END", rank=0)
    assert start0["pid"] == end0["pid"] and start0["gen"] == 0
    # Rank 1: the job's process died; the replacement is a new process for the same rank, generation 1.
    first, second = said(evts, "START", rank=1)
    assert (first["gen"], second["gen"]) == (0, 1) and first["pid"] != second["pid"]
    assert second["local_rank"] == 1 and second["attempt"] == 0  # RANK, LOCAL_RANK, the attempt: unchanged
    line = _replacement_line(out.stderr)
    assert int(line[1]) == first["pid"] and int(line[3]) == second["pid"]
    assert line[2].startswith("was killed by SIGKILL") and line[4] is None and line[8] is None
    assert (line[5], line[6], line[7]) == ("1", "1", "3")
    assert "restarting all ranks" not in out.stderr and "stopping" not in out.stderr
    # The generation the survivors read: which rank, why, its old pid, no spare.
    (entry,) = end0["generations"]
    assert (entry["rank"], entry["pid"], entry["spare"]) == (1, first["pid"], False)
    assert entry["why"].startswith("was killed by SIGKILL") and entry["time"] <= second["t"]
    # The ranks' settings; the recovery folder is private, in memory where it can be, and gone after the job.
    assert start0["recovery"] == second["recovery"] == "in-place"
    folder = start0["folder"]
    assert folder == second["folder"] and start0["mode"] == 0o700
    assert folder.startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
    assert not os.path.exists(folder)


@pytest.mark.parametrize("capable", ["1", "cuda"])
def test_the_replacement_starts_while_the_kernel_still_ends_the_dead_rank_unless_it_used_a_gpu(fake, capable):
    # 4 GiB take the kernel half a second to free after the SIGKILL (0.25 s for 2 GiB, which a busy
    # machine's fresh interpreter once needed all of); a replacement (a new interpreter, no torch)
    # looks at the old process in a tenth of that. A GPU's memory is freed only at the very end.
    plan = json.dumps({"ballast_gb": 4, "capable": capable})
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1", fake, plan, timeout=60)
    assert out.returncode == 0, out.stderr
    (old,) = said(events(out.stdout), "OLD", rank=1)
    if capable == "cuda":
        assert old == {**old, "dying": None, "gone": True}  # waited for
    else:
        assert old == {**old, "dying": -signal.SIGKILL, "gone": False}  # seen dying, not waited for
    line = _replacement_line(out.stderr)
    assert line[2].startswith("was killed by SIGKILL"), line[2]


def test_restarts_count_replacements_and_a_death_past_them_ends_the_job_as_usual(fake):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1", fake,
                      json.dumps({"die_gens": [0, 1]}))
    assert out.returncode == 1, out.stderr
    evts = events(out.stdout)
    assert len(said(evts, "START", rank=0)) == 1 and not said(evts, "END", rank=0)  # stopped, never restarted
    line = _replacement_line(out.stderr)
    assert (line[5], line[6], line[7]) == ("1", "1", "1")
    second = said(evts, "START", rank=1, gen=1)[0]["pid"]
    assert (f"dptrain run: rank 1 (local rank 1, pid {second}) was killed by SIGKILL" in out.stderr
            and "; stopping the other 1 rank(s) of this node" in out.stderr)
    assert "giving up after 1 restart(s)" in out.stderr and "restarting all ranks" not in out.stderr


# -- where in-place recovery cannot work: the whole job restarts, and says why once ---------------
def test_ranks_that_did_not_say_they_can_recover_get_a_restart_of_all_said_once(fake):
    plan = {"incapable": [1], "die_attempts": [0, 1]}
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "2", fake, json.dumps(plan))
    assert out.returncode == 0, out.stderr
    why = ("dptrain run: in-place recovery needs every rank to train with dptrain.Trainer or dptrain.RecoverableLoop "
           "on dptrain's DDP (rank(s) 1 did not say they can; a Trainer that cannot says why when it starts); "
           "restarting all ranks instead")
    assert out.stderr.count(why) == 1, out.stderr
    assert "restarting all ranks (restart 1 of 2)" in out.stderr and "restarting all ranks (restart 2 of 2)" in out.stderr
    assert "in-place recovery: replacement" not in out.stderr
    assert [e["attempt"] for e in said(events(out.stdout), "START", rank=0)] == [0, 1, 2]


def test_a_rank_that_writes_fallback_gets_a_restart_of_all(fake):
    plan = {"fallback": "strategy 'fsdp' cannot recover in place"}
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "3", fake, json.dumps(plan))
    assert out.returncode == 0, out.stderr
    line = _replacement_line(out.stderr)  # first replaced in place; then rank 0 said it cannot go on
    assert line[6] == "1"
    assert "rank 0 (local rank 0, pid" in out.stderr and "exited with code 75" in out.stderr
    why = ("dptrain run: a rank cannot recover in place (strategy 'fsdp' cannot recover in place); restarting all "
           "ranks instead")
    assert out.stderr.count(why) == 1, out.stderr
    assert "restarting all ranks (restart 2 of 3)" in out.stderr  # the replacement was restart 1
    evts = events(out.stdout)
    assert said(evts, "END", rank=0, attempt=1) and said(evts, "END", rank=1, attempt=1)


# -- hot spares -------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["0", "1"], ids=["interpreter", "forked"])
def test_a_hot_spare_becomes_the_replacement(fake, template):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "2", "--spares", "1",
                      fake, json.dumps({"wait_spare": True}), env={"DPTRAIN_WARM_TEMPLATE": template})
    assert out.returncode == 0, out.stderr
    evts = events(out.stdout)
    (died,) = said(evts, "DYING", rank=1)
    replacement = said(evts, "START", rank=1, gen=1)[0]
    line = _replacement_line(out.stderr)
    assert int(line[3]) == replacement["pid"] and line[4] == " (a hot spare)"
    # The spare had imported torch and was running before the rank died; the script got its argv and env.
    assert replacement["torch"] is True and replacement["local_rank"] == 1
    # Forked from the template (one import for every spare) or an interpreter of its own.
    assert replacement["forked"] is (template == "1")
    assert replacement["own_session"] and replacement["stdin"] == os.devnull
    # Its C library held memory already touched: a new 14 MiB block took few fresh pages (3584 in all).
    assert replacement["faults"] < 3584 // 4, replacement
    gap = replacement["t"] - died["t"]
    assert replacement["age"] > gap  # it existed before the rank died; how fast it took over is the benchmark's
    (end0,) = said(evts, "END", rank=0)
    assert end0["generations"][0]["spare"] is True
    # A new spare was started in its place, and is gone with the job; not before the recovery was
    # over: while the replacement joined, there was none.
    (joined,) = said(evts, "JOINED", rank=1)
    assert joined["spares"] == [], joined
    fresh = end0["spares"]
    assert len(fresh) == 1 and replacement["pid"] not in fresh, end0
    assert not _alive(fresh[0]) and not _alive(replacement["pid"])


# -- the warm template ------------------------------------------------------------------------------
def test_without_a_spare_the_replacement_is_forked_from_the_warm_template(fake):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "3", fake, "{}",
                      env={"DPTRAIN_WARM_TEMPLATE": "1"})
    assert out.returncode == 0, out.stderr  # the replacement's exit code 0 came back through the template
    evts = events(out.stdout)
    first, second = said(evts, "START", rank=1)
    (start0,) = said(evts, "START", rank=0)
    # The job's own ranks and the replacement are children of the template (one import of torch
    # for the node): torch imported before the script ran, a session of their own (the launcher
    # stops a rank and its workers with killpg), stdin /dev/null, their own output.
    for started in (start0, first, second):
        assert started["forked"] and started["torch"] and started["own_session"], started
        assert started["stdin"] == os.devnull and started["parent"] == start0["parent"], started
    assert second["local_rank"] == 1 and second["gen"] == 1 and second["pid"] != first["pid"]
    line = _replacement_line(out.stderr)
    assert int(line[3]) == second["pid"] and line[4] is None
    assert line[8] == " (the replacement is forked from the warm template)"
    (end0,) = said(evts, "END", rank=0)
    (entry,) = end0["generations"]
    assert (entry["spare"], entry["forked"]) == (False, True)
    assert not _alive(second["parent"])  # the template is gone with the job
    assert "warm template" not in out.stderr.replace(line[0], "")  # nothing else said about it


def test_a_forked_replacements_death_is_seen_and_counted_as_any_ranks(fake):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1", fake,
                      json.dumps({"die_gens": [0, 1]}), env={"DPTRAIN_WARM_TEMPLATE": "1"})
    assert out.returncode == 1, out.stderr
    evts = events(out.stdout)
    second = said(evts, "START", rank=1, gen=1)[0]
    assert second["forked"]
    assert (f"dptrain run: rank 1 (local rank 1, pid {second['pid']}) was killed by SIGKILL" in out.stderr
            and "giving up after 1 restart(s)" in out.stderr), out.stderr


def test_a_dead_template_leaves_replacements_to_new_interpreters(fake):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "3", fake,
                      json.dumps({"kill_template": True}), env={"DPTRAIN_WARM_TEMPLATE": "1"})
    assert out.returncode == 0, out.stderr
    evts = events(out.stdout)
    second = said(evts, "START", rank=1, gen=1)[0]
    assert not second["forked"] and not second["torch"]
    assert re.search(r"dptrain run: the warm template \(pid \d+\) exited with code -9; ranks and replacements "
                     r"start as new processes from now on", out.stderr), out.stderr
    # Rank 0, forked from the template, outlived it (the launcher adopted it) and its exit code 0 came back.
    (start0,), (end0,) = said(evts, "START", rank=0), said(evts, "END", rank=0)
    assert start0["forked"] and start0["pid"] == end0["pid"]
    assert "forked from the warm template" not in out.stderr


def test_a_template_that_cannot_fork_leaves_the_ranks_to_new_interpreters(fake, tmp_path):
    # As where importing torch loads the CUDA driver: the template ends before forking anything.
    # The job's ranks, waiting for it, start as new interpreters, and the launcher says why once.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif b'dptrain.launcher.template' in open('/proc/self/cmdline', 'rb').read():\n"
        "    os.write(2, b'cannot fork here\\n')\n    os._exit(3)\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "3", fake, "{}",
                      env={"DPTRAIN_WARM_TEMPLATE": "1", "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr
    evts = events(out.stdout)
    assert [e["forked"] for e in said(evts, "START")] == [False, False, False], evts  # ranks 0, 1, the replacement
    assert out.stderr.count("dptrain run: the warm template") == 1, out.stderr
    assert re.search(r"dptrain run: the warm template \(pid \d+\) exited with code 3: cannot fork here; ranks and "
                     r"replacements start as new processes from now on", out.stderr), out.stderr


# -- a stalled rank --------------------------------------------------------------------------------
def test_a_stalled_rank_is_ended_after_the_timeout_and_replaced(fake):
    out = dptrain_run("--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "2", "--timeout", "2",
                      fake, json.dumps({"how": "stall"}))
    assert out.returncode == 0, out.stderr
    evts = events(out.stdout)
    stalled = said(evts, "START", rank=1, gen=0)[0]["pid"]
    assert said(evts, "STALLING", rank=1) and not said(evts, "DYING", rank=1)
    assert re.search(rf"dptrain run: rank 1 \(local rank 1, pid {stalled}\) made no progress for \d+s \(outside any "
                     r"collective after #4, 0 steps\) while rank 0 waited in all_reduce #5, longer than the 2s "
                     r"collective timeout; ending it", out.stderr), out.stderr
    line = _replacement_line(out.stderr)
    assert int(line[1]) == stalled and line[2].startswith("stalled: it made no progress")
    (start0,), (end0,) = said(evts, "START", rank=0), said(evts, "END", rank=0)
    assert start0["pid"] == end0["pid"]
    assert end0["generations"][0]["why"].startswith("stalled: ")
    assert not _alive(stalled)


# -- what is refused, and what restart mode leaves as it was ----------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"recovery": "inplace"}, "--recovery 'inplace': choose restart"),
    ({"recovery": "in-place"}, "add e.g. --max-restarts 3"),
    ({"spares": 1, "max_restarts": 2}, "only in-place recovery does; add --recovery in-place"),
    ({"spares": -1, "recovery": "in-place", "max_restarts": 2}, "--spares must be >= 0, got -1"),
])
def test_launch_config_refuses_what_cannot_work(fake, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LaunchConfig(program=fake, **kwargs)
    LaunchConfig(program=fake, recovery="in-place", max_restarts=1, spares=2)


def test_dptrain_run_refuses_a_bad_recovery_and_spares_without_it(fake):
    out = dptrain_run("--recovery", "sometimes", fake)
    assert out.returncode == 2 and "argument --recovery: invalid choice: 'sometimes'" in out.stderr
    out = dptrain_run("--spares", "1", "--max-restarts", "1", fake)
    assert out.returncode == 2 and out.stderr.startswith("dptrain run: error: --spares 1 keeps processes ready")


def test_restart_mode_gives_the_ranks_no_recovery_settings(tmp_path):
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(sorted(k for k in os.environ if k.startswith('DPTRAIN_RECOVERY') "
                      "or k == 'DPTRAIN_GENERATION'))\n")
    inherited = {"DPTRAIN_RECOVERY": "in-place", "DPTRAIN_RECOVERY_DIR": str(tmp_path), "DPTRAIN_GENERATION": "2"}
    out = dptrain_run("--nproc-per-node", "2", "--max-restarts", "1", str(script), env=inherited)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("] []") == 2, out.stdout


# -- when a rank counts as stalled: the rule, on a clock of our own --------------------------------
class _Stalls:
    """``InPlaceRecovery._end_stalled`` against a real store, with heartbeats planted by hand and a
    clock that moves one second per call, as the watch calls it (collective timeout 10 s; the
    default heartbeat interval, 2 s: the others' waits are watched from 5 s of stillness on)."""

    def __init__(self, client, monkeypatch, tmp_path):
        from types import SimpleNamespace

        from dptrain.launcher import inplace
        from dptrain.launcher.store_values import Warnings

        monkeypatch.setenv("TMPDIR", str(tmp_path))
        monkeypatch.delenv("DPTRAIN_HEARTBEAT_S", raising=False)
        self.now = 0.0
        monkeypatch.setattr(inplace.time, "monotonic", lambda: self.now)
        self.client, self.lines, self.killed = client, [], []
        job = SimpleNamespace(config=SimpleNamespace(timeout=10.0, spares=0), store=client, log=self.lines.append,
                              janitor=SimpleNamespace(tell=lambda *a: None), warnings=Warnings(self.lines.append),
                              layout=SimpleNamespace(world_size=2))
        self.recovery = inplace.InPlaceRecovery(job)
        self.ranks = [SimpleNamespace(rank=r, local_rank=r, proc=SimpleNamespace(pid=100 + r),
                                      send=lambda sig, r=r: self.killed.append((r, sig))) for r in (0, 1)]

    def beat(self, rank, seq, op="", t=0.0, failed=False, pid=None):
        entry = {"seq": seq, "op": op, "ticks": 0, "ddp_steps": 0, "failed": failed, "t": 1e9 + t,
                 "pid": pid or 100 + rank}
        self.client.set(f"dptrain/attempt0/dp/hb/{rank}", json.dumps(entry))

    def tick(self):
        self.recovery._end_stalled([r for r in self.ranks if r.rank not in dict(self.killed)], 0)
        self.now += 1.0

    def run(self, seconds, rank0, rank1=lambda now: (4, "", 0.0)):
        """Call once a second for ``seconds``: ``rankN(now)`` gives (seq, op, t) of its heartbeat."""
        for _ in range(seconds):
            self.beat(0, *rank0(self.now))
            self.beat(1, *rank1(self.now))
            self.tick()
        return [t for t in self.killed]

    def close(self):
        self.recovery.close()


@pytest.fixture
def stalls(server, monkeypatch, tmp_path):  # noqa: F811 - the store fixture
    from dptrain.launcher.store import StoreClient

    client = StoreClient("127.0.0.1", server.port, timeout=5)
    s = _Stalls(client, monkeypatch, tmp_path)
    yield s
    s.close()
    client.close()


def test_a_rank_still_past_the_timeout_while_another_waits_is_ended(stalls):
    waiting = lambda now: (5, "all_reduce", now)  # noqa: E731 - a live heartbeat, in one collective
    assert stalls.run(10, waiting) == []  # not before the timeout
    assert stalls.run(3, waiting) == [(1, signal.SIGKILL)]
    (line,) = stalls.lines
    assert re.fullmatch(r"dptrain run: rank 1 \(local rank 1, pid 101\) made no progress for 1\ds \(outside any "
                        r"collective after #4, 0 steps\) while rank 0 waited in all_reduce #5, longer than the 10s "
                        r"collective timeout; ending it", line), line
    assert stalls.recovery.ended[101].startswith("stalled: it made no progress for 1")


def test_a_rank_the_others_have_just_begun_to_wait_for_is_left_alone(stalls):
    # Rank 0 works until second 12, then waits: rank 1 has stood still since 0, but rank 0's wait is young.
    late = lambda now: (5, "all_reduce", now) if now >= 12 else (int(now), "", now)  # noqa: E731
    assert stalls.run(16, late) == []
    assert stalls.run(6, late) == [(1, signal.SIGKILL)]


def test_the_last_heartbeat_of_a_rank_that_is_gone_is_no_wait(stalls):
    gone = lambda now: (5, "all_reduce", 0.0)  # noqa: E731 - written once, never again: exited, or stopped beating
    assert stalls.run(30, gone) == []


def test_a_rank_whose_collective_failed_waits_for_the_recovery(stalls):
    failed = lambda now: (5, "", now, True)  # noqa: E731 - outside any collective, its own failed: waiting
    assert stalls.run(13, failed) == [(1, signal.SIGKILL)]
    assert "while rank 0 waited in a collective that failed" in stalls.lines[0]


def test_a_rank_that_is_leaving_or_a_heartbeat_of_another_process_is_no_stall(stalls):
    waiting = lambda now: (5, "all_reduce", now)  # noqa: E731
    stalls.run(2, waiting)
    stalls.client.set("dptrain/attempt0/dp/left/1", json.dumps({"t": 1e9 + 1, "ddp_steps": 0}))  # shutting down
    assert stalls.run(20, waiting) == []
    stalls.client.delete_key("dptrain/attempt0/dp/left/1")
    # The heartbeat is the replaced process's (another pid): the replacement is not judged by it.
    assert stalls.run(20, waiting, rank1=lambda now: (4, "", 0.0, False, 999)) == []


def test_a_rank_stopped_whole_is_ended_whatever_its_last_heartbeat_said(stalls):
    # Rank 1 was stopped (SIGSTOP) just after its last heartbeat said it was inside a collective;
    # the heartbeat never changes again. Rank 0's collective with it failed; it waits for the recovery.
    failed = lambda now: (12, "", now, True)  # noqa: E731
    frozen = lambda now: (5, "DDP buffer broadcast (forward)", 0.0)  # noqa: E731
    assert stalls.run(10, failed, rank1=frozen) == []  # not before the timeout
    assert stalls.run(4, failed, rank1=frozen) == [(1, signal.SIGKILL)]
    assert "rank 1 (local rank 1, pid 101) made no progress" in stalls.lines[0]
    assert "while rank 0 waited in a collective that failed" in stalls.lines[0]


def test_a_rank_in_a_long_collective_whose_heartbeat_goes_on_is_no_stall(stalls):
    # Both wait in the same slow collective and both heartbeats are alive: neither is a stall.
    waiting = lambda now: (5, "all_reduce", now)  # noqa: E731
    assert stalls.run(30, waiting, rank1=waiting) == []


def test_only_a_dead_launchers_recovery_folder_counts_as_orphaned(tmp_path):
    # A test (or a clean-up) that removes a killed job's recovery folder must never take a running
    # job's: a job beside it on the machine lost its folder mid-run ("DPTRAIN_RECOVERY_DIR=... is
    # not a directory that exists" on every restart) when such clean-ups took every new folder.
    from dptrain.launcher.inplace import _make_directory, orphaned_directories

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"dptrain_recovery_{dead.pid}_abc", f"dptrain_recovery_{os.getpid()}_def",
                 "dptrain_recovery_ghi", "dptrain_recovery_x_y_z", "other_1_2"):
        (tmp_path / name).mkdir()
    assert orphaned_directories(str(tmp_path)) == [str(tmp_path / f"dptrain_recovery_{dead.pid}_abc")]
    made = _make_directory()
    try:
        assert os.path.basename(made).startswith(f"dptrain_recovery_{os.getpid()}_")
        assert made not in orphaned_directories(os.path.dirname(made))
    finally:
        os.rmdir(made)
