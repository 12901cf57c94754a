"""Single-process tests of dptrain.data: sampler parity with PyTorch, resume, loader, gather."""

from __future__ import annotations

import collections
import itertools
import random
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dptrain
from dptrain.data import DistributedSampler, gather_results, prepare_dataloader


class Indexed(tud.Dataset):
    """Item i is i itself, so a batch tells which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class RandomItem(tud.Dataset):
    """Item i is a draw from the worker's RNG: shows how workers are seeded."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(()).item()


def _torch_sampler(n, world, rank, shuffle, seed, drop_last, epoch):
    s = tud.DistributedSampler(Indexed(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    return s


def _take(sampler, k):
    """Draw k indices from a new iteration of ``sampler`` (which counts them as consumed)."""
    return list(itertools.islice(iter(sampler), k))


def _ours(n, world, rank, shuffle=True, seed=0, drop_last=False, epoch=0, pad=True):
    s = DistributedSampler(Indexed(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last, pad=pad)
    s.set_epoch(epoch)
    return s


# ---- parity with torch.utils.data.DistributedSampler ---------------------------------------


# How a script may hold its rank: torch's sampler accepts anything usable as an index.
_RANK_TYPES = {"int": int, "numpy": np.int64, "numpy32": np.int32, "tensor": torch.tensor,
               "1-element tensor": lambda r: torch.tensor([r])}


@settings(max_examples=300, deadline=None, database=None)
@given(
    n=st.integers(0, 60),
    world=st.integers(1, 9),
    rank_frac=st.floats(0, 0.999),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 1000),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    rank_type=st.sampled_from(sorted(_RANK_TYPES)),
)
@example(n=0, world=3, rank_frac=0.5, seed=0, epoch=0, shuffle=True, drop_last=False, rank_type="int")
@example(n=0, world=3, rank_frac=0.9, seed=0, epoch=0, shuffle=False, drop_last=True, rank_type="int")
@example(n=2, world=3, rank_frac=0.9, seed=1, epoch=2, shuffle=True, drop_last=True, rank_type="numpy")
@example(n=5, world=2, rank_frac=0.9, seed=0, epoch=0, shuffle=True, drop_last=False, rank_type="tensor")
def test_indices_and_len_match_torch(n, world, rank_frac, seed, epoch, shuffle, drop_last, rank_type):
    rank = _RANK_TYPES[rank_type](int(rank_frac * world))
    ours = _ours(n, world, rank, shuffle, seed, drop_last, epoch)
    ref = _torch_sampler(n, world, rank, shuffle, seed, drop_last, epoch)
    assert len(ours) == len(ref)
    assert list(ours) == list(ref)
    assert (ours.num_samples, ours.total_size) == (ref.num_samples, ref.total_size)
    assert isinstance(ours, tud.DistributedSampler)
    assert type(ours.rank) is int and type(ours.state_dict()["rank"]) is int  # saves with weights_only


def _raised(build):
    try:
        list(build())  # torch checks some arguments only when it iterates
    except Exception as exc:  # noqa: BLE001 - the test compares exception types
        return type(exc)
    return None


@pytest.mark.parametrize(
    "num_replicas, rank",
    [(2, 2), (2, -1), (2, np.int64(-1)), (2, torch.tensor(2)), (0, 0), (-1, 0), (2, 1.0), (2.0, 1),
     (2, torch.tensor(1.0)), (2, np.float64(1)), (2, "1"), (2, np.array([1]))],
)
def test_invalid_world_raises_what_torch_raises(num_replicas, rank):
    ours = _raised(lambda: DistributedSampler(Indexed(5), num_replicas, rank))
    ref = _raised(lambda: tud.DistributedSampler(Indexed(5), num_replicas, rank))
    assert ours is not None and ours is ref


def test_a_bool_rank_is_refused_although_torch_takes_it():
    # rank=dptrain.is_main_process() is a bug torch lets through (ranks get the wrong shards)
    with pytest.raises(TypeError, match=r"rank must be an integer, got True \(bool\)"):
        DistributedSampler(Indexed(5), 2, True)
    assert list(tud.DistributedSampler(Indexed(5), 2, True, shuffle=False)) == [1, 3, 0]


def test_empty_dataset_and_drop_last_below_the_world_give_empty_shards():
    for drop_last in (False, True):
        for rank in range(3):
            s = _ours(0, 3, rank, drop_last=drop_last)
            assert (len(s), list(s), s.indices(), s.num_samples, s.total_size) == (0, [], [], 0, 0)
    shards = [list(_ours(2, 3, r, drop_last=True)) for r in range(3)]
    assert shards == [[], [], []] and len(_ours(2, 3, 0, drop_last=True)) == 0
    assert [list(_ours(0, 2, r, pad=False)) for r in range(2)] == [[], []]


def test_padding_example_from_the_issue():
    # 10 samples, 3 ranks, no shuffle: the padding wraps around to the start.
    assert [list(_ours(10, 3, r, shuffle=False)) for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    # fewer samples than ranks: the list is repeated more than once
    assert [list(_ours(2, 5, r, shuffle=False)) for r in range(5)] == [[0], [1], [0], [1], [0]]
    assert [list(_ours(10, 3, r, shuffle=False, drop_last=True)) for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_defaults_come_from_the_world():
    s = DistributedSampler(Indexed(7))
    assert (s.num_replicas, s.rank) == (dptrain.world_size(), dptrain.rank()) == (1, 0)
    assert sorted(s) == list(range(7))


@settings(max_examples=60, deadline=None, database=None)
@given(n=st.integers(1, 40), world=st.integers(1, 7), shuffle=st.booleans(), epoch=st.integers(0, 50))
def test_pad_false_is_an_exact_partition(n, world, shuffle, epoch):
    shards = [list(_ours(n, world, r, shuffle=shuffle, epoch=epoch, pad=False)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(_ours(n, world, r, pad=False)) for r in range(world)] == [len(s) for s in shards]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # the first n positions are the padded sampler's, in the same order
    padded = [list(_ours(n, world, r, shuffle=shuffle, epoch=epoch)) for r in range(world)]
    for r in range(world):
        assert padded[r][: len(shards[r])] == shards[r]


def test_epoch_and_seed_change_the_order():
    a = list(_ours(50, 2, 0, epoch=0))
    assert list(_ours(50, 2, 0, epoch=1)) != a
    assert list(_ours(50, 2, 0, seed=1)) != a
    assert list(_ours(50, 2, 0, epoch=0)) == a


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=10, num_replicas=2, rank=2), r"rank 2 is outside \[0, 1\]"),
        (dict(n=10, num_replicas=2, rank=-1), r"rank -1 is outside"),
        (dict(n=10, num_replicas=0, rank=0), r"num_replicas must be an integer >= 1, got 0"),
        (dict(n=10, num_replicas=2, rank=0, drop_last=True, pad=False), r"contradict"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    n = kwargs.pop("n")
    with pytest.raises(ValueError, match=match):
        DistributedSampler(Indexed(n), **kwargs)


def test_dataset_without_len_raises_type_error():
    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="has none"):
        DistributedSampler(Stream(), 1, 0)


def test_bad_states_are_rejected():
    s = _ours(20, 2, 0)
    good = s.state_dict()
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="dataset of 20 samples but this dataset has 21"):
        _ours(21, 2, 0).load_state_dict(good)
    with pytest.raises(ValueError, match="shuffle=True"):
        _ours(20, 2, 0, shuffle=False).load_state_dict(good)
    with pytest.raises(ValueError, match="consumed 11 samples, but it has 10"):
        s.load_state_dict({**good, "consumed": 11, "epoch": 4})
    assert s.epoch == 0 and len(s) == 10  # the rejected state changed nothing
    manual = DistributedSampler(Indexed(20), 2, 0, count_yields=False)
    list(manual)
    with pytest.raises(ValueError, match="advance"):
        manual.advance(11)
    with pytest.raises(ValueError, match="ranks \\[0, 0\\]"):
        DistributedSampler.merge_states([good, good])
    with pytest.raises(ValueError, match="epoch"):
        DistributedSampler.merge_states([good, {**_ours(20, 2, 1).state_dict(), "epoch": 3}])


def test_prepare_dataloader_bad_input():
    with pytest.raises(ValueError, match="mode"):
        prepare_dataloader(Indexed(4), 2, mode="test")
    with pytest.raises(ValueError, match="drop sampler="):
        prepare_dataloader(Indexed(4), 2, sampler=None)
    with pytest.raises(ValueError, match="eval mode"):
        prepare_dataloader(Indexed(4), 2, mode="eval", drop_last=True)
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers"):
        prepare_dataloader(Indexed(4), 2, persistent_workers=True)


# ---- resume on the same world size -----------------------------------------------------------


def _drain(loader, k=None):
    out = []
    for b, batch in enumerate(loader):
        out.append(batch.tolist() if isinstance(batch, torch.Tensor) else [batch])
        if k is not None and b + 1 == k:
            break
    return [i for batch in out for i in batch]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_through_a_real_dataloader(num_workers):
    # 2 ranks of 23 samples, batch 5 (shard of 12: batches of 5, 5, 2): stop after 1 batch while
    # the workers have prefetched all of them; restore into a fresh loader: nothing lost or repeated.
    kw = dict(batch_size=5, num_workers=num_workers, seed=7, num_replicas=2, prefetch_factor=2 if num_workers else None)
    for rank in range(2):
        full_loader = prepare_dataloader(Indexed(23), rank=rank, **kw)
        full_loader.set_epoch(3)
        full = _drain(full_loader)
        assert full == list(_torch_sampler(23, 2, rank, True, 7, False, 3))

        first = prepare_dataloader(Indexed(23), rank=rank, **kw)
        first.set_epoch(3)
        head = _drain(first, k=1)
        state = first.state_dict()
        assert state["sampler"]["consumed"] == 5 and state["sampler"]["epoch"] == 3

        fresh = prepare_dataloader(Indexed(23), rank=rank, **kw)
        fresh.load_state_dict(state)
        fresh.set_epoch(3)  # the usual loop calls this; the same epoch keeps the position
        assert len(fresh) == 2 and len(fresh.sampler) == 7
        tail = _drain(fresh)
        assert head + tail == full
        assert fresh.state_dict()["sampler"]["consumed"] == 12
        # only that one iteration resumes: the next pass is the whole epoch again
        assert _drain(fresh) == full
        fresh.set_epoch(4)
        assert _drain(fresh) == list(_torch_sampler(23, 2, rank, True, 7, False, 4))


def test_resume_counts_partial_and_dropped_last_batches():
    # shard of 10 with batch 4: batches of 4, 4, 2. The partial batch counts 2 samples.
    loader = prepare_dataloader(Indexed(20), 4, num_replicas=2, rank=1, shuffle=False)
    assert _drain(loader) == list(range(1, 20, 2))
    assert loader.state_dict()["sampler"]["consumed"] == 10
    # drop_last: the dropped partial batch is never handed out and never counted
    loader = prepare_dataloader(Indexed(21), 4, num_replicas=2, rank=0, shuffle=False, drop_last=True)
    assert len(loader.sampler) == 10 and len(loader) == 2
    got = _drain(loader)
    assert got == list(range(0, 16, 2))
    state = loader.state_dict()
    assert state["sampler"]["consumed"] == 8
    # resuming that (batch 4, drop_last) gives 2 samples: no full batch, an empty pass
    fresh = prepare_dataloader(Indexed(21), 4, num_replicas=2, rank=0, shuffle=False, drop_last=True)
    fresh.load_state_dict(state)
    assert len(fresh.sampler) == 2 and _drain(fresh) == []


def test_resume_at_the_end_of_an_epoch_then_next_epoch():
    loader = prepare_dataloader(Indexed(9), 2, num_replicas=3, rank=2, seed=1)
    loader.set_epoch(5)
    _drain(loader)
    state = loader.state_dict()
    fresh = prepare_dataloader(Indexed(9), 2, num_replicas=3, rank=2, seed=1)
    fresh.load_state_dict(state)
    fresh.set_epoch(5)
    assert len(fresh) == 0 and _drain(fresh) == []
    fresh.set_epoch(6)
    assert _drain(fresh) == list(_torch_sampler(9, 3, 2, True, 1, False, 6))


def test_set_epoch_to_another_epoch_discards_the_position():
    s = _ours(30, 2, 1, epoch=2)
    _take(s, 4)
    state = s.state_dict()
    t = _ours(30, 2, 1)
    t.load_state_dict(state)
    assert t.epoch == 2 and len(t) == 11
    t.set_epoch(3)
    assert len(t) == 15 and list(t) == list(_torch_sampler(30, 2, 1, True, 0, False, 3))


def test_resume_restores_seed_and_batch_size_may_change():
    a = prepare_dataloader(Indexed(40), 4, num_replicas=2, rank=0, seed=11)
    head = _drain(a, k=3)
    b = prepare_dataloader(Indexed(40), 3, num_replicas=2, rank=0, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.sampler.seed == 11
    assert head + _drain(b) == list(_torch_sampler(40, 2, 0, True, 11, False, 0))


def test_state_between_iter_and_first_batch_describes_the_new_iteration():
    loader = prepare_dataloader(Indexed(10), 2, num_replicas=1, rank=0)
    _drain(loader, k=2)
    it = iter(loader)  # a new pass begins; nothing handed out yet
    assert loader.state_dict()["sampler"]["consumed"] == 0
    next(it)
    assert loader.state_dict()["sampler"]["consumed"] == 2


# ---- resume on a different world size --------------------------------------------------------


def _consume(n, world, counts, **kw):
    """States after rank r consumed counts[r] samples; returns (states, consumed multiset)."""
    states, seen = [], []
    for r, c in enumerate(counts):
        s = _ours(n, world, r, **kw)
        seen += _take(s, c)
        states.append(s.state_dict())
    return states, seen


def _epoch_set(n, world, **kw):
    return {i for r in range(world) for i in _ours(n, world, r, **kw)}


def _after_resume(state, n, world, **kw):
    out = []
    for r in range(world):
        s = _ours(n, world, r, **kw)
        s.load_state_dict(state)
        assert len(s) == len(s.indices())
        out.append(list(s))
    return out


@settings(max_examples=120, deadline=None, database=None)
@given(
    n=st.integers(0, 50),
    world=st.integers(1, 5),
    new_world=st.integers(1, 6),
    frac=st.floats(0, 1),
    uneven=st.booleans(),
    shuffle=st.booleans(),
    mode=st.sampled_from(["pad", "drop_last", "exact"]),
    seed=st.integers(0, 1000),
)
def test_resume_on_another_world_size_sees_every_unseen_sample_once(n, world, new_world, frac, uneven, shuffle, mode, seed):
    kw = dict(shuffle=shuffle, seed=seed, epoch=seed % 7, drop_last=mode == "drop_last", pad=mode != "exact")
    lengths = [len(_ours(n, world, r, **kw)) for r in range(world)]
    base = int(frac * min(lengths))
    counts = [min(base + (r % 2 if uneven else 0), lengths[r]) for r in range(world)]
    states, seen = _consume(n, world, counts, **kw)
    state = DistributedSampler.merge_states(states) if uneven else states[0]
    shards = _after_resume(state, n, new_world, **kw)
    got = [i for s in shards for i in s]
    unseen = _epoch_set(n, world, **kw) - set(seen)
    lens = [len(s) for s in shards]
    if new_world == world:
        # same world size: each rank simply continues its own sequence (padding repeats included,
        # as in the uninterrupted epoch)
        for r in range(world):
            assert shards[r] == list(_ours(n, world, r, **kw))[counts[r]:]
        if mode == "exact":
            assert sorted(got) == sorted(unseen)
    elif mode == "exact":
        assert sorted(got) == sorted(unseen)  # exactly once, no padding
        assert max(lens) - min(lens) <= 1
    elif mode == "pad":
        assert set(got) == unseen
        repeats = sum(c - 1 for c in collections.Counter(got).values())
        assert repeats == (-len(unseen)) % new_world  # only the padding to equal shards
        assert len(set(lens)) == 1
    else:  # drop_last: never a repeat, at most new_world - 1 unseen samples wait for the next epoch
        assert len(got) == len(set(got)) and set(got) <= unseen
        assert len(unseen) - len(got) == len(unseen) % new_world
        assert len(set(lens)) == 1


def test_resume_chain_over_three_world_sizes():
    n, kw = 37, dict(seed=3, pad=False, shuffle=True)
    seen = []
    states, got = _consume(n, 4, [3, 3, 2, 3], **kw)  # first job: 4 ranks (uneven counts)
    seen += got
    merged = DistributedSampler.merge_states(states)
    second = []
    for r in range(3):  # second job: 3 ranks, each takes 2 more samples and saves
        s = _ours(n, 3, r, **kw)
        s.load_state_dict(merged)
        seen += _take(s, 2)
        second.append(s.state_dict())
    assert all(len(st_["history"]) == 1 for st_ in second)
    merged2 = DistributedSampler.merge_states(second)
    rest = [i for s in _after_resume(merged2, n, 2, **kw) for i in s]  # third job: 2 ranks
    assert sorted(seen + rest) == list(range(n))


def test_lockstep_state_from_rank_zero_is_enough():
    # under DDP all ranks consume equally: rank 0's state alone resumes a world of another size
    states, seen = _consume(50, 4, [5] * 4)
    a = [i for s in _after_resume(states[0], 50, 3) for i in s]
    b = [i for s in _after_resume(DistributedSampler.merge_states(states), 50, 3) for i in s]
    assert a == b and set(a) == set(range(50)) - set(seen)


# ---- the loader: seeds, pinning, eval mode ---------------------------------------------------


def _draws(seed, rank, epoch, persistent=False, epochs=1):
    loader = prepare_dataloader(RandomItem(), 2, num_workers=2, seed=seed, num_replicas=2, rank=rank,
                                persistent_workers=persistent)
    out = []
    for e in range(epoch, epoch + epochs):
        loader.set_epoch(e)
        out.append(_drain(loader))
    return out


def test_worker_seeds_depend_on_seed_rank_and_epoch_only():
    a = _draws(0, 0, 0)
    assert a == _draws(0, 0, 0)
    assert a != _draws(0, 1, 0) and a != _draws(0, 0, 1) and a != _draws(1, 0, 0)
    draws = a[0]
    assert len(set(draws)) == len(draws)  # the two workers do not share a stream
    p = _draws(0, 0, 0, persistent=True, epochs=2)
    assert p == _draws(0, 0, 0, persistent=True, epochs=2) and p[0] != p[1]


def test_pin_memory_default_follows_cuda_and_eval_mode_is_exact():
    loader = prepare_dataloader(Indexed(5), 2, mode="eval", num_replicas=2, rank=1, shuffle=True)
    assert loader.pin_memory == torch.cuda.is_available()
    s = loader.sampler
    assert (s.shuffle, s.pad, s.drop_last) == (False, False, False)
    assert _drain(loader) == [1, 3] == s.indices()


def test_indices_does_not_disturb_a_restored_position():
    s = _ours(12, 2, 0)
    ref = list(_ours(12, 2, 0))
    _take(s, 2)
    t = _ours(12, 2, 0)
    t.load_state_dict(s.state_dict())
    assert t.indices() == ref[2:] and t.indices() == ref[2:]
    assert list(t) == ref[2:]


# ---- gather_results without a process group ----------------------------------------------------


def test_gather_results_single_process_orders_and_dedups():
    values = torch.tensor([[30.0], [10.0], [20.0], [31.0]])
    out = gather_results(values, [3, 1, 2, 3], num_samples=None)
    assert out.tolist() == [[10.0], [20.0], [30.0]]  # index 3 kept once: its first occurrence
    batches = [torch.tensor([5, 6]), torch.tensor([4])]
    assert gather_results(batches, [torch.tensor([1, 2]), torch.tensor([0])], dst=0, num_samples=3).tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="1 missing"):
        gather_results(torch.ones(2), [0, 2], num_samples=3)
    with pytest.raises(ValueError, match="3 values but 2 indices"):
        gather_results(torch.ones(3), [0, 1])
    with pytest.raises(ValueError, match="dst=1 is not a rank"):
        gather_results(torch.ones(1), [0], dst=1)


def test_gather_results_single_process_with_no_rows():
    assert gather_results(torch.empty(0), [], num_samples=0).shape == (0,)
    out = gather_results(torch.empty(0, 3, dtype=torch.int64), torch.zeros(0))
    assert out.shape == (0, 3) and out.dtype == torch.int64
    with pytest.raises(ValueError, match=r"empty list on every rank.*torch.empty\(0, num_classes\)"):
        gather_results([], [])


def test_shuffled_single_process_eval_matches_dataset_order():
    rng = random.Random(0)
    data = [rng.random() for _ in range(17)]
    loader = prepare_dataloader(Indexed(17), 4, shuffle=True, num_replicas=1, rank=0)
    preds = [torch.tensor([data[i] for i in batch.tolist()], dtype=torch.float64) for batch in loader]
    assert gather_results(preds, loader.sampler.indices(), num_samples=17).tolist() == data


def test_states_survive_a_weights_only_checkpoint(tmp_path):
    states, _ = _consume(26, 3, [2, 3, 2], seed=4)
    merged = DistributedSampler.merge_states(states)
    loader = prepare_dataloader(Indexed(26), 2, num_replicas=3, rank=1, seed=4)
    _drain(loader, k=1)
    torch.save({"merged": merged, "loader": loader.state_dict()}, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back == {"merged": merged, "loader": loader.state_dict()}
    fresh = prepare_dataloader(Indexed(26), 2, num_replicas=3, rank=1)
    fresh.load_state_dict(back["loader"])
    assert _drain(fresh) == list(_torch_sampler(26, 3, 1, True, 4, False, 0))[2:]


def test_main_process_first_without_a_process_group():
    ran = []
    with dptrain.main_process_first():
        ran.append(1)
    with dptrain.main_process_first(local=True):
        ran.append(2)
    assert ran == [1, 2]
    with pytest.raises(OSError, match="boom"):
        with dptrain.main_process_first():
            raise OSError("boom")


def test_resume_into_the_same_loader_with_persistent_workers():
    # the persistent workers still hold prefetched batches of the interrupted pass; the resumed
    # pass must come from the restored position, not from those
    loader = prepare_dataloader(Indexed(40), 3, num_workers=2, persistent_workers=True, num_replicas=2, rank=1, seed=3)
    loader.set_epoch(1)
    head = _drain(loader, k=2)
    loader.load_state_dict(loader.state_dict())
    loader.set_epoch(1)
    assert head + _drain(loader) == list(_torch_sampler(40, 2, 1, True, 3, False, 1))
    loader.set_epoch(2)
    assert _drain(loader) == list(_torch_sampler(40, 2, 1, True, 3, False, 2))


# ---- a new pass without set_epoch (issue 30) -------------------------------------------------


@pytest.fixture
def warn_afresh(monkeypatch):
    monkeypatch.setattr(dptrain.runtime.env, "_WARNED", set())  # the warn-once memory of this process


def _repeat_warnings(record):
    return [str(w.message) for w in record if "set_epoch" in str(w.message)]


def test_a_second_shuffled_pass_without_set_epoch_warns_once(warn_afresh):
    s = DistributedSampler(Indexed(10), num_replicas=2, rank=0)
    first = list(s)
    with pytest.warns(UserWarning) as record:
        assert list(s) == first  # PyTorch's sampler repeats its order silently too
    assert _repeat_warnings(record) == [
        "DistributedSampler: a new pass over the data starts in epoch 0 again, so it repeats the previous pass's "
        "shuffled order; call sampler.set_epoch(epoch) (or loader.set_epoch(epoch)) at the start of each epoch: "
        "for epoch in range(epochs): sampler.set_epoch(epoch); for batch in loader: ..."
    ]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        list(s)  # once per sampler
    assert _repeat_warnings(record) == []
    loader = prepare_dataloader(Indexed(10), 2, num_replicas=2, rank=1)
    loader.set_epoch(3)
    _drain(loader)
    with pytest.warns(UserWarning, match=r"starts in epoch 3 again.*loader\.set_epoch\(epoch\)"):
        _drain(loader)
    # set_epoch called every epoch, but with the same number: the order repeats just the same
    loader = prepare_dataloader(Indexed(10), 2, drop_last=False, num_replicas=2, rank=0)
    loader.set_epoch(5)
    _drain(loader)
    loader.set_epoch(5)
    with pytest.warns(UserWarning, match=r"starts in epoch 5 again"):
        _drain(loader)


def test_no_repeat_warning_where_a_pass_repeats_nothing_or_is_meant(warn_afresh):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # a look at the first batch, then the usual loop over epochs, with persistent workers
        loader = prepare_dataloader(Indexed(12), 2, num_workers=2, persistent_workers=True, num_replicas=2, rank=0)
        next(iter(loader))
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert len(loader) == 3 and len(loader.sampler) == 6
            _drain(loader)
        # a pass that was started but never drawn from
        s = _ours(10, 2, 0)
        iter(s)
        list(s)
        # resumed mid-epoch, into the same sampler and into a fresh one (no set_epoch either time)
        s = _ours(30, 2, 0, epoch=2)
        _take(s, 4)
        state = s.state_dict()
        s.load_state_dict(state)
        list(s)
        fresh = DistributedSampler(Indexed(30), num_replicas=2, rank=0)
        fresh.load_state_dict(state)
        list(fresh)
        # the order does not matter: no shuffle, or the exact evaluation partition
        for loader in (prepare_dataloader(Indexed(10), 2, shuffle=False, num_replicas=2, rank=0),
                       prepare_dataloader(Indexed(10), 2, mode="eval", num_replicas=2, rank=1)):
            _drain(loader)
            _drain(loader)
    assert _repeat_warnings(record) == []
