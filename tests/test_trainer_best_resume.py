"""After a resume, the best model is the best of the state that was resumed: never a best.pt
written by a part of the run that a fallback to an older checkpoint discarded."""

from __future__ import annotations

import torch
from torch import nn

import dptrain
from dptrain import checkpoint
from dptrain.train import Trainer, TrainerConfig
from tests.test_trainer_best import _data, _model, _same


class _Scores:
    def __init__(self, values):
        self.values = list(values)

    def __call__(self, out, tgt):
        return {"score": self.values.pop(0) if self.values else 0.0}


def _trainer(cdir, scores, resume=None):
    dptrain.seed_everything(0)
    model = _model()
    config = TrainerConfig(batch_size=6, checkpoint_dir=cdir, keep_last=0, best_metric="score", best_mode="max",
                           verbose=False, progress=False, export_safetensors=f"{cdir}/best.safetensors")
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), _data(30, 1), nn.CrossEntropyLoss(), config,
                   dev_data=_data(12, 2), test_data=_data(12, 3), metric_fn=_Scores(scores), resume=resume)


def _best_after_falling_back(tmp_path, scores, best_epoch):
    cdir = str(tmp_path / "ck")
    _trainer(cdir, scores).fit(3)
    assert checkpoint.load(f"{cdir}/best.pt")["epoch"] == 3  # written by the part of the run about to be lost
    newest = checkpoint.latest_checkpoint(cdir)
    with open(newest, "r+b") as fh:  # the newest checkpoint is lost: resume falls back to epoch 2's
        fh.truncate(1000)
    resumed = _trainer(cdir, [], resume="auto")
    assert resumed.resumed_from.endswith("ckpt-e0002-s000000010.pt")
    summary = resumed.fit(2)  # nothing left to train: the final test and export only
    (best_ckpt,) = [p for p in checkpoint.list_checkpoints(cdir) if f"ckpt-e{best_epoch:04d}-" in p]
    expected = checkpoint.load(best_ckpt)["model"]
    assert summary["best"]["epoch"] == best_epoch
    assert _same(resumed.best_state, expected), "the final test used a best model from the discarded epoch 3"
    best_pt = checkpoint.load(f"{cdir}/best.pt")
    assert best_pt["epoch"] == best_epoch and _same(best_pt["model"], expected)
    assert _same(checkpoint.load_safetensors(f"{cdir}/best.safetensors"), expected)


def test_best_follows_the_resumed_state_when_it_was_the_resumed_epoch(tmp_path):
    _best_after_falling_back(tmp_path, [0.1, 0.2, 0.3], best_epoch=2)


def test_best_follows_the_resumed_state_when_it_was_an_earlier_epoch(tmp_path):
    _best_after_falling_back(tmp_path, [0.5, 0.1, 0.9], best_epoch=1)
