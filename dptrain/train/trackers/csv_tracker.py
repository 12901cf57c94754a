"""The metrics file: every logged value as one record, CSV or JSON lines, on rank 0.

``TrainerConfig(metrics_path=...)`` or ``loggers=["csv"]`` choose it. One record per value --
``step``, ``epoch``, ``split``, ``metric``, ``value``, ``wall_time`` -- so ``pandas.read_csv``
(or ``read_json(path, lines=True)``) gives a table to plot by step. The run's configuration
goes beside it once, as ``<name>.hparams.json``.
"""

from __future__ import annotations

import csv
import json
import os
import time
from typing import Any, Mapping

from dptrain.runtime.settings import open_regular
from dptrain.train.trackers.base import Tracker, plain

__all__ = ["CSVTracker"]


class CSVTracker(Tracker):
    """Every logged value as one record in a file: CSV for a ``.csv`` name, else JSON lines.

    Appends on a resume (dropping the records a crashed attempt wrote after the step the run
    continues from), starts the file afresh otherwise.

    Args:
        path: the file; its folder is created.

    Example:
        >>> TrainerConfig(loggers=[CSVTracker("runs/exp1/metrics.csv")])
    """

    name = "csv"
    rewinds = True
    FIELDS = ("step", "epoch", "split", "metric", "value", "wall_time")

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.csv = self.path.lower().endswith(".csv")
        self._fh = None
        self._writer = None

    @property
    def hparams_path(self) -> str:
        return os.path.splitext(self.path)[0] + ".hparams.json"

    def start(self, run_id: str | None, resume_step: int | None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.lexists(self.path):  # a FIFO there would hold rank 0 in open() forever: refuse it at once
            os.close(open_regular(self.path))
        if resume_step is None or not os.path.exists(self.path):
            self._fh = open(self.path, "w", newline="")
        else:
            self._drop_after(resume_step)  # what a crashed attempt logged after the step we continue from
            self._fh = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._fh, fieldnames=self.FIELDS) if self.csv else None
        if self._writer is not None and self._fh.tell() == 0:
            self._writer.writeheader()
        return None

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

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        tmp = self.hparams_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(plain(dict(params)), fh, indent=1, sort_keys=True)
        os.replace(tmp, self.hparams_path)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int | None = None) -> None:
        if self._fh is None:
            return
        now = time.time()
        for key, value in metrics.items():
            split, _, metric = key.partition("/")
            row = {"step": step, "epoch": epoch, "split": split, "metric": metric, "value": float(value),
                   "wall_time": now}
            if self._writer is not None:
                self._writer.writerow(row)
            else:
                # NaN/inf are written as JSON's NaN/Infinity, which pandas reads.
                self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def finalize(self, status: str) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = self._writer = None
