"""A Trainer's trackers together: rank 0 only, one run per job, never a step logged twice.

[Note: one run per job]
A tracker's run must outlive the process that opened it: a restarted attempt
(``dptrain run --max-restarts``), a resume from a checkpoint, and a replacement of a dead
rank 0 under in-place recovery (which runs the script from the top) all continue the run
that was open, instead of opening a second one and leaving the first "running". So each
tracker's run id, with the last step each metric was logged at, is kept in two places:

* the checkpoint: the ``"trackers"`` part (:meth:`TrackerGroup.state_dict`), which a resume
  restores -- also in another job, days later;
* the job's state: a key of the launcher's store, which outlives every rank and every attempt
  of the job (``dptrain run`` and torchrun host the store themselves), written when a run opens
  and after every logged step. A replacement rank 0 gets its state from a live rank, not from a
  checkpoint, so this is where it finds the run; a restarted attempt finds there the steps
  logged after the newest checkpoint too. The key names the Trainer's checkpoint directory
  (``dptrain/trackers/<absolute path>``: whoever resumes from those checkpoints trains that
  run), or without one the process's n-th Trainer (``dptrain/trackers/trainer<n>``: a
  replacement runs the same script, so its n-th Trainer is the same one); it lies outside
  the per-attempt prefix of ``_heartbeat``'s [Note: the store's key layout].

When a run opens, what this process opened before wins, then the job's state, then the
checkpoint. A tracker that cannot rewrite its history (W&B, MLflow: ``Tracker.rewinds`` is
False) never gets a metric at a step it holds already -- a run continued from an older
checkpoint, or a step that a recovery does again, keeps the values first logged; one that
can (TensorBoard, the CSV file) drops what was logged after the step training continues from
when it opens, and gets those steps again. Within one process's life no tracker gets a
metric at a step it got already (a survivor of an in-place recovery may do a step again).

[Note: the end of a run]
``fit`` finalizes the run in every case: ``"success"``, ``"failed"`` when it raised, ``"killed"``
when it was interrupted (see :func:`~dptrain.train.trackers.base.status_of`). A SIGTERM --
``dptrain run`` stops a job's ranks with it, and so does a dead launcher's parent-death
signal -- would end the process without unwinding, so while runs are open rank 0 answers it
by finalizing them ``"killed"`` and then dying of the signal as before (only where no handler
of the script's own, or the Slurm preemption's, is installed). A SIGKILL leaves the run
"running" until the job continues it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import warnings
from typing import Any, Mapping, Sequence

from dptrain.train.trackers.base import Tracker

__all__ = ["TrackerGroup"]


class _JobState:
    """The trackers' state under ``key`` in the launcher's store, or nowhere (no key, or no store:
    one process without a launcher)."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self._said = False

    def _store(self):
        from dptrain.runtime import env

        # The job's store itself, with no attempt's prefix: see [Note: one run per job].
        return env._STATE.base_store if self.key else None

    def read(self) -> dict:
        store = self._store()
        if store is None:
            return {}
        try:
            if not store.check([self.key]):
                return {}
            return json.loads(store.get(self.key))
        except Exception as exc:  # noqa: BLE001 - a store that cannot answer: the checkpoint still says
            self._say(exc)
            return {}

    def write(self, state: Mapping[str, Any]) -> None:
        store = self._store()
        if store is None:
            return
        try:
            store.set(self.key, json.dumps(state))
        except Exception as exc:  # noqa: BLE001 - losing the job's copy must not stop training
            self._say(exc)

    def _say(self, exc: Exception) -> None:
        if not self._said:
            self._said = True
            warnings.warn(f"dptrain: the trackers' run ids could not be kept in the job's store ({exc}); a "
                          f"replacement of rank 0 would open a new run", stacklevel=3)


class TrackerGroup:
    """The trackers of one Trainer: opened by ``fit`` on rank 0, their run ids kept per job.

    On any other rank (``active=False``) it holds no tracker and every method does nothing, so
    the training loop never asks which rank logs. See [Note: one run per job].

    Args:
        trackers: :class:`~dptrain.train.trackers.Tracker` objects, with distinct names.
        active: this is rank 0. Default True.
        params: the run's configuration, recorded once per run (see :meth:`Tracker.log_hyperparams`).
        job_key: where the job's state of these runs is kept in the launcher's store (see the
            Note). Default None: nowhere (the checkpoint still keeps it).

    Raises:
        ValueError: two trackers share a name.

    Example:
        >>> group = TrackerGroup([CSVTracker("metrics.csv")], active=dptrain.rank() == 0)
        >>> group.start(resume_step=None); group.log_metrics({"train/loss": 0.5}, step=10, epoch=1)
        >>> group.finalize("success")
    """

    def __init__(self, trackers: Sequence[Tracker] = (), active: bool = True,
                 params: Mapping[str, Any] | None = None, job_key: str | None = None) -> None:
        names = [t.name for t in trackers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"trackers {twice} appear more than once among {names}; give each tracker its own name "
                             f"(Tracker.name)")
        self.active = active
        self.trackers = list(trackers) if active else []
        self.params = dict(params or {})
        self._job = _JobState(job_key if active else None)
        self._restored: dict[str, dict] = {}  # from the checkpoint a resume read
        self._state: dict[str, dict] = {}  # the runs this process opened: name -> {"run_id", "steps"}
        self._open: list[Tracker] = []
        self._warned: set[str] = set()
        self._old_term: Any = None

    # -- the run's life -------------------------------------------------------------------
    def start(self, resume_step: int | None) -> None:
        """Open every tracker's run (a new one, or the job's; see the Note) and record the
        configuration in the new ones. ``resume_step``: the step training continues from."""
        if not self.active or self._open:
            return
        try:
            self._start(resume_step)
        except BaseException:
            self.finalize("failed")  # the runs opened before the one that could not open
            raise
        self._job.write(self._state)
        self._answer_sigterm()

    def _start(self, resume_step: int | None) -> None:
        job = self._job.read()
        params = None
        for tracker in self.trackers:
            known = self._state.get(tracker.name) or job.get(tracker.name) or self._restored.get(tracker.name)
            run_id = known.get("run_id") if known else None
            got = tracker.start(run_id, resume_step)
            self._open.append(tracker)
            same = known is not None and got == run_id
            steps = dict(known.get("steps") or {}) if same and not tracker.rewinds else {}
            if same and not tracker.rewinds:
                for key, step in tracker.logged_steps().items():
                    steps[key] = max(step, steps.get(key, step))
            self._state[tracker.name] = {"run_id": got, "steps": steps}
            if not same or tracker.resends_hyperparams:
                params = self._run_params() if params is None else params
                self._call(tracker, "log_hyperparams", params)

    def _run_params(self) -> dict[str, Any]:
        params = dict(self.params)
        resolved = _script_config()
        if resolved:
            params.update(resolved)
        return params

    def log_metrics(self, values: Mapping[str, Any], step: int, epoch: int | None = None) -> None:
        """Record the numbers among ``values`` at ``step`` in every open tracker, each value once."""
        if not self._open:
            return
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self._open:
            held = self._state[tracker.name]["steps"]
            if tracker.monotonic_steps and held and step < max(held.values()):
                fresh = {}  # see [Note: W&B and steps] in wandb_tracker
            else:
                fresh = {k: v for k, v in numbers.items() if step > held.get(k, -1)}
            if fresh and self._call(tracker, "log_metrics", fresh, step, epoch):
                held.update(dict.fromkeys(fresh, step))
        self._job.write(self._state)

    def log_summary(self, params: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """At the end of a successful ``fit``: the hyperparameters with the final metrics."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self._open:
            self._call(tracker, "log_summary", params, numbers)

    def finalize(self, status: str) -> None:
        """Close every open run with ``status`` (see [Note: the end of a run]); idempotent."""
        open_, self._open = self._open, []
        for tracker in reversed(open_):
            self._call(tracker, "finalize", status)
        self._restore_sigterm()

    def _call(self, tracker: Tracker, method: str, *args: Any) -> bool:
        """A tracker's failure after its start is said once and never stops training."""
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - a tracker (a network, a full disk) must not end the run
            if tracker.name not in self._warned:
                self._warned.add(tracker.name)
                warnings.warn(f"dptrain: the {tracker.name!r} tracker failed in {method} ({type(exc).__name__}: "
                              f"{exc}); training goes on, its values may be missing from that tracker", stacklevel=3)
            return False

    # -- SIGTERM, see [Note: the end of a run] ------------------------------------------------
    def _answer_sigterm(self) -> None:
        if not self._open or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            old = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._old_term = old if old is not None else signal.SIG_DFL

    def _restore_sigterm(self) -> None:
        if self._old_term is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._old_term)
        self._old_term = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.finalize("killed")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # and die of it, as without us

    # -- what a checkpoint keeps -----------------------------------------------------------
    def state_dict(self) -> dict[str, dict]:
        """Each tracker's run id and the last step of each metric it holds (rank 0's; ``{}`` elsewhere)."""
        return json.loads(json.dumps({**self._restored, **self._state}))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._restored = {str(k): dict(v) for k, v in state.items() if isinstance(v, Mapping)}


def _script_config() -> dict | None:
    """The fuller resolved config of a script that uses dptrain's config files, else None."""
    try:
        from dptrain.train import cli_config
    except ImportError:
        return None
    resolved = getattr(cli_config, "resolved", None)
    return resolved() if callable(resolved) else None
