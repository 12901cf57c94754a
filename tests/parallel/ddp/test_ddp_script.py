"""A typical PyTorch DDP training script, run with PyTorch's class and with ours.

The script is what tutorials and real projects write: a CNN with BatchNorm and dropout,
``DistributedSampler`` with ``set_epoch``, SGD with momentum and weight decay, a learning
rate schedule, gradient clipping, gradient accumulation with ``no_sync()``, ``train()`` /
``eval()`` with a validation pass, an EMA of the weights kept with ``copy.deepcopy`` of
the wrapped model, a few epochs. Changing the DDP class must not change a bit of the final
weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dptrain
from tests._dist import run_ranks


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(16 * 4 * 4, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def train_script(ddp_class, rank: int, world_size: int, epochs: int = 3, accumulate: int = 2) -> dict:
    """The script; ``ddp_class`` is the one line a user changes."""
    torch.manual_seed(1234)  # same data and initial model on every rank, as usual
    data = TensorDataset(torch.randn(96, 1, 8, 8), torch.randint(0, 4, (96,)))
    val = TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 4, (32,)))
    torch.manual_seed(1234 + rank)  # per-rank dropout stream
    model = ddp_class(SmallCNN())
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    val_loader = DataLoader(val, batch_size=16, sampler=DistributedSampler(val, world_size, rank, shuffle=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = copy.deepcopy(model)  # exponential moving average of the weights, never trained
    val_losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(loader):
            last_micro = (i + 1) % accumulate == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(model(x), y) / accumulate
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for e, p in zip(ema.module.parameters(), model.module.parameters()):
                        e.lerp_(p, 0.1)
        sched.step()
        model.eval()
        with torch.no_grad():
            val_losses.append(sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in val_loader))
            val_losses.append(sum(F.cross_entropy(ema.module(x), y, reduction="sum").item() for x, y in val_loader))
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    state.update({"ema." + k: v.clone() for k, v in ema.module.state_dict().items()})
    return {"state": state, "val": val_losses}


def _both(rank):
    import torch.distributed as dist

    ws = dist.get_world_size()
    return train_script(nn.parallel.DistributedDataParallel, rank, ws), train_script(dptrain.DDP, rank, ws)


def test_a_real_training_script_gives_the_same_weights_with_either_class():
    for theirs, ours in run_ranks(_both, 2):
        assert ours["val"] == theirs["val"]
        for k, v in theirs["state"].items():
            assert torch.equal(ours["state"][k], v), k
