"""Who am I: each launch environment answers from its own variables.

- :mod:`~dptrain.environments.torchrun` -- ``torchrun``, ``dptrain run``, ``dptrain.spawn``
  or a hand-written ``RANK``/``WORLD_SIZE`` environment;
- :mod:`~dptrain.environments.slurm` -- ``srun`` without torchrun (host-list grammar, the
  port rule, requeue count);
- :mod:`~dptrain.environments.single` -- no launcher: one process.

:func:`detect` picks the first that applies, in that order, and returns the fields of
:class:`dptrain.World`; ``dptrain.runtime.env`` builds the World from them. Nothing else in the
package reads these variables.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from dptrain.environments import single, slurm, torchrun
from dptrain.environments.slurm import expand_nodelist

__all__ = ["detect", "expand_nodelist", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform says it, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def detect(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The World's fields for this process: torchrun's variables, else Slurm's, else a single process.

    Raises:
        ValueError: a variable is missing or malformed (named, with its value and the fix).
    """
    env = os.environ if environ is None else environ
    for environment in (torchrun, slurm):
        if environment.applies(env):
            return environment.read(env)
    return single.read(env)
