"""Small models, data and a training loop shared by the DDP tests (run inside rank processes)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import dptrain
from dptrain.models import MLP


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class BNNet(nn.Module):
    """Linear, BatchNorm, Linear on 6 features: parameters and buffers, all used."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 6, batch_first=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


class UnusedBranch(nn.Module):
    """``never`` is never used; ``sometimes`` only when the batch says so (rank-dependent)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.never = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if x[0, 0] > 0:
            h = h + self.sometimes(h)
        return self.b(h)


class TwoHeads(nn.Module):
    """Returns (logits, aux); the tests' loss uses only the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x).mean(1))))


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.b.weight.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Checkpointed(nn.Module):
    """Reentrant activation checkpointing; with ``twice`` one layer runs in two segments."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.twice = twice
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        if self.twice:
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        return self.c(h)


MODELS = {
    "mlp": lambda: MLP([6, 16, 16, 3]),
    "convbn": ConvBN,
    "lstm": LSTMClassifier,
    "unused": UnusedBranch,
    "tied": Tied,
    "frozen": Frozen,
}
EXTRA_MODELS = {"two_heads": TwoHeads, "ckpt": Checkpointed, "ckpt_twice": lambda: Checkpointed(twice=True)}


def make_batch(model: str, rank: int, step: int, batch: int = 4):
    """Deterministic per-(rank, step) data, so any process can rebuild another rank's batch."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if model.startswith("ckpt") or model == "two_heads":
        model = "mlp"
    if model == "convbn":
        x = torch.randn(batch, 3, 6, 6, generator=g)
    elif model == "lstm":
        x = torch.randn(batch, 4, 5, generator=g)
    elif model == "tied":
        x = torch.randint(0, 10, (batch, 3), generator=g)
    else:
        x = torch.randn(batch, 6, generator=g)
        if model == "unused":
            x[0, 0] = 1.0 if (rank + step) % 2 == 0 else -1.0  # 'sometimes' used on some ranks only
    y = torch.randint(0, 10 if model == "tied" else 3, (batch,), generator=g)
    return x, y


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def build_pair(model: str, rank: int, ddp_kwargs: dict, seed: int = 7):
    """Our DDP and PyTorch's on identical copies of one model (rank-dependent init: the
    constructors must broadcast rank 0's weights)."""
    torch.manual_seed(seed + rank)
    base = {**MODELS, **EXTRA_MODELS}[model]()
    ours = dptrain.DDP(copy.deepcopy(base), **ddp_kwargs)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    return ours, theirs


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def snapshot(ddp_model) -> dict:
    """Parameters, buffers and gradients, as plain tensors."""
    out = {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}
    for n, p in ddp_model.module.named_parameters():
        out["grad:" + n] = None if p.grad is None else p.grad.detach().clone()
    return out


def world() -> int:
    return dist.get_world_size()
