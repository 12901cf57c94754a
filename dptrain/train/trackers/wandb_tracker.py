"""Weights & Biases: one W&B run per job, written by rank 0.

``TrainerConfig(loggers=["wandb"])`` chooses it (the ``wandb`` extra installs the package). The
run's id is drawn here, so it is known before W&B is reached and kept by the Trainer (in its
checkpoints and in the launcher's job state): a restart, a resume or a replacement of rank 0
opens the same id again (``resume="allow"``). W&B's own settings apply as usual --
``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_DIR``, an API key.

[Note: W&B and steps]
W&B keeps one step counter per run and refuses a value at a step lower than the highest it
has seen, so this tracker is ``monotonic_steps``: the Trainer drops such values before they
are sent (a continued run starts after the steps the run holds). A run continued offline
writes a second ``offline-run-*`` folder with the same id; ``wandb sync`` merges them into
the one run. An offline run's data reaches its file every ``x_transaction_log_flush_interval``
seconds (15 by default) and when it finishes: a SIGKILLed rank 0 loses what W&B had not
written yet (the config is sent again by the process that continues the run).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Mapping

from dptrain.train.trackers.base import Tracker, plain

__all__ = ["WandbTracker"]

#: W&B's exit code for each way a run can end (non-zero shows the run as failed).
_EXIT_CODES = {"success": 0, "failed": 1, "killed": 143}


class WandbTracker(Tracker):
    """A Weights & Biases run: the config once, metrics by optimizer step, the exit code at the end.

    Args:
        project: the W&B project. Default None: ``WANDB_PROJECT``, else W&B's default.
        name: the run's display name. Default None: W&B draws one.
        dir: where W&B writes its ``wandb/`` folder. Default None: ``WANDB_DIR``, else the
            working directory.
        entity: the W&B user or team. Default None: ``WANDB_ENTITY`` or the account's default.
        **init_kwargs: more arguments for ``wandb.init`` (``tags``, ``group``, ``mode``, ...).

    Raises:
        ImportError: (from :meth:`start`) the ``wandb`` package is not installed.

    Example:
        >>> TrainerConfig(loggers=[WandbTracker(project="digits", tags=["baseline"])])
    """

    name = "wandb"
    monotonic_steps = True
    resends_hyperparams = True

    def __init__(self, project: str | None = None, name: str | None = None, dir: str | None = None,
                 entity: str | None = None, **init_kwargs: Any) -> None:
        for key in ("id", "resume", "reinit"):
            if key in init_kwargs:
                raise ValueError(
                    f"WandbTracker({key}=...): the Trainer sets it (one run per job, continued by id); leave it out"
                )
        self.project, self.run_name, self.dir, self.entity = project, name, dir, entity
        self.init_kwargs = init_kwargs
        self.run = None

    def start(self, run_id: str | None, resume_step: int | None) -> str:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "TrainerConfig(loggers=['wandb']) needs the wandb package: pip install 'dptrain[wandb]'"
            ) from exc
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
        run_id = run_id or uuid.uuid4().hex[:12]
        # reinit="create_new": a run of the script's own (wandb.init elsewhere) is left open, not finished.
        self.run = wandb.init(project=self.project, name=self.run_name, dir=self.dir, entity=self.entity, id=run_id,
                              resume="allow", reinit="create_new", **self.init_kwargs)
        return self.run.id

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(plain(dict(params)), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int | None = None) -> None:
        self.run.log(dict(metrics), step=step)

    def finalize(self, status: str) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=_EXIT_CODES.get(status, 1))
