"""Compiled training-step time: ``torch.compile(dptrain.DDP(m))`` vs ``torch.compile(torch DDP(m))``.

Two ranks on gloo, one thread each, the same processes. Each variant wraps an identical
copy of the model and is compiled (inductor) before timing: the warm-up steps include the
compilation and are not timed. Timed steps alternate between the variants (the order flips
every step) behind a barrier; each step counts as long as its slower rank; the table gives
medians, the ratio ours/PyTorch, and the number of graphs dynamo compiled for the wrapped
model and the pieces dynamo's DDPOptimizer split it into at bucket boundaries (so that
buckets are all-reduced while the rest of the compiled backward runs). Eager steps of both
wrappers are timed in the same loop for reference. The MLPs are user-defined modules: for a
bare ``nn.Sequential`` PyTorch's compiled DDP compiles nothing (dynamo skips torch.nn's
frames after the graph break in DDP's forward), which would compare compiled with eager.

    python benchmarks/ddp_compile.py             # MLP 8x1024 and the reversed MLP, batch 64/rank
    python benchmarks/ddp_compile.py --quick     # fewer timed steps
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import dptrain
from benchmarks.ddp_step import _bench_pair


def _graphs_per_variant(name: str) -> dict[str, str]:
    """Per compiled wrapper: dynamo graphs of one step, and the pieces DDPOptimizer split them into."""
    import torch._dynamo
    import torch._dynamo.backends.distributed as ddp_optimizer
    from torch._dynamo.utils import counters

    from benchmarks.ddp_step import _batch, _make, _step

    splits: list[int] = []
    original = ddp_optimizer.pretty_print_buckets

    def count(buckets, cap):  # benchmark instrumentation: how many buckets DDPOptimizer made
        splits.append(len(buckets))
        return original(buckets, cap)

    ddp_optimizer.pretty_print_buckets = count
    out = {}
    for label, cls in (("ours compiled", dptrain.DDP), ("torch compiled", nn.parallel.DistributedDataParallel)):
        torch._dynamo.reset()
        counters.clear()
        splits.clear()
        base, shape, out_dim = _make(name)
        model = torch.compile(cls(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = _batch(shape, out_dim, torch.distributed.get_rank(), 0, name)
        _step(model, opt, x, y, name)
        out[label] = f"{counters['stats']['unique_graphs']} graph(s), split into {sum(splits)}"
    ddp_optimizer.pretty_print_buckets = original
    torch._dynamo.reset()
    return out


def _ranks(rank, steps, warmup):
    torch.set_num_threads(1)
    dptrain.init(backend="gloo")
    variants = [
        ("ours compiled", lambda m: torch.compile(dptrain.DDP(m))),
        ("torch compiled", lambda m: torch.compile(nn.parallel.DistributedDataParallel(m))),
        ("ours eager", lambda m: dptrain.DDP(m)),
        ("torch eager", lambda m: nn.parallel.DistributedDataParallel(m)),
    ]
    results = {}
    for name in ("stack", "reversed"):
        graphs = _graphs_per_variant(name)
        results[name] = (_bench_pair(rank, name, variants, steps, warmup), graphs)
    dptrain.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 timed steps per variant instead of 20")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 20)
    warmup = 3  # the first steps compile (and recompile once the buckets are rebuilt)
    res = dptrain.spawn(_ranks, 2, args=(steps, warmup), timeout=3600)[0]
    print(f"timed steps per variant: {steps}; warm-up (compile) steps: {warmup}; 2 ranks, gloo, 1 thread/rank\n")
    print("| model | variant | median step (s) | ours / torch | dynamo graphs (DDPOptimizer pieces) |")
    print("| --- | --- | --- | --- | --- |")
    labels = {"stack": "MLP 8x1024, batch 64/rank", "reversed": "reversed MLP 8x1024, batch 64/rank"}
    for name, (times, graphs) in res.items():
        for variant, t in times.items():
            kind = variant.split()[1]
            ratio = f"{t / times['torch ' + kind]:.3f}" if variant.startswith("ours") else ""
            print(f"| {labels[name]} | {variant} | {t:.4f} | {ratio} | {graphs.get(variant, '')} |")


if __name__ == "__main__":
    main()
