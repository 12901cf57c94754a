"""The Trainer at the edges of real use: resuming into a longer run, resume that finds nothing
or a corrupt newest checkpoint, clear checkpoint errors (random bytes, another model, a full
disk, an unwritable directory), NaN/Inf policy, early stopping, callbacks, one TensorBoard
x-axis, progress lines, metrics files, CPU bf16 autocast, ranks without dev samples."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess

import pytest
import torch
from torch import nn

import dptrain
from dptrain import checkpoint
from dptrain.data import prepare_dataloader
from dptrain.train import Callback, EarlyStopping, NonFiniteError, Trainer, TrainerConfig
from tests._dist import run_ranks
from tests.test_trainer import _dataset, _model, _params, _same, _trainer


def _onecycle_trainer(cdir, epochs, resume=False, **cfg):
    dptrain.seed_everything(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = prepare_dataloader(_dataset(48), 8, seed=3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=epochs * len(loader))
    config = TrainerConfig(checkpoint_dir=cdir, scheduler_interval="step", verbose=False, keep_last=0, **cfg)
    return Trainer(model, opt, loader, nn.CrossEntropyLoss(), config, scheduler=sched, resume=resume)


class _LRs(Callback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, trainer, step):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


# ---------------------------------------------------------------- resume rules -------


def test_resume_into_a_longer_run_replans_a_onecycle_schedule(tmp_path, capsys):
    cdir = str(tmp_path / "ck")
    _onecycle_trainer(cdir, 1).fit(1)
    longer = _onecycle_trainer(cdir, 3, resume="auto")
    assert "OneCycleLR re-planned for this run (total_steps 6 -> 18)" in capsys.readouterr().err
    seen = _LRs()
    longer.callbacks.append(seen)
    longer.fit(3)  # failed before: "Tried to step 7 times. The specified number of total steps is 6"
    assert longer.global_step == 18
    # the learning rates of the resumed steps are those of a schedule planned for 3 epochs from the start
    reference = _onecycle_trainer(None, 3)
    ref = _LRs()
    reference.callbacks.append(ref)
    reference.fit(3)
    assert seen.lrs == ref.lrs[6:]


def test_resume_with_the_same_length_stays_bitwise(tmp_path):
    cdir = str(tmp_path / "ck")
    full = _onecycle_trainer(None, 2)
    full.fit(2)
    _onecycle_trainer(cdir, 2).fit(1)
    again = _onecycle_trainer(cdir, 2, resume="auto")
    again.fit(2)
    assert _same(_params(again), _params(full))


def test_auto_resume_that_finds_nothing_says_so(tmp_path, capsys):
    t = _trainer(str(tmp_path / "typo"), resume="auto")
    err = capsys.readouterr().err
    assert "no checkpoint was found in" in err and "typo" in err and "training from scratch" in err
    assert t.resumed_from is None
    with pytest.raises(FileNotFoundError, match="nope.pt.*no such checkpoint"):
        _trainer(str(tmp_path / "ck"), resume=str(tmp_path / "nope.pt"))


def test_auto_resume_skips_a_corrupt_newest_checkpoint_and_keeps_it(tmp_path, capsys):
    cdir = str(tmp_path / "ck")
    _trainer(cdir).fit(2)
    newest = checkpoint.latest_checkpoint(cdir)
    with open(newest, "r+b") as fh:  # a torn write on a filesystem without atomic rename
        fh.truncate(os.path.getsize(newest) // 2)
    t = _trainer(cdir, resume="auto")
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest!r}" in err and "is truncated: its end is missing" in err and "not deleted" in err
    assert "PytorchStreamReader" not in err and "miniz" not in err  # said whole, in our words
    assert t.resumed_from == checkpoint.checkpoint_path(cdir, 1, 16) and t.epoch == 1
    # kept, out of the way: the run's next checkpoint at step 32 must not replace it
    aside = os.path.join(cdir, "set-aside", os.path.basename(newest))
    assert f"moved {newest!r} to {aside!r}" in err and os.path.getsize(aside) > 0
    t.fit(2)  # and training goes on from there


def test_all_checkpoints_unreadable_is_an_error_listing_them(tmp_path):
    cdir = tmp_path / "ck"
    cdir.mkdir()
    for step in (4, 8):
        (cdir / os.path.basename(checkpoint.checkpoint_path(cdir, 0, step))).write_bytes(os.urandom(100))
    with pytest.raises(checkpoint.CheckpointError, match="none of the 2 checkpoints.*s000000008.*s000000004"):
        _trainer(str(cdir), resume="auto")


# ---------------------------------------------------------------- messages ------------


def test_random_bytes_get_our_message_without_torchs_advice(tmp_path):
    path = tmp_path / "random.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(path)
    text = str(info.value)
    assert "random.pt" in text and "4096 bytes" in text
    assert "weights_only=False" not in text and "Re-running" not in text


def test_checkpoint_of_another_model_names_the_file_keys_and_shapes(tmp_path):
    cdir = str(tmp_path / "ck")
    _trainer(cdir).fit(1)
    path = checkpoint.latest_checkpoint(cdir)
    dptrain.seed_everything(0)
    other = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    with pytest.raises(checkpoint.CheckpointError) as info:
        Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), prepare_dataloader(_dataset(), 8),
                nn.CrossEntropyLoss(), TrainerConfig(checkpoint_dir=cdir, verbose=False), resume=path)
    text = str(info.value)
    assert path in text and "does not fit this model" in text
    assert "'0.weight': given (16, 6), model (32, 6)" in text
    assert "Unexpected key(s)" in text and "'1.running_mean'" in text


def test_full_disk_is_named_with_bytes_and_the_training_state_is_kept(tmp_path, monkeypatch):
    cdir = str(tmp_path / "ck")
    t = _trainer(cdir)
    t.fit(1)
    kept = checkpoint.latest_checkpoint(cdir)
    real = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(checkpoint.CheckpointSpaceError) as info:
        t.fit(2)
    text = str(info.value)
    assert re.search(r"no space left on device: writing '.*ckpt-e0002-s000000032.pt' needs about [\d.]+ kB but .* has 1000 bytes free", text)
    assert f"newest complete checkpoint is {kept!r}" in text
    assert info.value.errno == 28 and isinstance(info.value, OSError)
    assert checkpoint.list_checkpoints(cdir) == [kept] and not [n for n in os.listdir(cdir) if ".tmp-" in n]


@contextlib.contextmanager
def _tiny_tmpfs(path, size="64k"):
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the monkeypatched test covers the message")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def test_a_really_full_filesystem_gives_the_same_message(tmp_path):
    with _tiny_tmpfs(tmp_path / "small"):
        with pytest.raises(checkpoint.CheckpointSpaceError, match="no space left on device"):
            checkpoint.save({"w": torch.zeros(100_000)}, tmp_path / "small" / "c.pt")  # 400 kB into 64 kB
        assert os.listdir(tmp_path / "small") == []


def test_unwritable_checkpoint_dir_is_found_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        return nn.functional.cross_entropy(out, y)

    dptrain.seed_everything(0)
    model = _model()
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint_dir .*file/ck.* cannot be written.*before training"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), prepare_dataloader(_dataset(), 8), loss_fn,
                TrainerConfig(checkpoint_dir=str(blocker / "ck"), verbose=False))
    assert calls == []


# ---------------------------------------------------------------- NaN / Inf -----------


class _PoisonAt:
    """A loss that turns NaN (once) at one optimizer step, on chosen ranks."""

    def __init__(self, trainer, step, ranks=(0,), value=float("nan")):
        self.t, self.step, self.ranks, self.value = trainer, step, ranks, value
        self.done = False

    def __call__(self, out, y):
        loss = nn.functional.cross_entropy(out, y)
        if not self.done and self.t.global_step + 1 == self.step:
            self.done = True
            if dptrain.rank() in self.ranks:
                loss = loss * self.value
        return loss


def test_nan_stops_the_run_before_the_step_and_keeps_finite_checkpoints(tmp_path):
    cdir = str(tmp_path / "ck")
    t = _trainer(cdir)
    t.config.keep_last = t.checkpointer.keep_last = 1
    t.loss_fn = _PoisonAt(t, 21)  # epoch 2 (16 steps per epoch on one rank)
    with pytest.raises(NonFiniteError) as info:
        t.fit(4)
    text = str(info.value)
    assert "non-finite loss at step 21 (epoch 2, batch 5 of 16) on rank(s) [0] (rank 0: loss nan)" in text
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    kept = checkpoint.list_checkpoints(cdir)
    assert kept == [checkpoint.checkpoint_path(cdir, 1, 16)] and repr(kept[0]) in text
    assert all(torch.isfinite(v).all() for v in checkpoint.load(kept[0])["model"].values() if v.is_floating_point())


def test_skip_policy_drops_the_step_and_goes_on(tmp_path):
    t = _trainer(None, nan_policy="skip")
    t.loss_fn = _PoisonAt(t, 5, value=float("inf"))
    summary = t.fit(2)
    assert t.state.skipped_steps == 1 and summary["global_step"] == 31  # 32 batches, one step dropped
    assert all(math.isfinite(h["train_loss"]) for h in summary["history"])
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_skip_policy_gives_up_after_too_many_in_a_row():
    t = _trainer(None, nan_policy="skip", max_consecutive_skips=3)
    t.loss_fn = lambda out, y: nn.functional.cross_entropy(out, y) * float("nan")
    with pytest.raises(NonFiniteError, match=r"\(4 steps in a row\)"):
        t.fit(1)


def _nan_on_rank1(rank, cdir):
    t = _trainer(cdir)
    t.loss_fn = _PoisonAt(t, 3, ranks=(1,))
    try:
        t.fit(2)
    except NonFiniteError as exc:
        return str(exc), t.global_step, checkpoint.list_checkpoints(cdir)
    return None, t.global_step, None


def test_nan_on_one_rank_stops_every_rank_in_the_same_step(tmp_path):
    results = run_ranks(_nan_on_rank1, 2, str(tmp_path / "ck"))
    for rank, (text, step, _) in enumerate(results):
        assert text is not None and text.startswith(f"rank {rank}: ")
        assert "non-finite loss at step 3 (epoch 1, batch 3 of 8) on rank(s) [1] (rank 1: loss nan)" in text
        assert "gradient norm nan on rank(s) [0, 1]" in text and step == 2


def test_best_model_ignores_a_nan_metric():
    t = _trainer(None)
    t._update_best({"accuracy": 0.5, "loss": 1.0}, 1)
    t._update_best({"accuracy": float("nan"), "loss": float("nan")}, 2)
    assert t.best_epoch == 1 and t.best_metric == 0.5


def test_early_stopping_stops_and_reports(tmp_path):
    dptrain.seed_everything(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # nothing improves
    t = Trainer(model, opt, prepare_dataloader(_dataset(), 8), nn.CrossEntropyLoss(),
                TrainerConfig(checkpoint_dir=str(tmp_path / "ck"), early_stopping_patience=2, verbose=False),
                dev_data=prepare_dataloader(_dataset(20, seed=2), 8, mode="eval"))
    summary = t.fit(10)
    assert len(summary["history"]) == 3  # the first evaluation sets the bar; two more without improvement
    assert summary["stopped"].startswith("early stopping: dev loss has not improved by more than 0 for 2 evaluation(s)")
    assert checkpoint.latest_checkpoint(tmp_path / "ck").endswith("ckpt-e0003-s000000036.pt")
    state = checkpoint.load(checkpoint.latest_checkpoint(tmp_path / "ck"))["callbacks"]["EarlyStopping"]
    assert state["wait"] == 2


def test_early_stopping_callback_validates_and_names_missing_metric():
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)
    t = _trainer(None)
    t.callbacks.append(EarlyStopping("f1"))
    with pytest.raises(ValueError, match=r"EarlyStopping\(metric='f1'\) is not among the dev metrics"):
        t.fit(1)


# ---------------------------------------------------------------- what a user watches --


def test_tensorboard_one_x_axis_and_epochs_from_one(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = _trainer(None, log_dir=str(tmp_path / "tb"), log_every_steps=5)
    t.fit(2)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    lr_steps = [e.step for e in acc.Scalars("train/lr")]
    assert lr_steps == sorted(lr_steps) == [5, 10, 15, 20, 25, 30]  # per step only
    assert [e.step for e in acc.Scalars("train/loss")] == [16, 32]
    assert [e.value for e in acc.Scalars("train/epoch")] == [1.0, 2.0]


def test_failed_resume_leaves_no_empty_event_file(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"junk")
    with pytest.raises(checkpoint.CheckpointError):
        _trainer(None, resume=str(bad), log_dir=str(tmp_path / "tb"))
    assert not (tmp_path / "tb").exists()


def test_progress_lines_without_a_terminal(capsys, monkeypatch):
    monkeypatch.setenv("DPTRAIN_PROGRESS", "lines")
    t = _trainer(None, progress=None, progress_interval_s=1e-9)
    t.fit(1)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("epoch 1/1 | batch")]
    assert lines and all("samples/s" in l or "ETA" in l for l in lines)
    assert any("ETA 0:00:" in l for l in lines)


@pytest.mark.parametrize("name", ["metrics.jsonl", "metrics.csv"])
def test_metrics_file_has_one_record_per_value(tmp_path, name):
    import csv

    path = tmp_path / name
    t = _trainer(None, metrics_path=str(path), log_every_steps=8)
    t.fit(2)
    if name.endswith(".csv"):
        rows = list(csv.DictReader(open(path)))
    else:
        rows = [json.loads(line) for line in open(path)]
    assert set(rows[0]) == {"step", "epoch", "split", "metric", "value", "wall_time"}
    dev_acc = [r for r in rows if r["split"] == "dev" and r["metric"] == "accuracy"]
    assert [int(r["epoch"]) for r in dev_acc] == [1, 2] and [int(r["step"]) for r in dev_acc] == [16, 32]
    assert float(dev_acc[-1]["value"]) == pytest.approx(t.history[-1]["dev_accuracy"])
    assert {r["metric"] for r in rows if r["split"] == "train"} >= {"step_loss", "lr", "loss", "epoch"}


# ---------------------------------------------------------------- CPU bf16, tiny dev sets --


def test_cpu_bfloat16_autocast_trains_and_resumes_exactly(tmp_path):
    cdir = str(tmp_path / "ck")
    full = _trainer(None, amp=True, amp_dtype="bfloat16", steps=0)
    assert full.amp and full.scaler is None
    full.fit(2)
    assert all(p.dtype == torch.float32 for p in full.model.parameters())
    _trainer(cdir, amp=True, amp_dtype="bfloat16", steps=5).fit(1)
    os.remove(checkpoint.latest_checkpoint(cdir))  # resume from the mid-epoch one of step 15
    again = _trainer(cdir, resume="auto", amp=True, amp_dtype="bfloat16", steps=5)
    assert again.global_step == 15
    again.fit(2)
    assert _same(_params(again), _params(full))


def _tiny_dev(rank, strategy, n):
    kw = {"fsdp_kwargs": {}} if strategy == "fsdp" else {}
    t = _trainer(None, strategy=strategy, dev_n=n, **kw)
    # The reference: the same weights, one process, the whole dev set in one batch.
    plain = _model()
    plain.load_state_dict(t.model_state_dict())
    plain.eval()
    x, y = _dataset(n, seed=2).tensors
    with torch.no_grad():
        out = plain(x)
    ref = {"loss": float(nn.functional.cross_entropy(out, y)), "accuracy": float((out.argmax(1) == y).float().mean())}
    return t.evaluate(), len(t.dev_loader), ref


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dev_set_smaller_than_the_world(strategy):
    results = run_ranks(_tiny_dev, 3, strategy, 2)
    assert [n for _, n, _ in results] == [1, 1, 0]
    assert results[0][0] == results[1][0] == results[2][0]
    got, ref = results[0][0], results[0][2]
    assert got.keys() >= {"loss", "accuracy"}, got
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6) and got["accuracy"] == ref["accuracy"], (got, ref)
