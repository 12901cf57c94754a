"""Time lost per failure: one rank SIGKILLed in a Trainer job, recovered five ways, paired.

Each round draws (``--seed``) one failure -- a victim rank, an optimizer step, and a phase
among forward / all_reduce / optimizer -- and runs ``benchmarks/recovery_job.py`` (an MLP of
about 3.6 M parameters on CPU, gloo, ``--nproc`` ranks, a checkpoint every ``--every`` steps,
``--epochs`` epochs of ``--steps`` steps) once per variant, in alternating order (forward on
even rounds, backward on odd ones):

    u   uninterrupted, ``dptrain run``                    (baseline of b, c, d)
    ut  uninterrupted, ``torchrun --standalone``          (baseline of a)
    a   ``torchrun --max-restarts 1``: all ranks restarted, the Trainer resumes from its newest
        checkpoint (TORCHELASTIC_RESTART_COUNT > 0)
    b   ``dptrain run --max-restarts 1`` (restart-and-resume, the default ``--recovery restart``)
    c   ``dptrain run --max-restarts 1 --recovery in-place`` (the replacement is forked from the
        warm template, see ``dptrain.launcher.template``)
    cn  the same with ``DPTRAIN_WARM_TEMPLATE=0``: the replacement is a new interpreter
    d   ``dptrain run --max-restarts 1 --recovery in-place --spares 1``
    c0  ``dptrain run --recovery in-place`` with no failure (what in-place costs, or saves, when
        nothing fails: its ranks are forked from the warm template, one import for the node)
    d0  the same with ``--spares 1`` (what a hot spare costs when nothing fails)

c minus c0 and d minus d0 in the same round, printed after the table, are what the failure
itself costs against the uninterrupted run of the same configuration.

The victim kills itself only in its first process (DPTRAIN_GENERATION and
TORCHELASTIC_RESTART_COUNT both 0). Per variant: time lost per failure (the variant's wall
time minus its baseline's in the same round: median, min, max), the time from the kill until
every rank finished the killed step, the time lost in the run (from the last step every rank
had finished before the kill to every rank finishing the second step after it, minus two
median steps of that run: the failure's cost without the seconds by which whole runs of the
same job differ), steps done twice, processes started, bytes read from
checkpoint files (every ``torch.load`` of a file under the checkpoint directory, at the
file's size; goal 0 for c and d), the job's median step time, and whether the final weights
of every rank equal the uninterrupted run's bitwise.

    .venv/bin/python benchmarks/recovery.py --pairs 5 --seed 1
    .venv/bin/python benchmarks/recovery.py --quick          # 1 round, shorter job: a smoke run
    .venv/bin/python benchmarks/recovery.py --pairs 5 --seed 1 --torchft-venv /tmp/torchft-venv   # adds (e)

    e0  torchft, uninterrupted (baseline of e)          \  only with --torchft-venv DIR, a throw-away venv
    e   torchft, one replica group per rank, each under   /   with torch and torchft (see TORCHFT_NOTE); a
        ``torchrun --max-restarts 1``; the replacement heals from a live peer (plain loop, not the Trainer)
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "recovery_job.py")
PHASES = ("forward", "all_reduce", "optimizer")
# (e): the same MLP, optimizer and step count as recovery_job.py in a plain torchft loop (torchft has its own
# Manager, DDP and optimizer wrappers; dptrain.Trainer cannot run under it). One replica group of one process
# per "rank", each under its own `torchrun --max-restarts 1`, min_replica_size = all of them (as in c: the
# survivors wait for the replacement, which heals from a live peer). Each replica trains its own random batches
# (seeded by step and replica), so its weights are compared with its own uninterrupted run (e0), not with u.
# Phases: forward = after optimizer.zero_grad() (quorum started), before forward; all_reduce = in backward, when
# the first layer's gradient is ready (the other buckets' all-reduces are in flight); optimizer = after
# optimizer.step() (the commit).
FT_JOB = r'''import time
T0 = time.time()
import json, os, signal, sys
from datetime import timedelta
import torch
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

out, kill = sys.argv[1], sys.argv[6]
total, batch, width, depth = map(int, sys.argv[2:6])
R, N = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
torch.set_num_threads(1)
os.makedirs(out, exist_ok=True)
LOG = open(os.path.join(out, f"proc-rank{R}-pid{os.getpid()}.log"), "a", buffering=1)
def log(s):
    LOG.write(s + "\n")
log("start " + json.dumps({"rank": R, "pid": os.getpid(), "gen": RESTART, "restart": RESTART, "t0": T0}))
torch.manual_seed(0)
layers, w = [nn.Linear(256, width), nn.ReLU()], width
for _ in range(depth - 1):
    layers += [nn.Linear(w, w), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(w, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

def state_dict():
    return {"model": model.state_dict(), "optim": opt.state_dict()}

def load_state_dict(sd):
    model.load_state_dict(sd["model"]); opt.load_state_dict(sd["optim"])

manager = Manager(pg=ProcessGroupGloo(), min_replica_size=N, load_state_dict=load_state_dict, state_dict=state_dict,
                  replica_id=f"bench_{R}", timeout=timedelta(seconds=30))
ddp = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, opt)
log(f"init {time.time()}")
victim, phase, at = (kill.split(":") if kill != "-" else ("-1", "", "0"))
armed = int(victim) == R and RESTART == 0
at = int(at)

def die():
    log(f"kill {phase} {at} {time.time()}")
    os.kill(os.getpid(), signal.SIGKILL)

if armed and phase == "all_reduce":
    model[0].weight.register_hook(lambda g: die() if manager.current_step() + 1 == at else None)
loss_fn = nn.CrossEntropyLoss()
while manager.current_step() < total:
    step = manager.current_step()
    g = torch.Generator().manual_seed(step * N + R)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    optimizer.zero_grad()
    if armed and phase == "forward" and step + 1 == at:
        die()
    loss = loss_fn(ddp(x), y)
    loss.backward()
    optimizer.step()
    if armed and phase == "optimizer" and step + 1 == at:
        die()
    log(f"step {manager.current_step()} {time.time()}")
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final-rank{R}.pt"))
log(f"done {time.time()}")
LOG.close()
os._exit(0)  # not the Manager's threads' shutdown, which takes seconds: the job is done
'''
TORCHFT_NOTE = (
    "(e) torchft: not run{why}. To run it: python3 -m venv /tmp/torchft-venv && /tmp/torchft-venv/bin/pip install "
    "torch==2.13.0 && /tmp/torchft-venv/bin/pip install torchft==0.2.0 (CPU torch; torchft pulls opentelemetry, no "
    "CUDA), then add --torchft-venv /tmp/torchft-venv.")

VARIANTS = {  # name: (label, launcher, baseline, killed?)
    "u": ("u: uninterrupted, dptrain run", "dptrain", None, False),
    "ut": ("ut: uninterrupted, torchrun", "torchrun", None, False),
    "a": ("a: torchrun --max-restarts 1 + checkpoint resume", "torchrun", "ut", True),
    "b": ("b: dptrain run --max-restarts 1 (restart)", "dptrain", "u", True),
    "c": ("c: dptrain run --recovery in-place", "dptrain", "u", True),
    "cn": ("cn: in-place, DPTRAIN_WARM_TEMPLATE=0", "dptrain", "u", True),
    "d": ("d: in-place --spares 1", "dptrain", "u", True),
    "c0": ("c0: in-place, no failure", "dptrain", "u", False),
    "d0": ("d0: in-place --spares 1, no failure", "dptrain", "u", False),
    "e0": ("e0: uninterrupted, torchft", "torchft", None, False),
    "e": ("e: torchft (replica per rank, heal from a live peer)", "torchft", "e0", True),
}


def command(variant: str, args, out: str, ckpt: str, kill: str | None) -> list[str]:
    py = sys.executable
    if VARIANTS[variant][1] == "torchrun":
        torchrun = os.path.join(os.path.dirname(py), "torchrun")
        launcher = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone",
                    "--nproc-per-node", str(args.nproc), "--max-restarts", "1" if kill else "0"]
    else:
        launcher = [py, "-m", "dptrain", "run", "--nproc-per-node", str(args.nproc),
                    "--max-restarts", "1" if kill or variant in ("c0", "d0") else "0"]  # in-place needs >= 1
        if variant in ("c", "cn", "d", "c0", "d0"):
            launcher += ["--recovery", "in-place"]
        if variant in ("d", "d0"):
            launcher += ["--spares", "1"]
    job = [JOB, "--out", out, "--ckpt", ckpt, "--epochs", str(args.epochs), "--steps", str(args.steps),
           "--every", str(args.every), "--batch", str(args.batch), "--width", str(args.width),
           "--depth", str(args.depth)] + (["--ballast-mb", str(args.ballast_mb)] if args.ballast_mb else [])
    return [*launcher, *job, *(["--kill", kill] if kill else [])]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchft(args, where: str, out: str, kill: str | None) -> tuple[list[str], int | None, str, float]:
    """(e): a lighthouse and one ``torchrun --max-restarts 1`` per replica; (command, rc, output, wall)."""
    venv_bin = os.path.join(args.torchft_venv, "bin")
    job = os.path.join(where, "ft_job.py")
    with open(job, "w") as fh:
        fh.write(FT_JOB)
    port = free_port()
    lighthouse_log = open(os.path.join(where, "lighthouse.txt"), "w")  # kept with the round (--keep)
    lighthouse = subprocess.Popen(
        [os.path.join(venv_bin, "torchft_lighthouse"), "--min_replicas", str(args.nproc), "--quorum_tick_ms", "100",
         "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"],
        stdout=lighthouse_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:  # until it listens
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        cmd = [os.path.join(venv_bin, "torchrun"), "--standalone", "--nproc-per-node", "1", "--max-restarts",
               "1" if kill else "0", job, out, str(args.epochs * args.steps), str(args.batch), str(args.width),
               str(args.depth), kill or "-"]
        t0 = time.time()
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=where,
                                  start_new_session=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "REPLICA_GROUP_ID": str(r),
                                       "NUM_REPLICA_GROUPS": str(args.nproc),
                                       "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"})
                 for r in range(args.nproc)]
        texts, rc = [], 0
        for r, proc in enumerate(procs):
            try:
                text, _ = proc.communicate(timeout=max(1.0, args.timeout - (time.time() - t0)))
                rc = rc or proc.returncode
            except subprocess.TimeoutExpired:
                for q in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(q.pid, signal.SIGKILL)
                text, _ = proc.communicate()
                rc = None
            texts.append(f"[replica {r}]\n{text}")
            if rc is None:
                break
        wall = time.time() - t0
        for proc in procs:  # after a timeout, the ones not waited for yet
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
        lighthouse_log.close()
    return cmd, rc, "\n".join(texts), wall


def run(variant: str, args, where: str, kill: str | None) -> dict:
    """Run one variant in ``where``; return what it measured (``error`` set when it failed)."""
    out, ckpt = os.path.join(where, "out"), os.path.join(where, "ckpt")
    os.makedirs(out)
    if VARIANTS[variant][1] == "torchft":
        cmd, rc, text, wall = run_torchft(args, where, out, kill)
    else:
        cmd = command(variant, args, out, ckpt, kill)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if variant == "cn":
            env["DPTRAIN_WARM_TEMPLATE"] = "0"
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                start_new_session=True)  # its own process group: a timeout ends launcher and ranks
        try:
            text, _ = proc.communicate(timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            rc = None
        wall = time.time() - t0
    with open(os.path.join(where, "output.txt"), "w") as fh:  # the launcher's and ranks' output, for --keep
        fh.write(text)
    res = {"variant": variant, "wall": wall, "rc": rc, "output": text, "cmd": cmd, "out": out, "kill": kill}
    res.update(parse_logs(out, ckpt, args))
    # In-place recovery's own log line (dptrain/train/recovery.py): how long the survivors waited, state transfer.
    waited = re.findall(r"the survivors waited ([\d.]+) s", text)
    moved = re.findall(r"\(([\d.]+) MiB of weights in ([\d.]+) s\)", text)
    res["waited"] = max(map(float, waited)) if waited else None
    res["transfer"] = sum(float(t) for _, t in moved) if moved else None
    res["transfer_mib"] = sum(float(m) for m, _ in moved) if moved else None
    if rc is None:
        res["error"] = f"timed out after {args.timeout} s"
    elif rc != 0:
        res["error"] = f"exit code {rc}"
    elif len(glob.glob(os.path.join(out, "final-rank*.pt"))) != args.nproc:
        res["error"] = "exit code 0 but not every rank saved its final weights"
    return res


def parse_logs(out: str, ckpt: str, args) -> dict:
    """What the job's processes logged: reads, steps, kill, processes (see recovery_job.py)."""
    ckpt = os.path.realpath(ckpt)
    procs, ckpt_bytes, other_bytes, kill_at, kill_t, resumed = [], 0, 0, None, None, []
    steps_per_rank: dict[int, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(out, "proc-rank*-pid*.log"))):
        steps = []
        with open(path) as fh:
            for line in fh:
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "start":
                    head = json.loads(rest)
                    procs.append(head)
                elif kind == "read":
                    file, size = rest.rsplit(" ", 1)
                    if file == ckpt or file.startswith(ckpt + os.sep):
                        ckpt_bytes += int(size)
                    else:
                        other_bytes += int(size)
                elif kind == "step":
                    n, t = rest.split()
                    steps.append((int(n), float(t)))
                elif kind == "kill":
                    _, n, t = rest.split()
                    kill_at, kill_t = int(n), float(t)
                elif kind in ("init", "fit"):
                    procs[-1][kind] = float(rest)
                elif kind == "resumed":
                    file, n = rest.rsplit(" ", 1)
                    if file != "-":
                        resumed.append(int(n))
        steps_per_rank.setdefault(head["rank"], []).extend(steps)
        procs[-1]["diffs"] = [b[1] - a[1] for a, b in zip(steps, steps[1:]) if b[0] == a[0] + 1]
    total = args.epochs * args.steps
    diffs = [d for p in procs for d in p.get("diffs", [])]
    res = {"procs": len(procs), "ckpt_bytes": ckpt_bytes, "other_bytes": other_bytes,
           "step": statistics.median(diffs) if diffs else None, "kill_at": kill_at, "resumed": resumed,
           "redone": max((len(s) - total for s in steps_per_rank.values()), default=None)}
    if kill_t is not None:  # until every rank finished the killed step (or a later one) after the kill
        firsts = [min((t for n, t in s if n >= kill_at and t >= kill_t), default=None) for s in steps_per_rank.values()]
        res["kill_to_step"] = max(firsts) - kill_t if firsts and None not in firsts else None
        res["lost_in_run"] = lost_in_run(steps_per_rank, kill_t, res["step"])
        later = [p for p in procs if p["t0"] >= kill_t]  # replacements / restarted ranks
        for key, what in (("t0", "started"), ("init", "init"), ("fit", "fit")):
            times = [p[key] for p in later if key in p]
            res[f"new_{what}"] = max(times) - kill_t if times else None
    return res


def lost_in_run(steps_per_rank: dict[int, list[tuple[int, float]]], kill_t: float, step: float | None) -> float | None:
    """The failure's cost read off the run itself, free of the seconds by which whole runs differ: from
    the last step every rank had finished before the kill (n) to the first time after the kill that
    every rank had finished step n + 2 (the killed step and the one after it, where a replacement's
    first step shows), minus two median steps. An uninterrupted run takes two median steps there,
    wherever in a step the kill lands. None when the run did not get that far."""
    if not step or not steps_per_rank:
        return None
    ranks = list(steps_per_rank.values())
    common = set.intersection(*({m for m, t in s if t <= kill_t} for s in ranks))
    if not common:
        return None
    n = max(common)
    start = max(max(t for m, t in s if m == n and t <= kill_t) for s in ranks)
    after = [min((t for m, t in s if m == n + 2 and t > kill_t), default=None) for s in ranks]
    if None in after:
        return None
    return max(after) - start - 2 * step


def same_weights(out: str, ref_out: str, nproc: int) -> bool | None:
    """Final weights of every rank bitwise equal to the reference run's (None: one is missing)."""
    import torch

    for r in range(nproc):
        a, b = os.path.join(out, f"final-rank{r}.pt"), os.path.join(ref_out, f"final-rank{r}.pt")
        if not (os.path.exists(a) and os.path.exists(b)):
            return None
        sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        if sa.keys() != sb.keys() or any(
                sa[k].dtype != sb[k].dtype or sa[k].shape != sb[k].shape
                or sa[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                != sb[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k in sa):
            return False
    return True


def in_place_available() -> str | None:
    """None when ``dptrain run`` knows --recovery and --spares, else why not."""
    done = subprocess.run([sys.executable, "-m", "dptrain", "run", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    missing = [flag for flag in ("--recovery", "--spares") if flag not in done.stdout]
    return f"`dptrain run --help` shows no {', '.join(missing)}" if missing else None


def fmt(x, spec=".2f", none="-") -> str:
    return none if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5, help="rounds: one drawn failure, every variant once")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per epoch")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps (save_every_steps)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--ballast-mb", type=int, default=0,
                    help="memory each rank holds besides the model (MiB): a larger process takes the kernel longer to end")
    ap.add_argument("--variants", default="u,ut,a,b,c,d,c0", help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=300, help="seconds one run may take before it is killed")
    ap.add_argument("--quick", action="store_true", help="1 round of a 1-epoch, 20-step job (every 5 steps)")
    ap.add_argument("--keep", help="keep every run's files under this directory")
    ap.add_argument("--torchft-venv", help="a throw-away venv with torch and torchft: adds variants e0 and e")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.epochs, args.steps, args.every = 1, 1, 20, 5
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    why_no_torchft = None
    if args.torchft_venv:
        if not os.path.exists(os.path.join(args.torchft_venv, "bin", "torchft_lighthouse")):
            ap.error(f"--torchft-venv {args.torchft_venv}: no bin/torchft_lighthouse there; install torchft into it")
        variants += [v for v in ("e0", "e") if v not in variants]
    elif any(v in ("e", "e0") for v in variants):
        ap.error("variants e and e0 need --torchft-venv")
    else:
        why_no_torchft = " (no --torchft-venv given)"
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    for v in list(variants):
        base = VARIANTS[v][2]
        if base and base not in variants:
            variants.insert(0, base)
    total = args.epochs * args.steps
    if total < 3:
        ap.error("the job needs at least 3 steps (--epochs x --steps)")
    rng = random.Random(args.seed)
    why_no_inplace = in_place_available()
    print(f"seed {args.seed}; {args.pairs} round(s) x {len(variants)} variants; job: {args.nproc} ranks (gloo, CPU), "
          f"MLP 256-{args.width}x{args.depth}-10, batch {args.batch}/rank, "
          f"{args.epochs} epoch(s) x {args.steps} steps, "
          f"checkpoint every {args.every} steps; load average {os.getloadavg()[0]:.1f}", flush=True)
    if why_no_inplace:
        print(f"note: {why_no_inplace}: variants c, d, c0 will fail until in-place recovery lands", flush=True)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    tmp = args.keep or tempfile.mkdtemp(prefix="dptrain-recovery-")
    os.makedirs(tmp, exist_ok=True)
    t_start = time.monotonic()
    try:
        for i in range(args.pairs):
            victim, at, phase = rng.randrange(args.nproc), rng.randint(2, total - 1), rng.choice(PHASES)
            kill = f"{victim}:{phase}:{at}"
            order = variants if i % 2 == 0 else variants[::-1]
            print(f"round {i}: SIGKILL rank {victim} at step {at}, phase {phase}; order {' '.join(order)}", flush=True)
            round_res = {}
            for v in order:
                res = run(v, args, os.path.join(tmp, f"round{i}", v), kill if VARIANTS[v][3] else None)
                round_res[v] = res
                if res.get("error"):
                    tail = "\n".join(res["output"].strip().splitlines()[-25:])
                    print(f"  {v}: FAILED ({res['error']}) after {res['wall']:.1f} s: {' '.join(res['cmd'])}\n"
                          f"    last lines of its output:\n    " + tail.replace("\n", "\n    "), flush=True)
            for v in order:  # time lost and bitwise, against the baseline of the same round
                res, base = round_res[v], VARIANTS[v][2]
                ref = round_res.get(base) if base else None
                if ref is not None and not ref.get("error") and not res.get("error"):
                    res["lost"] = res["wall"] - ref["wall"]
                ref_name = "e0" if VARIANTS[v][1] == "torchft" else "u"  # torchft's job: its own data
                ref = round_res.get(ref_name)
                res["bitwise"] = (same_weights(res["out"], ref["out"], args.nproc)
                                  if ref is not None and not ref.get("error") and not res.get("error") else None)
                results[v].append(res)
                if not res.get("error"):
                    print(f"  {v:>2}: wall {res['wall']:6.2f} s, lost {fmt(res.get('lost'), '+.2f')} s, kill->step "
                          f"{fmt(res.get('kill_to_step'))} s, redone {res['redone']}, procs {res['procs']}, "
                          f"ckpt read {res['ckpt_bytes'] / 1e6:.1f} MB, "
                          f"step {fmt(res['step'] and res['step'] * 1e3, '.1f')}"
                          f" ms, bitwise {res['bitwise']}", flush=True)
                    if res.get("kill_at") is not None:
                        print(f"      after the kill: new process(es) started +{fmt(res.get('new_started'))} s, "
                              f"init done (dptrain.init, torchft: Manager) +{fmt(res.get('new_init'))} s, fit started "
                              f"+{fmt(res.get('new_fit'))} s, every rank done with step {res['kill_at']} "
                              f"+{fmt(res.get('kill_to_step'))} s; other files read by torch.load "
                              f"{res['other_bytes'] / 1e3:.0f} kB; time lost in the run "
                              f"{fmt(res.get('lost_in_run'), '+.3f')} s", flush=True)
                    if res.get("waited") is not None:
                        print(f"      in-place recovery's log: survivors waited {res['waited']:.2f} s, state transfer "
                              f"{fmt(res.get('transfer'), '.3f')} s ({fmt(res.get('transfer_mib'), '.2f')} MiB)",
                              flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{args.pairs} round(s), seed {args.seed}, {time.monotonic() - t_start:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| variant | ok runs | time lost per failure (wall - baseline), median (min, max) s "
          "| kill -> killed step done on every rank, median (min, max) s "
          "| time lost in the run (two steps from the kill - 2 median steps), median (min, max) s "
          "| steps redone | processes started "
          "| survivors waited / state transfer (in-place log), median s | checkpoint bytes read, median (max) "
          "| other files torch.load read, median | median step (ms) | final weights bitwise = u (e: = e0) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    med_lost, med_k2s, med_run = {}, {}, {}

    def spread(xs: list[float], sign: str = "") -> str:
        return f"{statistics.median(xs):{sign}.2f} ({min(xs):{sign}.2f}, {max(xs):{sign}.2f})" if xs else "-"

    for v in variants:
        rows = results[v]
        ok = [r for r in rows if not r.get("error")]
        lost = [r["lost"] for r in ok if r.get("lost") is not None]
        k2s = [r["kill_to_step"] for r in ok if r.get("kill_to_step") is not None]
        in_run = [r["lost_in_run"] for r in ok if r.get("lost_in_run") is not None]
        red = [r["redone"] for r in ok if r["redone"] is not None]
        steps = [r["step"] for r in ok if r["step"] is not None]
        byts = [r["ckpt_bytes"] for r in ok]
        other = [r["other_bytes"] for r in ok]
        bit = [r["bitwise"] for r in ok]
        waited = [r["waited"] for r in ok if r.get("waited") is not None]
        moved = [r["transfer"] for r in ok if r.get("transfer") is not None]
        med_lost[v] = statistics.median(lost) if lost else None
        med_k2s[v] = statistics.median(k2s) if k2s else None
        med_run[v] = statistics.median(in_run) if in_run else None
        print(f"| {VARIANTS[v][0]} | {len(ok)}/{len(rows)} | {spread(lost, '+') if VARIANTS[v][2] else '-'} "
              f"| {spread(k2s)} | {spread(in_run, '+')} | {fmt(statistics.median(red) if red else None, 'g')} "
              f"| {fmt(statistics.median([r['procs'] for r in ok]) if ok else None, 'g')} "
              f"| {fmt(statistics.median(waited) if waited else None)} / "
              f"{fmt(statistics.median(moved) if moved else None, '.3f')} "
              f"| {fmt(statistics.median(byts) / 1e6 if byts else None, '.1f')} MB "
              f"({fmt(max(byts) / 1e6 if byts else None, '.1f')}) "
              f"| {fmt(statistics.median(other) / 1e3 if other else None, '.0f')} kB "
              f"| {fmt(statistics.median(steps) * 1e3 if steps else None, '.1f')} "
              f"| {sum(b is True for b in bit)}/{len(rows)} |")
    for v in variants:
        for i, r in enumerate(results[v]):
            if r.get("error"):
                print(f"({v} failed in round {i}: {r['error']})")
    step_u = statistics.median([r["step"] for r in results.get("u", []) if not r.get("error") and r["step"]] or [0])

    def ratios(med: dict) -> str:
        b = med.get("b")
        parts = [f"{v}/b = {med[v] / b:.3f}" if med[v] is not None and b else f"{v}/b = n/a"
                 for v in ("c", "cn", "d", "e") if v in med]
        if med.get("a") and b:
            parts.append(f"b/a = {b / med['a']:.3f}")
        return ", ".join(parts) or "n/a"

    print(f"\nratios of medians: time lost per failure {ratios(med_lost)}; kill -> killed step done {ratios(med_k2s)}"
          f"; time lost in the run {ratios(med_run)}"
          + (f" (goal: c, d <= 0.1 x b; d <= 2 steps = {2 * step_u * 1e3:.0f} ms + state transfer)" if step_u else ""))
    transfers = [r["transfer"] for r in results.get("d", []) if not r.get("error") and r.get("transfer") is not None]
    if med_run.get("d") is not None and step_u:
        goal = 2 * step_u + (statistics.median(transfers) if transfers else 0.0)
        print(f"d's time lost in the run: median {med_run['d'] * 1e3:.0f} ms; goal 2 steps + state transfer = "
              f"{goal * 1e3:.0f} ms: {'met' if med_run['d'] <= goal else 'not met'}")
    # The failure's own cost where the uninterrupted run of the same configuration differs from u
    # (the in-place variants fork their ranks from one import per node; a spare is one more process).
    for v, v0 in (("c", "c0"), ("d", "d0")):
        own = [r["lost"] - r0["lost"] for r, r0 in zip(results.get(v, []), results.get(v0, []))
               if not r.get("error") and not r0.get("error") and r.get("lost") is not None
               and r0.get("lost") is not None]
        if own:
            b = med_lost.get("b")
            print(f"{v} - {v0} (the failure's cost against the same configuration's uninterrupted run, same round): "
                  + ", ".join(f"{x:+.2f}" for x in own) + f" s; median {statistics.median(own):+.2f} s"
                  + (f" = {statistics.median(own) / b:.3f} x b" if b else ""))
    if why_no_torchft:
        print(TORCHFT_NOTE.format(why=why_no_torchft))
    return 0 if all(not r.get("error") for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
