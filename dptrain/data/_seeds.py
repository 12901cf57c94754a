"""The seed of a rank's loader workers in an epoch (``dptrain.data.loader``'s Note "worker seeds")."""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(seed: int, rank: int, epoch: int) -> int:
    """A 63-bit seed fixed by ``(seed, rank, epoch)``: the same in every run, different per rank and epoch."""
    digest = hashlib.sha256(f"dptrain-loader/{seed}/{rank}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
