"""The error types of dptrain, at the bottom of the import graph (no torch needed).

Every module that raises or catches one of these imports it from here, so the launcher
(which starts the ranks before it imports torch) and the ranks share them. The public
modules re-export them where users look: ``dptrain.comm.CollectiveError``,
``dptrain.RankFailedError``.
"""

from __future__ import annotations

__all__ = ["CollectiveError", "CollectiveMismatchError", "ModelMismatchError", "RankFailedError"]


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the operation."""


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one with different shapes."""


class ModelMismatchError(ValueError, RuntimeError):
    """The ranks built different models (or passed different wrapper settings).

    A ``ValueError`` (bad input) and a ``RuntimeError`` (what PyTorch raises for it), so
    code written for either keeps catching it.
    """


class RankFailedError(RuntimeError):
    """A rank of a job raised or exited non-zero.

    Attributes:
        rank: the global rank that failed first.
        exit_code: its exit code (negative: killed by that signal), or None if it raised.
        traceback_text: the traceback it printed or sent, when there was one.
    """

    def __init__(self, message: str, rank: int, exit_code: int | None = None, traceback_text: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.traceback_text = traceback_text

    def __reduce__(self):  # pickled across processes with all its fields
        return (type(self), (str(self), self.rank, self.exit_code, self.traceback_text))


# Tracebacks and pickles name each error where users import it from (those modules re-export it).
CollectiveError.__module__ = "dptrain.comm"
CollectiveMismatchError.__module__ = "dptrain.comm"
ModelMismatchError.__module__ = "dptrain.parallel"
RankFailedError.__module__ = "dptrain"
