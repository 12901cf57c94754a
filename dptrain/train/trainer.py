"""The Trainer: the training loop, composed of a strategy, a train state and a checkpointer.

``Trainer`` owns the loop only -- batches, forward, backward, the optimizer step, evaluation
at the end of each epoch, logging -- and asks its parts for everything else:

* a :class:`~dptrain.train.strategy.Strategy` (``none``, ``ddp``, ``torch-ddp``, ``fsdp``)
  wraps the model and answers every question that depends on how it is replicated;
* a :class:`~dptrain.train.state.TrainState` holds where the run is and replays a resumed
  epoch exactly (its module explains what makes a resume bitwise);
* a :class:`~dptrain.train.checkpointer.Checkpointer` owns the checkpoint directory: it saves
  the dict of stateful parts the Trainer hands it, prunes, keeps ``best.pt`` and chooses what
  to resume from;
* callbacks (:mod:`dptrain.train.callbacks`) add behaviour at fixed points; the NaN policy and
  early stopping are two of them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from dptrain import comm
from dptrain.runtime import heartbeat as _heartbeat, interrupt as _interrupt, settings as _settings
from dptrain.runtime.tensors import move_to_device
from dptrain.data import ShadowBatch, prepare_dataloader
from dptrain.data._lockstep import StreamIterator
from dptrain.runtime.env import (World, _warn_once_main, device as _default_device, get_world, init, is_initialized,
                                 world_from_environ)
from dptrain.train import _parts, evaluation
from dptrain.seeding import get_rng_state, set_rng_state
from dptrain.train.evaluation import batch_size_of, forward, loss_of, num_samples, split_batch
from dptrain.train.callbacks import Callback, EarlyStopping, NonFiniteError, NonFiniteGuard, StepInfo, gather_step_values
from dptrain.train.checkpointer import Checkpointer
from dptrain.train.config import TrainerConfig
from dptrain.train.log import TrainerLog, format_metrics
from dptrain.train.preemption import Preempted, PreemptionWatcher, in_slurm_job, requeue_job
from dptrain.train.profile import StepProfiler
from dptrain.train.recovery import InPlaceRecovery, is_replacement
from dptrain.train.report import install_excepthook
from dptrain.train.sharding import check_equal_batches, check_optimizer_params, shard_train_loader
from dptrain.train.state import TrainState, reads_state
from dptrain.train.schedule import WarmupDecay
from dptrain.train.strategy import build_scheduler, make_strategy
from dptrain.train.trackers import trackers_for

__all__ = ["Trainer"]


def _join_if_launched() -> World:
    """The world, joined: a script under a launcher that forgot ``dptrain.init()`` is joined here.

    The Trainer owns the loop, so it can make the call the script left out; without it every
    rank would train alone on its share and end with weights of its own.
    """
    if not is_initialized():
        described = world_from_environ()
        if described.is_distributed or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            init()
            _warn_once_main(
                f"dptrain.Trainer: dptrain.init() had not been called, so the Trainer called it (this job has "
                f"{described.world_size} ranks); call it yourself at the top of the script, before building the "
                f"model, the loaders or DDP"
            )
    return get_world()


def _joining_job():
    from dptrain.parallel.ddp import joining_job

    return joining_job()


def _training_device(model: nn.Module) -> torch.device:
    """The device a model trains on when the user names none: see ``Trainer(device=...)``."""
    where = next(iter(model.parameters()), None)
    if where is None:
        where = next(iter(model.buffers()), None)
    place = where.device if where is not None else torch.device("cpu")
    dist = torch.distributed
    if place.type == "cpu" and dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return _default_device()  # NCCL moves CUDA tensors only: this rank's GPU
    return place


class Trainer:
    """Train a model on every rank of the job: wrap it, feed it, evaluate it, checkpoint it.

    Args:
        model: the plain model, on the device it should train on (see ``device``); the
            Trainer wraps it with ``config.strategy``.
        optimizer: an optimizer built on ``model.parameters()``, or a callable
            ``params -> optimizer`` (required for ``"fsdp"``, whose parameters only exist
            after wrapping). One that holds parameters of another module (a copy of the
            model, a second model) is refused.
        train_data: a DataLoader (ideally from :func:`dptrain.prepare_dataloader`, whose
            position can be checkpointed) or a Dataset (then ``config.batch_size`` is used).
            On several ranks a plain DataLoader (PyTorch's default sampler) is rebuilt over a
            :class:`dptrain.DistributedSampler` with its batch size, shuffle, ``drop_last``,
            collate function and workers, unless ``config.use_distributed_sampler`` is False.
            Every rank must get the same number of batches: the ranks compare their counts
            when an epoch starts. A stream (an ``IterableDataset``, with or without
            ``__len__``; or a plain DataLoader over one) is split among the ranks and loader
            workers by a :class:`dptrain.data.StreamLoader`, every rank taking the same number
            of steps (``config.uneven``) and resuming mid-epoch from its position.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor`` (mean over the batch), with batches
            of ``(inputs, targets)`` or mappings with a ``"target"`` key. Default None: the model
            computes its own loss, as Hugging Face models do -- each batch (any mapping, tuple or
            tensor) goes to the model whole (``model(**batch)``, ``model(*batch)`` or
            ``model(batch)``) and the loss is the output's ``.loss``, its ``["loss"]``, or the
            output itself when it is a scalar tensor.
        config: a :class:`TrainerConfig`. Default ``TrainerConfig()``.
        dev_data: optional loader/dataset evaluated after every epoch, gathered exactly
            (every sample once, also when some ranks have no sample); selects the best model.
        test_data: optional loader/dataset evaluated once at the end of ``fit`` with the
            best model.
        scheduler: an LR scheduler on ``optimizer``, or a callable ``optimizer -> scheduler``.
            Resuming into a run of another length re-plans length-dependent schedules
            (OneCycleLR, CosineAnnealingLR, ...): see :mod:`dptrain.train.schedule`.
        metric_fn: ``metric_fn(outputs, targets) -> float | dict[str, float]``, called on the
            whole dev (or test) set in dataset order, identically on every rank.
        resume: None (default): resume from the newest checkpoint in
            ``config.checkpoint_dir`` when the launcher restarted the job
            (``TORCHELASTIC_RESTART_COUNT > 0``, or a Slurm requeue), else start fresh -- and
            fresh also when that newest checkpoint names another job (a restart whose first
            attempt died before its Trainer was built; see
            :func:`dptrain.train.checkpointer.job_identity`). ``"auto"``/True: resume
            from the newest checkpoint that can be read (an unreadable one is skipped with a
            notice and left in place; none at all: a notice, and training starts fresh).
            False: never. A path: that file.
        device: where to train; the model and every batch are moved there. Default None: where
            the model already is -- a model on the CPU trains on the CPU, one the script moved to
            ``cuda:1`` trains there; nothing moves to a GPU because one exists. The one exception:
            a process group on NCCL, which only moves CUDA tensors, puts a CPU model on this
            rank's GPU (:func:`dptrain.device`). For one GPU per rank pass
            ``device=dptrain.device()`` (or move the model there first).
        hparams: extra hyper-parameters, recorded with the settings by every tracker
            (``config.loggers``; TensorBoard's hparams table).
        callbacks: :class:`dptrain.train.Callback` objects, called in order after the
            built-in ones (the NaN guard and early stopping the config asks for).
        training_step: your own step, ``training_step(model, batch) -> loss``: ``model`` is the
            wrapped model (call it, so that DDP averages the gradients), ``batch`` is already on
            the device, and the loss (a scalar tensor, or an output with ``.loss``/``["loss"]``)
            is what the Trainer scales, accumulates, back-propagates, checks for NaN and clips
            around. Default None: :meth:`training_step`, which a subclass may override instead.
        evaluation_step: the same for evaluation, ``evaluation_step(model, batch) -> loss or
            {name: value}``, run without gradients; the values are averaged over every sample of
            every rank (weighted by batch size). Default None: :meth:`evaluation_step`.

    Under a launcher (``dptrain run``, torchrun, ``srun``) the Trainer calls
    :func:`dptrain.init` itself when the script has not (saying so once).

    Raises:
        ValueError: inconsistent arguments (e.g. a Dataset without ``config.batch_size``,
            ``"torch-ddp"`` without a process group, an optimizer on parameters that are not
            the model's), with the fix.
        RuntimeError: (from ``fit``) the ranks' train loaders yield different numbers of
            batches in an epoch; the message gives every rank's count.
        FileNotFoundError: ``resume`` names a missing file.
        dptrain.checkpoint.CheckpointError: the checkpoint directory cannot be written
            (found before any training), or ``resume`` names an unreadable file or one
            that does not fit the model (the message names the first differing keys).

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
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        config: TrainerConfig | None = None,
        dev_data: Any = None,
        test_data: Any = None,
        scheduler: Any = None,
        metric_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        resume: str | bool | None = None,
        device: torch.device | str | None = None,
        hparams: Mapping[str, Any] | None = None,
        callbacks: Iterable[Callback] | None = None,
        training_step: Callable[[nn.Module, Any], Any] | None = None,
        evaluation_step: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        install_excepthook()  # its user errors as one line for the job: see [Note: user errors]
        self.config = config if config is not None else TrainerConfig()
        if not isinstance(self.config, TrainerConfig):
            raise ValueError(f"config must be a dptrain.TrainerConfig, got {type(self.config).__name__}")
        cfg = self.config
        self.world = _join_if_launched()
        self.rank = self.world.rank
        self.device = torch.device(device) if device is not None else _training_device(model)
        self.loss_fn = loss_fn
        self.metric_fn = metric_fn
        if training_step is not None:
            self.training_step = training_step  # type: ignore[method-assign] - the instance's own step
        if evaluation_step is not None:
            self.evaluation_step = evaluation_step  # type: ignore[method-assign]
        self._check_step_choices(loss_fn, metric_fn, scheduler)
        self.hparams = dict(hparams or {})
        self.strategy = make_strategy(cfg.strategy, self.world.world_size, self.device, cfg, optimizer)
        if not callable(optimizer):
            check_optimizer_params(optimizer, model, loss_fn)

        self.train_loader = self._loader(train_data, "train")
        self.dev_loader = self._loader(dev_data, "eval") if dev_data is not None else None
        self.test_loader = self._loader(test_data, "eval") if test_data is not None else None

        joining = is_replacement()  # this process replaces a rank that died: see [Note: in-place recovery]
        with _joining_job() if joining else contextlib.nullcontext():
            self.model, self.optimizer = self.strategy.prepare(model.to(self.device), optimizer, self.world.world_size)
        if cfg.lr_schedule is not None:
            scheduler = functools.partial(WarmupDecay, total_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps,
                                          kind=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
        self.scheduler = build_scheduler(scheduler, self.optimizer, given=optimizer)
        self._setup_amp()

        self.state = TrainState(self.device)
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.keep_last, self.rank, self.world.world_size)
        self.callbacks: list[Callback] = []
        if cfg.nan_policy != "off":
            self.callbacks.append(NonFiniteGuard(cfg.nan_policy, cfg.max_consecutive_skips))
        if cfg.early_stopping_patience is not None:
            self.callbacks.append(EarlyStopping(
                cfg.early_stopping_metric or cfg.best_metric, cfg.early_stopping_patience,
                cfg.early_stopping_min_delta, cfg.best_mode,
            ))  # fmt: skip
        self.callbacks.extend(callbacks or ())
        self.best_state: dict[str, torch.Tensor] | None = None  # plain-key CPU copy of the best weights
        self.resumed_from: str | None = None
        self.stop_reason: str | None = None
        self._max_steps: int | None = None  # fit's step budget
        self._epoch_done = False  # whether the last _train_batches reached the epoch's end
        self._saved_step: int | None = None  # the global step of the last checkpoint written
        self._preempted_by: int | None = None
        self._preemption = PreemptionWatcher(False)
        self.log = TrainerLog(False, None, False, False)  # the real one is made by fit()

        # Rank 0's experiment trackers, made before a resume restores their run ids: one run per job.
        self.trackers = trackers_for(cfg, self.rank == 0, {**self.hparams, "world_size": self.world.world_size})
        self._parts = _parts.StatefulParts(
            strategy=self.strategy, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, progress=self.state, train_loader=self.train_loader, callbacks=self.callbacks,
            checkpointer=self.checkpointer, config=cfg, world=self.world, trackers=self.trackers,
        )  # fmt: skip

        self._recovery = InPlaceRecovery(self)
        if joining and self._recovery.active:
            self._recovery.join()  # the state comes from a live rank, not from a checkpoint
            return
        self.checkpointer.prepare()
        candidates = self.checkpointer.resume_candidates(resume, self.world.restart_count)
        if candidates:
            path, content = self.checkpointer.read_first_readable(candidates, map_location=self.device)
            if path is not None:  # None: the restart found another job's checkpoints, and starts fresh
                self.best_state = self._parts.restore(path, content)
                self.resumed_from = path

    # -- progress, read from self.state (where the loop changes it) ----------------------
    epoch = reads_state("epoch")
    batch_in_epoch = reads_state("batch_in_epoch")
    global_step = reads_state("global_step")
    history = reads_state("history")
    best_metric = reads_state("best_metric")
    best_epoch = reads_state("best_epoch")
    best_step = reads_state("best_step")

    # ------------------------------------------------------------------ construction ----
    def _loader(self, data: Any, mode: str):
        if isinstance(data, torch.utils.data.DataLoader):
            if mode != "train":
                return data
            return shard_train_loader(data, self.world.world_size, self.config.seed, self.config.use_distributed_sampler,
                                      self.config.uneven)
        if isinstance(data, torch.utils.data.Dataset):
            bs = self.config.batch_size if mode == "train" else (self.config.eval_batch_size or self.config.batch_size)
            if bs is None:
                raise ValueError(
                    f"a {type(data).__name__} was given as {mode} data but TrainerConfig(batch_size=None); set "
                    f"TrainerConfig(batch_size=...) or pass a loader from dptrain.prepare_dataloader(...)"
                )
            stream = isinstance(data, torch.utils.data.IterableDataset)
            extra = {"uneven": self.config.uneven if mode == "train" else "join"} if stream else {}
            return prepare_dataloader(
                data, batch_size=bs, shuffle=None if stream else (mode == "train"), num_workers=self.config.num_workers,
                drop_last=False, mode=mode, seed=self.config.seed,
                pin_memory=self.device.type == "cuda",  # pinned pages serve copies to a GPU we train on, only
                **extra,
            )
        if isinstance(data, Iterable):
            return data
        raise ValueError(f"{mode} data must be a DataLoader or a Dataset, got {type(data).__name__}")

    def _check_step_choices(self, loss_fn: Any, metric_fn: Any, scheduler: Any) -> None:
        """Refuse combinations of the step's parts that cannot mean what they seem to."""
        cfg = self.config
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(outputs, targets), or None for the model's own loss; "
                             f"got {type(loss_fn).__name__}")
        if metric_fn is not None and self._own_evaluation():
            raise ValueError(
                "metric_fn(outputs, targets) needs the Trainer's own evaluation over (inputs, targets) batches with a "
                "loss_fn; with the model's own loss (loss_fn=None) or an evaluation_step, return the metrics from the "
                "evaluation_step instead, e.g. Trainer(..., evaluation_step=lambda model, batch: {'loss': "
                "model(**batch).loss, 'acc': ...})"
            )
        if cfg.lr_schedule is not None and scheduler is not None:
            raise ValueError(
                f"TrainerConfig(lr_schedule={cfg.lr_schedule!r}) builds the learning-rate schedule, and a scheduler "
                f"was passed too; keep one of them"
            )

    def _users_own(self, hook: str) -> bool:
        """Whether ``hook`` (``"training_step"``, ``"evaluation_step"``) is the user's: passed to the
        Trainer (an instance attribute) or overridden in a subclass."""
        return hook in vars(self) or getattr(type(self), hook) is not getattr(Trainer, hook)

    def _own_evaluation(self) -> bool:
        """Whether evaluation goes through :meth:`evaluation_step` (averaged) rather than the exact gathering."""
        return self.loss_fn is None or self._users_own("evaluation_step")

    # ------------------------------------------------------------------ the step --------
    def training_step(self, model: nn.Module, batch: Any) -> Any:
        """The loss of one (micro-)batch; override it in a subclass, or pass ``Trainer(training_step=...)``.

        Args:
            model: the wrapped model (DDP, FSDP, ...): call it, so that its gradients are averaged.
            batch: what the loader yielded, moved to the device as a whole.

        Returns:
            A scalar tensor (the mean over the batch), or a model output holding it (``.loss``,
            ``["loss"]``). The Trainer does the rest: AMP autocast around this call, accumulation,
            backward, clipping, the NaN policy, the optimizer step, recovery.

        The default: ``loss_fn(model(inputs), targets)`` for batches of ``(inputs, targets)``
        when a ``loss_fn`` was given, else the loss the model computes from the whole batch.
        """
        if self.loss_fn is None:
            return evaluation.forward_batch(model, batch)
        inputs, targets = split_batch(batch)
        return self.loss_fn(forward(model, inputs), targets)

    def evaluation_step(self, model: nn.Module, batch: Any) -> Any:
        """One batch's evaluation values when the loss comes from the model or from your own step.

        Called without gradients on the evaluation copy of the model; returns a loss (a scalar
        tensor, or an output with ``.loss``/``["loss"]``) or a mapping ``{name: value}`` of scalars.
        :meth:`evaluate` averages every value over all samples of all ranks, each batch weighted
        by its size. The default returns the model's own loss. (With a ``loss_fn`` and no
        evaluation step of your own, evaluation instead gathers every output and target and
        computes ``loss_fn`` and ``metric_fn`` over the whole set, exactly.)
        """
        return evaluation.forward_batch(model, batch)

    def _setup_amp(self) -> None:
        cfg = self.config
        self.amp_dtype = torch.float16 if cfg.amp_dtype == "float16" else torch.bfloat16
        self.amp = bool(cfg.amp)
        if self.amp and self.device.type != "cuda" and self.amp_dtype == torch.float16:
            _warn_once_main(
                f"TrainerConfig(amp=True) is ignored on device {self.device}: float16 autocast is only used on CUDA; "
                f"pass amp_dtype='bfloat16' for CPU mixed precision"
            )
            self.amp = False
        self.scaler = torch.amp.GradScaler("cuda") if self.amp and self.amp_dtype == torch.float16 else None

    def _autocast(self):
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    # -------------------------------------------------------------------- state ---------
    def model_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's weights with plain keys (no ``module.``), whatever the strategy.

        For FSDP the full weights are gathered (collective: call it on every rank); with
        ``rank0_only`` the other ranks get ``{}``.
        """
        return self.strategy.model_state_dict(self.model, rank0_only=rank0_only)

    def save_checkpoint(self, path: str | None = None) -> str:
        """Write a checkpoint (collective: call on every rank); return its path.

        Default path: ``<checkpoint_dir>/ckpt-e<epoch>-s<step>.pt``; older ones beyond
        ``keep_last`` are deleted. Never writes non-finite weights (raises
        :class:`~dptrain.train.NonFiniteError` instead, keeping the older checkpoints).

        Raises:
            CheckpointError: writing failed (e.g. a full disk), on every rank alike.
        """
        self._check_finite_weights()
        path = self.checkpointer.save(self._parts.to_save(self.best_state), path, epoch=self.epoch, step=self.global_step)
        self._saved_step = self.global_step
        self._call("on_checkpoint", path)
        return path

    def _check_finite_weights(self) -> None:
        if self.config.nan_policy == "off":
            return
        bad = [n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
        everyone = comm.all_gather_object(bad[:3])
        ranks = [r for r, b in enumerate(everyone) if b]
        if ranks:
            newest = self.checkpointer.newest()
            raise NonFiniteError(
                f"rank {self.rank}: the weights became non-finite after step {self.global_step} (rank(s) {ranks}, "
                f"e.g. {everyone[ranks[0]]}); not writing a checkpoint"
                + (f", the newest one {newest!r} is kept" if newest else "")
                + ". Lower the learning rate or clip gradients (TrainerConfig(max_grad_norm=...))"
            )

    def request_stop(self, reason: str) -> None:
        """Ask ``fit`` to stop after the current step (from a callback; every rank must ask alike)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(self, *args)

    # ------------------------------------------------------------------------- fit ------
    def fit(self, max_epochs: int | None = None, max_steps: int | None = None) -> dict[str, Any]:
        """Train until ``max_epochs`` epochs or ``max_steps`` optimizer steps are done, whichever
        comes first (counting what came before a resume).

        Every epoch: ``set_epoch``, train (with accumulation, AMP, clipping, the NaN check
        and step checkpoints), evaluate on the dev data, keep the best model, step an epoch
        scheduler, log, checkpoint every ``save_every`` epochs. At the end: evaluate the
        test data with the best model, export safetensors if asked, and return a summary.
        A resumed run with a larger ``max_epochs`` or ``max_steps`` continues to it (see
        :mod:`dptrain.train.schedule` for what happens to the LR schedule: a schedule planned
        over the steps, such as ``TrainerConfig(lr_schedule="cosine")`` or OneCycleLR, keeps the
        new plan and continues it from the step reached).

        A step budget may end inside an epoch: the dev data is then evaluated at that step (also
        with ``eval_every_steps``), a checkpoint is written there (with ``checkpoint_dir``), and a
        resumed run with a larger budget continues from that batch, bit for bit.

        Args:
            max_epochs: total number of epochs, >= 1. Default None: ``TrainerConfig.max_epochs``
                when neither budget is given here, else no limit on epochs.
            max_steps: total number of optimizer steps, >= 1. Default None:
                ``TrainerConfig.max_steps`` when neither budget is given here, else no limit.

        Returns:
            ``{"history": [per-epoch dicts], "best": {"epoch", "metric", "value"} or None,
            (epochs counted from 1, as in the printed lines, checkpoint names and best.pt)
            "test": {metrics} or None, "global_step": int, "stopped": reason or None}``; the
            same on every rank.

        Raises:
            ValueError: no budget at all (neither argument nor ``TrainerConfig.max_epochs`` /
                ``max_steps``), or one that is not an integer >= 1.
            NonFiniteError: with ``nan_policy="stop"``, a loss or gradient norm was not finite.
        """
        cfg = self.config
        if max_epochs is None and max_steps is None:
            max_epochs, max_steps = cfg.max_epochs, cfg.max_steps
        if max_epochs is None and max_steps is None:
            raise ValueError(
                "fit() needs a budget: fit(max_epochs=...) or fit(max_steps=...) (or TrainerConfig(max_epochs=..., "
                "max_steps=...))"
            )
        for name, value in (("max_epochs", max_epochs), ("max_steps", max_steps)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"fit({name}={value!r}) needs an integer >= 1")
        self._max_steps = max_steps
        self.log = TrainerLog(
            self.rank == 0, None, cfg.progress, cfg.verbose,
            # A resume, a replacement of rank 0 and a second fit all go on from this step.
            resume_step=self.global_step if self.resumed_from or self.global_step else None,
            progress_interval_s=cfg.progress_interval_s, refresh_every=cfg.log_every_steps, trackers=self.trackers,
        )  # fmt: skip
        self.stop_reason = None
        self._preempted_by = None
        self._profiler = self._make_profiler()
        preemption = cfg.preemption == "on" or (cfg.preemption == "auto" and in_slurm_job())
        self._preemption = PreemptionWatcher(preemption)
        try:
            self._preemption.__enter__()
            if self.resumed_from:
                self.log.line(
                    f"resumed from {self.resumed_from} (epoch {self.epoch + 1}, batch {self.batch_in_epoch}, "
                    f"step {self.global_step})"
                )
            self._recovery.announce()
            if self._recovery.pending_save:  # a replacement joined where a checkpoint was being written
                with self._recovery.saving():
                    self.save_checkpoint()
            self._call("on_fit_start")
            while (max_epochs is None or self.epoch < max_epochs) and self.stop_reason is None and not self._budget_spent():
                try:
                    self._run_epoch(max_epochs)
                except Exception as exc:
                    if not self._recovery.can_recover(exc):
                        raise
                    self._recovery.recover(exc)  # the survivors go on from the last commit
                    if self._recovery.pending_save:
                        with self._recovery.saving():
                            self.save_checkpoint()
            self._recovery.finish()  # a node let in at the last step boundary joins the end
            if self.stop_reason is not None:
                self.log.line(self.stop_reason)
            if self._profiler is not None and self._profiler.steps:
                self._profiler.report(final=True)
            if self._preempted_by is not None:
                self._leave_for_preemption()
            summary = self._finish()
            self._call("on_fit_end", summary)
            return summary
        except BaseException as exc:
            self.log.failed(exc)  # the trackers' runs end failed (or killed), not running
            with contextlib.suppress(Exception):  # a callback's failure must not hide the real one
                self._call("on_exception", exc)
            raise
        finally:
            self._preemption.__exit__(None, None, None)
            if self._profiler is not None:
                self._profiler.close()
            self.log.close()

    def _make_profiler(self) -> StepProfiler | None:
        cfg = self.config
        wanted = cfg.profile if cfg.profile is not None else _settings.get("DPTRAIN_PROFILE")
        if not wanted:
            return None
        out = cfg.profile_dir or cfg.log_dir or cfg.checkpoint_dir or "."
        return StepProfiler(self.device, self.rank, cfg.profile_every_steps, out)

    def _leave_for_preemption(self) -> None:
        """After the preemption checkpoint: requeue (rank 0), then leave with :class:`Preempted`."""
        why = requeue_job() if self.rank == 0 and in_slurm_job() else "not a Slurm job"
        why = comm.broadcast_object(why, src=0)
        if why is None:
            self.log.line("job requeued with scontrol; it resumes from the checkpoint when it runs again")
            raise Preempted(0)
        self.log.line(f"not requeued ({why}); continue with resume='auto' (the examples' --resume)")
        raise Preempted(143)

    def _finish(self) -> dict[str, Any]:
        cfg = self.config
        test = self.test() if self.test_loader is not None else None
        if cfg.export_safetensors:
            self.export_safetensors(cfg.export_safetensors)
        final = dict(self.history[-1]) if self.history else {}
        if test:
            final.update({f"test/{k}": v for k, v in test.items()})
        self.log.hparams({**cfg.to_dict(), **self.hparams, "world_size": self.world.world_size}, final)
        best = None
        if self.best_epoch is not None:
            best = {"epoch": self.best_epoch, "metric": cfg.best_metric, "value": self.best_metric}
        return {"history": list(self.history), "best": best, "test": test, "global_step": self.global_step,
                "stopped": self.stop_reason}

    def _budget_spent(self) -> bool:
        """Whether ``fit``'s step budget is used up."""
        return self._max_steps is not None and self.global_step >= self._max_steps

    def _run_epoch(self, max_epochs: int | None) -> None:
        epoch, start = self.epoch, self.batch_in_epoch
        it, num_batches = self.state.begin_epoch(self.train_loader)
        if num_batches is not None and not getattr(self.train_loader, "equal_steps", False):
            check_equal_batches(num_batches, start, epoch, self.world, self.device)
        self.model.train()
        self.log.start_epoch(epoch, max_epochs, num_batches, start)
        t0 = time.perf_counter()
        b = self._train_batches(it, start, num_batches)
        self.log.end_epoch()
        stopped = self.stop_reason is not None or self._budget_spent()
        if num_batches is not None and b != num_batches and not stopped:
            raise RuntimeError(
                f"rank {self.rank}: the train loader yielded {b} batches in epoch {epoch}, but len(loader) is "
                f"{num_batches}; every rank must see the same number of batches (use dptrain.prepare_dataloader)"
            )
        if num_batches is None and b == start and max_epochs is None and not stopped:
            raise RuntimeError(
                f"rank {self.rank}: the train data yielded no batch in epoch {epoch + 1}, so fit(max_steps="
                f"{self._max_steps}) would never reach its budget; check the data set (an empty stream?)"
            )
        if stopped and not self._epoch_done:  # stopped mid-epoch: the checkpoint continues from this batch
            self.state.batch_in_epoch = b
            if self.config.checkpoint_dir and self._saved_step != self.global_step:
                self.save_checkpoint()
            if isinstance(it, StreamIterator):
                # The stream loader keeps its pass (for its position): its workers would live on
                # until the Trainer is collected, which then waits 5 s per worker (StreamIterator.close).
                it.close()
            return
        self._end_epoch(epoch, start, time.perf_counter() - t0, max_epochs)

    def _train_batches(self, it: Iterable[Any], b: int, num_batches: int | None) -> int:
        """Train on the epoch's remaining batches; return how many batches of the epoch are done.

        ``num_batches`` is None for a loader without a length (a stream): its iterator then says
        which batch is the epoch's last (``is_last``), and every rank yields as many (see
        :class:`dptrain.data.StreamLoader`); a rank whose share ran out yields stand-ins
        (:class:`dptrain.data.ShadowBatch`), trained with a zero weight, as ``Join`` does.
        """
        cfg = self.config
        accum = cfg.gradient_accumulation_steps
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        step_sums = []
        prof = self._profiler
        self._epoch_done = False
        if prof is not None:
            prof.start()
        for batch in it:
            self._recovery.take_newcomers()  # a node let in joins here, before the next step
            if prof is not None:
                prof.lap("data")
            shadow = isinstance(batch, ShadowBatch)
            if shadow:
                batch = batch.batch
            batch = move_to_device(batch, self.device)
            n = 0 if shadow else self._samples_in(batch)
            last = b + 1 == num_batches if num_batches is not None else bool(getattr(it, "is_last", False))
            sync = (b + 1) % accum == 0 or last
            _interrupt.arm()  # a peer's death noted from here to the backward's end stops the step at once
            try:
                with contextlib.nullcontext() if sync else self.strategy.no_sync(self.model):
                    with self._autocast():
                        loss = loss_of(self.training_step(self.model, batch), "training_step")
                    if shadow:
                        loss = loss * 0.0  # the gradients of a stand-in count for nothing: Join's zeros
                    if sync and self._recovery.active:
                        self._recovery.prepare_step(step_sums + [(loss.detach(), n)])
                    if prof is not None:
                        prof.lap("forward")
                    scaled = loss / accum if accum > 1 else loss
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    scaled.backward()
            finally:
                _interrupt.disarm()
            if prof is not None:
                prof.lap("backward")
            step_loss += loss.detach().to(torch.float64)
            step_sums.append((loss.detach(), n))
            b += 1
            if sync:
                self._epoch_done = last
                self._after_micro_batches(b, num_batches, step_loss, step_sums, loss, last)
                step_loss.zero_()
                step_sums = []
            if self.log.progress:
                self.log.update(1, n * self.world.world_size, loss.detach())
            if sync and (self.stop_reason is not None or self._budget_spent()):
                break
            if prof is not None:
                prof.start()  # checkpoints and logging between steps are not the next batch's wait
        else:
            self._epoch_done = True
            if step_sums:
                # Only a loader that cannot say which batch is its last gets here (no length and no
                # ``is_last``): the micro-batches after the last full accumulation group were never
                # all-reduced, so stepping on them would part the replicas.
                self.optimizer.zero_grad(set_to_none=True)
                _warn_once_main(
                    f"Trainer: the train data has no length and does not say which batch is an epoch's last, so the "
                    f"last {len(step_sums)} micro-batch(es) of epoch {self.epoch + 1} did not fill an accumulation "
                    f"group of {accum} and were not stepped on; use dptrain.prepare_dataloader (whose loaders say "
                    f"it) or a data set with __len__"
                )
        return b

    def _samples_in(self, batch: Any) -> int:
        """The samples of one batch, for the epoch's mean loss and the samples/s."""
        if self.loss_fn is not None and not self._users_own("training_step"):
            return num_samples(split_batch(batch)[1])  # (inputs, targets): as many as targets
        return batch_size_of(batch)

    def _after_micro_batches(self, b: int, num_batches: int | None, step_loss: torch.Tensor, step_sums: list,
                             loss: torch.Tensor, last: bool) -> None:
        """The optimizer step that closes an accumulation group, and what follows it."""
        cfg, prof = self.config, self._profiler
        took = self._optimizer_step(b, num_batches, step_loss, step_sums)
        if prof is not None:
            prof.lap("optimizer")
            prof.end_step()
            if prof.due:
                prof.report()
        if not took:
            return  # a skipped step's losses stay out of the epoch's average; nothing to save
        if self.global_step % cfg.log_every_steps == 0:
            self.log.scalars({"train/step_loss": float(loss.detach()), "train/lr": self._lr()},
                             self.global_step, self.epoch + 1)
        final = self._budget_spent()
        every = cfg.eval_every_steps
        if self.dev_loader is not None and ((every and self.global_step % every == 0) or (final and (every or not last))):
            # Evaluations by step (and at a budget's end inside an epoch); at an epoch's end
            # without eval_every_steps, _end_epoch evaluates.
            self._evaluate_at_step(b)
        if cfg.save_every_steps and self.global_step % cfg.save_every_steps == 0 and not last:
            # A step checkpoint on the epoch's last batch is left to the end-of-epoch one,
            # which is taken after the dev evaluation (see [Note: bitwise resume]).
            self.state.batch_in_epoch = b
            with self._recovery.saving():
                self.save_checkpoint()

    def _evaluate_at_step(self, b: int) -> None:
        """Evaluate the dev data between two steps, leaving the training exactly as it was.

        The RNG streams are put back afterwards (starting the dev loader draws from torch's
        generator), so a run with step evaluations trains bit for bit like one without, and a
        resume or an in-place recovery (whose commit precedes this) does not depend on it.
        """
        rng = get_rng_state()
        try:
            dev = self.evaluate(self.dev_loader)
        finally:
            set_rng_state(rng)
        self.state.batch_in_epoch = b
        self._update_best(dev, self.epoch + 1)
        budget = f"/{self._max_steps}" if self._max_steps is not None else ""
        self.log.line(f"step {self.global_step}{budget} | dev " + format_metrics(dev))
        self.log.scalars({f"dev/{k}": v for k, v in dev.items()}, self.global_step, self.epoch + 1)
        self._call("on_evaluate", "dev", dev)

    def _optimizer_step(self, batch: int, num_batches: int, step_loss: torch.Tensor, step_sums: list) -> bool:
        """Clip, check, step, record the step's losses; returns False when the step was skipped."""
        cfg = self.config
        norm = None
        if self.scaler is not None and (cfg.max_grad_norm is not None or cfg.nan_policy != "off"):
            self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm is not None:
            norm = self.strategy.clip_grad_norm_(self.model, cfg.max_grad_norm)
        elif cfg.nan_policy != "off" and self.scaler is None:
            # With a gradient scaler, infinite gradients are its business (it skips the step).
            norm = self.strategy.grad_norm(self.model)
        info = None
        if cfg.nan_policy != "off" or self.callbacks or self._preemption.enabled:
            signalled = self._preemption.signal or 0
            losses, norms, flags = gather_step_values(step_loss, norm if self.scaler is None else None, self.device,
                                                      signalled)
            info = StepInfo(self.global_step + 1, self.epoch + 1, batch, num_batches, losses, norms)
            self._call("on_before_optimizer_step", info)
            self._note_preemption(flags, info.step)
        skip = info is not None and info.skip
        if skip:
            self.state.skipped_steps += 1
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if not skip:
            self.strategy.after_optimizer_step()  # DiLoCo's count (and, in turn, its outer sync): before the commit
        self.optimizer.zero_grad(set_to_none=True)
        if not skip:
            self.state.global_step += 1
            _heartbeat.tick()  # the launcher's stall report counts these steps
            if self.scheduler is not None and cfg.scheduler_interval == "step":
                self.scheduler.step()
            for value, count in step_sums:  # a skipped step's losses stay out of the epoch's average
                self.state.record_batch(value, count)
        # Nothing collective since the step: this is a commit (see [Note: in-place recovery]).
        self._recovery.commit(batch, prepared=not skip)
        if info is not None:
            self._call("on_step_end", info)
        return not skip

    def _note_preemption(self, flags: list[float], step: int) -> None:
        received = [(r, int(f)) for r, f in enumerate(flags) if f]
        if received and self._preempted_by is None:
            import signal

            rank, sig = received[0]
            self._preempted_by = sig
            self.request_stop(
                f"preempted: {signal.Signals(sig).name} reached rank {rank}; stopping after step {step} to write a checkpoint"
            )

    def _end_epoch(self, epoch: int, start: int, elapsed: float, max_epochs: int | None) -> None:
        cfg = self.config
        # Loss averaged over every sample of every rank this epoch.
        totals = torch.stack([self.state.loss_sum,
                              torch.tensor(float(self.state.sample_count), dtype=torch.float64, device=self.device)])
        if self.dev_loader is None or cfg.eval_every_steps:
            self._recovery.prepare_epoch_end()  # the buffers are final already
        comm.all_reduce(totals, op="sum")
        record: dict[str, Any] = {
            "epoch": epoch + 1,  # counted from 1, as everywhere a user reads an epoch
            "train_loss": float(totals[0] / max(float(totals[1]), 1.0)),
            "time_s": elapsed,
            "samples_per_s": float(totals[1]) / elapsed if start == 0 and elapsed > 0 else float("nan"),
            "lr": self._lr(),
        }
        if self.dev_loader is not None and not cfg.eval_every_steps:
            dev = self.evaluate(self.dev_loader, _after_sync=self._recovery.prepare_epoch_end)
            record.update({f"dev_{k}": v for k, v in dev.items()})
            self._update_best(dev, epoch + 1)
            self._call("on_evaluate", "dev", dev)
        if self.scheduler is not None and cfg.scheduler_interval == "epoch":
            self.scheduler.step()
        self.state.finish_epoch(record)
        self._recovery.commit(0, prepared=True)
        self._log_epoch(record, max_epochs)
        self._call("on_epoch_end", record)
        stopping = self.stop_reason is not None or self._budget_spent()
        if cfg.checkpoint_dir and (
            (cfg.save_every and (self.epoch % cfg.save_every == 0 or self.epoch == max_epochs)) or stopping
        ):
            with self._recovery.saving():
                self.save_checkpoint()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _log_epoch(self, record: dict[str, Any], max_epochs: int | None) -> None:
        dev = {k[4:]: v for k, v in record.items() if k.startswith("dev_")}
        text = f"epoch {record['epoch']}" + (f"/{max_epochs}" if max_epochs is not None else "")
        if self._max_steps is not None:
            text += f" | step {self.global_step}/{self._max_steps}"
        text += f" | train loss {record['train_loss']:.4f}"
        if dev:
            text += " | dev " + format_metrics(dev)
        rate = record["samples_per_s"]
        text += f" | {record['time_s']:.2f} s" + (f" ({rate:.0f} samples/s)" if math.isfinite(rate) else " (resumed)")
        if self.state.skipped_steps:
            text += f" | {self.state.skipped_steps} non-finite step(s) skipped so far"
        self.log.line(text)
        scal = {"train/loss": record["train_loss"], "train/epoch_time_s": record["time_s"], "train/epoch": record["epoch"]}
        if math.isfinite(rate):
            scal["train/samples_per_s"] = rate
        scal.update({f"dev/{k}": v for k, v in dev.items()})
        self.log.scalars(scal, self.global_step, record["epoch"])

    # -------------------------------------------------------------------- evaluation ----
    def evaluate(self, data: Any = None, _after_sync: Callable[[], None] | None = None) -> dict[str, float]:
        """Evaluate on ``data`` (default: the dev data) with every sample counted exactly once.

        Each rank runs its shard (the eval loader partitions without padding; a rank may
        have no sample at all), then the outputs and targets are gathered in dataset order
        with :func:`dptrain.gather_results`; the loss and ``metric_fn`` are computed on the
        whole set, identically on every rank. Every rank first takes rank 0's buffers
        (BatchNorm's running statistics), so one and the same model is evaluated everywhere.
        Collective: call it on every rank.

        With the model's own loss (``loss_fn=None``), an ``evaluation_step`` of your own, or a
        streamed data set (no sampler lists its samples), each rank runs its share through
        :meth:`evaluation_step` (for a stream with a ``loss_fn``: ``loss_fn`` and ``metric_fn`` on
        each batch) and every value is averaged over all samples of all ranks, each batch weighted
        by its size.

        Returns:
            ``{"loss": float, **metrics}``.
        """
        loader = self.dev_loader if data is None else (data if isinstance(data, torch.utils.data.DataLoader) else self._loader(data, "eval"))
        if loader is None:
            raise ValueError("evaluate() needs data: pass it, or give the Trainer dev_data=...")
        self.strategy.sync_buffers(self.model)  # one model state on every rank (BatchNorm statistics)
        if _after_sync is not None:
            _after_sync()
        net = self.strategy.eval_module(self.model)
        streamed = isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
        own = self._own_evaluation()
        with self.strategy.evaluating(self.model):  # DiLoCo: the replicas' common weights
            if own or streamed:
                step = self.evaluation_step if own else self._batch_metrics
                return evaluation.evaluate_steps(step, net, loader, device=self.device,
                                                 lockstep=self.strategy.lockstep_eval, autocast=self._autocast)
            return evaluation.evaluate(
                net, loader, device=self.device, lockstep=self.strategy.lockstep_eval,
                autocast=self._autocast, loss_fn=self.loss_fn, metric_fn=self.metric_fn, rank=self.rank,
            )  # fmt: skip

    def _batch_metrics(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """``loss_fn`` and ``metric_fn`` on one batch: evaluation of a stream, which cannot be gathered in order."""
        inputs, targets = split_batch(batch)
        out = forward(model, inputs)
        values: dict[str, Any] = {"loss": self.loss_fn(out, targets)}
        if self.metric_fn is not None:
            extra = self.metric_fn(out, targets)
            values.update(extra if isinstance(extra, Mapping) else {"metric": extra})
        return values

    def _update_best(self, metrics: Mapping[str, float], epoch: int) -> None:
        key = self.config.best_metric
        if key not in metrics:
            raise ValueError(
                f"TrainerConfig(best_metric={key!r}) is not among the dev metrics {sorted(metrics)}; return it from metric_fn "
                f"or choose one of those"
            )
        value = float(metrics[key])
        if not math.isfinite(value):
            return  # a NaN or infinite metric is never the best
        better = self.best_metric is None or (value > self.best_metric if self.config.best_mode == "max" else value < self.best_metric)
        if not better:
            return
        self.state.best_metric, self.state.best_epoch, self.state.best_step = value, epoch, self.global_step
        self.best_state = {k: v.detach().to("cpu").clone() for k, v in self.model_state_dict(rank0_only=False).items()}
        self.checkpointer.save_best(
            {"model": self.best_state, "epoch": epoch, "metric": key, "value": value, "global_step": self.global_step}
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
            self.strategy.load_model_state_dict(self.model, self.best_state, source="the best model")
        metrics = self.evaluate(loader)
        self.log.line("test " + format_metrics(metrics))
        self.log.scalars({f"test/{k}": v for k, v in metrics.items()}, self.global_step, self.epoch)
        self._call("on_evaluate", "test", metrics)
        return metrics

    def export_safetensors(self, path: str) -> str | None:
        """Write the best (else current) weights as safetensors on rank 0 (collective for FSDP)."""
        from dptrain import checkpoint as ckpt

        state = self.best_state if self.best_state is not None else self.model_state_dict(rank0_only=True)
        out = None
        if self.rank == 0:
            epoch = self.best_epoch if self.best_state is not None else self.epoch
            out = ckpt.save_safetensors(state, path, metadata={"epoch": str(epoch)})
        comm.barrier()
        return out
