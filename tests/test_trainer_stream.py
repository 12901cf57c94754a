"""The Trainer over a streamed data set (an IterableDataset without ``__len__``): 2 ranks x 2 loader
workers, every sample trained exactly once per epoch, the same steps on every rank, and a stop and
resume, and a rank killed under ``--recovery in-place``, both ending bit for bit where an
uninterrupted run ends. The job is ``tests/scripts/train_stream.py`` (see its docstring for how a
sample's count is read off the weights)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests._dist import run_ranks
from tests.scripts import train_stream as job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_stream.py")
N = 203  # 203 samples, 4 readers, batches of 4: the ranks' shares end at different batches


def _counts(trainer, world_size: int) -> torch.Tensor:
    """How many times each sample was trained with a non-zero weight (see train_stream.py)."""
    return -trainer.model_state_dict()["w"] * world_size


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _exactly_once(rank: int, uneven: str, as_loader: bool):
    import dptrain

    if as_loader:  # a plain DataLoader over the stream, as a user writes it: rebuilt by the Trainer
        dptrain.seed_everything(0)
        model = job.Model(N)
        loader = torch.utils.data.DataLoader(job.Numbered(N), batch_size=4, num_workers=2)
        trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), loader,
                                  config=dptrain.TrainerConfig(verbose=False, nan_policy="off", uneven=uneven))
    else:  # rank 0's share is 142 samples (36 batches), rank 1's 61 (16): 20 stand-ins or drops per epoch
        trainer = job.build(N, 2, uneven=uneven, stream="uneven")
    trainer.fit(max_epochs=2)
    return _counts(trainer, 2), trainer.global_step, [h["train_loss"] for h in trainer.history]


@pytest.mark.parametrize("as_loader", [False, True], ids=["prepare_dataloader", "plain-DataLoader"])
def test_two_ranks_two_workers_train_every_sample_of_a_stream_exactly_once_per_epoch(as_loader):
    (c0, s0, h0), (c1, s1, h1) = run_ranks(_exactly_once, 2, "join", as_loader, timeout=120)
    assert torch.equal(c0, c1) and s0 == s1 and h0 == h1
    assert torch.equal(c0, torch.full((N,), 2.0)), c0  # every sample, twice in 2 epochs, none more
    # The plain stream is split by sample (102 and 101 samples, 26 batches each); the uneven one by
    # its parts, and the shorter rank goes on with zero-weight stand-ins to the longer one's end.
    assert s0 == 2 * (26 if as_loader else 36)


def test_uneven_drop_stops_every_rank_at_the_shortest_share_and_trains_nothing_twice():
    (c0, s0, _), (c1, s1, _) = run_ranks(_exactly_once, 2, "drop", False, timeout=120)
    assert torch.equal(c0, c1) and s0 == s1
    assert s0 == 2 * 16  # the shorter share's end
    assert set(c0.tolist()) <= {0.0, 1.0, 2.0} and int((c0 < 2).sum()) > 0  # some left out, none twice
    assert float(c0.sum()) == 2 * (61 + 16 * 4)  # rank 1's whole share, and as many of rank 0's


def _stop_and_resume(rank: int, tmp: str, stream: str):
    whole = job.build(N, 2, stream=stream)
    whole.fit(max_steps=40)  # into the second epoch
    first = job.build(N, 2, os.path.join(tmp, "ckpt"), stream=stream)
    first.fit(max_steps=33)
    second = job.build(N, 2, os.path.join(tmp, "ckpt"), resume="auto", stream=stream)
    assert second.global_step == 33 and second.batch_in_epoch == (33 if stream == "uneven" else 33 - 26)
    second.fit(max_steps=40)
    return job.state(whole), job.state(second)


# "uneven": stopped while rank 1 stands in (its share ended at batch 16 of 36), resumed there.
@pytest.mark.parametrize("stream", ["seekable", "plain", "uneven"], ids=["seeks", "reads-and-drops", "standing-in"])
def test_a_stream_stopped_inside_an_epoch_resumes_bit_for_bit(tmp_path, stream):
    for whole, resumed in run_ranks(_stop_and_resume, 2, str(tmp_path), stream, timeout=150):
        assert _same(whole["state"], resumed["state"]) and whole["step"] == resumed["step"] == 40


def _run(out, *extra, timeout=180, **env):
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", *extra, SCRIPT]
    full_env = dict(os.environ, OUT=str(out), PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", **env)
    job_ = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(out))
    assert job_.returncode == 0, job_.stderr[-4000:] + job_.stdout[-2000:]
    finals = {int(os.path.basename(p)[len("final-rank"):-3]): torch.load(p, weights_only=False)
              for p in glob.glob(os.path.join(out, "final-rank*.pt"))}
    return finals, job_.stdout + job_.stderr


def test_a_rank_killed_inside_a_stream_epoch_is_replaced_in_place_bit_for_bit(tmp_path):
    reference, _ = _run(tmp_path / "whole")
    finals, log = _run(tmp_path / "killed", "--recovery", "in-place", "--max-restarts", "2", KILL="1:31")
    with open(tmp_path / "killed" / "killed-rank1.json") as fh:
        killed = json.load(fh)
    assert killed["step"] == 30 and "recovered in place" in log
    assert sorted(finals) == [0, 1]
    for rank in (0, 1):
        assert _same(finals[rank]["state"], reference[rank]["state"]), rank
        assert finals[rank]["history"] == reference[rank]["history"] and finals[rank]["step"] == reference[rank]["step"]
    assert finals[1]["pid"] != killed["pid"]
    assert torch.equal(-finals[0]["state"]["w"] * 2, torch.full((N,), 2.0))


class _Sized(torch.utils.data.IterableDataset):
    """A stream that knows its length (the epoch's progress and ETA can then be shown)."""

    def __len__(self) -> int:
        return 50

    def __iter__(self):
        for i in range(50):
            yield torch.full((3,), float(i)), torch.tensor(i % 2)


def _sized_trainer(cdir, resume):
    import dptrain

    dptrain.seed_everything(0)
    model = torch.nn.Linear(3, 2)
    return dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), dptrain.prepare_dataloader(_Sized(), 4),
                           torch.nn.CrossEntropyLoss(), dptrain.TrainerConfig(checkpoint_dir=cdir, verbose=False),
                           resume=resume)


def test_a_stream_with_a_length_resumes_inside_an_epoch_with_the_epoch_counted_whole(tmp_path):
    # len() of a stream loader stays the whole epoch's after a resume (unlike the sampler loader's,
    # which counts what is left): the resumed epoch once ended with "yielded 13 batches, but 18".
    whole = _sized_trainer(None, False)
    whole.fit(max_epochs=2)
    _sized_trainer(str(tmp_path), False).fit(max_steps=5)
    resumed = _sized_trainer(str(tmp_path), True)
    assert (resumed.global_step, resumed.batch_in_epoch) == (5, 5)
    with pytest.warns(UserWarning, match="cannot seek"):
        resumed.fit(max_epochs=2)
    assert resumed.global_step == whole.global_step == 26
    assert _same(resumed.model_state_dict(), whole.model_state_dict())
