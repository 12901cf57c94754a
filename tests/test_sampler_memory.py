"""The sampler's memory per rank does not hold a Python list of the epoch; the lazy shuffle.

The memory bound is measured (peak resident memory of a fresh process), never timed:
timings live in benchmarks/sampler_memory.py.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

from dptrain.data import DistributedSampler, prepare_dataloader
from dptrain.data.order import keyed_permutation
from tests.test_data import Indexed


def _sampler(n, world, rank, shuffle=True, seed=0, epoch=0, drop_last=False, pad=True):
    s = DistributedSampler(Indexed(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last, pad=pad)
    s.set_epoch(epoch)
    return s


# ---- memory, measured in a fresh process ------------------------------------------------

_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    import dptrain
    from dptrain.data import DistributedSampler, prepare_dataloader

    class Sized(torch.utils.data.Dataset):
        def __init__(self, n): self.n = n
        def __len__(self): return self.n
        def __getitem__(self, i): return i

    def peak():  # bytes; ru_maxrss is in KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def now():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    out = {}
    base = peak()
    # The lazy shuffle and the exact-evaluation indices at 10^9 samples: nothing of that size.
    s = DistributedSampler(Sized(10**9), num_replicas=8, rank=3, shuffle="lazy", seed=1)
    out["lazy_first"] = type(next(iter(s))).__name__
    ev = prepare_dataloader(Sized(10**9), batch_size=4, mode="eval", num_replicas=8, rank=3)
    out["eval_first"] = ev.sampler.indices()[:3].tolist()
    out["lazy_peak"] = peak() - base
    # PyTorch's order at N = 5e7 through prepare_dataloader: the first batch of an epoch.
    before = now()
    loader = prepare_dataloader(Sized(N), batch_size=4, num_replicas=8, rank=3, seed=2)
    loader.set_epoch(1)
    out["batch"] = next(iter(loader)).tolist()
    out["default_peak"] = peak() - base
    out["default_kept"] = now() - before
    out["state"] = loader.state_dict()
    print(json.dumps(out))
""")


def test_an_epoch_of_5e7_samples_costs_a_tensor_not_a_list():
    n = 5 * 10**7
    run = subprocess.run([sys.executable, "-c", f"N = {n}\n" + _PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # torch's sampler: randperm(N).tolist(), a list of N Python ints (an 8-byte pointer plus
    # a 28-byte int object each), on every rank.
    list_bytes = n * (8 + 28)
    assert out["default_peak"] < list_bytes / 4, (out["default_peak"], list_bytes)
    # What is kept while the epoch runs: this rank's share (N / 8 int32), not the permutation.
    assert out["default_kept"] < n / 8 * 4 + 32 * 2**20, out["default_kept"]
    # The first batch holds PyTorch's indices: positions 3, 11, 19, 27 of randperm(N).
    g = torch.Generator()
    g.manual_seed(2 + 1)
    assert out["batch"] == torch.randperm(n, generator=g)[3 : 3 + 4 * 8 : 8].tolist()
    # The lazy shuffle and the eval indices at 10^9: nothing near N bytes.
    assert out["lazy_first"] == "int" and out["eval_first"] == [3, 11, 19]
    assert out["lazy_peak"] < 32 * 2**20, out["lazy_peak"]
    # The saved position is O(1): epoch, seed, counts.
    state = out["state"]["sampler"]
    assert (state["epoch"], state["seed"], state["consumed"], state["history"]) == (1, 2, 4, [])


def test_the_default_still_matches_torch_on_a_million_samples():
    # int32 randperm draws the same permutation as torch's int64 one (the parity tests check
    # small N; this checks a size where torch's randperm takes its other path).
    n = 10**6 + 7
    for rank in (0, 7):
        ours = _sampler(n, 8, rank, seed=5, epoch=3)
        ref = tud.DistributedSampler(Indexed(n), num_replicas=8, rank=rank, seed=5)
        ref.set_epoch(3)
        assert ours.indices() == list(ref)
        assert all(type(i) is int for i in itertools.islice(iter(ours), 3))


# ---- the lazy shuffle: every sample once, PyTorch's arrangement over another order ------

def _arranged(base, world, drop_last, pad):
    n = len(base)
    if not pad or n == 0:
        return base
    if drop_last:
        return base[: n - n % world]
    total = math.ceil(n / world) * world
    return [base[p % n] for p in range(total)]


def test_lazy_shuffle_is_a_permutation_arranged_as_pytorch_arranges():
    for n in itertools.chain(range(0, 41), [127, 128, 129, 1000, 4097]):
        base = keyed_permutation(torch.arange(n), n, seed=n, epoch=2).tolist()
        assert sorted(base) == list(range(n))
        for world in (1, 3, 8):
            for drop_last, pad in ((False, True), (True, True), (False, False)):
                order = _arranged(base, world, drop_last, pad)
                shards = [list(_sampler(n, world, r, "lazy", seed=n, epoch=2, drop_last=drop_last, pad=pad))
                          for r in range(world)]
                assert shards == [order[r::world] for r in range(world)]
                assert [len(_sampler(n, world, r, "lazy", drop_last=drop_last, pad=pad)) for r in range(world)] \
                    == [len(s) for s in shards]


def test_lazy_order_changes_with_epoch_and_seed_and_is_not_pytorchs():
    n = 1000
    orders = {(seed, epoch): tuple(_sampler(n, 1, 0, "lazy", seed=seed, epoch=epoch))
              for seed in (0, 1) for epoch in (0, 1, 2)}
    assert len(set(orders.values())) == len(orders)
    assert orders[(0, 0)] == tuple(_sampler(n, 1, 0, "lazy", seed=0, epoch=0))  # deterministic
    assert list(orders[(0, 0)]) != list(_sampler(n, 1, 0, True, seed=0, epoch=0))


def test_lazy_order_looks_random():
    n = 20000
    perm = np.array(list(_sampler(n, 1, 0, "lazy", seed=7)), dtype=np.float64)
    # Neighbouring positions hold unrelated samples, and position says nothing of the sample:
    # |r| of independent draws is about 1/sqrt(n) = 0.007.
    assert abs(np.corrcoef(perm[:-1], perm[1:])[0, 1]) < 0.03
    assert abs(np.corrcoef(np.arange(n), perm)[0, 1]) < 0.03
    # Gaps between neighbours are spread like those of a uniform permutation (mean n / 3).
    gaps = np.abs(np.diff(perm))
    assert abs(gaps.mean() / (n / 3) - 1) < 0.03

    # Over epochs every sample lands on every rank equally often: chi-square with
    # n * (world - 1) degrees of freedom, bound at mean + 5 standard deviations.
    n, world, epochs = 60, 4, 200
    counts = np.zeros((n, world))
    for epoch in range(epochs):
        for r in range(world):
            for i in _sampler(n, world, r, "lazy", seed=3, epoch=epoch):
                counts[i, r] += 1
    expected = epochs / world
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = n * (world - 1)
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_lazy_shuffle_resumes_mid_epoch_and_on_another_world_size_exactly_once():
    n, kw = 103, dict(shuffle="lazy", seed=4, epoch=1, pad=False)
    seen = []
    states = []
    for r, c in enumerate([9, 8, 9, 8]):
        s = _sampler(n, 4, r, **kw)
        seen += list(itertools.islice(iter(s), c))
        states.append(s.state_dict())
    merged = DistributedSampler.merge_states(states)
    rest = []
    for r in range(3):
        s = _sampler(n, 3, r, **kw)
        s.load_state_dict(merged)
        rest += list(s)
    assert sorted(seen + rest) == list(range(n))
    # Same world size: each rank continues its own sequence.
    s = _sampler(n, 4, 1, **kw)
    s.load_state_dict(states[1])
    assert list(s) == list(_sampler(n, 4, 1, **kw))[8:]


def test_lazy_shuffle_through_prepare_dataloader_and_its_state():
    loader = prepare_dataloader(Indexed(50), batch_size=4, shuffle="lazy", num_replicas=2, rank=1, seed=3)
    loader.set_epoch(2)
    first = [b.tolist() for b in itertools.islice(iter(loader), 3)]
    state = loader.state_dict()
    assert state["sampler"]["shuffle"] == "lazy" and state["sampler"]["consumed"] == 12
    again = prepare_dataloader(Indexed(50), batch_size=4, shuffle="lazy", num_replicas=2, rank=1, seed=3)
    again.load_state_dict(state)
    rest = [i for b in again for i in b.tolist()]
    assert sum(first, []) + rest == list(_sampler(50, 2, 1, "lazy", seed=3, epoch=2))
    with pytest.raises(ValueError, match="shuffle=lazy"):
        prepare_dataloader(Indexed(50), batch_size=4, shuffle=True, num_replicas=2, rank=1).load_state_dict(state)
    with pytest.raises(ValueError, match='True, False or "lazy"'):
        DistributedSampler(Indexed(5), 1, 0, shuffle="blockwise")


def test_lazy_shuffle_of_a_trillion_samples_starts_at_once():
    s = _sampler(10**12, 8, 5, "lazy", seed=9)
    first = list(itertools.islice(iter(s), 1000))
    assert len(set(first)) == 1000 and all(0 <= i < 10**12 for i in first)
    assert len(s) == 10**12 // 8


# ---- the resume rule: the compact remainder equals filtering the materialized order -----

def _reference_remainder(order, world, counts):
    """The rule of dptrain.data.sampler's Note, on the materialized order (as it was computed)."""
    arr = np.asarray(order, dtype=np.int64)
    taken = np.zeros(len(arr), dtype=bool)
    for r, count in enumerate(counts):
        taken[r : r + count * world : world] = True
    seen = np.zeros(int(arr.max()) + 1 if len(arr) else 0, dtype=bool)
    seen[arr[taken]] = True
    rest = arr[~taken]
    rest = rest[~seen[rest]]
    _, first = np.unique(rest, return_index=True)
    return rest[np.sort(first)].tolist()


def _base(n, shuffle, seed, epoch):
    if shuffle == "lazy":
        return keyed_permutation(torch.arange(n), n, seed, epoch).tolist()
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return torch.randperm(n, generator=g).tolist()
    return list(range(n))


@settings(max_examples=150, deadline=None, database=None)
@given(
    n=st.integers(0, 40),
    # consecutive sizes differ: on the same size a rank just continues (tested in test_data.py)
    worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4).filter(lambda w: all(a != b for a, b in zip(w, w[1:]))),
    fracs=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=3, max_size=3),
    shuffle=st.sampled_from([True, False, "lazy"]),
    mode=st.sampled_from(["pad", "drop_last", "exact"]),
    seed=st.integers(0, 100),
)
def test_resume_chains_match_the_materialized_rule(n, worlds, fracs, shuffle, mode, seed):
    drop_last, pad = mode == "drop_last", mode != "exact"
    kw = dict(shuffle=shuffle, seed=seed, epoch=seed % 5, drop_last=drop_last, pad=pad)
    order = _arranged(_base(n, shuffle, seed, seed % 5), worlds[0], drop_last, pad)
    state = None
    for k, world in enumerate(worlds):
        samplers = [_sampler(n, world, r, **kw) for r in range(world)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        assert [list(s.indices()) for s in samplers] == [order[r::world] for r in range(world)]
        if k == len(worlds) - 1:
            break
        lo, hi = sorted(fracs[k])
        counts = [int((lo if r % 2 else hi) * len(s)) for r, s in enumerate(samplers)]
        states = []
        for s, c in zip(samplers, counts):
            collections.deque(itertools.islice(iter(s), c), maxlen=0)
            states.append(s.state_dict())
        state = DistributedSampler.merge_states(states)
        order = _arranged(_reference_remainder(order, world, counts), worlds[k + 1], drop_last, pad)
