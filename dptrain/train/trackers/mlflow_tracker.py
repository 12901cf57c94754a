"""MLflow: one MLflow run per job, written by rank 0 through an ``MlflowClient``.

``TrainerConfig(loggers=["mlflow"])`` chooses it (the ``mlflow`` extra installs
``mlflow-skinny`` with SQLAlchemy, enough for MLflow's default local store,
``sqlite:///mlflow.db``, with no server). The client is used directly, never MLflow's
active-run stack, so a script's own ``mlflow.start_run()`` is left alone. MLflow's store
makes the run's id; the Trainer keeps it (in its checkpoints and in the launcher's job state)
so that a restart, a resume or a replacement of rank 0 continues the same run: it is set
``RUNNING`` again and ends ``FINISHED``, ``FAILED`` or ``KILLED``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

from dptrain.train.trackers.base import Tracker, flatten

__all__ = ["MLflowTracker"]

_STATUS = {"success": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


class MLflowTracker(Tracker):
    """An MLflow run: parameters once, metrics by optimizer step, its status at the end.

    Args:
        experiment: the experiment's name (created when missing). Default None:
            ``MLFLOW_EXPERIMENT_NAME``, else MLflow's ``"Default"``.
        run_name: the run's name. Default None: MLflow draws one.
        tracking_uri: where runs are stored: a server (``http://...``), a database
            (``sqlite:///mlflow.db``) or a folder (``file:./mlruns``, which MLflow 3 opens only
            with ``MLFLOW_ALLOW_FILE_STORE=true``). Default None: ``MLFLOW_TRACKING_URI``, else
            MLflow's default.
        tags: tags set on a new run.

    Raises:
        ImportError: (from :meth:`start`) the ``mlflow`` package is not installed.

    Example:
        >>> TrainerConfig(loggers=[MLflowTracker(experiment="digits", tracking_uri="sqlite:///runs/mlflow.db")])
    """

    name = "mlflow"

    def __init__(self, experiment: str | None = None, run_name: str | None = None, tracking_uri: str | None = None,
                 tags: Mapping[str, str] | None = None) -> None:
        self.experiment, self.run_name, self.tracking_uri = experiment, run_name, tracking_uri
        self.tags = dict(tags or {})
        self.client = None
        self.run_id: str | None = None

    def start(self, run_id: str | None, resume_step: int | None) -> str:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(
                "TrainerConfig(loggers=['mlflow']) needs the mlflow package: pip install 'dptrain[mlflow]'"
            ) from exc
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        if run_id is not None and self._reopen(run_id):
            self.run_id = run_id
            return run_id
        run = self.client.create_run(self._experiment_id(), run_name=self.run_name, tags=self.tags or None)
        self.run_id = run.info.run_id
        return self.run_id

    def _reopen(self, run_id: str) -> bool:
        """Set the run ``RUNNING`` again; False when this store does not hold it (then a new run opens)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            from dptrain.train.checkpointer import notice

            notice(f"MLflow run {run_id!r} of this job is not in the tracking store {self.client.tracking_uri!r}; "
                   f"a new run is opened")
            return False
        self.client.update_run(run_id, status="RUNNING")
        return True

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another job created it in the meantime
            return self.client.get_experiment_by_name(name).experiment_id

    def logged_steps(self) -> Mapping[str, int]:
        held = self.client.get_run(self.run_id).data.metrics
        return {key: max(m.step for m in self.client.get_metric_history(self.run_id, key)) for key in held}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        items = [Param(str(k), str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in flatten(params).items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finalize(self, status: str) -> None:
        if self.run_id is not None and self.client is not None:
            run_id, self.run_id = self.run_id, None
            self.client.set_terminated(run_id, status=_STATUS.get(status, "FAILED"))
