"""How a user error that ends a training job is shown: one clear line, once for the job.

[Note: user errors]
Errors such as "no readable checkpoint", a full disk or a non-finite loss carry a message
that says what is wrong and how to fix it. Printed the default way, each rank adds 40-60
lines of traceback above it, and every rank prints the same thing. A script that uses the
Trainer therefore gets an exception hook (installed by the Trainer, once, chaining the one
it finds) that prints such an error as its one line -- from rank 0 alone when every rank
raised it alike (checkpoint errors the ranks agreed on, non-finite values) -- and leaves
every other exception, and everything under ``dptrain run --debug`` (``DPTRAIN_DEBUG=1``),
to the hook it replaced. The process still exits with status 1.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from dptrain.runtime import settings as _settings

__all__ = ["install_excepthook", "on_every_rank"]

_EVERY_RANK = "_dptrain_every_rank"  # attribute: every rank raised this error alike
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (os.path.join(_PACKAGE, "train") + os.sep, os.path.join(_PACKAGE, "checkpoint.py"))
_previous_hook: Any = None


def on_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised identically on every rank (only rank 0 then prints it); returns it."""
    setattr(exc, _EVERY_RANK, True)
    return exc


def _debugging() -> bool:
    try:
        return _settings.get("DPTRAIN_DEBUG")
    except _settings.SettingError:  # this hook must print the error it was given, not another one
        return False


def _is_user_error(exc: BaseException) -> bool:
    from dptrain.checkpoint import CheckpointError
    from dptrain.train.callbacks import NonFiniteError

    if isinstance(exc, (CheckpointError, NonFiniteError)):
        return True
    if isinstance(exc, (ValueError, FileNotFoundError)):
        # The Trainer's own checks (bad settings, a missing resume file), not a user's bug deep
        # in a model or a dataset, where the traceback is what helps.
        frames = traceback.extract_tb(exc.__traceback__)
        return bool(frames) and frames[-1].filename.startswith(_OURS)
    return False


def _hook(etype: type, exc: BaseException, tb: Any) -> None:
    if _debugging() or not _is_user_error(exc):
        _previous_hook(etype, exc, tb)
        return
    from dptrain.runtime.env import get_world

    rank = get_world().rank
    if getattr(exc, _EVERY_RANK, False) and rank != 0:
        return  # rank 0 says it for the job
    print(f"{etype.__module__}.{etype.__qualname__}: {exc}", file=sys.stderr)
    if rank == 0:
        print("dptrain: the traceback is shown under `dptrain run --debug` (or DPTRAIN_DEBUG=1)", file=sys.stderr)
    sys.stderr.flush()


def install_excepthook() -> None:
    """Show the Trainer's user errors as one line (see [Note: user errors]); idempotent."""
    global _previous_hook
    if sys.excepthook is _hook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _hook
