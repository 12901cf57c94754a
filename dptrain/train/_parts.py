"""The Trainer's stateful parts, as the Checkpointer sees them.

A checkpoint is the dict built by :meth:`StatefulParts.to_save`: one entry per part, each
an object with ``state_dict()``/``load_state_dict()`` (a few are small adapters around a
part that needs context: the strategy for the model and optimizer, the optimizer's fresh
learning rates for the scheduler). Restoring walks the same dict in the same order --
model, optimizer, scheduler, scaler, progress, per-rank state, loader position, callbacks --
so what is saved and what is loaded can never drift apart.

[Note: the best model follows the resumed state]
``best.pt`` is rewritten whenever the dev metric improves, so after a fall-back to an older
checkpoint (the newest one corrupt) it may hold the best of a part of the run that is being
discarded. Each checkpoint therefore carries its own best: the checkpoint's weights when the
best is the epoch just saved, else a copy of the best weights (``best_model``). A resume takes
the best from there and rewrites ``best.pt`` when the file on disk is another one, so the
final test, the export and ``best.pt`` all follow the state that was resumed.
"""

from __future__ import annotations

from typing import Any

import torch

from dptrain import comm
from dptrain.env import _warn_once_main
from dptrain.train.checkpointer import notice
from dptrain.train.schedule import restore_scheduler

__all__ = ["StatefulParts", "delegate"]


def delegate(name: str) -> property:
    """A Trainer attribute kept in its TrainState (``trainer.epoch`` is ``trainer.state.epoch``)."""

    def get(self):
        return getattr(self.state, name)

    def set_(self, value):
        setattr(self.state, name, value)

    return property(get, set_, doc=f"``self.state.{name}``; see :class:`dptrain.train.TrainState`.")


class _Model:
    def __init__(self, trainer) -> None:
        self.t = trainer
        self.source = "the checkpoint"

    def state_dict(self) -> dict:
        return self.t.strategy.model_state_dict(self.t.model, rank0_only=True)

    def load_state_dict(self, state: dict) -> None:
        self.t.strategy.load_model_state_dict(self.t.model, state, source=self.source)


class _Optimizer:
    def __init__(self, trainer) -> None:
        self.t = trainer
        self.sharded = trainer.strategy.shards_optimizer  # each rank writes its own part
        # What the freshly built scheduler set, before a checkpoint's rates replace them.
        self.fresh_lrs = [g["lr"] for g in trainer.optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.t.strategy.optimizer_state_dict(self.t.optimizer)

    def load_state_dict(self, state: dict) -> None:
        self.t.strategy.load_optimizer_state_dict(self.t.optimizer, state)


class _Scheduler:
    def __init__(self, trainer, optimizer_part: _Optimizer) -> None:
        self.t, self.opt = trainer, optimizer_part
        self.note: str | None = None
        self.saved_world_size: int | None = None  # set by restore() before loading

    def state_dict(self) -> dict:
        return self.t.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.note = restore_scheduler(self.t.scheduler, state, self.t.optimizer, self.opt.fresh_lrs, self._position())

    def _position(self) -> int | None:
        """Where a re-planned schedule must be put: the saved count on the same world size, else
        this run's equivalent of the saved progress (epochs done, and steps within the epoch)."""
        t = self.t
        if self.saved_world_size == t.world.world_size:
            return None
        if t.config.scheduler_interval == "epoch":
            return t.epoch
        accum = t.config.gradient_accumulation_steps
        per_epoch = -(-len(t.train_loader) // accum)
        batches = t.batch_in_epoch * self.saved_world_size / t.world.world_size  # same samples, other shards
        return t.epoch * per_epoch + min(per_epoch, round(batches / accum))


class _PerRank:
    """Every rank's RNG streams, running epoch sums and buffers, gathered to rank 0."""

    def __init__(self, trainer) -> None:
        self.t = trainer

    def state_dict(self) -> list | None:
        mine = self.t.state.rank_state_dict()
        # Buffers too: FSDP (unlike DDP) never syncs them, so each rank's BatchNorm statistics are its own.
        mine["buffers"] = {k: v.detach().cpu() for k, v in self.t.model.named_buffers()}
        return comm.gather_object(mine, dst=0)

    def load_state_dict(self, per_rank: list) -> None:
        t = self.t
        world = t.world.world_size
        t.state.load_rank_states(per_rank, t.rank, world)
        if len(per_rank) == world:
            buffers = dict(t.model.named_buffers())
            with torch.no_grad():
                for name, value in per_rank[t.rank].get("buffers", {}).items():
                    if name in buffers and buffers[name].shape == value.shape:
                        buffers[name].copy_(value)


class _Loader:
    def __init__(self, trainer) -> None:
        self.t = trainer

    def state_dict(self) -> Any:
        loader = self.t.train_loader
        if self.t.batch_in_epoch == 0:
            return None
        if hasattr(loader, "state_dict"):
            return loader.state_dict()
        sampler = getattr(loader, "sampler", None)
        # A plain DataLoader over a resumable sampler: the sampler counts what it yielded
        # (exact without workers; with workers prepare_dataloader's loader is the exact one).
        return {"sampler": sampler.state_dict()} if hasattr(sampler, "state_dict") else None

    def load_state_dict(self, state: Any) -> None:
        self.t.state.set_loader_position(state)


class _Callbacks:
    def __init__(self, trainer) -> None:
        self.t = trainer

    def state_dict(self) -> dict:
        return {type(cb).__name__: cb.state_dict() for cb in self.t.callbacks if hasattr(cb, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for cb in self.t.callbacks:
            if type(cb).__name__ in state and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state[type(cb).__name__])


class StatefulParts:
    """Builds the checkpoint dict of a Trainer, and restores a Trainer from one."""

    def __init__(self, trainer) -> None:
        self.t = trainer
        self.model = _Model(trainer)
        self.optimizer = _Optimizer(trainer)
        self.scheduler = _Scheduler(trainer, self.optimizer)

    def _parts(self) -> dict[str, Any]:
        t = self.t
        # The progress comes before the scheduler, which may need it to re-plan (see schedule.py).
        parts: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, "train_state": t.state}
        if t.scheduler is not None:
            parts["scheduler"] = self.scheduler
        if t.scaler is not None:
            parts["scaler"] = t.scaler
        parts.update(per_rank=_PerRank(t), train_loader=_Loader(t), callbacks=_Callbacks(t))
        return parts

    def to_save(self) -> dict[str, Any]:
        return {**self._parts(), "best_model": self._best_to_save(), "strategy": self.t.strategy.name,
                "config": self.t.config.to_dict()}

    def _best_to_save(self) -> dict[str, torch.Tensor] | None:
        """The best weights unless the checkpoint's own are the best (the epoch just finished)."""
        t = self.t
        if t.best_state is None or (t.best_epoch == t.epoch and t.batch_in_epoch == 0):
            return None
        return t.best_state

    def _resumed_best(self, path: str, content: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The best model of the resumed state; see [Note: the best model follows the resumed state]."""
        t = self.t
        if t.best_epoch is None:
            return None
        best = content.get("best_model")
        if best is None and t.best_step is not None and t.best_epoch == t.epoch and t.batch_in_epoch == 0:
            best = content["model"]
        on_disk = t.checkpointer.load_best()
        disk_step = on_disk.get("global_step") if on_disk is not None else None
        # A checkpoint of format 2 does not say which best it had: a best.pt not newer than it is the one.
        fits = disk_step is not None and (disk_step == t.best_step if t.best_step is not None else disk_step <= t.global_step)
        if best is None and fits:
            best = on_disk["model"]
        where = t.checkpointer.best_path
        if best is None:
            notice(
                f"{path!r} recorded its best model at epoch {t.best_epoch}, but {where!r} now holds one of a later, "
                f"discarded part of the run; the best model is chosen again from here on"
            )
            t.best_metric = t.best_epoch = t.best_step = None
            return None
        best = {k: v.detach().to("cpu").clone() for k, v in best.items()}
        if not fits:
            notice(
                f"{where!r} held the best model of a discarded part of the run (step {disk_step}); rewritten with the "
                f"best model of {path!r} (epoch {t.best_epoch}, step {t.best_step})"
            )
            t.checkpointer.save_best({"model": best, "epoch": t.best_epoch, "metric": t.config.best_metric,
                                      "value": t.best_metric, "global_step": t.best_step})
        return best

    def restore(self, path: str, content: dict[str, Any]) -> None:
        """Load every part from ``content`` (read from ``path`` by the Checkpointer)."""
        t = self.t
        saved_strategy = content.get("strategy")
        saved_sharded = "optimizer" in content.get("sharded", ()) or saved_strategy == "fsdp"
        if saved_sharded != t.strategy.shards_optimizer:
            raise ValueError(
                f"{path!r} was written with strategy {saved_strategy!r}, whose optimizer state is "
                f"{'sharded across ranks' if saved_sharded else 'replicated'}, but this Trainer uses strategy "
                f"{t.strategy.name!r}; resume it with strategy={saved_strategy!r}"
                + (" and the same world size" if saved_sharded else "")
            )
        self.model.source = f"checkpoint {path!r}"
        self.scheduler.saved_world_size = len(content["per_rank"])
        for name, part in self._parts().items():
            value = content.get(name)
            if value is not None:
                part.load_state_dict(value)
        saved_world = self.scheduler.saved_world_size
        if saved_world != t.world.world_size:
            _warn_once_main(
                f"{path!r} was written by {saved_world} ranks and is resumed on {t.world.world_size}: weights and optimizer "
                f"are restored, but the run will not replay the original one bit for bit (RNG streams and data shards differ)"
            )
        t.best_state = self._resumed_best(path, content)
        t.resumed_from = path
        if self.scheduler.note:
            notice(self.scheduler.note)
