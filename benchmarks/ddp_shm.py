"""Step time of dptrain's DDP with the shared-memory all-reduce, and of ZeRO-1, against PyTorch's DDP.

Ranks on one machine, gloo, one thread each. Every variant wraps an identical copy of the
model in the same processes; steps alternate between variants (the order reversed every
step) behind a barrier, so all see the same machine load. Reported: the median step time
(a step lasts as long as its slowest rank), the ratio to PyTorch's DDP with the same
optimizer, and the median CPU time per step of the busiest rank (all its threads: a rank
that spins while it waits shows up here). The SGD tables also time each rank stepping alone,
with no gradient exchange: the compute floor, under which no DDP's step can go.

    python -m benchmarks.ddp_shm                  # 2 ranks: MLP 8x1024 SGD, ResNet-18 SGD, MLP Adam + ZeRO-1
    python -m benchmarks.ddp_shm --nprocs 4       # oversubscribed on a 2-core machine
    python -m benchmarks.ddp_shm --quick          # a smoke run
    python -m benchmarks.ddp_shm --only mlp-sgd   # one table (run from the repository root)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import dptrain
from benchmarks.ddp_step import _batch, _make, _step


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def _ours(shm=None):
    return lambda m: dptrain.DDP(m, shm=shm)


def _torch(m):
    return nn.parallel.DistributedDataParallel(m)


# Each rank steps its own copy with no gradient exchange at all: the compute-only step, in
# the same processes and under the same load. No DDP can be faster; its ratio to PyTorch's DDP
# is the lowest ratio ours can reach.
FLOOR = "no DDP: each rank alone (the compute floor)"


# table -> (model, [(label, wrap, make optimizer)], reference label)
TABLES = {
    "mlp-sgd": ("mlp", [
        ("ours, shared memory", _ours(), _sgd),
        ("ours, gloo (shm=False)", _ours(False), _sgd),
        ("torch DDP", _torch, _sgd),
        (FLOOR, lambda m: m, _sgd),
    ], "torch DDP"),
    "resnet18-sgd": ("resnet18", [
        ("ours, shared memory", _ours(), _sgd),
        ("torch DDP", _torch, _sgd),
        (FLOOR, lambda m: m, _sgd),
    ], "torch DDP"),
    "mlp-adam": ("mlp", [
        ("ours, shared memory + ZeRO-1 Adam", _ours(),
         lambda p: dptrain.ZeroRedundancyOptimizer(p, torch.optim.Adam, lr=1e-4)),
        ("ours, shared memory + Adam", _ours(), _adam),
        ("torch DDP + Adam", _torch, _adam),
        ("torch DDP + torch ZeRO Adam", _torch, lambda p: TorchZero(p, torch.optim.Adam, lr=1e-4)),
    ], "torch DDP + Adam"),
}


def _state_bytes(opt) -> int:
    opt = getattr(opt, "optim", opt)  # a ZeRO wrapper: its local optimizer holds this rank's state
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _run_table(rank, table, steps, warmup):
    name, variants, _ = TABLES[table]
    base, shape, out_dim = _make(name)
    models, opts = [], []
    for _, wrap, make_opt in variants:
        m = wrap(copy.deepcopy(base))
        models.append(m)
        opts.append(make_opt(m.parameters()))
    wall = [[] for _ in variants]
    cpu = [[] for _ in variants]
    for step in range(warmup + steps):
        x, y = _batch(shape, out_dim, rank, step, name)
        order = range(len(variants)) if step % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(models[i], opts[i], x, y, name)
            if step >= warmup:
                wall[i].append(time.perf_counter() - t0)
                cpu[i].append(time.process_time() - c0)
    rows = []
    for (label, _, _), w, c, opt in zip(variants, wall, cpu, opts):
        t = torch.tensor([w, c], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slowest / busiest rank
        rows.append((label, statistics.median(t[0].tolist()), statistics.median(t[1].tolist()), _state_bytes(opt)))
    return rows


def _ranks(rank, tables, steps, warmup):
    torch.set_num_threads(1)
    dptrain.init(backend="gloo")
    out = {t: _run_table(rank, t, steps * (2 if TABLES[t][0] == "mlp" else 1), warmup) for t in tables}
    dptrain.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (ResNet; MLPs get twice)")
    parser.add_argument("--quick", action="store_true", help="3 timed steps per variant")
    parser.add_argument("--only", choices=sorted(TABLES), action="append", help="run only these tables")
    parser.add_argument("--out", default=None, help="also write the results as JSON here (benchmarks/compare.py reads it)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 10)
    warmup = 1 if args.quick else 2
    tables = args.only or list(TABLES)
    load = ' '.join(f'{v:.2f}' for v in os.getloadavg())
    res = dptrain.spawn(_ranks, args.nprocs, args=(tables, steps, warmup))[0]
    print(f"{args.nprocs} ranks, gloo, 1 thread/rank; timed steps per variant: ResNet {steps}, MLP {2 * steps}; "
          f"warm-up {warmup}; load average before: {load}\n")
    print("| table | variant | median step (s) | / reference | CPU s/step (busiest rank) | optimizer state/rank (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for table in tables:
        ref_label = TABLES[table][2]
        ref = next(t for label, t, _, _ in res[table] if label == ref_label)
        for label, t, c, nbytes in res[table]:
            print(f"| {table} | {label} | {t:.4f} | {t / ref:.3f} | {c:.4f} | {nbytes / 2**20:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({table: {label: {"step_s": t, "cpu_s": c, "ratio": t / next(
                r[1] for r in res[table] if r[0] == TABLES[table][2])} for label, t, c, _ in res[table]}
                for table in tables}, f, indent=1)


if __name__ == "__main__":
    main()
