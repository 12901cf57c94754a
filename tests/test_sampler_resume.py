"""What a sampler's state counts: a raw sampler counts what it yields, the prepared loader what it handed out.

Single process: the samplers are built for an explicit ``num_replicas`` and ``rank``.
"""

from __future__ import annotations

import itertools

import pytest
import torch.utils.data as tud

from dptrain.data import DistributedSampler, prepare_dataloader
from tests.test_data import Indexed, _torch_sampler


def _torch_order(n, world, rank, seed=0, epoch=0, drop_last=False):
    return list(_torch_sampler(n, world, rank, True, seed, drop_last, epoch))


def _batches(loader, stop_after=None):
    return [i for batch in itertools.islice(loader, stop_after) for i in batch.tolist()]


# ---- the tutorial pattern: DataLoader(ds, sampler=DistributedSampler(ds)) ------------------------


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_raw_dataloader_resume_continues_with_exactly_the_rest(stop_after, drop_last):
    # 23 samples on 2 ranks: shards of 12 (padded) or 11 (drop_last); batches of 4
    n, world, b, epoch = 23, 2, 4, 3
    for rank in range(world):
        sampler = DistributedSampler(Indexed(n), world, rank, seed=5, drop_last=drop_last)
        sampler.set_epoch(epoch)
        head = _batches(tud.DataLoader(Indexed(n), batch_size=b, sampler=sampler), stop_after)
        state = sampler.state_dict()
        assert state["consumed"] == len(head) == min(stop_after * b, len(sampler))

        fresh = DistributedSampler(Indexed(n), world, rank, seed=5, drop_last=drop_last)
        fresh.load_state_dict(state)
        fresh.set_epoch(epoch)
        tail = _batches(tud.DataLoader(Indexed(n), batch_size=b, sampler=fresh))
        assert head + tail == _torch_order(n, world, rank, seed=5, epoch=epoch, drop_last=drop_last)
        assert fresh.state_dict()["consumed"] == len(sampler)  # the whole shard, counted once


def test_raw_sampler_iterated_k_items_resumes_with_the_rest_and_keeps_counting():
    full = _torch_order(30, 3, 1, epoch=2)
    for k in range(len(full) + 1):
        s = DistributedSampler(Indexed(30), 3, 1)
        s.set_epoch(2)
        head = list(itertools.islice(iter(s), k))
        fresh = DistributedSampler(Indexed(30), 3, 1)
        fresh.load_state_dict(s.state_dict())
        fresh.set_epoch(2)
        assert len(fresh) == len(full) - k
        it = iter(fresh)
        more = list(itertools.islice(it, 2))
        again = DistributedSampler(Indexed(30), 3, 1)  # a second stop and resume in the same epoch
        again.load_state_dict(fresh.state_dict())
        assert head + more + list(again) == full


def test_raw_samplers_resume_on_another_number_of_ranks():
    # 3 ranks each draw 4 of their 10 samples (n=29: the padding repeats one sample), then 2 ranks finish
    n, counts = 29, [4, 4, 3]
    states, seen = [], []
    for rank, k in enumerate(counts):
        s = DistributedSampler(Indexed(n), 3, rank, seed=9)
        seen += list(itertools.islice(iter(s), k))
        states.append(s.state_dict())
    assert [st["consumed"] for st in states] == counts
    merged = DistributedSampler.merge_states(states)
    rest = []
    for rank in range(2):
        s = DistributedSampler(Indexed(n), 2, rank, seed=9)
        s.load_state_dict(merged)
        rest += list(s)
    unseen = set(range(n)) - set(seen)
    assert set(rest) == unseen and len(rest) == len(unseen) + len(unseen) % 2


def test_a_stale_iterator_no_longer_moves_the_position():
    s = DistributedSampler(Indexed(20), 2, 0)
    old = iter(s)
    next(old)
    s.set_epoch(1)  # a new epoch: the old iteration is over
    new = iter(s)
    next(new), next(old), next(old)
    assert s.state_dict()["consumed"] == 1


# ---- counting by hand, and the prepared loader --------------------------------------------


def test_advance_on_a_self_counting_sampler_is_refused():
    s = DistributedSampler(Indexed(10), 2, 0)
    next(iter(s))
    with pytest.raises(RuntimeError, match=r"rank 0: .*count_yields=False"):
        s.advance(1)
    manual = DistributedSampler(Indexed(10), 2, 0, count_yields=False)
    assert list(manual) == [int(i) for i in _torch_order(10, 2, 0)]
    assert manual.state_dict()["consumed"] == 0  # nothing counted until advance() says so
    manual.advance(2)
    assert manual.state_dict()["consumed"] == 2


@pytest.mark.parametrize("stop_after", [1, 2])
def test_prepared_loader_with_workers_counts_handed_out_batches_not_prefetched_ones(stop_after):
    n, b = 40, 3
    kw = dict(batch_size=b, num_workers=2, prefetch_factor=2, num_replicas=2, rank=1, seed=4)
    loader = prepare_dataloader(Indexed(n), **kw)
    assert loader.sampler.count_yields is False
    loader.set_epoch(1)
    head = _batches(loader, stop_after)
    assert loader.state_dict()["sampler"]["consumed"] == stop_after * b
    fresh = prepare_dataloader(Indexed(n), **kw)
    fresh.load_state_dict(loader.state_dict())
    fresh.set_epoch(1)
    assert head + _batches(fresh) == _torch_order(n, 2, 1, seed=4, epoch=1)

    # the raw pattern with workers counts what was sent to the workers: ahead of the loop
    raw = DistributedSampler(Indexed(n), 2, 1, seed=4)
    raw.set_epoch(1)
    assert _batches(tud.DataLoader(Indexed(n), batch_size=b, sampler=raw, num_workers=2), stop_after) == head
    assert raw.state_dict()["consumed"] > stop_after * b


# ---- empty epochs ----------------------------------------------------------------------------


@pytest.mark.parametrize("n, drop_last, pad", [(0, False, True), (0, True, True), (0, False, False), (2, True, True)])
def test_empty_shards_save_merge_and_resume(n, drop_last, pad):
    world = 3
    states = []
    for rank in range(world):
        s = DistributedSampler(Indexed(n), world, rank, drop_last=drop_last, pad=pad)
        assert list(tud.DataLoader(Indexed(n), batch_size=2, sampler=s)) == []
        states.append(s.state_dict())
    merged = DistributedSampler.merge_states(states)
    assert merged["consumed"] == [0] * world
    for state in (states[0], merged):
        for new_world in (world, 2):  # the same and another number of ranks
            for rank in range(new_world):
                s = DistributedSampler(Indexed(n), new_world, rank, drop_last=drop_last, pad=pad)
                s.load_state_dict(state)
                assert (len(s), s.indices(), list(s)) == (0, [], [])
    loader = prepare_dataloader(Indexed(n), 2, num_replicas=world, rank=2, drop_last=drop_last)
    assert (len(loader), list(loader), loader.state_dict()["sampler"]["consumed"]) == (0, [], 0)
