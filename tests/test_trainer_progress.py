"""Progress through a pipe (a log file, tee, a cluster's output): a line every few seconds,
with the loss, samples/s and the time left -- on a simulated clock, so no test waits."""

from __future__ import annotations

import re
import time
import types

import torch
from torch import nn

import dptrain
from dptrain.train import Trainer, TrainerConfig
from dptrain.train import log as log_module

SECONDS_PER_BATCH = 0.35  # a 32 s epoch of 92 batches, as in the report that a pipe showed nothing for 35 s


def test_a_piped_epoch_shows_a_full_line_every_few_seconds(monkeypatch, capsys):
    monkeypatch.setenv("DPTRAIN_PROGRESS", "lines")
    clock = [1000.0]
    monkeypatch.setattr(log_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))

    def loss_fn(out, tgt):  # every batch takes SECONDS_PER_BATCH of the simulated clock
        clock[0] += SECONDS_PER_BATCH
        return nn.functional.cross_entropy(out, tgt)

    dptrain.seed_everything(0)
    model = nn.Linear(4, 3)
    data = torch.utils.data.TensorDataset(torch.randn(368, 4), torch.randint(0, 3, (368,)))
    config = TrainerConfig(batch_size=4, verbose=False)  # the default progress settings
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn, config).fit(1)

    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch 1/1 | batch")]
    pattern = r"epoch 1/1 \| batch (\d+)/92 \(\d+%\) \| \d+ samples/s \| loss \d+\.\d{4} \| ETA \d:\d\d:\d\d"
    assert lines and all(re.fullmatch(pattern, line) for line in lines), lines
    batches = [0] + [int(re.match(r"epoch 1/1 \| batch (\d+)", line).group(1)) for line in lines] + [92]
    gaps_s = [(b - a) * SECONDS_PER_BATCH for a, b in zip(batches, batches[1:])]
    assert max(gaps_s) <= 10.5, f"no progress line for {max(gaps_s):.1f} s of the epoch: {lines}"
    assert min(gaps_s[1:-1], default=5) >= 4.9, f"lines come more often than every 5 s: {lines}"
