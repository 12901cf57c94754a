"""TrainerConfig: every setting of the Trainer, validated once, on construction."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TrainerConfig", "STRATEGIES", "NAN_POLICIES", "LR_SCHEDULES"]

#: Names accepted by ``TrainerConfig(strategy=...)``.
STRATEGIES = ("ddp", "fsdp", "torch-ddp", "none", "zero", "diloco")
#: Schedules accepted by ``TrainerConfig(lr_schedule=...)``.
LR_SCHEDULES = ("cosine", "linear", "constant")
#: What the Trainer does when a loss or gradient norm is not finite.
NAN_POLICIES = ("stop", "skip", "off")


@dataclasses.dataclass
class TrainerConfig:
    """Settings of a :class:`dptrain.Trainer`; validated on construction.

    Attributes:
        strategy: how the model is replicated: ``"ddp"`` (dptrain's DDP), ``"zero"`` (DDP with a
            ZeRO-1 optimizer: 1/N of the optimizer state per rank), ``"fsdp"`` (dptrain's
            FSDP), ``"torch-ddp"`` (PyTorch's DDP, for comparison), ``"diloco"`` (local steps and a
            rare outer sync, for replicas joined by slow links: see ``diloco_kwargs``) or ``"none"``.
            Default None: ``"ddp"`` when the world has more than one process, else ``"none"``.
        zero_stage: 1 shards the optimizer state (ZeRO-1) under DDP: the same as
            ``strategy="zero"``. Passing a :class:`dptrain.ZeroRedundancyOptimizer` does it
            too. Default 0.
        compression: gradient compression of dptrain's DDP (strategies ``"ddp"`` and
            ``"zero"``): ``"auto"`` (measured in the first steps, on only where it pays, e.g.
            across nodes on a slow link), ``"bf16"``, ``"fp16"`` or ``"powersgd"``; see
            :class:`dptrain.DDP`. Default None: full-precision all-reduce. Ignored on one process.
        overlap_optimizer: step each gradient bucket's parameters as soon as its all-reduce
            completes, during backward (strategy ``"ddp"``; SGD, Adam, AdamW and the other
            per-parameter optimizers; bitwise the same update). Cannot be combined with
            ``max_grad_norm`` (the global norm needs every gradient first), fp16 AMP (the
            scaler unscales gradients before the step) or ``nan_policy="skip"`` (the update
            is applied before the check). Default False. Ignored on one process.
        batch_size: per-rank batch size, used only when datasets (not loaders) are given.
        eval_batch_size: per-rank batch size for dev/test datasets. Default: ``batch_size``.
        num_workers: DataLoader workers when the Trainer builds the loaders. Default 0.
        seed: sampler seed when the Trainer builds the loaders (or re-shards a plain one). Default 0.
        use_distributed_sampler: on several ranks, a train DataLoader with PyTorch's default
            sampler (sequential or random, no DistributedSampler) is rebuilt over a
            :class:`dptrain.DistributedSampler` with the same batch size, shuffle, ``drop_last``,
            collate function and workers, so each rank trains on its own share (said once
            from rank 0). False keeps such a loader as it is. Default True.
        gradient_accumulation_steps: micro-batches per optimizer step; the first k-1 run
            under ``no_sync()``. Default 1.
        max_grad_norm: clip the global gradient norm to this value. Default None (no clipping).
        amp: automatic mixed precision. On CUDA with ``float16`` (and a gradient scaler) or
            ``bfloat16``; on CPU with ``bfloat16`` only (CPU autocast); ``amp=True`` with
            ``float16`` on CPU warns once and trains in fp32. Default False.
        amp_dtype: ``"float16"`` or ``"bfloat16"``. Default ``"float16"``.
        scheduler_interval: ``"epoch"`` or ``"step"``: when ``scheduler.step()`` runs. Default ``"epoch"``.
        max_epochs: how many epochs ``fit()`` trains when it is called without a budget. Default None.
        max_steps: how many optimizer steps ``fit()`` trains when called without a budget (with
            ``max_epochs`` too, whichever ends first); the way language models are trained. Default None.
        eval_every_steps: evaluate the dev data (and choose the best model) every this many optimizer
            steps and after the last one, instead of at the end of each epoch (0: at epoch ends). Default 0.
        lr_schedule: a learning-rate schedule over the optimizer steps that the Trainer builds itself:
            ``"cosine"`` (linear warmup, then cosine decay to ``min_lr_ratio`` times the optimizer's
            learning rate at ``max_steps``), ``"linear"`` (warmup, then linear decay) or ``"constant"``
            (warmup, then flat); see :class:`dptrain.train.WarmupDecay`. Needs ``max_steps`` and no
            ``scheduler`` of your own; sets ``scheduler_interval="step"``. Default None.
        warmup_steps: optimizer steps of linear warmup from 0 for ``lr_schedule``. Default 0.
        min_lr_ratio: the learning rate ``lr_schedule`` ends at, as a fraction of the optimizer's. Default 0.
        uneven: what happens when the ranks' shares of a streamed data set (an ``IterableDataset``)
            end at different batches: ``"join"`` (default) -- a rank that ran out takes part in the
            remaining steps with a zero-weight stand-in batch, as ``torch``'s ``Join`` does, so no
            sample is left out and no rank waits; ``"drop"`` -- every rank stops at the first rank's
            end, and the dropped batches are counted once.
        checkpoint_dir: where checkpoints go. Default None (no checkpoints).
        save_every: write a checkpoint every this many epochs (0: never at epoch ends). Default 1.
        save_every_steps: also every this many optimizer steps (0: never). Default 0.
        keep_last: keep only the newest K checkpoints (0: keep all). Default 3.
        best_metric: dev metric that selects the best model (``"loss"`` or a key returned by
            ``metric_fn``); non-finite values never become the best. Default ``"loss"``.
        best_mode: ``"min"`` or ``"max"``: whether smaller or larger ``best_metric`` is better.
            Default ``"min"``.
        nan_policy: what happens when the loss or the gradient norm of a step is NaN or
            infinite on any rank (all ranks agree in the same step): ``"stop"`` ends the run
            with :class:`dptrain.train.NonFiniteError` naming the step, the epoch and the
            rank(s), before the optimizer step, so no checkpoint ever holds non-finite
            weights; ``"skip"`` drops that step (as AMP's gradient scaler does) and stops
            after ``max_consecutive_skips`` skipped steps in a row; ``"off"`` does not check
            (one small all-reduce per step less). Default ``"stop"``.
        max_consecutive_skips: with ``nan_policy="skip"``, stop after this many skipped steps
            in a row. Default 20.
        early_stopping_patience: stop when the dev metric ``early_stopping_metric`` has not
            improved by more than ``early_stopping_min_delta`` for this many evaluations.
            Default None (never stop early).
        early_stopping_metric: the dev metric to watch. Default None: ``best_metric``.
        early_stopping_min_delta: the smallest change that counts as an improvement. Default 0.
        preemption: ``"auto"`` (default): under Slurm (``SLURM_JOB_ID`` set), SIGUSR1 or SIGTERM
            make ``fit`` finish the current step, write a checkpoint, requeue the job with
            ``scontrol requeue`` and exit (see :mod:`dptrain.train.preemption`); ``"on"``:
            the same outside Slurm too (without the requeue); ``"off"``: signals keep their
            default meaning.
        log_dir: TensorBoard directory (rank 0 writes). Default None.
        log_every_steps: step-scalar interval for TensorBoard and the metrics file. Default 10.
        metrics_path: also write every logged value to this file on rank 0, one record per
            line (``step``, ``epoch``, ``split``, ``metric``, ``value``, ``wall_time``):
            JSON lines, or CSV when the name ends in ``.csv``. Readable with
            ``pandas.read_json(path, lines=True)`` / ``pandas.read_csv(path)``. Default None.
        loggers: experiment trackers, written by rank 0 only, one run per job (a restart, a
            resume and an in-place recovery continue it; a failed ``fit`` marks it failed):
            names -- ``"wandb"``, ``"mlflow"``, ``"csv"`` (the metrics file: ``metrics_path``,
            default ``<log_dir or .>/metrics.csv``), ``"tensorboard"`` (needs ``log_dir``) -- as a
            list or one comma-separated string, or :class:`dptrain.train.trackers.Tracker` objects.
            Each records the resolved config once and the metrics by optimizer step. ``log_dir``
            and ``metrics_path`` add TensorBoard and the metrics file without being named. W&B
            and MLflow are optional extras (``pip install 'dptrain[wandb]'`` / ``'dptrain[mlflow]'``).
            Default None. See :mod:`dptrain.train.trackers`.
        run_name: the run's name in W&B and MLflow. Default None: the tracker draws one.
        project: the W&B project, and the MLflow experiment. Default None: ``WANDB_PROJECT`` /
            ``MLFLOW_EXPERIMENT_NAME``, else each tracker's default.
        tracking_uri: MLflow's store: ``"sqlite:///mlflow.db"``, ``"http://host:5000"``, ...
            Default None: ``MLFLOW_TRACKING_URI``, else MLflow's default.
        progress: progress on rank 0: True, False, or None (default): a live bar when a
            terminal watches (directly, or through ``dptrain run``), else (a pipe, a log file)
            a progress line every ``progress_interval_s`` seconds with the loss, samples/s and
            the time left.
        progress_interval_s: seconds between progress lines when no terminal watches. Default 5.
        profile: time every step on every rank (data, forward, backward, exposed
            communication, optimizer) and have rank 0 print a per-rank table every
            ``profile_every_steps`` steps and at the end, naming the slowest rank, plus
            ``profile.png`` (see :mod:`dptrain.train.profile`). Default None: on when
            ``DPTRAIN_PROFILE=1`` (``dptrain run --profile``).
        profile_every_steps: steps between profile tables. Default 100.
        profile_dir: where ``profile.png`` goes. Default None: ``log_dir``, else
            ``checkpoint_dir``, else the working directory.
        verbose: print one line per epoch on rank 0. Default True.
        export_safetensors: after ``fit``, write the best (else final) weights here as safetensors.
        ddp_kwargs: extra arguments for the DDP constructor (``bucket_cap_mb``, ...).
        fsdp_kwargs: extra arguments for the FSDP constructor (``auto_wrap_policy``, ...).
        diloco_kwargs: the settings of :class:`dptrain.DiLoCo` for ``strategy="diloco"``
            (``sync_every``, ``outer_lr``, ``outer_momentum``, ``nesterov``, ``num_fragments``,
            ``fragment_sync_delay``, ``fragment_update_alpha``, ``compression``), plus
            ``replica``: ``"rank"`` (default: every rank a replica) or ``"node"`` (each node one
            replica, DDP inside it, DiLoCo between the nodes). Default {}: DiLoCo's defaults.

    Raises:
        ValueError: a setting is out of range; the message shows the value and the fix.

    Example:
        >>> TrainerConfig(checkpoint_dir="ckpt", save_every_steps=100, best_metric="accuracy", best_mode="max",
        ...               early_stopping_patience=3)
    """

    strategy: str | None = None
    zero_stage: int = 0
    compression: str | None = None
    overlap_optimizer: bool = False
    batch_size: int | None = None
    eval_batch_size: int | None = None
    num_workers: int = 0
    seed: int = 0
    use_distributed_sampler: bool = True
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    amp: bool = False
    amp_dtype: str = "float16"
    scheduler_interval: str = "epoch"
    max_epochs: int | None = None
    max_steps: int | None = None
    eval_every_steps: int = 0
    lr_schedule: str | None = None
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    uneven: str = "join"
    checkpoint_dir: str | None = None
    save_every: int = 1
    save_every_steps: int = 0
    keep_last: int = 3
    best_metric: str = "loss"
    best_mode: str = "min"
    nan_policy: str = "stop"
    max_consecutive_skips: int = 20
    early_stopping_patience: int | None = None
    early_stopping_metric: str | None = None
    early_stopping_min_delta: float = 0.0
    preemption: str = "auto"
    log_dir: str | None = None
    log_every_steps: int = 10
    metrics_path: str | None = None
    loggers: Any = None  # str | list[str | Tracker] | None: see _check_trackers
    run_name: str | None = None
    project: str | None = None
    tracking_uri: str | None = None
    progress: bool | None = None
    progress_interval_s: float = 5.0
    profile: bool | None = None
    profile_every_steps: int = 100
    profile_dir: str | None = None
    verbose: bool = True
    export_safetensors: str | None = None
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    fsdp_kwargs: dict = dataclasses.field(default_factory=dict)
    diloco_kwargs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"TrainerConfig(strategy={self.strategy!r}) is not one of {list(STRATEGIES)} (or None for automatic)")
        if self.zero_stage not in (0, 1):
            raise ValueError(
                f"TrainerConfig(zero_stage={self.zero_stage!r}) must be 0 or 1 (stage 2 and 3 shard gradients and "
                f"parameters too: use strategy='fsdp')"
            )
        self._check_ddp_extensions()
        self._check_diloco()
        self._check_trackers()
        for name in ("batch_size", "eval_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"TrainerConfig({name}={v!r}) must be a positive integer or None")
        for name in ("num_workers", "save_every", "save_every_steps", "keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainerConfig({name}={v!r}) must be an integer >= 0")
        for name in ("gradient_accumulation_steps", "log_every_steps", "max_consecutive_skips", "profile_every_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                hint = " (1 = step after every batch)" if name == "gradient_accumulation_steps" else ""
                raise ValueError(f"TrainerConfig({name}={v!r}) must be an integer >= 1{hint}")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0):
            raise ValueError(f"TrainerConfig(max_grad_norm={self.max_grad_norm!r}) must be > 0, or None for no clipping")
        if self.amp_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"TrainerConfig(amp_dtype={self.amp_dtype!r}) must be 'float16' or 'bfloat16'")
        self._check_budget()
        if self.scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"TrainerConfig(scheduler_interval={self.scheduler_interval!r}) must be 'epoch' or 'step'")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"TrainerConfig(best_mode={self.best_mode!r}) must be 'min' or 'max'")
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"TrainerConfig(nan_policy={self.nan_policy!r}) must be one of {list(NAN_POLICIES)}")
        if self.early_stopping_patience is not None and (
            not isinstance(self.early_stopping_patience, int) or self.early_stopping_patience < 1
        ):
            raise ValueError(
                f"TrainerConfig(early_stopping_patience={self.early_stopping_patience!r}) must be an integer >= 1, "
                f"or None to never stop early"
            )
        if self.preemption not in ("auto", "on", "off"):
            raise ValueError(f"TrainerConfig(preemption={self.preemption!r}) must be 'auto', 'on' or 'off'")
        if not self.early_stopping_min_delta >= 0:
            raise ValueError(f"TrainerConfig(early_stopping_min_delta={self.early_stopping_min_delta!r}) must be >= 0")
        if not self.progress_interval_s > 0:
            raise ValueError(f"TrainerConfig(progress_interval_s={self.progress_interval_s!r}) must be > 0 seconds")
        if self.save_every_steps and self.checkpoint_dir is None:
            raise ValueError(
                f"TrainerConfig(save_every_steps={self.save_every_steps}) needs checkpoint_dir=... to know where to write"
            )
        if not isinstance(self.seed, int):
            raise ValueError(f"TrainerConfig(seed={self.seed!r}) must be an integer")

    def _check_budget(self) -> None:
        """The step budget and the schedule over it: ``max_epochs``, ``max_steps``, ``lr_schedule`` ..."""
        for name in ("max_epochs", "max_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"TrainerConfig({name}={v!r}) must be an integer >= 1, or None")
        for name in ("eval_every_steps", "warmup_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainerConfig({name}={v!r}) must be an integer >= 0")
        if self.lr_schedule is not None:
            if self.lr_schedule not in LR_SCHEDULES:
                raise ValueError(f"TrainerConfig(lr_schedule={self.lr_schedule!r}) must be one of {list(LR_SCHEDULES)} or None")
            if self.max_steps is None:
                raise ValueError(
                    f"TrainerConfig(lr_schedule={self.lr_schedule!r}) plans the learning rate over max_steps, which is "
                    f"None; set TrainerConfig(max_steps=...)"
                )
            if self.warmup_steps > self.max_steps:
                raise ValueError(
                    f"TrainerConfig(warmup_steps={self.warmup_steps}) is longer than max_steps={self.max_steps}; "
                    f"warm up for fewer steps"
                )
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise ValueError(f"TrainerConfig(min_lr_ratio={self.min_lr_ratio!r}) must be between 0 and 1")
        if self.lr_schedule is not None and self.scheduler_interval == "epoch":
            self.scheduler_interval = "step"  # the schedule is planned in optimizer steps
        if self.uneven not in ("join", "drop"):
            raise ValueError(f"TrainerConfig(uneven={self.uneven!r}) must be 'join' or 'drop'")

    def _check_trackers(self) -> None:
        """``loggers`` and the run's names: known trackers, their packages installed, found on every rank alike."""
        import importlib.util

        from dptrain.train.trackers.base import PACKAGES, TRACKER_NAMES, Tracker

        for name in ("run_name", "project", "tracking_uri"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"TrainerConfig({name}={v!r}) must be a string or None")
        spec = self.loggers
        if spec is None:
            return
        if isinstance(spec, str):
            items: list = [n.strip() for n in spec.split(",") if n.strip()]
        elif isinstance(spec, (list, tuple)):
            items = list(spec)
        else:
            raise ValueError(f"TrainerConfig(loggers={spec!r}) must be a name, a list of names and Tracker objects, "
                             f"or None; e.g. loggers=['wandb', 'mlflow']")
        names = []
        for item in items:
            if isinstance(item, Tracker):
                names.append(item.name)
                continue
            if item not in TRACKER_NAMES:
                raise ValueError(f"TrainerConfig(loggers=[{item!r}]): not one of {list(TRACKER_NAMES)}; pass one of "
                                 f"those, or a dptrain.train.trackers.Tracker object")
            names.append(item)
            module, extra = PACKAGES.get(item, (None, None))
            if module is not None and importlib.util.find_spec(module) is None:
                raise ImportError(f"TrainerConfig(loggers=[{item!r}]) needs the {module} package, which is not "
                                  f"installed: pip install 'dptrain[{extra}]' (or pip install {module})")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"TrainerConfig(loggers={spec!r}) names {twice} twice; give each tracker once")
        if "tensorboard" in items and not self.log_dir:  # the name; a TensorBoardTracker object has its own
            raise ValueError("TrainerConfig(loggers=['tensorboard']) needs a directory for the event files: set "
                             "TrainerConfig(log_dir='runs/tb')")

    def _check_ddp_extensions(self) -> None:
        """``compression`` and ``overlap_optimizer``: what DDP can do, set where the Trainer manages it."""
        from dptrain.parallel.ddp._compression import CHOICES

        for name in ("compression", "overlap_optimizer"):
            if name in self.ddp_kwargs:
                raise ValueError(
                    f"TrainerConfig(ddp_kwargs={{{name!r}: ...}}): set TrainerConfig({name}=...) instead; the Trainer "
                    f"builds the optimizer and passes it to DDP itself"
                )
        if not isinstance(self.overlap_optimizer, bool):
            raise ValueError(f"TrainerConfig(overlap_optimizer={self.overlap_optimizer!r}) must be True or False")
        if self.compression is not None and self.compression not in CHOICES:
            raise ValueError(f"TrainerConfig(compression={self.compression!r}) must be one of {list(CHOICES)} or None")
        wanted = [n for n in ("compression", "overlap_optimizer") if getattr(self, n)]
        ddp_only = ("ddp",) if self.overlap_optimizer else ("ddp", "zero")
        if wanted and self.strategy is not None and self.strategy not in ddp_only:
            raise ValueError(
                f"TrainerConfig({wanted[-1]}=...) needs dptrain's DDP, but strategy={self.strategy!r}; use "
                f"strategy={ddp_only[0]!r} (or None, which picks it on several processes)"
            )
        if not self.overlap_optimizer:
            return
        clash = (
            "zero_stage=1 (ZeRO-1 steps whole shards after the all-reduce)" if self.zero_stage else
            f"max_grad_norm={self.max_grad_norm} (clipping needs the global norm of every gradient first)"
            if self.max_grad_norm is not None else
            "amp=True with amp_dtype='float16' (the scaler unscales the gradients before the step)"
            if self.amp and self.amp_dtype == "float16" else
            "nan_policy='skip' (the update is applied during backward, before the check)"
            if self.nan_policy == "skip" else None
        )  # fmt: skip
        if clash:
            raise ValueError(f"TrainerConfig(overlap_optimizer=True) cannot be combined with {clash}; drop one of them")

    def _check_diloco(self) -> None:
        """``diloco_kwargs``: DiLoCo's own settings, each validated as DiLoCo will, and only with its strategy."""
        if not isinstance(self.diloco_kwargs, dict):
            raise ValueError(f"TrainerConfig(diloco_kwargs={self.diloco_kwargs!r}) must be a dict, e.g. "
                             f"{{'sync_every': 100, 'outer_lr': 0.7}}")
        if self.diloco_kwargs and self.strategy != "diloco":
            raise ValueError(f"TrainerConfig(diloco_kwargs=...) configures strategy='diloco', but strategy="
                             f"{self.strategy!r}; set strategy='diloco' or drop diloco_kwargs")
        from dptrain.parallel.diloco import check_trainer_settings

        check_trainer_settings(self.diloco_kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (what checkpoints and TensorBoard's hparams store)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        return out
