"""What the Trainer shows: a progress bar, TensorBoard scalars and hparams, one line per epoch.

Everything here runs on rank 0 only; other ranks get a logger whose methods do nothing,
so the training loop never branches on the rank to log.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Mapping


def format_metrics(metrics: Mapping[str, Any], prefix: str = "") -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e12:
            parts.append(f"{prefix}{key} {int(value)}")  # counts stay counts
        elif isinstance(value, float):
            parts.append(f"{prefix}{key} {value:.4f}")
        else:
            parts.append(f"{prefix}{key} {value}")
    return " ".join(parts)


class TrainerLog:
    """Rank 0's outputs. ``active=False`` (other ranks) turns every method into a no-op."""

    def __init__(self, active: bool, log_dir: str | None, progress: bool | None, verbose: bool, purge_step: int | None = None):
        self.active = active
        self.verbose = verbose and active
        if progress is None:  # a bar in a pipe (dptrain run relays lines) is noise
            progress = sys.stderr.isatty()
        self.progress = bool(progress) and active
        self.writer = None
        if active and log_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # pragma: no cover - tensorboard is in the examples extra
                raise ImportError(
                    "TrainerConfig(log_dir=...) needs the tensorboard package: pip install tensorboard"
                ) from exc
            # purge_step drops events a crashed attempt wrote after the checkpoint we resume from.
            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
        self._bar = None

    # -- progress bar --------------------------------------------------------------------
    def start_epoch(self, epoch: int, num_epochs: int, total: int, initial: int) -> None:
        if not self.progress:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, initial=initial, desc=f"epoch {epoch + 1}/{num_epochs}", unit="batch",
            dynamic_ncols=True, leave=False, file=sys.stderr, mininterval=0.5,
        )

    def update(self, n: int, loss: float | None, samples_per_s: float | None) -> None:
        if self._bar is None:
            return
        self._bar.update(n)
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if samples_per_s is not None:
            post["samples/s"] = f"{samples_per_s:.0f}"
        if post:
            self._bar.set_postfix(post, refresh=False)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- scalars and lines ---------------------------------------------------------------
    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def line(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        if self.writer is None:
            return
        clean = {}
        for key, value in hparams.items():
            if isinstance(value, (bool, int, float, str)):
                clean[key] = value
            elif value is None:
                clean[key] = "None"
            else:
                clean[key] = str(value)
        scal = {f"hparam/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        # run_name="." keeps the hparams next to the scalars instead of in a timestamped subfolder.
        self.writer.add_hparams(clean, scal, run_name=".")

    def close(self) -> None:
        self.end_epoch()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
