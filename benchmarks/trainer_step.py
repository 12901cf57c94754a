"""The Trainer's step, paired against another commit: what the loop around the model costs.

Times ``Trainer.fit`` steps (after a warm-up) of a small model on 2 ranks (gloo, CPU, one thread
each) for this working tree and for a base commit checked out as a git worktree, alternating the
two, and prints the median milliseconds per step of each and their ratio. Cases:

* ``map``: an MLP on a map-style data set, ``loss_fn`` given (the loop as it was before);
* ``own-loss``: the same model returning its own loss (``loss_fn=None``; this tree only if the
  base lacks it);
* ``stream``: the same samples as a stream (an ``IterableDataset`` without ``__len__``) through
  ``StreamLoader``, whose every step runs one small all-reduce (this tree only).

    python benchmarks/trainer_step.py --base 7f6bcaf --pairs 5

A run prints one line per case and pair, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in each rank of a job, with PYTHONPATH at the tree being measured.
_JOB = r'''
import json, os, sys, time
import torch
from torch import nn
import dptrain

case, steps, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dptrain.init()
torch.set_num_threads(1)
dptrain.seed_everything(0)
n, width = (steps + warm) * 64 * dptrain.world_size(), 256
g = torch.Generator().manual_seed(0)
x, y = torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)


class Own(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))

    def forward(self, x, y=None):
        out = self.net(x)
        return out if y is None else nn.functional.cross_entropy(out, y)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(n):
            yield x[i], y[i]


model = Own()
if case == "map":
    data, loss_fn = dptrain.prepare_dataloader(torch.utils.data.TensorDataset(x, y), 64), nn.CrossEntropyLoss()
elif case == "own-loss":
    data, loss_fn = dptrain.prepare_dataloader(torch.utils.data.TensorDataset(x, y), 64), None
else:
    data, loss_fn = dptrain.prepare_dataloader(Stream(), 64), nn.CrossEntropyLoss()
times = []


class Clock(dptrain.train.Callback):
    def on_step_end(self, trainer, info):
        times.append(time.perf_counter())


trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), data, loss_fn,
                          dptrain.TrainerConfig(verbose=False, progress=False), callbacks=[Clock()])
trainer.fit(max_epochs=1)
per_step = statistics.median(b - a for a, b in zip(times[warm:], times[warm + 1:]))
if dptrain.rank() == 0:
    print("RESULT", json.dumps({"ms": 1000 * per_step}))
dptrain.shutdown()
'''


def measure(tree: str, case: str, steps: int, warm: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as fh:
            fh.write("import statistics\n" + _JOB)
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", script, case, str(steps),
                              str(warm)], capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
        for line in out.stdout.splitlines():
            if "RESULT" in line:
                return json.loads(line.split("RESULT", 1)[1])["ms"]
        raise RuntimeError(f"{case} in {tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to pair against")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warm", type=int, default=10)
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="trainer-step-base-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.base], check=True, capture_output=True)
    try:
        results: dict[tuple[str, str], list[float]] = {}
        for pair in range(args.pairs):
            for case in ("map", "own-loss", "stream"):
                trees = [("base", base), ("head", ROOT)] if pair % 2 == 0 else [("head", ROOT), ("base", base)]
                for name, tree in trees:
                    if name == "base" and case != "map":
                        continue  # the base has no model-computed loss or streams
                    ms = measure(tree, case, args.steps, args.warm)
                    results.setdefault((case, name), []).append(ms)
                    print(f"pair {pair} {case:8s} {name}: {ms:.3f} ms/step", flush=True)
        print("\nmedian ms per step (2 ranks, gloo, 1 thread each):")
        base_map = statistics.median(results[("map", "base")])
        for (case, name), values in sorted(results.items()):
            med = statistics.median(values)
            print(f"  {case:8s} {name}: {med:.3f}  ({med / base_map:.3f}x the base's map step)")
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], capture_output=True)


if __name__ == "__main__":
    main()
