"""Where the Trainer trains: the device follows the user's model and settings, never the mere
presence of a GPU (issue 20: on a CUDA machine the Trainer moved a CPU model to cuda:0 and the
user's CPU tensors no longer matched it)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import dptrain
from dptrain.train import Trainer, TrainerConfig


def _touch_cuda(*args, **kwargs):
    raise AssertionError("the Trainer initialised CUDA, but the user's model and settings are on the CPU")


def test_a_cpu_model_stays_on_the_cpu_where_cuda_exists(monkeypatch, tmp_path):
    # This machine has no GPU: pretend it has one, and fail on any use of it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_lazy_init", _touch_cuda)
    dptrain.seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    config = TrainerConfig(batch_size=8, checkpoint_dir=str(tmp_path / "ck"), verbose=False, progress=False)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, nn.CrossEntropyLoss(), config,
                      dev_data=data, test_data=data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "pin_memory ... but no accelerator is found"
        summary = trainer.fit(2)
    assert trainer.device == torch.device("cpu") and summary["test"] is not None
    assert all(p.device.type == "cpu" for p in model.parameters())
    # The user's own CPU tensors still meet the model (the error issue 20 reported).
    model.eval()
    assert model(torch.randn(3, 4)).shape == (3, 2)


def test_the_device_setting_overrides_the_rule():
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, nn.CrossEntropyLoss(),
                      TrainerConfig(batch_size=4, verbose=False), device="cpu")
    assert trainer.device == torch.device("cpu")
