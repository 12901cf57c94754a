"""The Trainer's checkpoints: what goes in, how a run resumes from one (issue 7's automatic
resume included), and the final export. A mixin of :class:`dptrain.Trainer`; the replay
rules that make a resume bitwise are in ``dptrain/trainer.py``'s [Note: bitwise resume].

A checkpoint is one file written by rank 0 (``dptrain.checkpoint.save``: atomic) holding
plain values only, so it loads with ``weights_only=True``:

- ``model``: full weights with plain keys (FSDP: gathered with ``full_state_dict``);
- ``optimizer`` (FSDP: ``optimizer_per_rank``, every rank's shard), ``scheduler``, ``scaler``;
- ``train_loader``: the loader's mid-epoch position (when taken mid-epoch);
- ``per_rank``: every rank's RNG states, running epoch loss and buffers;
- ``epoch``, ``batch_in_epoch``, ``global_step``, ``world_size``, ``strategy``;
- ``trainer``: history and best metric; ``config``: the TrainerConfig as a dict.
The best model's weights live next to the checkpoints in ``best.pt``.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Mapping

import torch

from dptrain import checkpoint as ckpt
from dptrain import comm
from dptrain.env import _warn_once_main
from dptrain.seeding import get_rng_state

_CKPT_FORMAT = "dptrain.trainer/1"


class TrainerCheckpointing:
    """Checkpoint methods of :class:`dptrain.Trainer` (state_dict, save, resume, export)."""

    def model_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's weights with plain keys (no ``module.``), whatever the strategy.

        For FSDP the full weights are gathered (collective: call it on every rank); with
        ``rank0_only`` the other ranks get ``{}``.
        """
        if self.is_fsdp:
            return dict(self.model.full_state_dict(rank0_only=rank0_only))
        return ckpt.strip_prefix(ckpt.unwrap_model(self.model).state_dict())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (collective: every rank must call it; complete on rank 0)."""
        # What differs between ranks: RNG streams and the running loss of the epoch.
        # Buffers too: FSDP (unlike DDP) never syncs them, so each rank's BatchNorm statistics are its own.
        per_rank = comm.all_gather_object(
            {
                "rng": get_rng_state(),
                "loss_sum": self._loss_sum.detach().cpu(),
                "sample_count": self._sample_count,
                "buffers": {k: v.detach().cpu() for k, v in self.model.named_buffers()},
            }
        )
        state: dict[str, Any] = {
            "format": _CKPT_FORMAT,
            "model": self.model_state_dict(rank0_only=True),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "per_rank": per_rank,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "global_step": self.global_step,
            "world_size": self.world.world_size,
            "strategy": self.strategy,
            "trainer": {
                "history": copy.deepcopy(self.history),
                "best_metric": self.best_metric,
                "best_epoch": self.best_epoch,
            },
            "config": self.config.to_dict(),
        }
        if self.is_fsdp:
            state["optimizer_per_rank"] = comm.all_gather_object(self.optimizer.state_dict())
        else:
            state["optimizer"] = self.optimizer.state_dict()
        if self.batch_in_epoch > 0 and hasattr(self.train_loader, "state_dict"):
            state["train_loader"] = self.train_loader.state_dict()
        return state

    def save_checkpoint(self, path: str | None = None) -> str:
        """Write a checkpoint (rank 0 writes; collective: call on every rank); return its path.

        Default path: ``<checkpoint_dir>/ckpt-e<epoch>-s<step>.pt``; older ones beyond
        ``keep_last`` are deleted.
        """
        if path is None:
            if not self.config.checkpoint_dir:
                raise ValueError("save_checkpoint() needs a path, or TrainerConfig(checkpoint_dir=...)")
            path = ckpt.checkpoint_path(self.config.checkpoint_dir, self.epoch, self.global_step)
        state = self.state_dict()
        if self.rank == 0:
            ckpt.save(state, path)
            if self.config.checkpoint_dir and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.config.checkpoint_dir):
                ckpt.prune_checkpoints(self.config.checkpoint_dir, self.config.keep_last)
        # Nobody runs ahead (and possibly dies) before the checkpoint is on disk.
        comm.barrier()
        return path

    def _resolve_resume(self, resume: str | bool | None) -> str | None:
        cdir = self.config.checkpoint_dir
        if resume is None:
            # A job the launcher restarted continues where it stopped -- if it keeps checkpoints.
            resume = "auto" if self.world.restart_count > 0 and cdir else False
        if resume is True or resume == "auto":
            if not cdir:
                raise ValueError("resume='auto' needs TrainerConfig(checkpoint_dir=...) to look for checkpoints")
            # Rank 0 decides, so every rank resumes from the same file.
            return comm.broadcast_object(ckpt.latest_checkpoint(cdir) if self.rank == 0 else None, src=0)
        if resume is not False:
            return os.fspath(resume)
        if cdir and self.rank == 0 and ckpt.list_checkpoints(cdir):
            # A fresh run must not mix with an old one's files (the newest by step would win a
            # later resume, and pruning would delete the new ones): move them aside.
            aside = os.path.join(cdir, "superseded-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
            os.makedirs(aside, exist_ok=True)
            for old in ckpt.list_checkpoints(cdir) + [os.path.join(cdir, "best.pt")]:
                if os.path.exists(old):
                    os.replace(old, os.path.join(aside, os.path.basename(old)))
            _warn_once_main(
                f"checkpoint_dir {cdir!r} already held checkpoints of an earlier run; starting fresh and moving them "
                f"to {aside!r}. Pass resume='auto' (the examples' --resume) to continue from the newest instead"
            )
        return None

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, scheduler, scaler, loader position, RNG and progress from ``path``.

        Every rank reads the file (a shared filesystem for multi-node jobs), mapped to its
        own device, with ``weights_only=True``.

        Raises:
            FileNotFoundError / CheckpointError: the file is missing, truncated or corrupt.
            ValueError: the file is not a Trainer checkpoint, or an FSDP optimizer state
                was saved with a different world size.
        """
        state = ckpt.load(path, map_location=self.device)
        if not isinstance(state, Mapping) or state.get("format") != _CKPT_FORMAT:
            raise ValueError(
                f"{path!r} is not a dptrain Trainer checkpoint (format {state.get('format') if isinstance(state, Mapping) else None!r}); "
                f"to load bare weights use dptrain.checkpoint.load_model_state(model, dptrain.checkpoint.load(path))"
            )
        ckpt.load_model_state(self.model, state["model"])
        if self.is_fsdp:
            per_rank = state.get("optimizer_per_rank")
            if per_rank is None or len(per_rank) != self.world.world_size:
                raise ValueError(
                    f"rank {self.rank}: {path!r} holds FSDP optimizer shards for {None if per_rank is None else len(per_rank)} "
                    f"ranks but this job has {self.world.world_size}; resume with the same world size"
                )
            self.optimizer.load_state_dict(per_rank[self.rank])
        else:
            if "optimizer" not in state:
                raise ValueError(f"{path!r} was written with strategy 'fsdp'; resume it with strategy='fsdp' and the same world size")
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        per_rank = state["per_rank"]
        mine = per_rank[self.rank] if self.rank < len(per_rank) else None
        self._pending_rng = mine["rng"] if mine is not None else None
        if mine is not None and len(per_rank) == self.world.world_size:
            self._loss_sum = mine["loss_sum"].to(device=self.device, dtype=torch.float64).clone()
            self._sample_count = int(mine["sample_count"])
            buffers = dict(self.model.named_buffers())
            with torch.no_grad():
                for name, value in mine.get("buffers", {}).items():
                    if name in buffers and buffers[name].shape == value.shape:
                        buffers[name].copy_(value)
        else:
            # Another world size: the partial epoch's loss is re-spread so the sum over ranks is kept.
            total = sum(float(p["loss_sum"]) for p in per_rank)
            count = sum(int(p["sample_count"]) for p in per_rank)
            self._loss_sum = torch.tensor(total if self.rank == 0 else 0.0, dtype=torch.float64, device=self.device)
            self._sample_count = count if self.rank == 0 else 0
        if len(per_rank) != self.world.world_size:
            _warn_once_main(
                f"{path!r} was written by {len(per_rank)} ranks and is resumed on {self.world.world_size}: weights and optimizer "
                f"are restored, but the run will not replay the original one bit for bit (RNG streams and data shards differ)"
            )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.global_step = int(state["global_step"])
        self._pending_loader_state = state.get("train_loader")
        tr = state["trainer"]
        self.history = list(tr["history"])
        self.best_metric = tr["best_metric"]
        self.best_epoch = tr["best_epoch"]
        self.best_state = None
        best_path = os.path.join(self.config.checkpoint_dir, "best.pt") if self.config.checkpoint_dir else None
        if self.best_epoch is not None and best_path and os.path.exists(best_path):
            best = ckpt.load(best_path, map_location="cpu")
            self.best_state = best["model"]
        self.resumed_from = path

    def export_safetensors(self, path: str) -> str | None:
        """Write the best (else current) weights as safetensors on rank 0 (collective for FSDP)."""
        state = self.best_state if self.best_state is not None else self.model_state_dict(rank0_only=True)
        out = None
        if self.rank == 0:
            out = ckpt.save_safetensors(state, path, metadata={"epoch": str(self.best_epoch if self.best_state is not None else self.epoch)})
        comm.barrier()
        return out
