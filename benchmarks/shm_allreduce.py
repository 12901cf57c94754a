"""The shared-memory all-reduce alone, against gloo's, and what a waiting rank costs in CPU.

For each size: the median time of one all-reduce (SUM, fp32) through shared memory in
place (the buffer lives in the segment, as DDP's buckets do), through shared memory with
a staging copy (an ordinary tensor), and through gloo; calls alternate between the three
behind a gloo barrier. Then rank 1 arrives 1 s late at a shared-memory all-reduce, and
the CPU time rank 0 used while it waited is reported (0 s: it slept; 1 s: it spun).

    python benchmarks/shm_allreduce.py                # 2 ranks
    python benchmarks/shm_allreduce.py --nprocs 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import dptrain
from dptrain import _shm

SIZES = [1 << 10, 1 << 18, 1 << 20, 25 << 18]  # elements: 4 KiB, 1 MiB, 4 MiB, 25 MiB of fp32


def _time(fn, reps):
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _ranks(rank, reps):
    torch.set_num_threads(1)
    dptrain.init(backend="gloo")
    # Room for every in-place buffer, and as much again for staging the largest.
    group = _shm.ShmGroup.create(None, (sum(SIZES) + max(SIZES)) * 4 + (1 << 20), what="benchmark all-reduce")
    rows = []
    for n in SIZES:
        in_place = group.zeros(n, torch.float32)
        in_place.normal_()
        plain = torch.randn(n)
        variants = {
            "shared memory, in place": lambda: group.all_reduce(in_place).wait(),
            "shared memory, staged": lambda: group.all_reduce(plain).wait(),
            "gloo": lambda: dist.all_reduce(plain),
        }
        times = {k: [] for k in variants}
        for rep in range(reps):
            for k in (list(variants) if rep % 2 == 0 else reversed(list(variants))):
                times[k] += _time(variants[k], 1)
        for k, t in times.items():
            tt = torch.tensor(t, dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            rows.append((n * 4, k, statistics.median(tt.tolist())))
    # CPU burnt while waiting for a late rank.
    t = group.zeros(16, torch.float32)
    group.all_reduce(t).wait()
    if rank != 0:
        time.sleep(1.0)
    c0, w0 = time.process_time(), time.perf_counter()
    group.all_reduce(t).wait()
    idle = (time.process_time() - c0, time.perf_counter() - w0)
    dptrain.shutdown()
    return rows, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    rows, idle = dptrain.spawn(_ranks, args.nprocs, args=(args.reps,))[0]
    print(f"{args.nprocs} ranks, 1 thread/rank, {args.reps} calls per variant and size (median of the slowest rank)\n")
    print("| size | variant | median (ms) | GB/s (size / time) |")
    print("| --- | --- | --- | --- |")
    for nbytes, k, t in rows:
        print(f"| {nbytes / 2**20:.3g} MiB | {k} | {t * 1e3:.3f} | {nbytes / t / 1e9:.2f} |")
    print(f"\nrank 0 waited {idle[1]:.2f} s for a late rank and used {idle[0] * 1e3:.1f} ms of CPU meanwhile")


if __name__ == "__main__":
    main()
