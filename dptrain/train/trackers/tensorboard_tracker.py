"""TensorBoard: event files in one directory, on rank 0.

``TrainerConfig(log_dir=...)`` chooses it (``loggers=["tensorboard"]`` says the same). The
writer is created at the first value, so a run that fails before logging anything leaves no
empty event file. The hparams table is written once, at the end of a successful ``fit``, with
the final metrics (TensorBoard's hparams plugin pairs the two).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from dptrain.train.trackers.base import Tracker, flatten

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(Tracker):
    """Scalars and the hparams table in TensorBoard's event files.

    A resumed run drops the events a crashed attempt wrote after the step it continues from
    (``SummaryWriter(purge_step=...)``), then logs those steps again.

    Args:
        log_dir: the directory of the event files.

    Raises:
        ImportError: (from :meth:`start`) the ``tensorboard`` package is not installed.

    Example:
        >>> TrainerConfig(loggers=[TensorBoardTracker("runs/tb")])
    """

    name = "tensorboard"
    rewinds = True

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._resume_step: int | None = None
        self._writer = None

    def start(self, run_id: str | None, resume_step: int | None) -> None:
        try:
            import torch.utils.tensorboard  # noqa: F401 - fail at start, not at the first scalar
        except ImportError as exc:
            raise ImportError(
                "TrainerConfig(log_dir=...) needs the tensorboard package: pip install tensorboard "
                "(or 'dptrain[examples]')"
            ) from exc
        self._resume_step = resume_step
        return None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard drops the events at and after purge_step: the steps after the one we continue from.
            purge = None if self._resume_step is None else self._resume_step + 1
            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge)
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int | None = None) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def log_summary(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        clean = {}
        for key, value in flatten(params).items():
            if isinstance(value, (bool, int, float, str)):
                clean[key] = value
            else:
                clean[key] = "None" if value is None else str(value)
        scalars = {f"hparam/{k}": float(v) for k, v in metrics.items() if math.isfinite(v)}
        # run_name="." keeps the hparams next to the scalars instead of in a timestamped subfolder.
        self.writer.add_hparams(clean, scalars, run_name=".")

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
