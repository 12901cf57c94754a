"""The best model: one and the same state on every rank, tested, saved and exported alike
(BatchNorm's running statistics included)."""

from __future__ import annotations

import torch
from torch import nn

import dptrain
from dptrain import checkpoint
from dptrain.train import Trainer, TrainerConfig
from tests._dist import run_ranks


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g) * 3 + 1  # far from BatchNorm's initial statistics
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 1).long())


def _model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _bn_ranks(rank, cdir):
    dptrain.seed_everything(0)
    model = _model()
    config = TrainerConfig(batch_size=5, checkpoint_dir=cdir, verbose=False, progress=False,
                           export_safetensors=f"{cdir}/best.safetensors")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), _data(60, 1), nn.CrossEntropyLoss(), config,
                      dev_data=_data(23, 2), test_data=_data(31, 3))
    summary = trainer.fit(2)
    return {"best": trainer.best_state, "test": summary["test"]}


def test_the_best_model_is_one_state_on_every_rank_and_the_one_saved(tmp_path):
    cdir = str(tmp_path / "ck")
    ranks = run_ranks(_bn_ranks, 2, cdir)
    assert _same(ranks[0]["best"], ranks[1]["best"]), "the ranks hold different best models (BatchNorm statistics?)"
    on_disk = checkpoint.load(f"{cdir}/best.pt")["model"]
    assert _same(on_disk, ranks[0]["best"])
    assert _same(checkpoint.load_safetensors(f"{cdir}/best.safetensors"), on_disk)
    # The test score printed by fit is that of best.pt, evaluated anywhere.
    plain = _model()
    plain.load_state_dict(on_disk)
    plain.eval()
    x, y = _data(31, 3).tensors
    with torch.no_grad():
        loss = nn.functional.cross_entropy(plain(x), y).item()
    assert abs(ranks[0]["test"]["loss"] - loss) <= 1e-5 * max(1.0, abs(loss)), (ranks[0]["test"], loss)
