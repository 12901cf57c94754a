"""Per-gradient overhead of dptrain's DDP against PyTorch's, where it is the whole step.

A stack of tiny linear layers (96 by default: 192 parameters of 16x16 or 16) on a batch of
4: computing the step costs almost nothing, so the step time is what each DDP spends per
gradient (hooks, copies, scaling) plus one bucket's all-reduce. That is the work that sits on
a GPU step's critical path, where the kernels themselves run asynchronously (issue 20), so
this CPU figure is the proxy this project can measure without a GPU.

Two ranks on gloo (``DPTRAIN_SHM=0`` is set here: the path that runs across GPUs and
nodes), one thread each; both wrappers hold copies of one model, steps alternate (ours,
PyTorch's, ...) behind a barrier, and the table reports the median step of each and the
ratio ours / PyTorch's, for the default arguments and for ``gradient_as_bucket_view=True``.

    python benchmarks/ddp_overhead.py            # 96 layers, 300 steps per variant
    python benchmarks/ddp_overhead.py --layers 48 --steps 100
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import dptrain

VARIANTS = {"default": {}, "gradient_as_bucket_view": {"gradient_as_bucket_view": True}}


def _rank(rank: int, layers: int, steps: int) -> dict:
    dptrain.init()
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    x = torch.randn(4, 16)
    out = {}
    for variant, kwargs in VARIANTS.items():
        wrapped = {"ours": dptrain.DDP(copy.deepcopy(base), **kwargs),
                   "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kwargs)}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in wrapped.items()}
        times = {k: [] for k in wrapped}
        for _ in range(steps):
            for k, model in wrapped.items():
                dist.barrier()
                t0 = time.perf_counter()
                opts[k].zero_grad()
                model(x).sum().backward()
                opts[k].step()
                times[k].append(time.perf_counter() - t0)
        warm = steps // 10  # the first steps build buckets, rebuild them, warm the allocator
        out[variant] = {k: statistics.median(v[warm:]) for k, v in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    os.environ["DPTRAIN_SHM"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = dptrain.spawn(_rank, 2, args=(args.layers, args.steps))
    print(f"torch {torch.__version__}, {args.layers} layers ({2 * args.layers} parameters), {args.steps} steps per variant")
    print("| variant | rank | ours (ms) | torch (ms) | ours / torch |")
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        for rank, res in enumerate(results):
            ours, theirs = res[variant]["ours"], res[variant]["torch"]
            print(f"| {variant} | {rank} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {ours / theirs:.3f} |")


if __name__ == "__main__":
    main()
