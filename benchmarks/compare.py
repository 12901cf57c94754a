"""Pair the working tree's DDP against a given commit's: the check to run before landing a change
to DDP, the comm layer, the heartbeat or the Trainer's step.

Every benchmark here already pairs dptrain with PyTorch inside the same processes (steps
alternate behind a barrier), so each run yields ratios ours / PyTorch that the machine's load
mostly cancels out of. This program runs those benchmarks once with the working tree's
``dptrain`` and once with the base commit's, alternating (head, base, base, head, ...) over
``--rounds`` rounds, and prints the medians of the ratios for both and their quotient:

- ``resnet``: ResNet-18 (32x32, batch 32/rank) on 2 ranks of one node, SGD, shared memory
  (``benchmarks/ddp_shm.py --only resnet18-sgd``): dptrain DDP / PyTorch DDP;
- ``mlp``: the MLP 8x1024 (batch 64/rank) the same way (``--only mlp-sgd``);
- ``link``: the MLP across two network namespaces joined by a veth pair shaped to
  ``--rate`` (``benchmarks/netlink.py`` + ``benchmarks/compression.py``, needs root and
  iproute2): ``compression="auto"`` / PyTorch DDP fp32.

The base commit is exported with ``git archive`` into a temporary folder and given the
working tree's ``benchmarks/`` (the same benchmark code measures both packages), and each run
imports ``dptrain`` from its tree through ``PYTHONPATH``. Nothing in the repository changes.

    python benchmarks/compare.py --base 6ccac70                       # all three, 3 rounds
    python benchmarks/compare.py --base HEAD~1 --only resnet --rounds 5
    python benchmarks/compare.py --base main --only link --rate 100mbit

Timings go to ``benchmarks/RESULTS.md`` with the command, never into tests. A quotient
head / base above 1 means the working tree is slower than the base relative to PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR = "no DDP: each rank alone (the compute floor)"  # benchmarks/ddp_shm.py's label (not imported: it imports torch)

#: benchmark -> (what it measures, the ratio's key in its JSON)
BENCHES = {
    "resnet": "ResNet-18 on 2 ranks, one node (shared memory): dptrain DDP / PyTorch DDP",
    "mlp": "MLP 8x1024 on 2 ranks, one node (shared memory): dptrain DDP / PyTorch DDP",
    "link": "MLP 8x1024 across a shaped link, 1 rank per node: compression='auto' / PyTorch DDP fp32",
}


def export_commit(commit: str, into: str) -> str:
    """Write ``commit``'s files into ``into`` (``git archive``), with the working tree's benchmarks/."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    shutil.rmtree(os.path.join(into, "benchmarks"), ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "benchmarks"), os.path.join(into, "benchmarks"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.png", "*.json", "timeline"))
    return sha


def _run(tree: str, bench: str, args: argparse.Namespace, out: str) -> tuple[float, float, float | None]:
    """One run of ``bench`` with ``tree``'s dptrain; returns its ratios ours / PyTorch: of the
    median step time, and of the median CPU time per step (all threads of the process: what a
    rank spends on waking, polling and copying shows here even when the machine's load hides it
    in the wall time); and, on one node, the compute floor's step / PyTorch's (the lowest ratio
    any DDP could reach in that run; None over the link)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
    if bench == "link":
        cmd = [sys.executable, "benchmarks/netlink.py", "--rate", args.rate, "--",
               "benchmarks/compression.py", "--variants", "torch,auto", "--steps", str(args.link_steps),
               "--out", out]
    else:
        table = "resnet18-sgd" if bench == "resnet" else "mlp-sgd"
        cmd = [sys.executable, "-m", "benchmarks.ddp_shm", "--only", table, "--out", out]
        if args.steps:
            cmd += ["--steps", str(args.steps)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    if bench == "link":
        sgd = data["sgd"]
        return sgd["auto"]["step_s"] / sgd["torch"]["step_s"], sgd["auto"]["cpu_s"] / sgd["torch"]["cpu_s"], None
    table = data["resnet18-sgd" if bench == "resnet" else "mlp-sgd"]
    ours, ref = table["ours, shared memory"], table["torch DDP"]
    floor = table.get(FLOOR)  # (a base tree's own benchmarks/ before it had one: none)
    return ours["step_s"] / ref["step_s"], ours["cpu_s"] / ref["cpu_s"], floor and floor["step_s"] / ref["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    ap.add_argument("--only", action="append", choices=sorted(BENCHES), help="run only these (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per tree and benchmark (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed ResNet steps per run (MLP twice; ddp_shm's default 10)")
    ap.add_argument("--link-steps", type=int, default=20, help="timed steps per run over the link (default 20)")
    ap.add_argument("--rate", default="1gbit", help="the link's rate, tc syntax (default 1gbit)")
    ap.add_argument("--head-tree", default=None, help="measure this folder's dptrain as the head instead of the "
                    "working tree (e.g. a copy with one change undone, to find what costs)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    benches = args.only or list(BENCHES)
    if "link" in benches:
        sys.path.insert(0, ROOT)
        from benchmarks.netlink import unavailable

        why = unavailable()
        if why:
            ap.error(f"the link benchmark cannot run here ({why}); leave it out with --only resnet --only mlp")
    head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    head_name = args.head_tree or f"working tree ({head_sha}{', with changes' if dirty else ''})"
    with tempfile.TemporaryDirectory(prefix="dptrain-compare-") as tmp:
        base_tree = os.path.join(tmp, "base")
        os.mkdir(base_tree)
        base_sha = export_commit(args.base, base_tree)
        out = os.path.join(tmp, "result.json")
        ratios: dict[str, dict[str, list[float]]] = {b: {"head": [], "base": []} for b in benches}
        cpus: dict[str, dict[str, list[float]]] = {b: {"head": [], "base": []} for b in benches}
        floors: dict[str, list[float]] = {b: [] for b in benches}
        print(f"head: {head_name}; base: {args.base} ({base_sha[:10]}); {args.rounds} round(s); "
              f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
        for r in range(args.rounds):
            for bench in benches:
                # Alternate which tree goes first, so a load that rises or falls over a round
                # does not always land on the same side.
                order = ("head", "base") if r % 2 == 0 else ("base", "head")
                for side in order:
                    t0 = time.monotonic()
                    ratio, cpu, floor = _run(args.head_tree or ROOT if side == "head" else base_tree, bench, args, out)
                    ratios[bench][side].append(ratio)
                    cpus[bench][side].append(cpu)
                    if floor is not None:
                        floors[bench].append(floor)
                    print(f"  round {r + 1} {bench:6s} {side}: {ratio:.3f} (CPU {cpu:.3f}; {time.monotonic() - t0:.0f} s, "
                          f"load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("Ratios ours / PyTorch (medians over the runs; a step is its slowest rank's), and of CPU time per step.\n")
    print("The floor: each rank stepping alone, no gradient exchange, in the same runs (both trees), over PyTorch's DDP.\n")
    print("| benchmark | head | base | head / base | CPU: head | CPU: base | head runs | base runs | floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for bench in benches:
        h, b = ratios[bench]["head"], ratios[bench]["base"]
        mh, mb = statistics.median(h), statistics.median(b)
        ch, cb = statistics.median(cpus[bench]["head"]), statistics.median(cpus[bench]["base"])
        print(f"| {BENCHES[bench]} | {mh:.3f} | {mb:.3f} | {mh / mb:.3f} | {ch:.3f} | {cb:.3f} | "
              f"{', '.join(f'{x:.3f}' for x in h)} | {', '.join(f'{x:.3f}' for x in b)} | "
              f"{f'{statistics.median(floors[bench]):.3f}' if floors[bench] else '-'} |")


if __name__ == "__main__":
    main()
