"""A Trainer job over a streamed data set (an IterableDataset without ``__len__``), for the stream tests.

Run under ``dptrain run`` (with ``--recovery in-place`` for the kill test) or called in a rank by
``run(...)``. Each sample carries its number (``idx``); the model has one weight per sample that only that
sample's loss touches (``w[id]``, plain SGD, lr 1), so after training ``-w * world_size`` counts
how many times each sample was trained with a non-zero weight: exactly once per epoch is a vector
of ones times the epochs. A small MLP with dropout besides makes the RNG streams matter.

Environment (script mode):
  OUT      directory for the final state of each rank (``final-rank<r>.pt``) and kill markers
  KILL     "rank:step": that rank's first process SIGKILLs itself in the forward of optimizer step ``step``
  SAMPLES  samples in the stream (default 203), WORKERS loader workers (default 2)
  STREAM   seekable (default), plain (no protocol: read whole, read and dropped on a resume) or uneven
  STEPS    fit(max_steps=...) (default: none, 2 epochs)
"""

from __future__ import annotations

import json
import os
import signal

import torch
from torch import nn
from torch.utils.data import IterableDataset

import dptrain


class Numbered(IterableDataset):
    """Samples ``{"idx", "x"}`` numbered 0..n-1, in an order that changes with the epoch; no ``__len__``,
    no way to split or seek (a generator): read whole by every reader, and read and dropped on a resume."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.part = n, 0, (0, 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ids(self) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        index, parts = self.part
        return order[index::parts]

    def _samples(self, start: int):
        for i in self._ids()[start:]:
            g = torch.Generator().manual_seed(i)
            yield {"idx": torch.tensor(i), "x": torch.randn(4, generator=g)}

    def __iter__(self):
        return self._samples(0)


class Seekable(Numbered):
    """The same stream with dptrain's protocol: split into parts that read nothing of the others, and sought."""

    num_shards = 16

    def shard(self, num_shards: int, index: int) -> "Seekable":
        part = Seekable(self.n)
        part.epoch, part.part = self.epoch, (index, num_shards)
        return part

    def iter_from(self, start: int):
        return self._samples(start)


class Uneven(Seekable):
    """Four parts of very different sizes (35%, 35%, 15%, 15%): on 2 ranks x 2 workers the first
    rank's share is more than twice the second's, so the ranks' ends differ by many batches."""

    num_shards = 4
    _CUTS = (0.0, 0.35, 0.7, 0.85, 1.0)

    def shard(self, num_shards: int, index: int) -> "Uneven":
        assert num_shards == 4, num_shards
        part = Uneven(self.n)
        part.epoch, part.part = self.epoch, (index, num_shards)
        return part

    def _ids(self) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        index, parts = self.part
        if parts == 1:
            return order
        return order[round(self._CUTS[index] * self.n):round(self._CUTS[index + 1] * self.n)]


class Model(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))

    def forward(self, idx, x):
        return self.w[idx].sum() + 0.01 * self.net(x).square().mean()


STREAMS = {"seekable": Seekable, "plain": Numbered, "uneven": Uneven}


def build(n: int, workers: int, cdir: str | None = None, resume=False, stream: str = "seekable", **cfg) -> dptrain.Trainer:
    dptrain.seed_everything(0)
    model = Model(n)
    loader = dptrain.prepare_dataloader(STREAMS[stream](n), batch_size=4, num_workers=workers,
                                        uneven=cfg.pop("uneven", "join"))
    config = dptrain.TrainerConfig(checkpoint_dir=cdir, keep_last=0, verbose=False, nan_policy="off", **cfg)
    return dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), loader, config=config, resume=resume)


def state(trainer: dptrain.Trainer) -> dict:
    return {"state": {k: v.detach().clone() for k, v in trainer.model_state_dict().items()},
            "step": trainer.global_step, "history": [{k: v for k, v in h.items() if k != "time_s" and
                                                      k != "samples_per_s"} for h in trainer.history]}


def main() -> None:
    out = os.environ["OUT"]
    dptrain.init()
    n, workers = int(os.environ.get("SAMPLES", "203")), int(os.environ.get("WORKERS", "2"))
    trainer = build(n, workers, stream=os.environ.get("STREAM", "seekable"))
    kill = os.environ.get("KILL")
    gen = int(os.environ.get("DPTRAIN_GENERATION") or 0)
    if kill and not gen:
        rank, at = (int(v) for v in kill.split(":"))
        if trainer.rank == rank:
            def pre(module, args):
                if module.training and trainer.global_step + 1 == at:
                    with open(os.path.join(out, f"killed-rank{rank}.json"), "w") as fh:
                        json.dump({"rank": rank, "step": trainer.global_step, "pid": os.getpid()}, fh)
                    os.kill(os.getpid(), signal.SIGKILL)
            trainer.model.module.register_forward_pre_hook(pre)
    steps = os.environ.get("STEPS")
    trainer.fit(max_steps=int(steps)) if steps else trainer.fit(max_epochs=2)
    torch.save({**state(trainer), "pid": os.getpid()}, os.path.join(out, f"final-rank{trainer.rank}.pt"))
    dptrain.shutdown()


if __name__ == "__main__":
    main()
