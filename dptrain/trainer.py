"""The training loop the notes sketch, completed: strategy wrapping, exact evaluation,
best-model selection, gradient accumulation, AMP, logging, and checkpoints that resume
bit for bit.

[Note: bitwise resume]
A run restarted from a checkpoint must reach the same parameters as a run that never
stopped (on CPU, bit for bit). That holds when the resumed run replays the very same
sequence of random draws and batches. ``fit`` is written so that:

* checkpoints are taken only between optimizer steps (never inside an accumulation group)
  or at the end of an epoch *after* everything the epoch's end does (dev evaluation, the
  scheduler step), so that "what comes next" is the same in both runs;
* every rank's RNG states (python, numpy, torch, CUDA) are saved and restored per rank;
* creating a DataLoader iterator draws one number from torch's global generator. A
  checkpoint taken at the start of an epoch was taken *before* that draw, one taken mid-
  epoch *after* it; so the RNG state is restored before ``iter(loader)`` in the first case
  and after it in the second;
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

import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from dptrain import checkpoint as ckpt
from dptrain import comm
from dptrain._trainer_log import TrainerLog, format_metrics
from dptrain.data import gather_results, prepare_dataloader
from dptrain import _diagnostics
from dptrain.env import _warn_once_main, device as _default_device, get_world
from dptrain._trainer_ckpt import TrainerCheckpointing
from dptrain.seeding import set_rng_state

__all__ = ["Trainer", "TrainerConfig"]

_STRATEGIES = ("ddp", "fsdp", "torch-ddp", "none")


@dataclasses.dataclass
class TrainerConfig:
    """Settings of a :class:`Trainer`; validated on construction.

    Attributes:
        strategy: how the model is replicated: ``"ddp"`` (dptrain's DDP), ``"fsdp"``
            (dptrain's FSDP), ``"torch-ddp"`` (PyTorch's DDP, for comparison) or ``"none"``.
            Default None: ``"ddp"`` when the world has more than one process, else ``"none"``.
        batch_size: per-rank batch size, used only when datasets (not loaders) are given.
        eval_batch_size: per-rank batch size for dev/test datasets. Default: ``batch_size``.
        num_workers: DataLoader workers when the Trainer builds the loaders. Default 0.
        seed: sampler seed when the Trainer builds the loaders. Default 0.
        gradient_accumulation_steps: micro-batches per optimizer step; the first k-1 run
            under ``no_sync()``. Default 1.
        max_grad_norm: clip the global gradient norm to this value. Default None (no clipping).
        amp: automatic mixed precision (CUDA only; warns once and is ignored on CPU). Default False.
        amp_dtype: ``"float16"`` (with a gradient scaler) or ``"bfloat16"``. Default ``"float16"``.
        scheduler_interval: ``"epoch"`` or ``"step"``: when ``scheduler.step()`` runs. Default ``"epoch"``.
        checkpoint_dir: where checkpoints go. Default None (no checkpoints).
        save_every: write a checkpoint every this many epochs (0: never at epoch ends). Default 1.
        save_every_steps: also every this many optimizer steps (0: never). Default 0.
        keep_last: keep only the newest K checkpoints (0: keep all). Default 3.
        best_metric: dev metric that selects the best model (``"loss"`` or a key returned by
            ``metric_fn``). Default ``"loss"``.
        best_mode: ``"min"`` or ``"max"``: whether smaller or larger ``best_metric`` is better.
            Default ``"min"``.
        log_dir: TensorBoard directory (rank 0 writes). Default None.
        log_every_steps: progress-bar and step-scalar interval. Default 10.
        progress: tqdm bar on rank 0: True, False, or None (default) for "only on a terminal".
        verbose: print one line per epoch on rank 0. Default True.
        export_safetensors: after ``fit``, write the best (else final) weights here as safetensors.
        ddp_kwargs: extra arguments for the DDP constructor (``bucket_cap_mb``, ...).
        fsdp_kwargs: extra arguments for the FSDP constructor (``auto_wrap_policy``, ...).

    Raises:
        ValueError: a setting is out of range; the message shows the value and the fix.

    Example:
        >>> TrainerConfig(checkpoint_dir="ckpt", save_every_steps=100, best_metric="accuracy", best_mode="max")
    """

    strategy: str | None = None
    batch_size: int | None = None
    eval_batch_size: int | None = None
    num_workers: int = 0
    seed: int = 0
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    amp: bool = False
    amp_dtype: str = "float16"
    scheduler_interval: str = "epoch"
    checkpoint_dir: str | None = None
    save_every: int = 1
    save_every_steps: int = 0
    keep_last: int = 3
    best_metric: str = "loss"
    best_mode: str = "min"
    log_dir: str | None = None
    log_every_steps: int = 10
    progress: bool | None = None
    verbose: bool = True
    export_safetensors: str | None = None
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    fsdp_kwargs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in _STRATEGIES:
            raise ValueError(f"TrainerConfig(strategy={self.strategy!r}) is not one of {list(_STRATEGIES)} (or None for automatic)")
        for name in ("batch_size", "eval_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"TrainerConfig({name}={v!r}) must be a positive integer or None")
        for name in ("num_workers", "save_every", "save_every_steps", "keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainerConfig({name}={v!r}) must be an integer >= 0")
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"TrainerConfig(gradient_accumulation_steps={self.gradient_accumulation_steps!r}) must be an integer >= 1 "
                f"(1 = step after every batch)"
            )
        if not isinstance(self.log_every_steps, int) or self.log_every_steps < 1:
            raise ValueError(f"TrainerConfig(log_every_steps={self.log_every_steps!r}) must be an integer >= 1")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0):
            raise ValueError(f"TrainerConfig(max_grad_norm={self.max_grad_norm!r}) must be > 0, or None for no clipping")
        if self.amp_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"TrainerConfig(amp_dtype={self.amp_dtype!r}) must be 'float16' or 'bfloat16'")
        if self.scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"TrainerConfig(scheduler_interval={self.scheduler_interval!r}) must be 'epoch' or 'step'")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"TrainerConfig(best_mode={self.best_mode!r}) must be 'min' or 'max'")
        if self.save_every_steps and self.checkpoint_dir is None:
            raise ValueError(
                f"TrainerConfig(save_every_steps={self.save_every_steps}) needs checkpoint_dir=... to know where to write"
            )
        if not isinstance(self.seed, int):
            raise ValueError(f"TrainerConfig(seed={self.seed!r}) must be an integer")

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (what checkpoints and TensorBoard's hparams store)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        return out


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping) and "target" in batch:
        inputs = {k: v for k, v in batch.items() if k != "target"}
        return inputs, batch["target"]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"the Trainer expects batches of (inputs, targets) or dicts with a 'target' key, got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
    )


def _forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def _num_samples(targets: Any) -> int:
    t = targets
    while isinstance(t, (list, tuple)):
        t = t[0]
    return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() > 0 else 1


class Trainer(TrainerCheckpointing):
    """Train a model on every rank of the job: wrap it, feed it, evaluate it, checkpoint it.

    Args:
        model: the plain model; the Trainer moves it to this rank's device and wraps it with
            ``config.strategy``.
        optimizer: an optimizer built on ``model.parameters()``, or a callable
            ``params -> optimizer`` (required for ``"fsdp"``, whose parameters only exist
            after wrapping).
        train_data: a DataLoader (ideally from :func:`dptrain.prepare_dataloader`, whose
            position can be checkpointed) or a Dataset (then ``config.batch_size`` is used).
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor`` (mean over the batch).
        config: a :class:`TrainerConfig`. Default ``TrainerConfig()``.
        dev_data: optional loader/dataset evaluated after every epoch, gathered exactly
            (every sample once); selects the best model.
        test_data: optional loader/dataset evaluated once at the end of ``fit`` with the
            best model.
        scheduler: an LR scheduler on ``optimizer``, or a callable ``optimizer -> scheduler``.
        metric_fn: ``metric_fn(outputs, targets) -> float | dict[str, float]``, called on the
            whole dev (or test) set in dataset order, identically on every rank.
        resume: None (default): resume from the newest checkpoint in
            ``config.checkpoint_dir`` when the launcher restarted the job
            (``TORCHELASTIC_RESTART_COUNT > 0``), else start fresh. ``"auto"``/True: resume
            from the newest checkpoint if there is one. False: never. A path: that file.
        device: where to train. Default :func:`dptrain.device` (``cuda:<local_rank>`` or CPU).
        hparams: extra hyper-parameters recorded in TensorBoard's hparams table.

    Raises:
        ValueError: inconsistent arguments (e.g. a Dataset without ``config.batch_size``,
            ``"torch-ddp"`` without a process group), with the fix.
        FileNotFoundError / dptrain.checkpoint.CheckpointError: ``resume`` names a missing
            or unreadable file.

    Example:
        >>> dptrain.init(); dptrain.seed_everything(0)
        >>> loader = dptrain.prepare_dataloader(train_set, batch_size=64)
        >>> trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
        ...                           nn.CrossEntropyLoss(), TrainerConfig(checkpoint_dir="ckpt"))
        >>> summary = trainer.fit(max_epochs=10)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        train_data: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        config: TrainerConfig | None = None,
        dev_data: Any = None,
        test_data: Any = None,
        scheduler: Any = None,
        metric_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        resume: str | bool | None = None,
        device: torch.device | str | None = None,
        hparams: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config if config is not None else TrainerConfig()
        if not isinstance(self.config, TrainerConfig):
            raise ValueError(f"config must be a dptrain.TrainerConfig, got {type(self.config).__name__}")
        self.world = get_world()
        self.rank = self.world.rank
        self.device = torch.device(device) if device is not None else _default_device()
        self.loss_fn = loss_fn
        self.metric_fn = metric_fn
        self.hparams = dict(hparams or {})
        self.strategy = self.config.strategy or ("ddp" if self.world.world_size > 1 else "none")

        self.train_loader = self._loader(train_data, "train")
        self.dev_loader = self._loader(dev_data, "eval") if dev_data is not None else None
        self.test_loader = self._loader(test_data, "eval") if test_data is not None else None

        self.model = self._wrap(model.to(self.device))
        self.optimizer = self._build_optimizer(optimizer, model)
        self.scheduler = scheduler(self.optimizer) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler

        self.amp = bool(self.config.amp)
        if self.amp and self.device.type != "cuda":
            _warn_once_main(
                f"TrainerConfig(amp=True) is ignored on device {self.device}: automatic mixed precision is only used on CUDA"
            )
            self.amp = False
        self.amp_dtype = torch.float16 if self.config.amp_dtype == "float16" else torch.bfloat16
        self.scaler = torch.amp.GradScaler("cuda") if self.amp and self.amp_dtype == torch.float16 else None

        # Progress of the run; all of it goes into checkpoints.
        self.epoch = 0  # epoch in progress (or next to run)
        self.batch_in_epoch = 0  # batches of `epoch` already trained
        self.global_step = 0  # optimizer steps so far
        self.history: list[dict[str, Any]] = []
        self.best_metric: float | None = None
        self.best_epoch: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None  # plain-key CPU copy of the best weights
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._sample_count = 0
        self._pending_rng: dict[str, Any] | None = None
        self._pending_loader_state: Any = None
        self.resumed_from: str | None = None

        if self.config.checkpoint_dir and self.rank == 0:
            ckpt.remove_stale_temporaries(self.config.checkpoint_dir)
        path = self._resolve_resume(resume)
        if path is not None:
            self.load_checkpoint(path)

    # ------------------------------------------------------------------ construction ----
    def _loader(self, data: Any, mode: str):
        if isinstance(data, torch.utils.data.DataLoader):
            return data
        if isinstance(data, torch.utils.data.Dataset):
            bs = self.config.batch_size if mode == "train" else (self.config.eval_batch_size or self.config.batch_size)
            if bs is None:
                raise ValueError(
                    f"a {type(data).__name__} was given as {mode} data but TrainerConfig(batch_size=None); set "
                    f"TrainerConfig(batch_size=...) or pass a loader from dptrain.prepare_dataloader(...)"
                )
            return prepare_dataloader(
                data, batch_size=bs, shuffle=(mode == "train"), num_workers=self.config.num_workers,
                drop_last=False, mode=mode, seed=self.config.seed,
            )
        if isinstance(data, Iterable):
            return data
        raise ValueError(f"{mode} data must be a DataLoader or a Dataset, got {type(data).__name__}")

    def _wrap(self, model: nn.Module) -> nn.Module:
        dev_ids = [self.device.index] if self.device.type == "cuda" and self.device.index is not None else None
        distributed = comm.is_distributed()
        if self.strategy == "none":
            if self.world.world_size > 1:
                _warn_once_main(
                    f"TrainerConfig(strategy='none') on {self.world.world_size} ranks: gradients are not averaged and "
                    f"the replicas drift apart; use strategy='ddp'"
                )
            return model
        if self.strategy == "torch-ddp" and not distributed:
            raise ValueError(
                f"TrainerConfig(strategy={self.strategy!r}) needs a process group, but this is a single process "
                f"(world size {self.world.world_size}); launch with `dptrain run --nproc-per-node N` or use strategy='none'"
            )
        if self.strategy == "torch-ddp":
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=dev_ids, **self.config.ddp_kwargs)
        if self.strategy == "ddp":
            from dptrain.parallel.ddp import DistributedDataParallel

            return DistributedDataParallel(model, device_ids=dev_ids, **self.config.ddp_kwargs)
        from dptrain.parallel.fsdp import FullyShardedDataParallel

        kwargs = dict(self.config.fsdp_kwargs)
        if self.device.type == "cuda":
            kwargs.setdefault("device_id", self.device)
        return FullyShardedDataParallel(model, **kwargs)

    def _build_optimizer(self, optimizer: Any, plain_model: nn.Module) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            if self.strategy == "fsdp":
                raise ValueError(
                    "strategy='fsdp' needs the optimizer built on the sharded parameters; pass a function instead of an "
                    "optimizer, e.g. Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-3), ...)"
                )
            return optimizer
        if callable(optimizer):
            return optimizer(self.model.parameters())
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or a callable params -> optimizer, got {type(optimizer).__name__}")

    @property
    def is_fsdp(self) -> bool:
        return self.strategy == "fsdp"

    def _no_sync(self):
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _autocast(self):
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    # ------------------------------------------------------------------------- fit ------
    def fit(self, max_epochs: int) -> dict[str, Any]:
        """Train until ``max_epochs`` epochs are done (counting epochs before a resume).

        Every epoch: ``set_epoch``, train (with accumulation, AMP, clipping and step
        checkpoints), evaluate on the dev data, keep the best model, step an epoch
        scheduler, log, checkpoint every ``save_every`` epochs. At the end: evaluate the
        test data with the best model, export safetensors if asked, and return a summary.

        Args:
            max_epochs: total number of epochs, >= 1.

        Returns:
            ``{"history": [per-epoch dicts], "best": {"epoch", "metric", "value"} or None,
            "test": {metrics} or None, "global_step": int}``; the same on every rank.

        Raises:
            ValueError: ``max_epochs < 1``.
        """
        if not isinstance(max_epochs, int) or max_epochs < 1:
            raise ValueError(f"fit(max_epochs={max_epochs!r}) needs an integer >= 1")
        cfg = self.config
        purge = self.global_step if self.resumed_from else None
        self.log = TrainerLog(self.rank == 0, cfg.log_dir, cfg.progress, cfg.verbose, purge_step=purge)
        try:
            if self.resumed_from:
                self.log.line(
                    f"resumed from {self.resumed_from} (epoch {self.epoch + 1}, batch {self.batch_in_epoch}, "
                    f"step {self.global_step})"
                )
            while self.epoch < max_epochs:
                self._run_epoch(max_epochs)
            test = self.test() if self.test_loader is not None else None
            if cfg.export_safetensors:
                self.export_safetensors(cfg.export_safetensors)
            final = dict(self.history[-1]) if self.history else {}
            if test:
                final.update({f"test/{k}": v for k, v in test.items()})
            self.log.hparams({**cfg.to_dict(), **self.hparams, "world_size": self.world.world_size}, final)
        finally:
            self.log.close()
        best = None
        if self.best_epoch is not None:
            best = {"epoch": self.best_epoch, "metric": cfg.best_metric, "value": self.best_metric}
        return {"history": list(self.history), "best": best, "test": test, "global_step": self.global_step}

    def _run_epoch(self, max_epochs: int) -> None:
        cfg, loader, epoch = self.config, self.train_loader, self.epoch
        accum = cfg.gradient_accumulation_steps
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)
        num_batches = len(loader)
        start = self.batch_in_epoch
        if self._pending_rng is not None and start == 0:
            set_rng_state(self._pending_rng)  # before iter(): see [Note: bitwise resume]
            self._pending_rng = None
        fast_forward = 0
        if start > 0:
            if self._pending_loader_state is not None and hasattr(loader, "load_state_dict"):
                loader.load_state_dict(self._pending_loader_state)
                # The loader now yields the rest of the epoch (re-shared if the world size changed).
                num_batches = start + len(loader)
            else:
                fast_forward = start
        self._pending_loader_state = None
        it = iter(loader)
        for _ in range(fast_forward):
            next(it)
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)  # after iter(): the checkpoint was taken mid-epoch
            self._pending_rng = None

        self.model.train()
        self.log.start_epoch(epoch, max_epochs, num_batches, start)
        t0 = time.perf_counter()
        window_t, window_samples = t0, 0
        b = start
        for batch in it:
            inputs, targets = _split_batch(_to_device(batch, self.device))
            n = _num_samples(targets)
            sync = (b + 1) % accum == 0 or b + 1 == num_batches
            with contextlib.nullcontext() if sync else self._no_sync():
                with self._autocast():
                    outputs = _forward(self.model, inputs)
                    loss = self.loss_fn(outputs, targets)
                scaled = loss / accum if accum > 1 else loss
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            self._loss_sum += loss.detach().to(torch.float64) * n
            self._sample_count += n
            window_samples += n
            b += 1
            if sync:
                self._optimizer_step()
                if cfg.save_every_steps and self.global_step % cfg.save_every_steps == 0 and b < num_batches:
                    # A step checkpoint on the epoch's last batch is left to the end-of-epoch one,
                    # which is taken after the dev evaluation (see [Note: bitwise resume]).
                    self.batch_in_epoch = b
                    self.save_checkpoint()
            if self.log.progress:
                self.log.update(1, None, None)
                if b % cfg.log_every_steps == 0 or b == num_batches:
                    now = time.perf_counter()
                    rate = window_samples * self.world.world_size / max(now - window_t, 1e-9)
                    self.log.update(0, float(loss.detach()), rate)
                    window_t, window_samples = now, 0
            if self.log.writer is not None and self.global_step % cfg.log_every_steps == 0 and sync:
                self.log.scalars({"train/step_loss": float(loss.detach()), "train/lr": self._lr()}, self.global_step)
        self.log.end_epoch()
        if b != num_batches:
            raise RuntimeError(
                f"rank {self.rank}: the train loader yielded {b} batches in epoch {epoch}, but len(loader) is "
                f"{num_batches}; every rank must see the same number of batches (use dptrain.prepare_dataloader)"
            )
        elapsed = time.perf_counter() - t0
        # Loss averaged over every sample of every rank this epoch.
        totals = torch.stack([self._loss_sum, torch.tensor(float(self._sample_count), dtype=torch.float64, device=self.device)])
        comm.all_reduce(totals, op="sum")
        train_loss = float(totals[0] / max(float(totals[1]), 1.0))
        record: dict[str, Any] = {
            "epoch": epoch,
            "train_loss": train_loss,
            "time_s": elapsed,
            "samples_per_s": float(totals[1]) / elapsed if start == 0 and elapsed > 0 else float("nan"),
            "lr": self._lr(),
        }
        if self.dev_loader is not None:
            dev = self.evaluate(self.dev_loader)
            record.update({f"dev_{k}": v for k, v in dev.items()})
            self._update_best(dev, epoch)
        if self.scheduler is not None and cfg.scheduler_interval == "epoch":
            self.scheduler.step()
        self.history.append(record)
        self._log_epoch(record, max_epochs)
        self.epoch, self.batch_in_epoch = epoch + 1, 0
        self._loss_sum.zero_()
        self._sample_count = 0
        if cfg.checkpoint_dir and cfg.save_every and (self.epoch % cfg.save_every == 0 or self.epoch == max_epochs):
            self.save_checkpoint()

    def _optimizer_step(self) -> None:
        cfg = self.config
        if cfg.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if hasattr(self.model, "clip_grad_norm_"):  # FSDP: the norm spans every rank's shard
                self.model.clip_grad_norm_(cfg.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        _diagnostics.tick()  # the launcher's stall report counts these steps
        if self.scheduler is not None and cfg.scheduler_interval == "step":
            self.scheduler.step()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _log_epoch(self, record: dict[str, Any], max_epochs: int) -> None:
        dev = {k[4:]: v for k, v in record.items() if k.startswith("dev_")}
        text = f"epoch {record['epoch'] + 1}/{max_epochs} | train loss {record['train_loss']:.4f}"
        if dev:
            text += " | dev " + format_metrics(dev)
        rate = record["samples_per_s"]
        text += f" | {record['time_s']:.2f} s" + (f" ({rate:.0f} samples/s)" if math.isfinite(rate) else " (resumed)")
        self.log.line(text)
        scal = {"train/loss": record["train_loss"], "train/epoch_time_s": record["time_s"], "train/lr": record["lr"]}
        if math.isfinite(rate):
            scal["train/samples_per_s"] = rate
        scal.update({f"dev/{k}": v for k, v in dev.items()})
        self.log.scalars(scal, record["epoch"] + 1)

    # -------------------------------------------------------------------- evaluation ----
    def evaluate(self, data: Any = None) -> dict[str, float]:
        """Evaluate on ``data`` (default: the dev data) with every sample counted exactly once.

        Each rank runs its shard (the eval loader partitions without padding), then the
        outputs and targets are gathered in dataset order with
        :func:`dptrain.gather_results`; the loss and ``metric_fn`` are computed on the whole
        set, identically on every rank. Collective: call it on every rank.

        Returns:
            ``{"loss": float, **metrics}``.
        """
        loader = self.dev_loader if data is None else (data if isinstance(data, torch.utils.data.DataLoader) else self._loader(data, "eval"))
        if loader is None:
            raise ValueError("evaluate() needs data: pass it, or give the Trainer dev_data=...")
        indices = self._eval_indices(loader)
        net = self.model if self.is_fsdp else ckpt.unwrap_model(self.model)
        was_training = net.training
        net.eval()
        outs, tgts = [], []
        num_batches = steps = len(loader)
        if self.is_fsdp:
            # Every rank must run the same number of forwards (each one all-gathers the
            # shards); a rank with fewer batches repeats its last one and drops the result.
            count = torch.tensor([num_batches], device=self.device)
            comm.all_reduce(count, op="max")
            steps = int(count.item())
            if steps and not num_batches:
                raise RuntimeError(f"rank {self.rank} has no evaluation samples; use fewer ranks or more data")
        with torch.no_grad():
            batches, batch = iter(loader), None
            for i in range(steps):
                if i < num_batches:
                    batch = next(batches)
                inputs, targets = _split_batch(_to_device(batch, self.device))
                with self._autocast():
                    out = _forward(net, inputs)
                if i < num_batches:
                    outs.append(out.float())
                    tgts.append(targets)
        net.train(was_training)
        outputs = torch.cat(outs) if outs else torch.empty(0)
        targets = torch.cat(tgts) if tgts else torch.empty(0)
        idx = torch.as_tensor(indices[: outputs.shape[0]], dtype=torch.int64, device=outputs.device)
        if idx.numel() != outputs.shape[0]:
            raise RuntimeError(
                f"rank {self.rank}: the eval loader yielded {outputs.shape[0]} samples but its sampler lists {len(indices)}"
            )
        all_out = gather_results(outputs, idx)
        all_tgt = gather_results(targets.to(outputs.device), idx)
        metrics: dict[str, float] = {"loss": float(self.loss_fn(all_out, all_tgt))}
        if self.metric_fn is not None:
            extra = self.metric_fn(all_out, all_tgt)
            if isinstance(extra, Mapping):
                metrics.update({str(k): float(v) for k, v in extra.items()})
            else:
                metrics["metric"] = float(extra)
        return metrics

    @staticmethod
    def _eval_indices(loader) -> list[int]:
        sampler = getattr(loader, "sampler", None)
        if sampler is None:
            raise ValueError("evaluation needs a DataLoader whose sampler lists the dataset indices (dptrain.prepare_dataloader(mode='eval'))")
        # sampler.indices() lists the shard without starting an iteration (which would
        # discard a restored position); any other sampler is simply iterated.
        listed = sampler.indices() if hasattr(sampler, "indices") else iter(sampler)
        return [int(i) for i in listed]

    def _update_best(self, metrics: Mapping[str, float], epoch: int) -> None:
        key = self.config.best_metric
        if key not in metrics:
            raise ValueError(
                f"TrainerConfig(best_metric={key!r}) is not among the dev metrics {sorted(metrics)}; return it from metric_fn "
                f"or choose one of those"
            )
        value = float(metrics[key])
        better = self.best_metric is None or (value > self.best_metric if self.config.best_mode == "max" else value < self.best_metric)
        if not better:
            return
        self.best_metric, self.best_epoch = value, epoch
        self.best_state = {k: v.detach().to("cpu").clone() for k, v in self.model_state_dict(rank0_only=False).items()}
        if self.config.checkpoint_dir and self.rank == 0:
            ckpt.save(
                {"model": self.best_state, "epoch": epoch, "metric": key, "value": value, "global_step": self.global_step},
                os.path.join(self.config.checkpoint_dir, "best.pt"),
            )

    def test(self, data: Any = None, use_best: bool = True) -> dict[str, float]:
        """Evaluate the test data (default: the Trainer's ``test_data``) with the best model.

        With ``use_best`` (default) and a best model recorded, its weights are loaded into
        the model first (so training should be over). Collective: call it on every rank.
        """
        loader = self.test_loader if data is None else data
        if loader is None:
            raise ValueError("test() needs data: pass it, or give the Trainer test_data=...")
        if use_best and self.best_state is not None:
            ckpt.load_model_state(self.model, self.best_state)
        metrics = self.evaluate(loader)
        if hasattr(self, "log"):
            self.log.line("test " + format_metrics(metrics))
            self.log.scalars({f"test/{k}": v for k, v in metrics.items()}, self.epoch)
        return metrics
