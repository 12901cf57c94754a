"""What a DiLoCo round snapshot costs: its size, the time to write it, and that time per inner step.

Under ``--recovery in-place`` a DiLoCo Trainer writes, once a round, a snapshot of everything a
resume from there needs (see [Note: DiLoCo, recovered in place] in ``dptrain/train/rollback.py``).
This builds a Trainer with ``strategy="diloco"`` and AdamW on an MLP (one process: the write is
per rank and involves no other rank), takes a few steps so the inner optimizer and the outer
momentum hold state, then times ``RoundSnapshots.write`` into a folder in ``/dev/shm`` (where the
launcher keeps its own) and an inner step, and reports the median of each and the write's share
of a step at a few values of ``sync_every``.

    python benchmarks/diloco_snapshot.py                 # 6 layers of 2048x2048: 25.2M parameters
    python benchmarks/diloco_snapshot.py --layers 2 --width 1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import types

import torch
from torch import nn

import dptrain
from dptrain.train import rollback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * 4, args.width), torch.randn(args.batch * 4, args.width))
    config = dptrain.TrainerConfig(strategy="diloco", diloco_kwargs={"sync_every": 2}, batch_size=args.batch,
                                   verbose=False)
    trainer = dptrain.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data, nn.MSELoss(), config)
    trainer.fit(1)  # 4 steps: AdamW's moments and the outer momentum exist
    folder = tempfile.mkdtemp(prefix="diloco_snapshot_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        recovery = types.SimpleNamespace(trainer=trainer, directory=folder, loader_state=None)
        snapshots = rollback.RoundSnapshots(recovery)
        own = {"rng": trainer.state.rng_state(), "loss_sum": torch.zeros((), dtype=torch.float64), "sample_count": 0}
        writes = []
        for seq in range(args.repeats):
            started = time.perf_counter()
            snapshots.write(seq, own)
            writes.append(time.perf_counter() - started)
        x, y = data.tensors[0][: args.batch], data.tensors[1][: args.batch]
        steps = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            nn.functional.mse_loss(trainer.model(x), y).backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            steps.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    write, step = statistics.median(writes), statistics.median(steps)
    print(f"{params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB in fp32), AdamW: a round snapshot is "
          f"{snapshots.bytes / 2**20:.0f} MiB, written in {write * 1e3:.0f} ms (median of {args.repeats}); an inner "
          f"step at batch {args.batch} takes {step * 1e3:.0f} ms")
    for every in (50, 500):
        print(f"  sync_every={every}: {write / every * 1e3:.2f} ms per step, {100 * write / every / step:.2f}% of a step")


if __name__ == "__main__":
    main()
