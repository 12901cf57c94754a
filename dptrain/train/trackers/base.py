"""The one small base class every experiment tracker derives from, and what a run's end is called.

A tracker is written for rank 0 alone: the Trainer hands its trackers to a
:class:`~dptrain.train.trackers.TrackerGroup`, which calls them on rank 0 only, so a tracker
never asks which rank it is on. Its package (``wandb``, ``mlflow``, ``tensorboard``) is
imported in :meth:`Tracker.start`, never at import time: ``import dptrain`` stays light, and a
tracker that is not chosen costs nothing.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["Tracker", "STATUSES", "TRACKER_NAMES", "PACKAGES", "status_of", "flatten", "plain"]

#: How a run can end: ``finalize(status)`` gets one of these.
STATUSES = ("success", "failed", "killed")
#: The names ``TrainerConfig(loggers=...)`` accepts.
TRACKER_NAMES = ("tensorboard", "csv", "wandb", "mlflow")
#: name -> (the module a tracker needs, the dptrain extra that installs it).
PACKAGES = {"tensorboard": ("tensorboard", "examples"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class Tracker:
    """An experiment tracker: where rank 0 writes one run's hyperparameters and metrics.

    Subclass it for a tracker of your own and pass the object in
    ``TrainerConfig(loggers=[...])``; override :meth:`log_metrics` and whichever of the other
    methods your tracker needs (each does nothing by default). The Trainer calls them on rank 0
    only, in this order: :meth:`start` when ``fit`` starts, :meth:`log_hyperparams` once per run
    (not again when a run is continued), :meth:`log_metrics` at every logged step,
    :meth:`log_summary` at the end of a successful ``fit``, and :meth:`finalize` always.

    Attributes:
        name: the key of this tracker's run id in checkpoints and in the job's state; unique
            among a Trainer's trackers. Default ``"tracker"``.
        rewinds: True when :meth:`start` drops what the run recorded after ``resume_step``
            (TensorBoard's purge, the CSV file's rows), so the steps after it are logged again.
            False (W&B, MLflow: what is logged stays logged): a continued run never gets a
            metric at a step it holds already. Default False.
        monotonic_steps: the tracker refuses a step lower than one it has seen (W&B), so any
            such value is dropped before it is sent. Default False.
        resends_hyperparams: a continued run gets :meth:`log_hyperparams` again (W&B merges
            its config, and a process killed before W&B wrote its buffer to disk would leave the
            run without one). Default False: once per run.

    Example:
        >>> class PrintTracker(Tracker):
        ...     name = "print"
        ...     def log_metrics(self, metrics, step, epoch=None):
        ...         print(step, dict(metrics))
        >>> TrainerConfig(loggers=[PrintTracker()])
    """

    name: str = "tracker"
    rewinds: bool = False
    monotonic_steps: bool = False
    resends_hyperparams: bool = False

    def __repr__(self) -> str:  # what TrainerConfig.to_dict() records for a tracker object
        return f"{type(self).__name__}(name={self.name!r})"

    def start(self, run_id: str | None, resume_step: int | None) -> str | None:
        """Open the run; return its id (None for a tracker without ids, such as a file).

        Args:
            run_id: None: open a new run. Else the id this method returned before, in this
                job or in the run a checkpoint was written by: continue that run.
            resume_step: the optimizer step training continues from (None: from the start).

        Raises:
            ImportError: the tracker's package is not installed.
        """
        return None

    def logged_steps(self) -> Mapping[str, int]:
        """For a continued run: the last step of each metric the run already holds, where the
        tracker can read its run back (MLflow can, W&B offline cannot). Default: nothing."""
        return {}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration: the resolved ``TrainerConfig``, ``Trainer(hparams=...)``
        and the world size (nested mappings allowed; see :func:`flatten`)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int | None = None) -> None:
        """Record ``metrics`` (tags such as ``"dev/accuracy"``: plain floats, maybe NaN) at
        optimizer step ``step``; ``epoch`` counts from 1."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics(metrics, step, epoch=None)")

    def log_summary(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """At the end of a successful ``fit``: the hyperparameters with the final metrics
        (TensorBoard's hparams table). Default: nothing."""

    def finalize(self, status: str) -> None:
        """Close the run: ``status`` is ``"success"``, ``"failed"`` (``fit`` raised) or
        ``"killed"`` (interrupted, preempted or stopped by the launcher; the job may continue
        it). Called once per :meth:`start`; a continued run is started again later."""


def status_of(exc: BaseException) -> str:
    """The status a run ends with when ``fit`` raised ``exc``.

    An interruption (Ctrl-C, a signal, a preemption, the exit that hands a recovery to the
    launcher) is ``"killed"``: the job may well continue the run. Anything else is ``"failed"``.
    """
    return "killed" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"


def flatten(params: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level: ``{"opt": {"lr": 0.1}}`` -> ``{"opt.lr": 0.1}`` (for
    trackers whose parameters are flat: MLflow, TensorBoard)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep, name + sep))
        else:
            out[name] = value
    return out


def plain(value: Any) -> Any:
    """A value a tracker can store as it is (a number, a string, a bool, None, or lists and
    mappings of those); anything else as its ``repr``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return repr(value)
