"""Which torch is installed, read without importing it, and the oldest one dptrain supports.

At the bottom of the import graph: ``import dptrain`` checks the version here (cheaply,
from the package metadata), and the launcher, which never imports torch, reads it too.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["MIN_TORCH", "installed", "older_than", "check"]

#: The oldest torch dptrain supports: 2.4 brought ``torch.is_autocast_enabled(device_type)``
#: and the ``torch.amp.GradScaler(device)`` form that the Trainer and DataParallel use.
MIN_TORCH = (2, 4)


def installed() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, from its package metadata; None when unknown
    (not installed, or a source build without metadata). Read once per process: the lookup scans
    every folder of ``sys.path`` (3 ms), and in-place recovery asks on its way to the new group."""
    if not _FOUND:
        try:
            parts = metadata.version("torch").split(".")
            _FOUND.append((int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)))
        except (metadata.PackageNotFoundError, ValueError, IndexError):
            _FOUND.append(None)
    return _FOUND[0]


_FOUND: list = []  # installed()'s answer, once known


def older_than(version: tuple[int, int]) -> bool:
    """Whether the installed torch is known to be older than ``version`` (major, minor); an
    unknown one counts as new."""
    found = installed()
    return found is not None and found < version


def check(found: tuple[int, int] | None = None) -> None:
    """Raise ``ImportError`` when the installed torch is older than :data:`MIN_TORCH`."""
    found = installed() if found is None else found
    if found is not None and found < MIN_TORCH:
        have = metadata.version("torch") if found == installed() else ".".join(map(str, found))
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"dptrain needs torch {need} or newer, but torch {have} is installed; "
                          f"upgrade it in this environment (pip install 'torch>={need}'), or use an "
                          f"environment that has a newer torch")
