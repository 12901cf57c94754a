"""What the Trainer's per-rank step report costs: step time with ``profile`` on and off.

Two ranks (gloo, one thread each) train one Trainer; its epochs alternate between the
profiler on and off (``config.profile`` is read at every ``fit``), so both see the same
machine. A callback stamps the end of every step; reported are the median step time of each
setting over all its epochs and their ratio. The end-of-run table and plot (written once per
``fit`` here, once per run in real use) are outside the steps and not counted.

    python -m benchmarks.profile_overhead                 # ResNet-18 on 32x32 images, batch 32/rank
    python -m benchmarks.profile_overhead --model mlp     # MLP 8x1024, batch 64/rank (short steps)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import dptrain
from dptrain.train import Callback, Trainer, TrainerConfig


class _Stamps(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, trainer, step) -> None:
        self.times.append(time.perf_counter())


def _setup(name: str):
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 10))
        data = torch.utils.data.TensorDataset(torch.randn(64 * 2 * 12, 1024, generator=g), torch.randint(0, 10, (64 * 2 * 12,), generator=g))
        return model, data, 64
    from benchmarks.ddp_step import ResNet18

    model = ResNet18(num_classes=10)
    data = torch.utils.data.TensorDataset(torch.randn(32 * 2 * 8, 3, 32, 32, generator=g), torch.randint(0, 10, (32 * 2 * 8,), generator=g))
    return model, data, 32


def _rank(rank: int, name: str, rounds: int) -> dict | None:
    dptrain.init()
    torch.manual_seed(0)
    model, data, batch = _setup(name)
    stamps = _Stamps()
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainerConfig(verbose=False, progress=False, profile_dir=out, profile_every_steps=10_000)
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), dptrain.prepare_dataloader(data, batch),
                    nn.functional.cross_entropy, cfg, callbacks=[stamps])
        steps: dict[bool, list[float]] = {True: [], False: []}
        epoch = 0
        for r in range(2 * rounds):
            on = (r % 2 == 0) != (r // 2 % 2 == 0)  # on off off on on off ...: neither always goes first
            t.config.profile = on
            stamps.times.clear()
            epoch += 1
            t.fit(epoch)
            steps[on] += [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    dptrain.shutdown()
    if rank:
        return None
    on, off = statistics.median(steps[True]), statistics.median(steps[False])
    return {"on": on, "off": off, "n": (len(steps[True]), len(steps[False]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["resnet18", "mlp"], default="resnet18")
    p.add_argument("--rounds", type=int, default=6, help="epochs per setting")
    args = p.parse_args()
    res = dptrain.spawn(_rank, nprocs=2, args=(args.model, args.rounds))[0]
    print(f"{args.model}, 2 ranks, gloo: median step with profile {res['on'] * 1e3:.2f} ms, without "
          f"{res['off'] * 1e3:.2f} ms; ratio {res['on'] / res['off']:.3f} (steps {res['n'][0]} / {res['n'][1]})")


if __name__ == "__main__":
    main()
