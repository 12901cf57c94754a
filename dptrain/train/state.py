"""TrainState: where a run is -- counters, the epoch's running sums, history, best metric --
and the one place that replays a resumed epoch exactly.

[Note: bitwise resume]
A run restarted from a checkpoint must reach the same parameters as a run that never
stopped (on CPU, bit for bit). That holds when the resumed run replays the very same
sequence of random draws and batches:

* checkpoints are taken only between optimizer steps (never inside an accumulation group)
  or at the end of an epoch *after* everything the epoch's end does (dev evaluation, the
  scheduler step), so that "what comes next" is the same in both runs;
* every rank's RNG states (python, numpy, torch, CUDA) are saved and restored per rank;
* creating a DataLoader iterator draws one number from torch's global generator. A
  checkpoint taken at the start of an epoch was taken *before* that draw, one taken mid-
  epoch *after* it; so the RNG state is restored before ``iter(loader)`` in the first case
  and after it in the second (:meth:`TrainState.begin_epoch`);
* the loader's position (``loader.state_dict()``, counted from what it handed out) brings
  back the remaining batches of the epoch in the same order; a loader without state is
  fast-forwarded by drawing and dropping the consumed batches;
* running sums (epoch loss), the step counter, the history and the best metric are part of
  the checkpoint.
Exactness needs ``num_workers=0`` (or datasets without random transforms): worker
processes own RNG streams that are not checkpointed. On more than two ranks the ring
all-reduce may sum in a different order after a restart (bucket layout), so there the
result matches to fp32 rounding.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch

from dptrain.data import StreamLoader
from dptrain.seeding import get_rng_state, set_rng_state

__all__ = ["TrainState", "reads_state"]


def reads_state(name: str) -> property:
    """A Trainer attribute that reads its TrainState (``trainer.epoch`` is ``trainer.state.epoch``);
    the Trainer changes the progress in ``self.state`` itself."""
    return property(lambda trainer: getattr(trainer.state, name),
                    doc=f"``self.state.{name}``, read-only; see :class:`dptrain.train.TrainState`.")


def _length(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader that has none (over a stream without ``__len__``)."""
    try:
        return len(loader)
    except TypeError:
        return None


class TrainState:
    """Progress of a run: what ``fit`` needs to continue exactly where a checkpoint stopped.

    Attributes:
        epoch: the epoch in progress (or next to run), counted from 0.
        batch_in_epoch: batches of ``epoch`` already trained.
        global_step: optimizer steps so far (skipped non-finite steps not counted).
        skipped_steps: optimizer steps dropped by ``nan_policy="skip"``.
        history: one dict per finished epoch; its ``"epoch"`` counts from 1, as everywhere a
            user reads an epoch (``epoch`` here is an index: the epochs done so far).
        best_metric, best_epoch: the best dev value so far and its epoch, from 1 (None before any).
        best_step: ``global_step`` when the best was found (None before any).
        loss_sum, sample_count: this rank's running loss sum and sample count of ``epoch``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.skipped_steps = 0
        self.history: list[dict[str, Any]] = []
        self.best_metric: float | None = None
        self.best_epoch: int | None = None
        self.best_step: int | None = None
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.sample_count = 0
        # Set by a resume, consumed by the next begin_epoch.
        self._pending_rng: dict[str, Any] | None = None
        self._pending_loader_state: Any = None

    # -- the epoch's running sums ------------------------------------------------------
    def record_batch(self, loss: torch.Tensor, num_samples: int) -> None:
        self.loss_sum += loss.detach().to(torch.float64) * num_samples
        self.sample_count += num_samples

    def finish_epoch(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.loss_sum.zero_()
        self.sample_count = 0

    # -- replaying a resumed epoch ------------------------------------------------------
    def begin_epoch(self, loader: Any) -> tuple[Iterator[Any], int | None]:
        """Start (or continue) ``epoch`` on ``loader``: returns the batch iterator and the
        number of batches the whole epoch has (so ``batch_in_epoch`` counts towards it), or None
        for a loader without a length (a stream)."""
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(self.epoch)
        num_batches = _length(loader)
        start = self.batch_in_epoch
        if self._pending_rng is not None and start == 0:
            set_rng_state(self._pending_rng)  # before iter(): see [Note: bitwise resume]
            self._pending_rng = None
        fast_forward = 0
        if start > 0:
            saved, sampler = self._pending_loader_state, getattr(loader, "sampler", None)
            if saved is not None and hasattr(loader, "load_state_dict"):
                loader.load_state_dict(saved)
            elif isinstance(saved, dict) and "sampler" in saved and hasattr(sampler, "load_state_dict"):
                sampler.load_state_dict(saved["sampler"])
            else:
                fast_forward = start
            if not fast_forward and num_batches is not None and not isinstance(loader, StreamLoader):
                # The loader now yields the rest of the epoch (re-shared if the world size changed);
                # a stream's length stays the whole epoch's.
                num_batches = start + len(loader)
        self._pending_loader_state = None
        it = iter(loader)
        for _ in range(fast_forward):
            next(it)
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)  # after iter(): the checkpoint was taken mid-epoch
            self._pending_rng = None
        return it, num_batches

    # -- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What is the same on every rank (rank 0's copy is saved)."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "history": copy.deepcopy(self.history),
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "best_step": self.best_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.history = list(state["history"])
        self.best_metric = state["best_metric"]
        self.best_epoch = state["best_epoch"]
        self.best_step = state.get("best_step")  # absent before format 3

    def rank_state_dict(self) -> dict[str, Any]:
        """What differs between ranks: RNG streams and the running loss of the epoch."""
        return {"rng": self.rng_state(), "loss_sum": self.loss_sum.detach().cpu(), "sample_count": self.sample_count}

    def rng_state(self) -> dict[str, Any]:
        """This rank's RNG streams as the run stands: a resumed state not yet applied (it is applied
        where the epoch's iterator is made, see :meth:`begin_epoch`) is the one that counts."""
        return self._pending_rng if self._pending_rng is not None else get_rng_state()

    def load_rank_states(self, per_rank: list[dict[str, Any]], rank: int, world_size: int) -> None:
        """Restore this rank's part of every rank's saved state.

        On the same world size each rank takes its own RNG streams and sums. On another one
        the RNG of the same rank number is used where it exists, and the partial epoch's loss
        is re-spread so that the sum over ranks is kept.
        """
        mine = per_rank[rank] if rank < len(per_rank) else None
        self._pending_rng = mine["rng"] if mine is not None else None
        if mine is not None and len(per_rank) == world_size:
            self.loss_sum = mine["loss_sum"].to(device=self.device, dtype=torch.float64).clone()
            self.sample_count = int(mine["sample_count"])
        else:
            total = sum(float(p["loss_sum"]) for p in per_rank)
            count = sum(int(p["sample_count"]) for p in per_rank)
            self.loss_sum = torch.tensor(total if rank == 0 else 0.0, dtype=torch.float64, device=self.device)
            self.sample_count = count if rank == 0 else 0

    def set_loader_position(self, loader_state: Any) -> None:
        self._pending_loader_state = loader_state
