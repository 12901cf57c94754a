"""Who am I with no launcher at all: a single process, world size 1, no process group."""

from __future__ import annotations

from typing import Any, Mapping

from dptrain.environments.torchrun import HINT

__all__ = ["read"]


def read(env: Mapping[str, str]) -> dict[str, Any]:
    """The World's fields of a single process (all defaults).

    Raises:
        ValueError: ``LOCAL_RANK`` is set without ``RANK``/``WORLD_SIZE`` -- a half-written
            launcher environment, which would otherwise silently train alone.
    """
    if "LOCAL_RANK" in env:
        raise ValueError(f"LOCAL_RANK={env['LOCAL_RANK']!r} is set but RANK and WORLD_SIZE are not; {HINT}")
    return {}
