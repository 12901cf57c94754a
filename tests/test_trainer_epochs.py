"""Epochs count from 1 wherever a user reads them: printed lines, the summary, the history,
best.pt, checkpoint names, the metrics file, the safetensors export and the callbacks."""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

import dptrain
from dptrain import checkpoint
from dptrain.train import Callback, Trainer, TrainerConfig


class _Scores:
    """A dev metric that makes the 2nd of 3 epochs the best one (then any call: 0)."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, out, tgt):
        return {"score": self.values.pop(0) if self.values else 0.0}


class _Seen(Callback):
    def __init__(self):
        self.step_epochs, self.record_epochs = set(), []

    def on_step_end(self, trainer, info):
        self.step_epochs.add(info.epoch)

    def on_epoch_end(self, trainer, record):
        self.record_epochs.append(record["epoch"])


def _fit(tmp_path, capsys, **kwargs):
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    seen = _Seen()
    config = TrainerConfig(
        batch_size=8, checkpoint_dir=str(tmp_path / "ck"), keep_last=0, best_metric="score", best_mode="max",
        metrics_path=str(tmp_path / "metrics.jsonl"), export_safetensors=str(tmp_path / "best.safetensors"),
        progress=False, verbose=True,
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, nn.CrossEntropyLoss(), config,
                      dev_data=data, metric_fn=_Scores([0.5, 0.9, 0.7]), callbacks=[seen], **kwargs)
    summary = trainer.fit(3)
    return trainer, summary, seen, capsys.readouterr().out


def test_every_place_counts_epochs_from_one(tmp_path, capsys):
    trainer, summary, seen, out = _fit(tmp_path, capsys)
    # The printed line of the best epoch is "epoch 2/3"; everything else must say 2 as well.
    best_line = [line for line in out.splitlines() if "score 0.9000" in line]
    assert len(best_line) == 1 and best_line[0].startswith("epoch 2/3 "), out
    assert summary["best"]["epoch"] == 2
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert seen.record_epochs == [1, 2, 3] and seen.step_epochs == {1, 2, 3}
    best = checkpoint.load(tmp_path / "ck" / "best.pt")
    assert best["epoch"] == 2
    names = sorted(os.listdir(tmp_path / "ck"))
    (best_ckpt,) = [n for n in names if n.startswith(f"ckpt-e{best['epoch']:04d}-")]
    assert all(torch.equal(v, checkpoint.load(tmp_path / "ck" / best_ckpt)["model"][k]) for k, v in best["model"].items())
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    (dev_best,) = [r for r in rows if r["split"] == "dev" and r["metric"] == "score" and r["value"] == 0.9]
    assert dev_best["epoch"] == 2
    from safetensors import safe_open

    with safe_open(str(tmp_path / "best.safetensors"), "pt") as fh:
        assert fh.metadata()["epoch"] == "2"


def test_a_resumed_run_keeps_counting_from_one(tmp_path, capsys):
    _fit(tmp_path, capsys)
    _, summary, _, out = _fit(tmp_path, capsys, resume=str(tmp_path / "ck" / "ckpt-e0002-s000000006.pt"))
    assert re.search(r"^resumed from .*\(epoch 3, batch 0, step 6\)$", out, re.M), out
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3] and summary["best"]["epoch"] == 2


def test_a_checkpoint_of_the_earlier_format_is_read_in_todays_numbering(tmp_path, capsys):
    # Format 2 counted the history and the best epoch from 0.
    _fit(tmp_path, capsys)
    path = tmp_path / "ck" / "ckpt-e0002-s000000006.pt"
    old = checkpoint.load(path)
    old["format"] = "dptrain.trainer/2"
    old["train_state"]["history"] = [dict(h, epoch=h["epoch"] - 1) for h in old["train_state"]["history"]]
    old["train_state"]["best_epoch"] -= 1
    old["train_state"].pop("best_step", None)
    checkpoint.save(old, path)
    _, summary, _, _ = _fit(tmp_path, capsys, resume=str(path))
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3] and summary["best"]["epoch"] == 2
