"""``dptrain.trainer``: the Trainer's import path of earlier releases; the code lives in :mod:`dptrain.train`."""

from dptrain.train import Trainer, TrainerConfig

__all__ = ["Trainer", "TrainerConfig"]
