"""What the Trainer shows and records: progress, one line per epoch, and its experiment trackers.

Everything here runs on rank 0 only; other ranks get a logger whose methods do nothing,
so the training loop never branches on the rank to log. Values go to the trackers
(:mod:`dptrain.train.trackers`: TensorBoard, the metrics file, W&B, MLflow, your own), which
the Trainer holds across ``fit`` calls so that their runs stay one run per job.

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

import datetime
import math
import sys
import time
from typing import Any, Mapping

from dptrain.runtime import settings as _settings
from dptrain.runtime.env import _warn_once_main
from dptrain.train.trackers import TrackerGroup, make_trackers, status_of

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


class TrainerLog:
    """Rank 0's outputs. ``active=False`` (other ranks) turns every method into a no-op.

    Args:
        active: this is rank 0.
        log_dir: TensorBoard directory or None (when ``trackers`` is not given); the writer is
            created at the first value, so a run that fails before logging anything leaves no
            empty event file.
        progress: ``TrainerConfig.progress``; see :func:`progress_mode`.
        verbose: print one line per epoch.
        resume_step: the step training continues from (a resume, a replacement of rank 0, a
            second ``fit``), or None: what the trackers recorded after it is dropped or kept
            once (see :class:`~dptrain.train.trackers.TrackerGroup`).
        metrics_path: the metrics file, or None (when ``trackers`` is not given).
        progress_interval_s: seconds between progress lines (without a terminal).
        refresh_every: batches between updates of the bar's loss and samples/s.
        trackers: the Trainer's :class:`~dptrain.train.trackers.TrackerGroup` (its runs are
            opened here and finalized by :meth:`close`). Default None: one made of ``log_dir``
            and ``metrics_path``.
    """

    def __init__(self, active: bool, log_dir: str | None, progress: bool | None, verbose: bool,
                 resume_step: int | None = None, metrics_path: str | None = None, progress_interval_s: float = 5.0,
                 refresh_every: int = 10, trackers: TrackerGroup | None = None):
        self.active = active
        self.verbose = verbose and active
        self.mode = progress_mode(progress) if active else "off"
        self.interval = progress_interval_s
        self.refresh_every = refresh_every
        self.resume_step = resume_step
        if trackers is None:
            chosen = make_trackers(None, log_dir=log_dir, metrics_path=metrics_path) if active else []
            trackers = TrackerGroup(chosen, active=active)
        self.trackers = trackers
        self._status = "success"  # how the runs end unless fit fails: see failed()
        if active:
            trackers.start(resume_step)
        self._bar = None
        self._epoch_text = ""
        self._total = self._done = self._start = 0
        self._t0 = self._last_line = 0.0
        self._loss: Any = None  # the last batch's loss, a tensor until shown
        self._window_t, self._window_samples = 0.0, 0  # samples since the last shown rate

    @property
    def progress(self) -> bool:
        return self.mode != "off"

    # -- progress -----------------------------------------------------------------------
    def start_epoch(self, epoch: int, num_epochs: int | None, total: int | None, initial: int) -> None:
        """``num_epochs`` None: a step budget only; ``total`` None: a stream without a length."""
        self._epoch_text = f"epoch {epoch + 1}" + (f"/{num_epochs}" if num_epochs is not None else "")
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
            if self._done % self.refresh_every == 0 or (self._total is not None and self._done >= self._total):
                loss_now, rate = self._read_values(now)
                post = {"loss": f"{loss_now:.4f}"} if loss_now is not None else {}
                if rate is not None:
                    post["samples/s"] = f"{rate:.0f}"
                self._bar.set_postfix(post, refresh=False)
            return
        if now - self._last_line >= self.interval and (self._total is None or self._done < self._total):
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
        done = self._done
        if self._total is None:  # a stream: how far, but not how far to go
            eta, text = float("nan"), f"{self._epoch_text} | batch {done}"
        else:
            total = max(self._total, 1)
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
        self.trackers.log_metrics(values, step, epoch)

    def line(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """At the end of a successful ``fit``: the hyperparameters with the final metrics (TensorBoard's table)."""
        self.trackers.log_summary(hparams, metrics)

    def failed(self, exc: BaseException) -> None:
        """``fit`` raised ``exc``: :meth:`close` ends the runs as failed (or killed, for an interruption)."""
        self._status = status_of(exc)

    def close(self) -> None:
        """End the progress bar and finalize the trackers' runs (``"success"`` unless :meth:`failed`)."""
        self.end_epoch()
        self.trackers.finalize(self._status)
