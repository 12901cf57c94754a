"""The Trainer's stateful parts, as the Checkpointer sees them.

A checkpoint is the dict built by :meth:`StatefulParts.to_save`: one entry per part, each
an object with ``state_dict()``/``load_state_dict()`` (a few are small adapters around a
part that needs context: the strategy for the model and optimizer, the optimizer's fresh
learning rates for the scheduler). Each adapter is handed the parts it serves, never the
Trainer. Restoring walks the same dict in the same order -- model, optimizer, scheduler,
scaler, progress, per-rank state, loader position, callbacks, the trackers' run ids -- so what
is saved and what is loaded can never drift apart.

[Note: the best model follows the resumed state]
``best.pt`` is rewritten whenever the dev metric improves, so after a fall-back to an older
checkpoint (the newest one corrupt) it may hold the best of a part of the run that is being
discarded. Each checkpoint therefore carries its own best: the checkpoint's weights when the
best is the epoch just saved, else a copy of the best weights (``best_model``). A resume takes
the best from there and rewrites ``best.pt`` when the file on disk is another one, so the
final test, the export and ``best.pt`` all follow the state that was resumed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dptrain import comm
from dptrain.runtime.env import _warn_once_main
from dptrain.train.checkpointer import notice
from dptrain.train.schedule import restore_scheduler

if TYPE_CHECKING:
    from dptrain.runtime.env import World
    from dptrain.train.callbacks import Callback
    from dptrain.train.checkpointer import Checkpointer
    from dptrain.train.config import TrainerConfig
    from dptrain.train.state import TrainState
    from dptrain.train.strategy import Strategy
    from dptrain.train.trackers import TrackerGroup

__all__ = ["StatefulParts"]


class _Model:
    def __init__(self, strategy: Strategy, model: nn.Module) -> None:
        self.strategy, self.model = strategy, model
        self.source = "the checkpoint"

    def state_dict(self) -> dict:
        return self.strategy.model_state_dict(self.model, rank0_only=True)

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_model_state_dict(self.model, state, source=self.source)


class _Optimizer:
    def __init__(self, strategy: Strategy, optimizer: torch.optim.Optimizer) -> None:
        self.strategy, self.optimizer = strategy, optimizer
        self.sharded = strategy.shards_optimizer  # each rank writes its own part
        # What the freshly built scheduler set, before a checkpoint's rates replace them.
        self.fresh_lrs = [g["lr"] for g in optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.strategy.optimizer_state_dict(self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_optimizer_state_dict(self.optimizer, state)


class _Scheduler:
    """The LR scheduler; on another world size it is re-planned from the progress (see schedule.py)."""

    def __init__(self, scheduler: Any, optimizer: _Optimizer, progress: TrainState, train_loader: Any, world_size: int,
                 config: TrainerConfig) -> None:
        self.scheduler, self.opt, self.progress, self.train_loader = scheduler, optimizer, progress, train_loader
        self.world_size, self.config = world_size, config
        self.note: str | None = None
        self.saved_world_size: int | None = None  # set by restore() before loading

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.note = restore_scheduler(self.scheduler, state, self.opt.optimizer, self.opt.fresh_lrs, self._position())

    def _position(self) -> int | None:
        """Where a re-planned schedule must be put: the saved count on the same world size, else
        this run's equivalent of the saved progress (epochs done, and steps within the epoch)."""
        p = self.progress
        if self.saved_world_size == self.world_size:
            return None
        if self.config.scheduler_interval == "epoch":
            return p.epoch
        accum = self.config.gradient_accumulation_steps
        try:
            per_epoch = -(-len(self.train_loader) // accum)
        except TypeError:  # a stream without a length: only the step count is known
            return p.global_step
        batches = p.batch_in_epoch * self.saved_world_size / self.world_size  # same samples, other shards
        return p.epoch * per_epoch + min(per_epoch, round(batches / accum))


class _PerRank:
    """Every rank's RNG streams, running epoch sums and buffers, gathered to rank 0."""

    def __init__(self, progress: TrainState, model: nn.Module, rank: int, world_size: int) -> None:
        self.progress, self.model, self.rank, self.world_size = progress, model, rank, world_size

    def state_dict(self) -> list | None:
        mine = self.progress.rank_state_dict()
        # Buffers too: FSDP (unlike DDP) never syncs them, so each rank's BatchNorm statistics are its own.
        mine["buffers"] = {k: v.detach().cpu() for k, v in self.model.named_buffers()}
        return comm.gather_object(mine, dst=0)

    def load_state_dict(self, per_rank: list) -> None:
        self.progress.load_rank_states(per_rank, self.rank, self.world_size)
        if len(per_rank) == self.world_size:
            buffers = dict(self.model.named_buffers())
            with torch.no_grad():
                for name, value in per_rank[self.rank].get("buffers", {}).items():
                    if name in buffers and buffers[name].shape == value.shape:
                        buffers[name].copy_(value)


class _Loader:
    def __init__(self, train_loader: Any, progress: TrainState) -> None:
        self.train_loader, self.progress = train_loader, progress

    def state_dict(self) -> Any:
        loader = self.train_loader
        if self.progress.batch_in_epoch == 0:
            return None
        if hasattr(loader, "state_dict"):
            return loader.state_dict()
        sampler = getattr(loader, "sampler", None)
        # A plain DataLoader over a resumable sampler: the sampler counts what it yielded
        # (exact without workers; with workers prepare_dataloader's loader is the exact one).
        return {"sampler": sampler.state_dict()} if hasattr(sampler, "state_dict") else None

    def load_state_dict(self, state: Any) -> None:
        self.progress.set_loader_position(state)


class _Callbacks:
    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks  # the Trainer's own list: callbacks appended later are saved too

    def state_dict(self) -> dict:
        return {type(cb).__name__: cb.state_dict() for cb in self.callbacks if hasattr(cb, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for cb in self.callbacks:
            if type(cb).__name__ in state and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state[type(cb).__name__])


class StatefulParts:
    """Builds the checkpoint dict of a Trainer's parts, and restores the parts from one."""

    def __init__(self, *, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 scaler: Any, progress: TrainState, train_loader: Any, callbacks: list[Callback],
                 checkpointer: Checkpointer, config: TrainerConfig, world: World,
                 trackers: TrackerGroup | None = None) -> None:
        self.strategy, self.progress, self.checkpointer, self.config = strategy, progress, checkpointer, config
        self.world_size = world.world_size
        self.model = _Model(strategy, model)
        self.optimizer = _Optimizer(strategy, optimizer)
        self.scheduler = _Scheduler(scheduler, self.optimizer, progress, train_loader, world.world_size, config)
        # The progress comes before the scheduler, which may need it to re-plan (see schedule.py).
        self.parts: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, **strategy.extra_parts(),
                                      "train_state": progress}
        if scheduler is not None:
            self.parts["scheduler"] = self.scheduler
        if scaler is not None:
            self.parts["scaler"] = scaler
        self.parts.update(per_rank=_PerRank(progress, model, world.rank, world.world_size),
                          train_loader=_Loader(train_loader, progress), callbacks=_Callbacks(callbacks))
        if trackers is not None:
            # Rank 0's run ids, so that a resume continues the same W&B / MLflow runs (see trackers.group).
            self.parts["trackers"] = trackers

    def to_save(self, best_state: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """The checkpoint dict; ``best_state``: the Trainer's copy of the best weights, if any."""
        return {**self.parts, "best_model": self._best_to_save(best_state), "strategy": self.strategy.name,
                "config": self.config.to_dict()}

    def _best_to_save(self, best_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The best weights unless the checkpoint's own are the best (the epoch just finished)."""
        p = self.progress
        if best_state is None or (p.best_epoch == p.epoch and p.batch_in_epoch == 0):
            return None
        return best_state

    def _resumed_best(self, path: str, content: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The best model of the resumed state; see [Note: the best model follows the resumed state]."""
        p = self.progress
        if p.best_epoch is None:
            return None
        best = content.get("best_model")
        if best is None and p.best_step is not None and p.best_epoch == p.epoch and p.batch_in_epoch == 0:
            best = content["model"]
        on_disk = self.checkpointer.load_best()
        disk_step = on_disk.get("global_step") if on_disk is not None else None
        # A checkpoint of format 2 does not say which best it had: a best.pt not newer than it is the one.
        fits = disk_step is not None and (disk_step == p.best_step if p.best_step is not None else disk_step <= p.global_step)
        if best is None and fits:
            best = on_disk["model"]
        where = self.checkpointer.best_path
        if best is None:
            notice(
                f"{path!r} recorded its best model at epoch {p.best_epoch}, but {where!r} now holds one of a later, "
                f"discarded part of the run; the best model is chosen again from here on"
            )
            p.best_metric = p.best_epoch = p.best_step = None
            return None
        best = {k: v.detach().to("cpu").clone() for k, v in best.items()}
        if not fits:
            notice(
                f"{where!r} held the best model of a discarded part of the run (step {disk_step}); rewritten with the "
                f"best model of {path!r} (epoch {p.best_epoch}, step {p.best_step})"
            )
            self.checkpointer.save_best({"model": best, "epoch": p.best_epoch, "metric": self.config.best_metric,
                                         "value": p.best_metric, "global_step": p.best_step})
        return best

    def restore(self, path: str, content: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """Load every part from ``content`` (read from ``path`` by the Checkpointer); returns the
        best weights of the resumed state (None when there is none), for the Trainer to keep."""
        strategy = self.strategy
        saved_strategy = content.get("strategy")
        saved_sharded = "optimizer" in content.get("sharded", ()) or saved_strategy == "fsdp"
        if saved_sharded != strategy.shards_optimizer:
            raise ValueError(
                f"{path!r} was written with strategy {saved_strategy!r}, whose optimizer state is "
                f"{'sharded across ranks' if saved_sharded else 'replicated'}, but this Trainer uses strategy "
                f"{strategy.name!r}; resume it with strategy={saved_strategy!r}"
                + (" and the same world size" if saved_sharded else "")
            )
        self.model.source = f"checkpoint {path!r}"
        self.scheduler.saved_world_size = len(content["per_rank"])
        for name, part in self.parts.items():
            value = content.get(name)
            if value is not None:
                part.load_state_dict(value)
        saved_world = self.scheduler.saved_world_size
        if saved_world != self.world_size:
            _warn_once_main(
                f"{path!r} was written by {saved_world} ranks and is resumed on {self.world_size}: weights and optimizer "
                f"are restored, but the run will not replay the original one bit for bit (RNG streams and data shards differ)"
            )
        best = self._resumed_best(path, content)
        if self.scheduler.note:
            notice(self.scheduler.note)
        return best
