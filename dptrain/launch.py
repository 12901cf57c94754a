"""Moved to :mod:`dptrain.launcher` (``dptrain.launcher.job``); this module keeps ``dptrain.launch`` imports working."""

from dptrain.launcher import LaunchConfig, RankFailedError, free_port, rank_environ, run_job

__all__ = ["LaunchConfig", "run_job", "RankFailedError", "free_port", "rank_environ"]
