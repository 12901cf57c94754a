"""Where the time goes in one in-place recovery: the survivors' and the replacement's timelines.

Runs ``benchmarks/recovery_job.py`` once under ``dptrain run --recovery in-place`` (with
``--spares 1`` unless ``--no-spare``) with one kill, and prints, from the moment of the kill,
when each watched function of the recovery was entered (``>``) and left (``<``) on every
process that did something after it, then when every rank finished each step. The functions
are timed by ``benchmarks/timeline/sitecustomize.py`` (see there); dptrain itself is unchanged.

    .venv/bin/python benchmarks/recovery_timeline.py --kill 1:forward:30
    .venv/bin/python benchmarks/recovery_timeline.py --kill 1:forward:30 -- --width 1280 --depth 3 --batch 64

Arguments after ``--`` go to the job (see ``benchmarks/recovery_job.py``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _events(path: str) -> list[tuple[float, str]]:
    out = []
    with open(path) as fh:
        for line in fh:
            stamp, _, what = line.rstrip("\n").partition(" ")
            out.append((float(stamp), what))
    return out


def main() -> int:
    argv = sys.argv[1:]
    job_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kill", default="1:forward:30", help="RANK:PHASE:STEP, as recovery_job.py's --kill")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--no-spare", action="store_true", help="no hot spare: the replacement is forked from the warm template (a new process with DPTRAIN_WARM_TEMPLATE=0)")
    ap.add_argument("--window", type=float, default=0.8, help="seconds after the kill to show (default 0.8)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dptrain-timeline-") as work:
        trace, out = os.path.join(work, "trace"), os.path.join(work, "out")
        env = dict(os.environ, DPTRAIN_TIMELINE_DIR=trace,
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "benchmarks", "timeline"), ROOT,
                                               os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", str(args.nproc), "--max-restarts", "1",
               "--recovery", "in-place"] + ([] if args.no_spare else ["--spares", "1"])
        cmd += [os.path.join(ROOT, "benchmarks", "recovery_job.py"), "--out", out, "--ckpt", os.path.join(work, "ckpt"),
                "--epochs", "1", "--kill", args.kill] + job_args
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        said = [line for line in done.stderr.splitlines() if "recovered in place" in line]
        if done.returncode != 0 or not said:
            print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
            print(f"the job failed (exit {done.returncode}) or did not recover in place", file=sys.stderr)
            return 1
        print(said[0])
        kills = [line.split() for p in glob.glob(os.path.join(out, "proc-*.log")) for line in open(p)
                 if line.startswith("kill ")]
        t_kill = float(kills[0][3])
        steps: dict[int, float] = {}
        for p in glob.glob(os.path.join(out, "proc-*.log")):
            for line in open(p):
                if line.startswith("step "):
                    _, step, stamp = line.split()
                    steps[int(step)] = max(steps.get(int(step), 0.0), float(stamp))
        for path in sorted(glob.glob(os.path.join(trace, "*.log"))):
            shown = [(t - t_kill, what) for t, what in _events(path) if t_kill - 0.005 < t < t_kill + args.window]
            if len(shown) < 4:
                continue
            print(f"\n== pid {os.path.basename(path)[:-4]}")
            for dt, what in shown:
                print(f"{dt:+.3f} {what}")
        print("\n== the job's own log (recovery_job.py: script start, init returned, fit started)")
        for p in sorted(glob.glob(os.path.join(out, "proc-*.log"))):
            name = os.path.basename(p)[len("proc-"):-len(".log")]
            for line in open(p):
                word, _, rest = line.partition(" ")
                stamp = json.loads(rest)["t0"] if word == "start" else float(rest) if word in ("init", "fit") else None
                if stamp is not None and t_kill - 0.005 < stamp < t_kill + args.window:
                    print(f"{stamp - t_kill:+.3f} {name} {word}")
        print("\nevery rank done with step (s after the kill): " + ", ".join(
            f"{s}: {t - t_kill:+.3f}" for s, t in sorted(steps.items()) if t_kill < t < t_kill + args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
