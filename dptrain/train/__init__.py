"""The training loop and its parts.

- :class:`Trainer` -- the loop: strategy wrapping, exact evaluation, best model, gradient
  accumulation, AMP, NaN policy, callbacks, logging, checkpoints that resume bit for bit.
- :class:`TrainerConfig` -- its settings, validated on construction.
- :class:`TrainState` (``state.py``) -- where a run is; replays a resumed epoch exactly.
- :class:`Checkpointer` (``checkpointer.py``) -- the checkpoint directory: atomic collective
  saves, pruning, ``best.pt``, what to resume from.
- :class:`Strategy` (``strategy.py``) -- none / ddp / torch-ddp / fsdp: wrapping, clipping,
  state dicts, evaluation in lock-step.
- :class:`Callback`, :class:`EarlyStopping`, :class:`NonFiniteGuard` (``callbacks.py``).
- ``schedule.py`` -- the rule for resuming an LR schedule into a run of another length, and
  :class:`WarmupDecay` (warmup, then cosine/linear decay over the steps).
- :func:`parse_config` (``cli_config.py``) -- TrainerConfig and a script's own dataclasses from
  YAML files and command-line options (jsonargparse, an optional extra).
- ``trackers/`` -- experiment trackers (TensorBoard, CSV, W&B, MLflow): one run per job, on rank 0.
"""

from dptrain.train.callbacks import Callback, EarlyStopping, NonFiniteError, NonFiniteGuard, StepInfo
from dptrain.train.checkpointer import Checkpointer
from dptrain.train.cli_config import parse_config
from dptrain.train.config import TrainerConfig
from dptrain.train.loop import RecoverableLoop
from dptrain.train.schedule import WarmupDecay
from dptrain.train.state import TrainState
from dptrain.train.strategy import Strategy
from dptrain.train.trainer import Trainer

__all__ = [
    "Trainer",
    "RecoverableLoop",
    "TrainerConfig",
    "parse_config",
    "TrainState",
    "Checkpointer",
    "Strategy",
    "Callback",
    "StepInfo",
    "EarlyStopping",
    "NonFiniteGuard",
    "NonFiniteError",
    "WarmupDecay",
]
