"""Soak test of elastic restarts: SIGKILL a rank at many random points, count bitwise recoveries.

Each trial runs tests/scripts/train_resilient.py on 2 ranks under
`dptrain run --max-restarts 1`, kills one rank (SIGKILL) at a random batch of the first
attempt, and checks two things against an uninterrupted run: every rank of the restarted
job resumed from the newest checkpoint completed before the kill (or, killed before the
first one, found none and said so), and the final weights are bitwise equal. The run is
deterministic, so a restart that trained from scratch would also reach the reference
digest: the resume is counted on its own.

    .venv/bin/python benchmarks/soak.py --trials 20 [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_resilient.py")
BATCHES_PER_RANK = 15  # 80 samples / 2 ranks / batch 8 = 5 per epoch, 3 epochs
NO_CHECKPOINT = "resume requested but no checkpoint was found"
_PREFIX = r"^(?:\[rank\d+\] )?"  # the launcher tags each line with its rank


def run_job(ckpt_dir, *extra, restarts=0, timeout=180) -> subprocess.CompletedProcess:
    """Run the resilient training job once; return the launcher's completed process."""
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           SCRIPT, "--ckpt", str(ckpt_dir), *map(str, extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def digests(stdout: str) -> set[str]:
    """The weight digests the ranks printed."""
    return {line.rsplit("digest ", 1)[1] for line in stdout.splitlines() if " digest " in line}


def saves(stdout: str) -> dict[int, str]:
    """The checkpoints rank 0 wrote: {step after which it was written: file name}."""
    return {int(m[2]): m[1] for m in re.finditer(_PREFIX + r"saved (\S+) after step (\d+)$", stdout, re.M)}


def resumes(stdout: str) -> dict[int, str]:
    """What each rank resumed from: {rank: file name}."""
    return {int(m[1]): m[2] for m in re.finditer(_PREFIX + r"rank (\d+) resumed from (\S+)$", stdout, re.M)}


def expected_resume(reference_saves: dict[int, str], kill_at: int) -> str | None:
    """The newest checkpoint complete when a rank dies computing the loss of batch ``kill_at``.

    Steps 1 .. kill_at - 1 are done on every rank, and so is a save that follows one of them
    (a save is collective: rank 0's rename commits it before any rank leaves it); the step
    of batch ``kill_at`` never completes, so no later save exists.
    """
    done = [step for step in reference_saves if step <= kill_at - 1]
    return reference_saves[max(done)] if done else None


def check_trial(out: subprocess.CompletedProcess, reference: str, reference_saves: dict[int, str],
                kill_at: int) -> list[str]:
    """What went wrong in a killed-and-restarted run (an empty list: it recovered bitwise, from the right checkpoint)."""
    wrong = []
    if out.returncode != 0:
        wrong.append(f"exit code {out.returncode}")
    want = expected_resume(reference_saves, kill_at)
    got = resumes(out.stdout)
    if want is None:
        if got or NO_CHECKPOINT not in out.stderr:
            wrong.append(f"killed before the first checkpoint, yet resumed {got} (or no notice of a fresh start)")
    elif got != {0: want, 1: want}:
        wrong.append(f"resumed from {got}, expected {want} on both ranks")
    if digests(out.stdout) != {reference}:
        wrong.append(f"digests {sorted(digests(out.stdout))}, expected {reference}")
    return wrong


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    print(f"seed {args.seed}", flush=True)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_job(os.path.join(tmp, "reference"))
        if ref.returncode != 0:
            print(ref.stderr)
            return 1
        (reference,) = digests(ref.stdout)
        reference_saves = saves(ref.stdout)
        ok = resumed = 0
        t0 = time.monotonic()
        for i in range(args.trials):
            rank, at = rng.randrange(2), rng.randint(1, BATCHES_PER_RANK)
            out = run_job(os.path.join(tmp, f"trial{i}"), "--kill-rank", rank, "--kill-at", at, restarts=1)
            wrong = check_trial(out, reference, reference_saves, at)
            ok += not wrong
            got = resumes(out.stdout)
            resumed += bool(got) and not wrong
            how = f"resumed from {got.get(0)}" if got else "no checkpoint yet, started fresh"
            print(f"trial {i:2d}: SIGKILL rank {rank} at batch {at:2d}: "
                  f"{how + ', recovered bitwise' if not wrong else 'FAILED: ' + '; '.join(wrong)}", flush=True)
            if wrong:
                print(out.stderr[-2000:])
        print(f"{ok}/{args.trials} runs recovered bitwise from the right checkpoint, {resumed} of them by a resume "
              f"(seed {args.seed}, {time.monotonic() - t0:.0f}s)")
    return 0 if ok == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
