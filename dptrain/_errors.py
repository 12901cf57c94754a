"""The error types of dptrain, at the bottom of the import graph (no torch needed).

Every module that raises or catches one of these imports it from here, so the launcher
(which must not import torch before it starts the ranks) and the ranks share them.
"""

from __future__ import annotations

__all__ = ["ModelMismatchError"]


class ModelMismatchError(ValueError, RuntimeError):
    """The ranks built different models (or passed different wrapper settings).

    A ``ValueError`` (bad input) and a ``RuntimeError`` (what PyTorch raises for it), so
    code written for either keeps catching it.
    """
