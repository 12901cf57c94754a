"""Experiment trackers: where rank 0 records a run's configuration and metrics.

``TrainerConfig(loggers=[...])`` chooses them by name -- ``"tensorboard"``, ``"csv"``,
``"wandb"``, ``"mlflow"`` -- or takes :class:`Tracker` objects (your own, or these classes with
settings of their own). ``log_dir`` alone still means TensorBoard and ``metrics_path`` alone the
metrics file. A tracker's package is imported only when its run opens (on rank 0, when ``fit``
starts); W&B and MLflow are optional extras (``pip install 'dptrain[wandb]'``, ``'dptrain[mlflow]'``).

- :class:`Tracker` (``base.py``) -- the one small base class: ``start``, ``log_hyperparams``
  (once per run), ``log_metrics`` (by optimizer step), ``log_summary``, ``finalize(status)``.
- :class:`TrackerGroup` (``group.py``) -- a Trainer's trackers, on rank 0 only: one run per job
  through restarts, resumes and in-place recoveries, each step logged once (see its
  [Note: one run per job]).
- :class:`TensorBoardTracker`, :class:`CSVTracker`, :class:`WandbTracker`,
  :class:`MLflowTracker` -- one module each.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dptrain.train.trackers.base import STATUSES, TRACKER_NAMES, Tracker, status_of
from dptrain.train.trackers.csv_tracker import CSVTracker
from dptrain.train.trackers.group import TrackerGroup
from dptrain.train.trackers.mlflow_tracker import MLflowTracker
from dptrain.train.trackers.tensorboard_tracker import TensorBoardTracker
from dptrain.train.trackers.wandb_tracker import WandbTracker

if TYPE_CHECKING:
    from dptrain.train.config import TrainerConfig

__all__ = [
    "Tracker",
    "TrackerGroup",
    "TensorBoardTracker",
    "CSVTracker",
    "WandbTracker",
    "MLflowTracker",
    "make_trackers",
    "trackers_for",
    "status_of",
    "STATUSES",
    "TRACKER_NAMES",
]

_TRAINERS = itertools.count()  # the n-th Trainer of this process: see [Note: one run per job] in group.py


def make_trackers(spec: str | Sequence[str | Tracker] | None, *, log_dir: str | None = None,
                  metrics_path: str | None = None, run_name: str | None = None, project: str | None = None,
                  tracking_uri: str | None = None) -> list[Tracker]:
    """The trackers ``spec`` names, plus TensorBoard for ``log_dir`` and the metrics file for ``metrics_path``.

    Args:
        spec: None, a name, comma-separated names (``"wandb,mlflow"``), or a list of names and
            :class:`Tracker` objects. Names: ``"tensorboard"`` (event files in ``log_dir``),
            ``"csv"`` (the metrics file: ``metrics_path``, default ``<log_dir or .>/metrics.csv``),
            ``"wandb"`` (project ``project``, run name ``run_name``, its folder under ``log_dir``
            when set), ``"mlflow"`` (experiment ``project``, run name ``run_name``, store
            ``tracking_uri``).
        log_dir: TensorBoard's directory; set, it adds a TensorBoard tracker when none is named.
            Default None.
        metrics_path: the metrics file; set, it adds a CSV tracker when none is named. Default None.
        run_name, project, tracking_uri: see above. Default None: each tracker's own default.

    Returns:
        The trackers, in the order named (the implied ones last).

    Raises:
        ValueError: an unknown name, an entry that is neither a name nor a Tracker, or
            ``"tensorboard"`` without ``log_dir``.

    Example:
        >>> [type(t).__name__ for t in make_trackers("csv", log_dir="runs/tb")]
        ['CSVTracker', 'TensorBoardTracker']
    """
    items: list[Any]
    if spec is None:
        items = []
    elif isinstance(spec, str):
        items = [name.strip() for name in spec.split(",") if name.strip()]
    else:
        items = list(spec)
    out: list[Tracker] = []
    for item in items:
        if isinstance(item, Tracker):
            out.append(item)
        elif item == "tensorboard":
            if not log_dir:
                raise ValueError("loggers=['tensorboard'] needs a directory for its event files: set "
                                 "TrainerConfig(log_dir='runs/tb')")
            out.append(TensorBoardTracker(log_dir))
        elif item == "csv":
            out.append(CSVTracker(metrics_path or os.path.join(log_dir or ".", "metrics.csv")))
        elif item == "wandb":
            out.append(WandbTracker(project=project, name=run_name, dir=log_dir))
        elif item == "mlflow":
            out.append(MLflowTracker(experiment=project, run_name=run_name, tracking_uri=tracking_uri))
        else:
            raise ValueError(f"loggers: {item!r} is not one of {list(TRACKER_NAMES)} nor a dptrain.train.trackers."
                             f"Tracker object")
    names = {t.name for t in out}
    if log_dir and "tensorboard" not in names:
        out.append(TensorBoardTracker(log_dir))
    if metrics_path and "csv" not in names:
        out.append(CSVTracker(metrics_path))
    return out


def trackers_for(config: TrainerConfig, active: bool, hparams: Mapping[str, Any] | None = None) -> TrackerGroup:
    """A Trainer's :class:`TrackerGroup`, from its config: the trackers on rank 0 (``active``), none
    elsewhere. ``hparams``: recorded with ``config.to_dict()`` as the run's configuration.
    Call it once per Trainer, on every rank (it numbers the process's Trainers).

    The job's state of its runs is kept under the checkpoint directory's name (a Trainer that
    resumes from those checkpoints, in this process or another, trains the same run), else
    under the Trainer's number in the process (see [Note: one run per job] in group.py)."""
    number = next(_TRAINERS)
    where = os.path.abspath(config.checkpoint_dir) if config.checkpoint_dir else f"trainer{number}"
    key = f"dptrain/trackers/{where}"
    chosen = make_trackers(config.loggers, log_dir=config.log_dir, metrics_path=config.metrics_path,
                           run_name=config.run_name, project=config.project,
                           tracking_uri=config.tracking_uri) if active else []
    return TrackerGroup(chosen, active=active, params={**config.to_dict(), **(hparams or {})}, job_key=key)
