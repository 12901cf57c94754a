"""The checkpoint's stateful parts without a Trainer: each adapter is handed its parts, so a
checkpoint written from one set of parts restores another, key for key, in the same order."""

from __future__ import annotations

import torch
from torch import nn

from dptrain import checkpoint
from dptrain.runtime.env import World
from dptrain.train import Checkpointer, EarlyStopping, TrainerConfig, TrainState
from dptrain.train._parts import StatefulParts
from dptrain.train.strategy import make_strategy


def _parts(tmp_path, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    config = TrainerConfig(checkpoint_dir=str(tmp_path))
    cpu = torch.device("cpu")
    progress, stopper = TrainState(cpu), EarlyStopping("accuracy", patience=3, mode="max")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8)), batch_size=2)
    parts = StatefulParts(
        strategy=make_strategy("none", 1, cpu, config), model=model, optimizer=optimizer, scheduler=scheduler,
        scaler=None, progress=progress, train_loader=loader, callbacks=[stopper],
        checkpointer=Checkpointer(str(tmp_path), 2, 0, 1), config=config, world=World(),
    )  # fmt: skip
    return parts, model, optimizer, scheduler, progress, stopper


def test_a_checkpoint_of_the_parts_restores_fresh_parts(tmp_path):
    parts, model, optimizer, scheduler, progress, stopper = _parts(tmp_path, 0)
    model(torch.randn(4, 4)).sum().backward()  # momentum buffers and BatchNorm statistics
    optimizer.step()
    scheduler.step()
    progress.epoch, progress.batch_in_epoch, progress.global_step = 1, 0, 4
    progress.history = [{"epoch": 1, "train_loss": 0.5}]
    stopper.best, stopper.best_epoch, stopper.wait = 0.75, 1, 1
    path = parts.checkpointer.save(parts.to_save(None), epoch=1, step=4)
    assert list(checkpoint.load(path, map_location="cpu")) == [
        "format", "world_size", "job", "lineage", "model", "optimizer", "train_state", "scheduler", "per_rank", "train_loader",
        "callbacks", "best_model", "strategy", "config", "sharded",
    ]  # fmt: skip

    fresh, model2, optimizer2, scheduler2, progress2, stopper2 = _parts(tmp_path, 1)
    assert fresh.restore(path, fresh.checkpointer.read(path, map_location="cpu")) is None  # no best recorded
    for (k, v), (k2, v2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert optimizer2.state_dict()["state"][0]["momentum_buffer"].equal(optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert progress2.state_dict() == progress.state_dict()
    assert stopper2.state_dict() == stopper.state_dict()
