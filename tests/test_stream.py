"""Streamed data sets (IterableDataset) through prepare_dataloader: split, equal steps, resume.

Single-process tests simulate ranks with ``num_replicas=``/``rank=`` (each loader then yields
its own share) or run one rank; the multi-rank ones run 2 ranks on gloo through
``tests/_dist.py``. The real Hugging Face ``datasets`` streaming (local JSON-lines files) and a
webdataset tar shard set are read by 2 ranks too.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import tarfile
import warnings

import pytest
import torch
import torch.utils.data as tud

import dptrain
from dptrain import comm
from dptrain.data import ShadowBatch, StreamLoader, prepare_dataloader, shard_stream_loader
from tests._dist import run_ranks

# The notices about reading costs are checked where they matter; elsewhere they are noise.
pytestmark = pytest.mark.filterwarnings("ignore:dptrain.StreamLoader:UserWarning")


class Numbers(tud.IterableDataset):
    """A plain generator: samples 0..n-1, no __len__, no shards, no seeking."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        yield from range(self.n)


class Files(tud.IterableDataset):
    """A stream over "files" (lists of samples) that splits by files: shard(num_shards, index)."""

    def __init__(self, files, reads=None):
        self.files = files
        self.reads = reads if reads is not None else []  # every sample read, in this process

    @property
    def num_shards(self):
        return len(self.files)

    def shard(self, num_shards, index):
        return type(self)(self.files[index::num_shards], self.reads)

    def __iter__(self):
        for f in self.files:
            for x in f:
                self.reads.append(x)
                yield x


class SeekableFiles(Files):
    """Files that can start at a sample without reading the ones before (dptrain's iter_from protocol)."""

    def iter_from(self, start):
        for f in self.files:
            if start >= len(f):
                start -= len(f)  # a whole file passed over unread
                continue
            for x in f[start:]:
                self.reads.append(x)
                yield x
            start = 0


class SizedNumbers(Numbers):
    def __len__(self):
        return self.n


class EpochNumbers(Numbers):
    """Reshuffles per epoch (here: backwards in odd epochs), as Hugging Face's shuffled streams do with set_epoch."""

    epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        yield from (reversed(range(self.n)) if self.epoch % 2 else range(self.n))


class RandomDraws(Numbers):
    """Each sample a draw from the reading worker's RNG: shows how the workers are seeded."""

    def __iter__(self):
        for _ in range(self.n):
            yield torch.rand(()).item()


# Uneven files: 4 readers (2 ranks x 2 workers) get 35, 19, 11 and 17 samples (files q, q+4).
FILES = [list(range(100 * k, 100 * k + n)) for k, n in enumerate([5, 17, 0, 9, 30, 2, 11, 8])]
ALL_FILES = sorted(x for f in FILES for x in f)


def _show(batch):
    if isinstance(batch, ShadowBatch):
        return ("shadow", batch.batch.tolist())
    return batch.tolist()


def _real_samples(items):
    return [x for b in items if not isinstance(b, tuple) for x in b]


@pytest.fixture(autouse=True)
def _fresh_warn_once(monkeypatch):
    monkeypatch.setattr(dptrain.runtime.env, "_WARNED", set())  # the warn-once memory of this process


# ---- one process -----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_sample_goes_to_one_rank_and_one_worker(world, workers):
    seen = []
    for rank in range(world):
        loader = prepare_dataloader(Numbers(23), 4, num_workers=workers, num_replicas=world, rank=rank)
        assert isinstance(loader, StreamLoader) and isinstance(loader, tud.DataLoader)
        batches = [b.tolist() for b in loader]
        assert all(len(b) == 4 for b in batches[:-1])
        seen += [x for b in batches for x in b]
    assert sorted(seen) == list(range(23))


def test_a_stream_without_length_says_so():
    loader = prepare_dataloader(Numbers(10), 4)
    assert not loader.has_length
    with pytest.raises(TypeError, match="has no length"):
        len(loader)
    sized = prepare_dataloader(SizedNumbers(10), 4, num_replicas=2, rank=1)
    assert sized.has_length and len(sized) == len(list(sized)) == 2


@pytest.mark.parametrize("stream", ["generator", "files", "seekable"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_saved_position_continues_exactly(stream, workers):
    """Every cut of an epoch: a fresh loader loaded with the state yields exactly the rest."""

    def make(rank):
        data = {"generator": Numbers(37), "files": Files(FILES), "seekable": SeekableFiles(FILES)}[stream]
        return prepare_dataloader(data, 3, num_workers=workers, num_replicas=2, rank=rank)

    for rank in range(2):
        whole = [_show(b) for b in make(rank)]
        for k in range(0, len(whole) + 1, 1 if workers == 0 else 3):
            first = make(rank)
            first.set_epoch(0)
            head = [_show(b) for b in itertools.islice(iter(first), k)]
            again = make(rank)
            again.load_state_dict(first.state_dict())
            again.set_epoch(0)  # the restored epoch keeps its position
            assert head + [_show(b) for b in again] == whole, (rank, k)


def test_set_epoch_reaches_the_stream_in_persistent_workers():
    loader = prepare_dataloader(EpochNumbers(20), 3, num_workers=2, persistent_workers=True, num_replicas=2, rank=1)
    epochs = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        epochs.append([b.tolist() for b in loader])
    assert epochs[0] == epochs[2] != epochs[1] and epochs[1][0] == [18, 16, 14]
    loader.set_epoch(1)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    loader.set_epoch(2)  # another epoch on the same workers, then back to the saved position
    assert [b.tolist() for b in loader] == epochs[2]
    loader.load_state_dict(state)
    loader.set_epoch(1)
    assert head + [b.tolist() for b in loader] == epochs[1]


def test_worker_seeds_follow_seed_rank_and_epoch():
    def draws(rank, epoch=0, seed=0):
        loader = prepare_dataloader(RandomDraws(8), 2, num_workers=2, num_replicas=2, rank=rank, seed=seed)
        loader.set_epoch(epoch)
        return [x for b in loader for x in b.tolist()]

    assert draws(0) == draws(0)  # the same in every run
    assert len({tuple(draws(0)), tuple(draws(1)), tuple(draws(0, epoch=1)), tuple(draws(0, seed=1))}) == 4


def test_a_seekable_stream_is_not_read_again_and_one_that_is_not_says_so():
    def consume_then_resume(data_cls):
        reads = []
        first = prepare_dataloader(data_cls([list(range(20)), list(range(20, 40))], reads), 4)
        it = iter(first)
        head = [next(it).tolist() for _ in range(6)]
        state = first.state_dict()
        reads.clear()
        again = prepare_dataloader(data_cls([list(range(20)), list(range(20, 40))], reads), 4)
        again.load_state_dict(state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rest = [b.tolist() for b in again]
        assert [x for b in head + rest for x in b] == list(range(40))
        return reads, [str(w.message) for w in caught]

    reads, said = consume_then_resume(SeekableFiles)
    assert reads == list(range(24, 40)) and not said  # the first file was never opened
    reads, said = consume_then_resume(Files)
    assert reads == list(range(40))  # read from the start: 24 samples read again and dropped
    assert len(said) == 1 and "cannot seek" in said[0] and "drop 24 samples" in said[0], said


def test_the_split_is_said_once_where_it_costs_reading():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank in range(2):
            prepare_dataloader(Numbers(10), 2, num_replicas=2, rank=rank)
        prepare_dataloader(Files(FILES), 2, num_workers=2, num_replicas=2, rank=0)  # 8 shards >= 4 readers: free
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "reads the whole stream" in said[0] and "shard(num_shards, index)" in said[0], said


def test_a_shadow_batch_refuses_a_plain_loop():
    shadow = ShadowBatch((torch.zeros(2), torch.ones(2)))
    with pytest.raises(TypeError, match="zero loss weight"):
        x, y = shadow
    with pytest.raises(TypeError, match="uneven='drop'"):
        shadow[0]
    with pytest.raises(AttributeError, match="ShadowBatch"):
        shadow.to("cpu")
    assert not hasattr(shadow, "pin_memory")  # protocol probes see a plain absence
    assert shadow.batch[1].sum() == 2


def test_a_user_dataloader_over_a_stream_is_rebuilt():
    def collate(samples):
        return torch.tensor(samples) * 10

    plain = tud.DataLoader(Numbers(11), batch_size=3, collate_fn=collate, drop_last=True)
    seen = []
    for rank in range(2):
        loader = shard_stream_loader(plain, num_replicas=2, rank=rank)
        assert loader.batch_size == 3 and loader.drop_last
        seen += [b.tolist() for b in loader]
    assert sorted(seen) == [[0, 20, 40], [10, 30, 50], [60, 80, 100]]  # rank 1's 90 is dropped
    assert shard_stream_loader(loader) is loader


def test_a_fit_stopped_inside_a_stream_epoch_ends_its_loader_workers_and_keeps_the_position():
    """fit(max_steps=...) stopping mid-epoch closes the pass: its worker processes end with fit,
    not when the Trainer is garbage-collected (torch then waits 5 s per worker before it kills
    them: 20 s per resume test in test_trainer_stream before the fix)."""
    import gc
    import multiprocessing
    import time

    from tests.scripts import train_stream as job

    before = set(multiprocessing.active_children())  # (the test pool's ranks, in this process)
    trainer = job.build(203, 2)
    trainer.fit(max_steps=5)
    assert set(multiprocessing.active_children()) - before == set()  # the two loader workers ended with fit
    loader = trainer.train_loader
    assert loader.state_dict()["items"] == 5  # the position stays for a checkpoint
    with pytest.raises(RuntimeError, match="was closed after 5 item"):
        next(loader._iterator_now)
    trainer.fit(max_steps=8)  # and the same Trainer goes on in the same epoch
    assert trainer.global_step == 8 and loader.state_dict()["items"] == 8
    del trainer, loader
    t0 = time.monotonic()
    gc.collect()
    assert time.monotonic() - t0 < 2.5


def test_wrong_settings_are_refused():
    with pytest.raises(ValueError, match="uneven"):
        prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(4)), 2, uneven="drop")
    with pytest.raises(ValueError, match="uneven must be"):
        prepare_dataloader(Numbers(4), 2, uneven="pad")
    with pytest.warns(UserWarning, match="does nothing for a stream"):
        prepare_dataloader(Numbers(4), 2, shuffle=True)
    state = prepare_dataloader(Numbers(8), 2, num_replicas=2, rank=0).state_dict()
    with pytest.raises(ValueError, match=r"batch_size 2 then, 4 now"):
        prepare_dataloader(Numbers(8), 4, num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="not a StreamLoader state"):
        prepare_dataloader(Numbers(8), 2).load_state_dict({"sampler": {}})


# ---- two ranks -------------------------------------------------------------------------------


def _workers(n, *preload):
    """Loader-worker arguments inside a rank: workers from a fork server that has imported what they need.

    Not forked from the rank: CPython before 3.11.8 can deadlock a child forked while another
    thread holds an interpreter lock (python/cpython#112275), and a rank runs gloo's threads.
    The rank's own fork server would start each worker as a fresh interpreter (seconds each)
    without the preload.
    """
    if not n:
        return {}
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dptrain", "tests.test_stream", *preload])
    return {"num_workers": n, "multiprocessing_context": context}


def _epoch(loader):
    """(items shown, is_last after each) of one pass, and the rank-0 warnings said meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        items, lasts = [], []
        for batch in it:
            items.append(_show(batch))
            lasts.append(it.is_last)
    return items, lasts, [str(w.message) for w in caught if "StreamLoader" in str(w.message)]


def _two_ranks(rank, workers):
    out = {}
    for name, data in (("generator", lambda: Numbers(33)), ("files", lambda: Files(FILES))):
        for uneven in ("join", "drop"):
            loader = prepare_dataloader(data(), 4, uneven=uneven, **_workers(workers))
            out[name, uneven] = _epoch(loader)
            out[name, uneven, "again"] = _epoch(loader)[2]  # a second epoch: nothing said twice
    # Evaluation: each rank exactly its share, no stand-ins, nothing in step.
    out["eval"] = _epoch(prepare_dataloader(Numbers(33), 4, mode="eval", **_workers(workers)))[0]
    # A position saved mid-epoch is the same on both ranks and continues exactly, also past the
    # end of rank 1's share (it then stands in with its last batch, read again).
    whole = out["files", "join"][0]
    for k in (3, 5, 11):
        first = prepare_dataloader(Files(FILES), 4, **_workers(workers))
        head = [_show(b) for b in itertools.islice(iter(first), k)]
        state = first.state_dict()
        assert comm.all_gather_object(state) == [state] * 2
        again = prepare_dataloader(Files(FILES), 4, **_workers(workers))
        again.load_state_dict(comm.broadcast_object(state, src=0))
        assert head + _epoch(again)[0] == whole, (rank, k)
    return out


@pytest.mark.parametrize("workers, steps, left", [
    (0, 12, "rank 0: 3 batch(es) (10 samples)"),  # one reader a rank: 46 and 36 samples
    (2, 14, "rank 0: 6 batch(es) (22 samples)"),  # two: 35 + 19 and 11 + 17 samples
])
def test_two_ranks_step_together_and_resume(workers, steps, left):
    r0, r1 = run_ranks(_two_ranks, 2, workers, timeout=60)
    for name, total in (("generator", list(range(33))), ("files", ALL_FILES)):
        join0, join1 = r0[name, "join"], r1[name, "join"]
        assert len(join0[0]) == len(join1[0])  # the same number of steps on every rank
        assert sorted(_real_samples(join0[0] + join1[0])) == total  # each sample once, none dropped
        assert join0[1] == join1[1] == [False] * (len(join0[0]) - 1) + [True]
        drop0, drop1 = r0[name, "drop"], r1[name, "drop"]
        shortest = min(sum(not isinstance(b, tuple) for b in join[0]) for join in (join0, join1))
        assert len(drop0[0]) == len(drop1[0]) == shortest
        assert drop0[0] == join0[0][:shortest] and drop1[0] == join1[0][:shortest]
        assert r0[name, "join", "again"] == r0[name, "drop", "again"] == []
        assert r1[name, "join"][2] == r1[name, "drop"][2] == []  # said from rank 0 only
    # The generator (33 samples, batches of 4): rank 0 has 5 batches, rank 1 four and a stand-in.
    assert r1["generator", "join"][0][-1] == ("shadow", r1["generator", "join"][0][-2])
    assert r0["eval"] == r0["generator", "join"][0] and r1["eval"] == r1["generator", "join"][0][:-1]
    join_said, drop_said = r0["files", "join"][2], r0["files", "drop"][2]
    assert len(r0["files", "join"][0]) == steps
    assert len(join_said) == 1 and f"{steps} steps with" in join_said[0], join_said
    assert len(drop_said) == 1 and left in drop_said[0] and "rank 1: 0 batch(es)" in drop_said[0], drop_said


# ---- real streaming libraries --------------------------------------------------------------


def _write_jsonl(folder, sizes):
    paths, i = [], 0
    for k, n in enumerate(sizes):
        path = os.path.join(folder, f"part{k}.jsonl")
        with open(path, "w") as f:
            for _ in range(n):
                f.write(json.dumps({"idx": i, "text": f"sample {i}"}) + "\n")
                i += 1
        paths.append(path)
    return paths, i


def _hf_rank(rank, paths, workers):
    from datasets import load_dataset

    def make():
        stream = load_dataset("json", data_files=paths, split="train", streaming=True)
        return prepare_dataloader(stream, 3, **_workers(workers, "datasets"))

    def show(batch):
        return ("shadow", batch.batch["idx"].tolist()) if isinstance(batch, ShadowBatch) else batch["idx"].tolist()

    loader = make()
    assert not loader.has_length
    whole = [show(b) for b in loader]
    first = make()
    head = [show(b) for b in itertools.islice(iter(first), 2)]
    again = make()
    again.load_state_dict(comm.broadcast_object(first.state_dict(), src=0))
    rest = [show(b) for b in again]
    return whole, head + rest


@pytest.mark.parametrize("workers", [2])  # Hugging Face splits its shards among the workers itself
def test_hugging_face_streaming_from_local_files(tmp_path, workers):
    pytest.importorskip("datasets")
    paths, n = _write_jsonl(str(tmp_path), [7, 3, 5, 6])  # 4 files = 4 shards: one per rank and worker
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    (w0, r0), (w1, r1) = run_ranks(_hf_rank, 2, paths, workers, timeout=90, env=env)
    assert len(w0) == len(w1)
    real = [x for b in w0 + w1 if not isinstance(b, tuple) for x in b]
    assert sorted(real) == list(range(n))
    assert (r0, r1) == (w0, w1)  # resumed after 2 steps: the same batches, in the same order


def _write_tars(folder, sizes):
    paths, i = [], 0
    for k, n in enumerate(sizes):
        path = os.path.join(folder, f"shard-{k:04d}.tar")
        with tarfile.open(path, "w") as tar:
            for _ in range(n):
                data = str(i).encode()
                info = tarfile.TarInfo(f"{i:06d}.idx")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                i += 1
        paths.append(path)
    return paths, i


def _sample_index(sample):
    return int(sample["idx"])


def _webdataset_rank(rank, paths):
    import webdataset as wds

    def make():
        return prepare_dataloader(wds.WebDataset(paths, shardshuffle=False).map(_sample_index), 2)

    whole = [_show(b) for b in make()]
    first = make()
    head = [_show(b) for b in itertools.islice(iter(first), 3)]
    again = make()
    again.load_state_dict(comm.broadcast_object(first.state_dict(), src=0))
    return whole, head + [_show(b) for b in again]


def test_a_webdataset_shard_set(tmp_path):
    pytest.importorskip("webdataset")
    paths, n = _write_tars(str(tmp_path), [4, 7, 3, 5, 2])  # 5 shards for 2 readers: shard lists
    (w0, r0), (w1, r1) = run_ranks(_webdataset_rank, 2, paths, timeout=60)
    assert len(w0) == len(w1)
    assert sorted(_real_samples(w0 + w1)) == list(range(n))
    assert (r0, r1) == (w0, w1)
