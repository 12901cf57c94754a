"""Soak test of elastic restarts: SIGKILL a rank at many random points, count bitwise recoveries.

Each trial runs tests/scripts/train_resilient.py on 2 ranks under
`dptrain run --max-restarts 1`, kills one rank (SIGKILL) at a random batch of the first
attempt, and compares the final weights with an uninterrupted run.

    .venv/bin/python benchmarks/soak.py --trials 20 [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_resilient.py")
BATCHES_PER_RANK = 15  # 80 samples / 2 ranks / batch 8 = 5 per epoch, 3 epochs


def run_job(ckpt_dir, *extra, restarts=0, timeout=180) -> subprocess.CompletedProcess:
    """Run the resilient training job once; return the launcher's completed process."""
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           SCRIPT, "--ckpt", str(ckpt_dir), *map(str, extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def digests(stdout: str) -> set[str]:
    """The weight digests the ranks printed."""
    return {line.rsplit("digest ", 1)[1] for line in stdout.splitlines() if " digest " in line}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_job(os.path.join(tmp, "reference"))
        if ref.returncode != 0:
            print(ref.stderr)
            return 1
        (reference,) = digests(ref.stdout)
        ok = 0
        t0 = time.monotonic()
        for i in range(args.trials):
            rank, at = rng.randrange(2), rng.randint(1, BATCHES_PER_RANK)
            out = run_job(os.path.join(tmp, f"trial{i}"), "--kill-rank", rank, "--kill-at", at, restarts=1)
            good = out.returncode == 0 and digests(out.stdout) == {reference}
            ok += good
            print(f"trial {i:2d}: SIGKILL rank {rank} at batch {at:2d}: {'recovered bitwise' if good else 'FAILED'}",
                  flush=True)
            if not good:
                print(out.stderr[-2000:])
        print(f"{ok}/{args.trials} runs recovered bitwise (seed {args.seed}, {time.monotonic() - t0:.0f}s)")
    return 0 if ok == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
