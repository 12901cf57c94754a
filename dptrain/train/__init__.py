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
- ``schedule.py`` -- the rule for resuming an LR schedule into a run of another length.
"""

from dptrain.train.callbacks import Callback, EarlyStopping, NonFiniteError, NonFiniteGuard, StepInfo
from dptrain.train.checkpointer import Checkpointer
from dptrain.train.config import TrainerConfig
from dptrain.train.loop import RecoverableLoop
from dptrain.train.state import TrainState
from dptrain.train.strategy import Strategy
from dptrain.train.trainer import Trainer

__all__ = [
    "Trainer",
    "RecoverableLoop",
    "TrainerConfig",
    "TrainState",
    "Checkpointer",
    "Strategy",
    "Callback",
    "StepInfo",
    "EarlyStopping",
    "NonFiniteGuard",
    "NonFiniteError",
]
