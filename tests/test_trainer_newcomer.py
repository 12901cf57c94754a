"""A newcomer's mistakes with the Trainer get the right training or a clear refusal, never a
run that looks fine and is not: a forgotten ``dptrain.init()``, a plain DataLoader, loaders with
different numbers of batches on different ranks, an optimizer on another model's parameters,
and no tqdm installed."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from torch import nn

import dptrain
from dptrain.data import prepare_dataloader
from dptrain.train import Trainer, TrainerConfig
from tests._dist import run_ranks
from tests.test_trainer import _dataset, _params, _same


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 3))  # batches of 1 train too


def _fit(loader_or_data, epochs=2, **cfg):
    dptrain.seed_everything(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = TrainerConfig(verbose=False, progress=False, **cfg)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = Trainer(model, opt, loader_or_data, nn.CrossEntropyLoss(), config)
        trainer.fit(epochs)
    return trainer, [str(w.message) for w in seen]


# -------------------------------------------------------------- a forgotten dptrain.init() --
def _without_init(rank):
    assert not dptrain.is_initialized()  # dptrain.spawn sets the launcher's variables, nothing more
    trainer, said = _fit(_dataset(9), batch_size=2)
    return {"params": _params(trainer), "said": said, "steps": trainer.global_step}


def test_a_trainer_under_a_launcher_joins_the_job_when_init_was_forgotten():
    """Before: each rank trained alone on its share and ended with weights of its own, exit 0."""
    r0, r1 = dptrain.spawn(_without_init, 2, start_method="forkserver", timeout=90)
    assert _same(r0["params"], r1["params"]), "the ranks diverged: DDP did not average their gradients"
    assert r0["steps"] == r1["steps"] == 2 * 3  # 9 samples over 2 ranks at batch 2: 3 steps an epoch
    assert any("dptrain.init() had not been called" in s for s in r0["said"]), r0["said"]
    assert not any("dptrain.init()" in s for s in r1["said"]), "said from rank 0 only"


# ------------------------------------------------------------------------ a plain loader --
def _plain_loaders(rank):
    data = _dataset(9)
    out = {}
    plain = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, drop_last=False)
    trainer, said = _fit(plain)
    out["plain"] = (_params(trainer), trainer.global_step, len(trainer.train_loader), said)
    trainer, _ = _fit(prepare_dataloader(data, batch_size=2, shuffle=True, seed=0))
    out["prepared"] = _params(trainer)
    # Told not to: the loader stays as it was (every rank reads all 9 samples: 5 batches).
    kept = torch.utils.data.DataLoader(data, batch_size=2)
    trainer, said = _fit(kept, epochs=1, use_distributed_sampler=False)
    out["kept"] = (trainer.train_loader is kept, trainer.global_step)
    # An evaluation-style loader (uneven shards: 5 and 4 batches) used for training.
    uneven = prepare_dataloader(data, batch_size=1, mode="eval")
    try:
        _fit(uneven, epochs=1)
        out["uneven"] = None
    except RuntimeError as exc:
        out["uneven"] = str(exc)
    return out


def test_a_plain_dataloader_is_resharded_and_unequal_batch_counts_are_refused():
    """Before: every rank trained on the whole data set (5 steps for 9 samples at batch 2), and
    a loader with 5 batches on rank 0 and 4 on rank 1 hung until the collective timeout."""
    r0, r1 = run_ranks(_plain_loaders, 2, timeout=120)
    for out in (r0, r1):
        params, steps, batches, _ = out["plain"]
        assert batches == 3 and steps == 2 * 3, (batches, steps)
        # exactly the training of a loader built with prepare_dataloader (the same shuffle and seed)
        assert _same(params, out["prepared"])
        assert out["kept"] == (True, 5)
        assert out["uneven"] is not None, "an epoch with unequal batch counts was not refused"
        assert "rank 0: 5, rank 1: 4" in out["uneven"] and "dptrain.prepare_dataloader" in out["uneven"]
    assert _same(r0["plain"][0], r1["plain"][0])
    said = r0["plain"][3]
    assert any("rebuilt over dptrain.DistributedSampler(shuffle=True" in s and "use_distributed_sampler=False" in s
               for s in said), said
    assert not any("rebuilt" in s for s in r1["plain"][3]), "said from rank 0 only"


# ---------------------------------------------------------------- an optimizer elsewhere --
@pytest.mark.parametrize("which", ["a copy of the model", "another model", "partly the model's"])
def test_an_optimizer_on_parameters_that_are_not_the_models_is_refused(which):
    """Before: the loss stayed where it was, epoch after epoch, with no message."""
    model = _model()
    if which == "a copy of the model":
        params = list(copy.deepcopy(model).parameters())
    elif which == "another model":
        params = list(nn.Linear(6, 3).parameters())
    else:
        params = list(model.parameters()) + [nn.Parameter(torch.zeros(4, 4))]
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match=r"the optimizer holds \d+ parameter\(s\) and .* the model's") as err:
        Trainer(model, opt, _dataset(12), nn.CrossEntropyLoss(), TrainerConfig(batch_size=4, verbose=False))
    assert "model.parameters()" in str(err.value)
    if which == "partly the model's":
        assert "(4, 4)" in str(err.value)


def test_an_optimizer_on_a_subset_or_a_learnable_loss_is_accepted():
    model = _model()
    loss = nn.CrossEntropyLoss()
    loss.temperature = nn.Parameter(torch.ones(()))  # a loss with a parameter of its own
    head_and_loss = list(model[-1].parameters()) + [loss.temperature]
    trainer = Trainer(model, torch.optim.SGD(head_and_loss, lr=0.1), _dataset(12), loss,
                      TrainerConfig(batch_size=4, verbose=False, progress=False))
    trainer.fit(1)
    assert trainer.global_step == 3


# ------------------------------------------------------------------------- without tqdm --
def test_the_trainer_shows_progress_lines_when_tqdm_is_not_installed(monkeypatch, capsys):
    """Before: ModuleNotFoundError: tqdm at the first epoch, in a terminal, after `pip install -e .`."""
    for name in [m for m in sys.modules if m == "tqdm" or m.startswith("tqdm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setenv("DPTRAIN_PROGRESS", "tty")  # a terminal watches
    dptrain.seed_everything(0)
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _dataset(12), nn.CrossEntropyLoss(),
                      TrainerConfig(batch_size=4, progress_interval_s=1e-9))
    trainer.fit(1)
    assert trainer.log.mode == "lines"
    assert "epoch 1/1 | batch" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="tqdm package is not installed"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _dataset(12), nn.CrossEntropyLoss(),
                TrainerConfig(batch_size=4, progress=True, verbose=False)).fit(1)
