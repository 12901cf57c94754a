"""Slurm preemption: checkpoint at the next step boundary, requeue the job, resume on restart.

Slurm warns a job before it takes its nodes away: with ``#SBATCH --signal=USR1@90`` every
task gets SIGUSR1 90 s before the end (preemption, time limit), and a preempted job also
gets SIGTERM some seconds before SIGKILL. While ``fit`` runs under Slurm the Trainer
catches both: the handler only records the signal; the training loop notices it after the
current optimizer step -- all ranks agree in the same step, because the flag travels with
the per-step check that every rank makes -- writes a checkpoint there, and rank 0 asks
Slurm to requeue the job (``scontrol requeue $SLURM_JOB_ID``). The requeued job runs the
same script; ``SLURM_RESTART_COUNT`` is then above 0, so ``Trainer(resume=None)`` resumes
from that checkpoint by itself.

The process then leaves with :class:`Preempted` (a ``SystemExit``): exit code 0 when the job
was requeued (it will run again), 143 when it could not be (training is incomplete).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading

__all__ = ["PreemptionWatcher", "Preempted", "requeue_job"]


class Preempted(SystemExit):
    """The run stopped for a preemption after writing a checkpoint; ``code`` is the exit code."""


class PreemptionWatcher:
    """Records SIGUSR1/SIGTERM while active (under Slurm only); restores the old handlers after.

    Args:
        enabled: handle the signals at all (``TrainerConfig(preemption=...)`` decides).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> "PreemptionWatcher":
        if self.enabled:
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def in_slurm_job() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def requeue_job() -> str | None:
    """Ask Slurm to requeue this job; returns None on success, else why it could not."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "SLURM_JOB_ID is not set"
    tool = shutil.which("scontrol")
    if tool is None:
        return "scontrol is not on PATH"
    try:
        done = subprocess.run([tool, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed: {exc}"
    if done.returncode != 0:
        return f"scontrol requeue {job} failed: {(done.stderr or done.stdout).strip() or f'exit code {done.returncode}'}"
    return None
