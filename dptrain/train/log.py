"""What the Trainer shows and records: progress, one line per epoch, TensorBoard, a metrics file.

Everything here runs on rank 0 only; other ranks get a logger whose methods do nothing,
so the training loop never branches on the rank to log.

[Note: one x-axis]
Every scalar -- per step or per epoch, in TensorBoard and in the metrics file -- is
recorded against the optimizer step (``global_step``). Per-step values (``train/step_loss``,
``train/lr``) and per-epoch values (``train/loss``, ``dev/*``, ``train/epoch``) live on tags
of their own, so no tag mixes two x-axes. Epochs are counted from 1 wherever a user reads
them (printed lines, ``train/epoch``, ``hparam/epoch``, the metrics file's ``epoch``).

[Note: progress]
With a terminal watching -- the process's own stderr, or ``dptrain run`` reporting one
through ``DPTRAIN_PROGRESS=tty`` -- a live tqdm bar is drawn (the launcher renders its
carriage returns under the rank prefix). Otherwise a line such as
``epoch 2/8 | batch 120/420 (29%) | 1520 samples/s | loss 0.5312 | ETA 0:00:42`` is printed
every ``progress_interval_s`` seconds (5 by default), so a log file, ``tee`` or a cluster's
output shows an epoch moving much as a terminal would. The loss shown is the last batch's,
read from the device only when it is shown (no extra synchronisation per step); samples/s
count every rank's samples since the previous line.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import sys
import time
from typing import Any, Mapping

from dptrain import _settings
from dptrain.env import _warn_once_main

__all__ = ["TrainerLog", "format_metrics", "progress_mode"]


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


def progress_mode(progress: bool | None) -> str:
    """``"bar"``, ``"lines"`` or ``"off"`` for ``TrainerConfig(progress=...)``; see [Note: progress]."""
    if progress is False:
        return "off"
    if progress is True:
        if _have_tqdm():
            return "bar"
        _warn_once_main("TrainerConfig(progress=True): the tqdm package is not installed, so progress is shown as "
                        "lines; pip install tqdm for a live bar")
        return "lines"
    watched = _settings.get("DPTRAIN_PROGRESS")  # set by dptrain run: tty, lines or off
    if watched == "off":  # dptrain run does not show this rank's output (--log-ranks)
        return "off"
    if watched == "tty" or (watched is None and sys.stderr.isatty()):
        return "bar" if _have_tqdm() else "lines"
    return "lines"


def _have_tqdm() -> bool:
    """Whether the bar can be drawn: tqdm is optional (the ``examples`` extra), lines need nothing."""
    try:
        import tqdm.auto  # noqa: F401
    except ImportError:
        return False
    return True


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _MetricsFile:
    """One record per line: JSON lines, or CSV for a ``.csv`` name. Appends, so a resumed run continues it."""

    FIELDS = ("step", "epoch", "split", "metric", "value", "wall_time")

    def __init__(self, path: str, resume_step: int | None) -> None:
        self.path = path
        self.csv = path.lower().endswith(".csv")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resume_step is None or not os.path.exists(path):
            self._fh = open(path, "w", newline="")
        else:
            self._drop_after(resume_step)  # what a crashed attempt logged after the checkpoint
            self._fh = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._fh, fieldnames=self.FIELDS) if self.csv else None
        if self._writer is not None and self._fh.tell() == 0:
            self._writer.writeheader()

    def _drop_after(self, step: int) -> None:
        with open(self.path, newline="") as fh:
            lines = fh.readlines()
        kept = []
        for i, line in enumerate(lines):
            if self.csv and i == 0:
                kept.append(line)
                continue
            try:
                row_step = int(next(csv.reader([line]))[0]) if self.csv else int(json.loads(line)["step"])
            except (ValueError, KeyError, IndexError, StopIteration):
                continue
            if row_step <= step:
                kept.append(line)
        with open(self.path, "w", newline="") as fh:
            fh.writelines(kept)

    def write(self, step: int, epoch: int, split: str, values: Mapping[str, Any]) -> None:
        now = time.time()
        for metric, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            row = {"step": step, "epoch": epoch, "split": split, "metric": metric, "value": float(value), "wall_time": now}
            if self._writer is not None:
                self._writer.writerow(row)
            else:
                # NaN/inf are written as JSON's NaN/Infinity, which pandas reads.
                self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TrainerLog:
    """Rank 0's outputs. ``active=False`` (other ranks) turns every method into a no-op.

    Args:
        active: this is rank 0.
        log_dir: TensorBoard directory or None; the writer is created at the first value,
            so a run that fails before logging anything leaves no empty event file.
        progress: ``TrainerConfig.progress``; see :func:`progress_mode`.
        verbose: print one line per epoch.
        resume_step: the step a resumed run continues from: TensorBoard events and metrics
            rows a crashed attempt wrote after it are dropped.
        metrics_path: the metrics file, or None.
        progress_interval_s: seconds between progress lines (without a terminal).
        refresh_every: batches between updates of the bar's loss and samples/s.
    """

    def __init__(self, active: bool, log_dir: str | None, progress: bool | None, verbose: bool,
                 resume_step: int | None = None, metrics_path: str | None = None, progress_interval_s: float = 5.0, refresh_every: int = 10):
        self.active = active
        self.verbose = verbose and active
        self.mode = progress_mode(progress) if active else "off"
        self.interval = progress_interval_s
        self.refresh_every = refresh_every
        self.log_dir = log_dir if active else None
        self.resume_step = resume_step
        self._writer = None
        if active and log_dir:
            try:
                import torch.utils.tensorboard  # noqa: F401 - fail at start, not at the first scalar
            except ImportError as exc:  # pragma: no cover - tensorboard is in the examples extra
                raise ImportError("TrainerConfig(log_dir=...) needs the tensorboard package: pip install tensorboard") from exc
        self.metrics = _MetricsFile(metrics_path, resume_step) if active and metrics_path else None
        self._bar = None
        self._epoch_text = ""
        self._total = self._done = self._start = 0
        self._t0 = self._last_line = 0.0
        self._loss: Any = None  # the last batch's loss, a tensor until shown
        self._window_t, self._window_samples = 0.0, 0  # samples since the last shown rate

    @property
    def progress(self) -> bool:
        return self.mode != "off"

    @property
    def writer(self):
        if self._writer is None and self.log_dir:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed attempt wrote after the checkpoint we resume from.
            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=self.resume_step)
        return self._writer

    # -- progress -----------------------------------------------------------------------
    def start_epoch(self, epoch: int, num_epochs: int, total: int, initial: int) -> None:
        self._epoch_text = f"epoch {epoch + 1}/{num_epochs}"
        self._total, self._done, self._start = total, initial, initial
        self._t0 = self._last_line = self._window_t = time.monotonic()
        self._window_samples, self._loss = 0, None
        if self.mode != "bar":
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, initial=initial, desc=self._epoch_text, unit="batch",
            dynamic_ncols=True, leave=False, file=sys.stderr, mininterval=0.5,
        )

    def update(self, n: int, samples: int = 0, loss: Any = None) -> None:
        """``n`` more batches done, holding ``samples`` samples on all ranks together;
        ``loss``: the last batch's loss (a tensor is read only when it is shown)."""
        if self.mode == "off":
            return
        self._done += n
        self._window_samples += samples
        if loss is not None:
            self._loss = loss
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(n)
            if self._done % self.refresh_every == 0 or self._done >= self._total:
                loss_now, rate = self._read_values(now)
                post = {"loss": f"{loss_now:.4f}"} if loss_now is not None else {}
                if rate is not None:
                    post["samples/s"] = f"{rate:.0f}"
                self._bar.set_postfix(post, refresh=False)
            return
        if now - self._last_line >= self.interval and self._done < self._total:
            self._last_line = now
            self._print_progress_line(now)

    def _read_values(self, now: float) -> tuple[float | None, float | None]:
        """The last loss and the samples/s since the previous read (which starts a new window)."""
        loss = None if self._loss is None else float(self._loss)
        elapsed = now - self._window_t
        rate = self._window_samples / elapsed if self._window_samples and elapsed > 0 else None
        self._window_t, self._window_samples = now, 0
        return loss, rate

    def _print_progress_line(self, now: float) -> None:
        loss, samples_per_s = self._read_values(now)
        done, total = self._done, max(self._total, 1)
        rate = (done - self._start) / max(now - self._t0, 1e-9)  # batches per second
        eta = (total - done) / rate if rate > 0 else float("nan")
        text = f"{self._epoch_text} | batch {done}/{total} ({100 * done / total:.0f}%)"
        if samples_per_s is not None:
            text += f" | {samples_per_s:.0f} samples/s"
        if loss is not None:
            text += f" | loss {loss:.4f}"
        if math.isfinite(eta):
            text += f" | ETA {datetime.timedelta(seconds=round(eta))}"
        print(text, file=sys.stderr, flush=True)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- values and lines ----------------------------------------------------------------
    def scalars(self, values: Mapping[str, Any], step: int, epoch: int) -> None:
        """Record ``values`` (tags like ``"dev/accuracy"``) at ``step``; ``epoch`` counts from 1."""
        if not self.active:
            return
        if self.log_dir:
            for key, value in values.items():
                if _finite_number(value):
                    self.writer.add_scalar(key, value, step)
        if self.metrics is not None:
            by_split: dict[str, dict[str, Any]] = {}
            for key, value in values.items():
                split, _, name = key.partition("/")
                by_split.setdefault(split, {})[name] = value
            for split, vals in by_split.items():
                self.metrics.write(step, epoch, split, vals)

    def line(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        if not (self.active and self.log_dir):
            return
        clean = {}
        for key, value in hparams.items():
            if isinstance(value, (bool, int, float, str)):
                clean[key] = value
            elif value is None:
                clean[key] = "None"
            else:
                clean[key] = str(value)
        scal = {f"hparam/{k}": float(v) for k, v in metrics.items() if _finite_number(v)}
        # run_name="." keeps the hparams next to the scalars instead of in a timestamped subfolder.
        self.writer.add_hparams(clean, scal, run_name=".")

    def close(self) -> None:
        self.end_epoch()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
