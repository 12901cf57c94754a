"""Training-step time of dptrain's DDP against PyTorch's DDP, in the same processes.

Two ranks on gloo, one thread each. For each model both wrappers hold identical copies of
the model; steps alternate (ours, PyTorch's, ours, ...) behind a barrier so that both see
the same machine load, and the table reports median step times, the ratio ours/PyTorch,
and weak-scaling efficiency (one rank, no DDP, same per-rank batch / two-rank step).

The "reversed MLP" defines its layers in the reverse of the order forward uses them, so its
gradients arrive in registration order, not the reverse the first buckets assume. Both
reducers rebuild their buckets in gradient order after the first step; the
"ours, no rebuild" row keeps the first buckets (dptrain before the rebuild existed), whose
first bucket is ready only at the end of backward, so no all-reduce overlaps backward.

    python benchmarks/ddp_step.py            # ResNet-18 (32x32, batch 32/rank), MLP 8x1024 (batch 64/rank)
    python benchmarks/ddp_step.py --quick    # fewer steps, for a smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn import functional as F

import dptrain
from dptrain.models import MLP, ResNet18
from dptrain.parallel import comm_hooks


class LayerStack(nn.Module):
    """The 8x1024 MLP as a user-defined module; ``reverse``: layers registered last-used-first."""

    def __init__(self, reverse: bool, depth: int = 8, width: int = 1024) -> None:
        super().__init__()
        self.reverse = reverse
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        layers = list(self.layers)[::-1] if self.reverse else list(self.layers)
        for layer in layers[:-1]:
            x = torch.relu(layer(x))
        return layers[-1](x)


def _make(name: str):
    torch.manual_seed(0)
    if name == "resnet18":
        return ResNet18(num_classes=10), (32, 3, 32, 32), 10
    if name in ("reversed", "stack"):
        return LayerStack(reverse=name == "reversed"), (64, 1024), 1024
    return MLP([1024] * 9), (64, 1024), 1024


def _batch(shape, out_dim, rank, step, name):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    x = torch.randn(*shape, generator=g)
    if name == "resnet18":
        return x, torch.randint(0, out_dim, (shape[0],), generator=g)
    return x, torch.randn(shape[0], out_dim, generator=g)


def _step(model, opt, x, y, name):
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y) if name == "resnet18" else F.mse_loss(out, y)
    loss.backward()
    opt.step()


def _bench_pair(rank, name, variants, steps, warmup):
    """Alternate steps of each (label, wrapper factory) variant; median seconds per step."""
    base, shape, out_dim = _make(name)
    models, opts = [], []
    for _, factory in variants:
        m = factory(copy.deepcopy(base))
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    times = [[] for _ in variants]
    for step in range(warmup + steps):
        x, y = _batch(shape, out_dim, rank, step, name)
        order = range(len(variants)) if step % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            dist.barrier()
            t0 = time.perf_counter()
            _step(models[i], opts[i], x, y, name)
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[i].append(dt)
    # A step is as slow as its slowest rank.
    med = []
    for t in times:
        tt = torch.tensor(t, dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        med.append(statistics.median(tt.tolist()))
    return {label: m for (label, _), m in zip(variants, med)}


def _early_launch_share(rank, rebuild: bool) -> float:
    """Reversed MLP, our DDP: share of gradient bytes whose all-reduce starts before backward
    has produced its last gradient (the overlap the bucket order allows), at step 3."""
    base, shape, out_dim = _make("reversed")
    ddp = dptrain.DDP(base)
    if not rebuild:
        ddp.reducer._rebuild.done = True
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    early = []
    for step in range(3):
        reducer = ddp.reducer
        launch = reducer._launch  # instrumented: is any gradient still missing at this launch?

        def counting(bucket, launch=launch, reducer=reducer):
            if step == 2 and not all(reducer._ready):
                early.append(sum(reducer._sizes[i] for i in bucket.indices))
            launch(bucket)

        reducer._launch = counting
        _step(ddp, opt, *_batch(shape, out_dim, rank, step, "reversed"), "reversed")
    return sum(early) / sum(reducer._sizes)


def _single(rank, name, steps, warmup):
    torch.set_num_threads(1)
    model, shape, out_dim = _make(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for step in range(warmup + steps):
        x, y = _batch(shape, out_dim, 0, step, name)
        t0 = time.perf_counter()
        _step(model, opt, x, y, name)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ranks(rank, steps, warmup):
    torch.set_num_threads(1)
    dptrain.init(backend="gloo")
    ours = lambda m: dptrain.DDP(m)  # noqa: E731
    theirs = lambda m: nn.parallel.DistributedDataParallel(m)  # noqa: E731

    def ours_bf16(m):
        d = dptrain.DDP(m)
        d.register_comm_hook(None, comm_hooks.bf16_compress_hook)
        return d

    def ours_no_rebuild(m):
        d = dptrain.DDP(m)
        d.reducer._rebuild.done = True  # keep the first (reverse-registration) buckets
        return d

    def theirs_fp16(m):
        # PyTorch refuses its bf16 hook without CUDA/NCCL; its fp16 hook moves the same bytes.
        d = nn.parallel.DistributedDataParallel(m)
        d.register_comm_hook(None, torch_hooks.fp16_compress_hook)
        return d

    results = {
        "resnet18": _bench_pair(rank, "resnet18", [("ours", ours), ("torch", theirs)], steps, warmup),
        "mlp": _bench_pair(
            rank,
            "mlp",
            [
                ("ours", ours),
                ("torch", theirs),
                ("ours+bf16", ours_bf16),
                ("torch+fp16", theirs_fp16),
                ("ours, bucket_cap_mb=4", lambda m: dptrain.DDP(m, bucket_cap_mb=4)),
                ("torch, bucket_cap_mb=4", lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=4)),
            ],
            steps * 2,
            warmup,
        ),
        "reversed": _bench_pair(
            rank,
            "reversed",
            [("ours", ours), ("torch", theirs), ("ours, no rebuild", ours_no_rebuild)],
            steps * 2,
            warmup,
        ),
    }
    results["early"] = {label: _early_launch_share(rank, rebuild) for label, rebuild in
                        (("ours", True), ("ours, no rebuild", False))}
    dptrain.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed steps per variant instead of 10")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (ResNet; MLP gets twice)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 10)
    warmup = 1 if args.quick else 2

    names = ("resnet18", "mlp", "reversed")
    single = {name: dptrain.spawn(_single, 1, args=(name, steps, warmup))[0] for name in names}
    res = dptrain.spawn(_ranks, 2, args=(steps, warmup))[0]

    print(f"steps per variant: resnet18 {steps}, mlps {2 * steps}; warmup {warmup}; 2 ranks, gloo, 1 thread/rank\n")
    print("| model | variant | median step (s) | ours / torch | scaling eff. vs 1 rank |")
    print("| --- | --- | --- | --- | --- |")
    labels = {
        "resnet18": "ResNet-18, 32x32, batch 32/rank",
        "mlp": "MLP 8x1024, batch 64/rank",
        "reversed": "reversed MLP 8x1024, batch 64/rank",
    }
    for name, label in labels.items():
        r = res[name]
        for variant, t in r.items():
            ratio = ""
            if variant == "ours":
                ratio = f"{t / r['torch']:.3f}"
            elif variant == "ours+bf16":
                ratio = f"{t / r['torch']:.3f} (vs torch fp32), {t / r['torch+fp16']:.3f} (vs torch+fp16)"
            elif variant == "ours, no rebuild":
                ratio = f"{t / r['torch']:.3f}"
            elif variant.startswith("ours, "):
                ratio = f"{t / r['torch' + variant[4:]]:.3f}"
            print(f"| {label} | {variant} | {t:.4f} | {ratio} | {single[name] / t:.2f} |")
        print(f"| {label} | 1 rank, no DDP | {single[name]:.4f} | | 1.00 |")
    early = res["early"]
    print(
        "\nReversed MLP, share of gradient bytes whose all-reduce starts while backward still runs (step 3): "
        f"ours {early['ours']:.0%}, ours without the rebuild {early['ours, no rebuild']:.0%}"
    )


if __name__ == "__main__":
    main()
