"""Step time with gradient compression: PyTorch's DDP (fp32, fp16) against dptrain's hooks and "auto".

All variants live in the same processes and take turns, step by step (the order reversed
every other step), each step behind a barrier, so they share the machine's and the link's
conditions; a step's time is its slowest rank's, and the tables give medians over steps.
"CPU" is the process CPU time of a step (both ranks' median), to show what compression
costs in computation.

Across a shaped link (two network namespaces, root; see benchmarks/netlink.py)::

    python benchmarks/netlink.py --rate 1gbit -- benchmarks/compression.py --steps 30 --out /tmp/link.json

On one node (loopback / shared memory)::

    dptrain run --nproc-per-node 2 benchmarks/compression.py --steps 30 --out /tmp/local.json

``--variants`` picks a subset (comma-separated keys, see ``VARIANTS``); ``--torch-powersgd``
adds PyTorch's PowerSGD hook, which can abort on gloo (its Q all-reduce is issued from a
callback, so ranks may issue collectives in different orders); ``--adam`` adds the Adam pair
(PyTorch's DDP + Adam against dptrain's ``overlap_optimizer``) and checks that their
parameters are bitwise equal at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn import functional as F

import dptrain
from dptrain.models import MLP
from dptrain.parallel import comm_hooks

TorchDDP = nn.parallel.DistributedDataParallel


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)


def _adam(m):
    return torch.optim.Adam(m.parameters(), lr=1e-4)


def _ours_psgd(rank):
    def make(m):
        d = dptrain.DDP(m)
        d.register_comm_hook(comm_hooks.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2),
                             comm_hooks.powerSGD_hook)
        return d, _sgd(d)
    return make


def _torch_hook(hook, state=None):
    def make(m):
        d = TorchDDP(m)
        d.register_comm_hook(state, hook)
        return d, _sgd(d)
    return make


def _ours_overlap(m):
    opt = _adam(m)
    return dptrain.DDP(m, overlap_optimizer=opt), opt


# key -> (label, factory(model) -> (wrapped model, optimizer)); bucket_cap_mb as given on the command line.
VARIANTS = {
    "torch": ("PyTorch DDP fp32", lambda m: (TorchDDP(m), _sgd(m))),
    "floor": ("no communication (floor)", lambda m: (m, _sgd(m))),
    "torch_fp16": ("PyTorch DDP + its fp16 hook", _torch_hook(torch_hooks.fp16_compress_hook)),
    "ours": ("dptrain DDP fp32", lambda m: (dptrain.DDP(m), _sgd(m))),
    "ours_gloo": ("dptrain DDP fp32, shm=False (gloo only)", lambda m: (dptrain.DDP(m, shm=False), _sgd(m))),
    "bf16": ('dptrain compression="bf16"', lambda m: (lambda d: (d, _sgd(d)))(dptrain.DDP(m, compression="bf16"))),
    "psgd1": ("dptrain PowerSGD rank 1", _ours_psgd(1)),
    "psgd2": ("dptrain PowerSGD rank 2", _ours_psgd(2)),
    "psgd4": ("dptrain PowerSGD rank 4", _ours_psgd(4)),
    "auto": ('dptrain compression="auto"', lambda m: (lambda d: (d, _sgd(d)))(dptrain.DDP(m, compression="auto"))),
    "torch_4": ("PyTorch DDP fp32, bucket_cap_mb=4", lambda m: (TorchDDP(m, bucket_cap_mb=4), _sgd(m))),
    "bf16_4": ('dptrain compression="bf16", bucket_cap_mb=4',
               lambda m: (lambda d: (d, _sgd(d)))(dptrain.DDP(m, bucket_cap_mb=4, compression="bf16"))),
}
ADAM = {
    "torch_adam": ("PyTorch DDP fp32 + Adam", lambda m: (TorchDDP(m), _adam(m))),
    "overlap_adam": ("dptrain overlap_optimizer=Adam", _ours_overlap),
}
TORCH_PSGD = {
    "torch_psgd1": ("PyTorch DDP + its PowerSGD rank 1", lambda m: _torch_hook(
        torch_powersgd.powerSGD_hook, torch_powersgd.PowerSGDState(None, 1, start_powerSGD_iter=2))(m)),
}


def _batch(rank: int, step: int, width: int, batch: int):
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _bench(rank: int, keys: list[str], table: dict, args) -> dict:
    torch.manual_seed(0)
    base = MLP([args.width] * (args.depth + 1))
    runs = []
    for key in keys:
        model = copy.deepcopy(base)
        wrapped, opt = table[key][1](model)
        runs.append((key, wrapped, opt))
    wall = {k: [] for k in keys}
    cpu = {k: [] for k in keys}
    for step in range(args.warmup + args.steps):
        x, y = _batch(rank, step, args.width, args.batch)
        order = runs if step % 2 == 0 else runs[::-1]
        for key, wrapped, opt in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            if step >= args.warmup:
                wall[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
    out = {}
    for key, wrapped, _ in runs:
        t = torch.tensor(wall[key], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        out[key] = {"label": table[key][0], "step_s": statistics.median(t.tolist()),
                    "cpu_s": statistics.median(cpu[key]), "steps": t.tolist()}
        if hasattr(wrapped, "compression_choice"):
            out[key]["choice"] = wrapped.compression_choice
    if "torch_adam" in keys and "overlap_adam" in keys:
        a, b = (next(r[1] for r in runs if r[0] == k) for k in ("torch_adam", "overlap_adam"))
        out["overlap_adam"]["bitwise_equal_to_torch"] = all(
            torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))
    return out


def _print(results: dict, reference: str, title: str) -> None:
    ref = results[reference]["step_s"]
    ref_cpu = results[reference]["cpu_s"]
    print(f"\n{title}\n| variant | median step (ms) | vs {results[reference]['label']} | CPU (ms) | CPU vs ref |")
    print("| --- | --- | --- | --- | --- |")
    for key, r in results.items():
        extra = f" (chose {r['choice'] or 'fp32'})" if key == "auto" else ""
        if "bitwise_equal_to_torch" in r:
            extra += f" (bitwise equal to PyTorch: {r['bitwise_equal_to_torch']})"
        print(f"| {r['label']}{extra} | {r['step_s'] * 1e3:.1f} | {r['step_s'] / ref:.3f}x | "
              f"{r['cpu_s'] * 1e3:.1f} | {r['cpu_s'] / ref_cpu:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=15, help="untimed steps first (auto decides within 14)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated keys of VARIANTS")
    ap.add_argument("--torch-powersgd", action="store_true", help="also PyTorch's PowerSGD (may abort on gloo)")
    ap.add_argument("--adam", action="store_true", help="also PyTorch DDP + Adam vs overlap_optimizer=Adam")
    ap.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = dptrain.init(backend="gloo")
    rank = world.rank
    table = dict(VARIANTS, **TORCH_PSGD) if args.torch_powersgd else dict(VARIANTS)
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    if args.torch_powersgd:
        keys.append("torch_psgd1")
    results = {"sgd": _bench(rank, keys, table, args)}
    if args.adam:
        results["adam"] = _bench(rank, list(ADAM), ADAM, args)
    if rank == 0:
        desc = f"MLP {args.depth}x{args.width}, batch {args.batch}/rank, {world.world_size} ranks"
        _print(results["sgd"], "torch" if "torch" in keys else keys[0], f"SGD+momentum, {desc}")
        if args.adam:
            _print(results["adam"], "torch_adam", f"Adam, {desc}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(results, args=vars(args), world_size=world.world_size), f, indent=1)
    dptrain.shutdown()


if __name__ == "__main__":
    main()
