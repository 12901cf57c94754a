"""A rank SIGKILLed inside the Trainer's step -- mid checkpoint write, inside the optimizer
step, inside the gradient all-reduce -- and the job restarted: it resumes from the newest
checkpoint complete before the kill and ends with the weights of a run never interrupted.

Each kill is armed from inside the victim rank (a patched function of that process only) and
the victim writes down where it was before it dies, so each test asserts where the kill
landed. The restart is the harness run again with TORCHELASTIC_RESTART_COUNT=1, what the
launcher sets (tests/test_fault_tolerance.py goes through ``dptrain run`` itself); the
Trainer's ``resume=None`` then resumes automatically.

The run: 2 ranks, 4 batches a rank an epoch, 2 epochs, a checkpoint every 2 steps and at
each epoch's end: after steps 2, 4, 6 and 8.
"""

from __future__ import annotations

import io
import json
import os
import signal
import traceback

import pytest
import torch

import dptrain
from dptrain import RankFailedError, checkpoint
from tests._dist import run_ranks
from tests.test_trainer import _params, _same, _trainer

EPOCHS = 2


def _die(marker: str, **where) -> None:
    """Write where this rank is (with the calling functions' names), then SIGKILL itself."""
    where["stack"] = [f.name for f in traceback.extract_stack()]
    where["rank"] = dptrain.rank()
    with open(marker, "w") as fh:
        json.dump(where, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_mid_write(trainer, marker: str, name: str) -> None:
    """Die half-way through writing checkpoint ``name``: half its bytes are in the temporary file."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        # checkpoint.save hands torch.save the temporary file it opened (named .<name>.tmp-<pid>)
        tmp = getattr(f, "name", f)
        if isinstance(tmp, (str, os.PathLike)) and os.path.basename(tmp).startswith(f".{name}.tmp-"):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            _die(marker, where="checkpoint write", tmp=os.fspath(tmp), written=len(data) // 2, total=len(data),
                 step=trainer.global_step)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def _arm_in_optimizer_step(trainer, marker: str, step: int) -> None:
    """Die inside ``optimizer.step()`` of optimizer step ``step``, once it updated the weights."""

    def after_step(optimizer, args, kwargs):
        if trainer.global_step + 1 == step:
            _die(marker, where="optimizer step", step=step, global_step=trainer.global_step)

    trainer.optimizer.register_step_post_hook(after_step)


def _arm_in_all_reduce(trainer, marker: str, step: int) -> None:
    """Die inside the gradient all-reduce of step ``step``: its first bucket launched, not waited for."""
    from dptrain.parallel.ddp._reducer import Reducer as reducer_type  # this process only: the victim

    real = reducer_type._all_reduce

    def all_reduce(self, flat, index):
        work = real(self, flat, index)
        if trainer.global_step + 1 == step:
            _die(marker, where="gradient all-reduce", bucket=index, step=step, global_step=trainer.global_step)
        return work

    reducer_type._all_reduce = all_reduce


def _train(rank, cdir, where, victim, at, marker):
    t = _trainer(cdir, resume=None, steps=2, n=48, dev=False)
    if dptrain.get_world().restart_count == 0 and rank == victim:
        {"write": _arm_mid_write, "step": _arm_in_optimizer_step, "all_reduce": _arm_in_all_reduce}[where](t, marker, at)
    t.fit(EPOCHS)
    return {"from": t.resumed_from, "params": _params(t), "step": t.global_step,
            "checkpoints": [os.path.basename(p) for p in checkpoint.list_checkpoints(cdir)]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = run_ranks(_train, 2, str(tmp_path_factory.mktemp("clean")), None, -1, None, None)
    assert out[0]["checkpoints"] == ["ckpt-e0000-s000000002.pt", "ckpt-e0001-s000000004.pt",
                                     "ckpt-e0001-s000000006.pt", "ckpt-e0002-s000000008.pt"]
    assert out[0]["step"] == 8
    return out[0]["params"]


def _kill_and_restart(tmp_path, where, victim, at):
    cdir, marker = str(tmp_path / "ckpt"), str(tmp_path / "where.json")
    with pytest.raises(RankFailedError) as info:
        run_ranks(_train, 2, cdir, where, victim, at, marker)
    # The harness reports whichever it sees first: the victim's death or the survivor's
    # failed collective (which tests/test_comm.py checks names its peer).
    message, other = str(info.value), 1 - victim
    assert (f"rank {victim} of 2 was killed by SIGKILL" in message
            or message.startswith(f"rank {other} of 2 failed: CollectiveError: rank {other}: ")), message
    with open(marker) as fh:
        landed = json.load(fh)
    assert landed["rank"] == victim
    left = sorted(os.listdir(cdir))
    again = run_ranks(_train, 2, cdir, where, victim, at, marker, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    return landed, left, again


def test_kill_mid_checkpoint_write_resumes_from_the_previous_one(tmp_path, uninterrupted):
    landed, left, again = _kill_and_restart(tmp_path, "write", 0, "ckpt-e0001-s000000006.pt")
    # It landed in Checkpointer.save, half-way through the bytes of step 6's checkpoint:
    assert landed["where"] == "checkpoint write" and landed["step"] == 6 and "save" in landed["stack"]
    assert 0 < landed["written"] < landed["total"]
    tmp = os.path.basename(landed["tmp"])
    assert left == sorted(["ckpt-e0000-s000000002.pt", "ckpt-e0001-s000000004.pt", tmp]), left
    assert os.path.getsize(tmp_path / "ckpt" / "ckpt-e0001-s000000004.pt") > 0
    for r in again:
        assert r["from"] == str(tmp_path / "ckpt" / "ckpt-e0001-s000000004.pt")
        assert r["step"] == 8
    assert tmp not in os.listdir(tmp_path / "ckpt")  # the restart cleaned the torn temporary
    assert _same(again[0]["params"], uninterrupted)


def test_kill_inside_the_optimizer_step_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    landed, left, again = _kill_and_restart(tmp_path, "step", 1, 5)
    # Inside optimizer.step of step 5, the weights updated, step 5 not yet counted:
    assert landed["where"] == "optimizer step" and landed["global_step"] == 4 and "_optimizer_step" in landed["stack"]
    assert left == ["ckpt-e0000-s000000002.pt", "ckpt-e0001-s000000004.pt"], left
    for r in again:
        assert r["from"] == str(tmp_path / "ckpt" / "ckpt-e0001-s000000004.pt") and r["step"] == 8
    assert _same(again[0]["params"], uninterrupted)


def test_kill_inside_the_gradient_all_reduce_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    landed, left, again = _kill_and_restart(tmp_path, "all_reduce", 1, 3)
    # In the backward of step 3, inside the reducer's all-reduce of its first bucket:
    assert landed["where"] == "gradient all-reduce" and landed["global_step"] == 2 and "backward" in landed["stack"]
    assert left == ["ckpt-e0000-s000000002.pt"], left
    for r in again:
        assert r["from"] == str(tmp_path / "ckpt" / "ckpt-e0000-s000000002.pt") and r["step"] == 8
    assert _same(again[0]["params"], uninterrupted)
