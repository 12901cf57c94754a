"""Memory and time to the first index of an epoch, per rank: PyTorch's sampler and dptrain's.

For each N, each sampler runs in a fresh process as rank 0 of 8 with shuffling on (a
map-style data set of N samples whose item i is i). Measured from ``set_epoch`` to the first
index out of ``iter(sampler)``:

- **peak**: growth of the process's peak resident memory (``ru_maxrss``) over its value
  after the imports and the sampler's construction;
- **kept**: resident memory held once the first index is out, with the epoch's iterator
  alive (what a running epoch keeps);
- **time**: wall time to the first index.

Columns: ``randperm`` (``torch.randperm(N)`` alone, int64: the bar for start-up), ``torch``
(``torch.utils.data.DistributedSampler``: ``randperm(N).tolist()``),
``dptrain`` (the default, PyTorch's order: the permutation as a tensor, this rank's share
kept) and ``lazy`` (``shuffle="lazy"``: a keyed bijection computed index by index; not
PyTorch's order). A configuration whose expected peak exceeds ``--max-gib`` of memory is
skipped and printed as such (torch at 10^9 needs ~41 GiB; this machine has 24 GiB).

Run (the numbers in RESULTS.md come from the first line)::

    python benchmarks/sampler_memory.py                    # N = 10^6, 10^7, 5x10^7, 10^8, 10^9
    python benchmarks/sampler_memory.py --sizes 1e6 1e7    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    import dptrain

    n, kind = int(sys.argv[1]), sys.argv[2]

    class Sized(torch.utils.data.Dataset):
        def __len__(self): return n
        def __getitem__(self, i): return i

    class Randperm:  # the bar: torch.randperm(N) alone, as int64, no sampler around it
        def set_epoch(self, epoch): self.epoch = epoch
        def __iter__(self):
            g = torch.Generator()
            g.manual_seed(self.epoch)
            return iter(torch.randperm(n, generator=g)[:1].tolist())

    if kind == "randperm":
        sampler = Randperm()
    elif kind == "torch":
        sampler = torch.utils.data.DistributedSampler(Sized(), num_replicas=8, rank=0, seed=0)
    else:
        shuffle = "lazy" if kind == "lazy" else True
        sampler = dptrain.DistributedSampler(Sized(), num_replicas=8, rank=0, shuffle=shuffle, seed=0)

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base_now = resident()
    start = time.perf_counter()
    sampler.set_epoch(1)
    epoch = iter(sampler)  # held, as a DataLoader holds it while the epoch runs
    first = next(epoch)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_peak
    print(json.dumps({"peak": peak, "kept": resident() - base_now, "time": seconds, "first": first}))
""")

# Rough peak bytes per sample, to skip what cannot fit: a list costs ~36 B an index plus
# torch's int64 permutation; ours, the int32 permutation plus a share.
_BYTES_PER_SAMPLE = {"randperm": 8.0, "torch": 44.0, "dptrain": 4.6, "lazy": 0.0}


def _measure(n: int, kind: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _PROBE, str(n), kind], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 5e7, 1e8, 1e9])
    parser.add_argument("--max-gib", type=float, default=18.0, help="skip runs expected to peak above this")
    parser.add_argument("--kinds", nargs="+", default=["randperm", "torch", "dptrain", "lazy"],
                        choices=["randperm", "torch", "dptrain", "lazy"])
    args = parser.parse_args()
    kinds = args.kinds
    print("per rank (rank 0 of 8), shuffle on: peak memory growth, memory kept, time to the first index")
    print(f"| N | {' | '.join(kinds)} |")
    print(f"|---|{'---|' * len(kinds)}")
    for size in args.sizes:
        n = int(size)
        cells = []
        for kind in kinds:
            if _BYTES_PER_SAMPLE[kind] * n > args.max_gib * 2**30:
                cells.append(f"skipped (~{_BYTES_PER_SAMPLE[kind] * n / 2**30:.0f} GiB)")
                continue
            m = _measure(n, kind)
            cells.append(f"+{m['peak'] / 2**20:,.0f} MiB peak, {m['kept'] / 2**20:,.0f} MiB kept, {m['time']:.3f} s")
        print(f"| {n:.0e} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
