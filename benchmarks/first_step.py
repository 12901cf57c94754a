"""Time to the first step: from starting the launcher until every rank has joined the job.

``dptrain run`` against ``torchrun`` on a hello-world script, alternating runs (A B A B ...)
so that a drifting machine affects both alike; the median of each and the ratio of medians.
The script prints, on every rank, the wall time since the launcher started at three points:
the rank's Python started, torch imported, ``dptrain.init()`` returned (the job can take its
first step). The figure is the slowest rank's ``init`` time.

    .venv/bin/python benchmarks/first_step.py --runs 10 --nproc 2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HELLO = """
import os, time
t0 = float(os.environ["FIRST_STEP_T0"])
started = time.time() - t0
import torch
imported = time.time() - t0
import dptrain
dptrain.init()
print(f"FIRST_STEP {started:.3f} {imported:.3f} {time.time() - t0:.3f}", flush=True)
dptrain.shutdown()
"""


def one_run(cmd: list[str], script: str) -> tuple[float, float]:
    """(slowest rank's time to init, whole process wall time) of one launch."""
    t0 = time.time()
    env = {**os.environ, "FIRST_STEP_T0": repr(t0), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, script], capture_output=True, text=True, env=env, timeout=300)
    wall = time.time() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{done.stderr[-2000:]}")
    inits = [float(m.group(3)) for m in re.finditer(r"FIRST_STEP ([\d.]+) ([\d.]+) ([\d.]+)", done.stdout)]
    return max(inits), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    py = sys.executable
    ours = [py, "-m", "dptrain", "run", "--nproc-per-node", str(args.nproc)]
    theirs = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "hello.py")
        with open(script, "w") as fh:
            fh.write(HELLO)
        one_run(ours, script), one_run(theirs, script)  # warm the page cache
        results = {"dptrain run": [], "torchrun": []}
        for i in range(args.runs):
            order = [("dptrain run", ours), ("torchrun", theirs)][:: 1 if i % 2 == 0 else -1]
            for name, cmd in order:
                results[name].append(one_run(cmd, script))
    print(f"{args.runs} alternating runs, {args.nproc} ranks, load average {os.getloadavg()[0]:.1f}")
    print("| launcher | median time to first step (s) | median whole run (s) |")
    print("| --- | --- | --- |")
    med = {}
    for name, rows in results.items():
        med[name] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        print(f"| {name} | {med[name][0]:.2f} | {med[name][1]:.2f} |")
    print(f"ratio dptrain run / torchrun: first step {med['dptrain run'][0] / med['torchrun'][0]:.3f}, "
          f"whole run {med['dptrain run'][1] / med['torchrun'][1]:.3f}")


if __name__ == "__main__":
    main()
