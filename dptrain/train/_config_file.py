"""``config.yaml`` in a checkpoint directory: its text, whether a file there already holds it,
and keeping an earlier one under another name (the Checkpointer decides when; see its
[Note: config.yaml])."""

from __future__ import annotations

import os
import stat
import time
from typing import Any

__all__ = ["CONFIG_NAME", "render", "holds", "keep_aside"]

#: The resolved settings of a run that used parse_config.
CONFIG_NAME = "config.yaml"
_HEADER = (
    "# The settings of this run, resolved by dptrain.train.parse_config (defaults < --config files < options).\n"
    "# Run them again: python <your script> --config config.yaml\n"
)
_MAX_BYTES = 1 << 20  # a config.yaml larger than this is not one of ours: it is kept, not read


def render(config: dict[str, Any]) -> str:
    """The text of ``config.yaml`` for the settings ``config`` (plain values)."""
    import yaml  # installed with jsonargparse, which parse_config needed

    return _HEADER + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)


def holds(path: str, config: dict[str, Any], text: str) -> bool:
    """Whether ``path`` is a plain file (not a link, never followed) that holds the settings ``config``."""
    import yaml

    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        # O_NOFOLLOW: a link put there after the lstat is not followed; O_NONBLOCK: nor is a FIFO waited on.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            held = f.read(_MAX_BYTES + 1)
    except OSError:
        return False
    if held == text.encode():
        return True
    try:  # the same settings written otherwise (another version of PyYAML, a hand edit)
        return len(held) <= _MAX_BYTES and yaml.safe_load(held) == config
    except yaml.YAMLError:
        return False


def keep_aside(path: str) -> str:
    """Rename ``path`` (a file, a link, a folder: the entry itself) to ``config-<when>.yaml`` beside
    it, a name not yet taken (when: the time it was written); returns the new path."""
    when = time.strftime("%Y%m%dT%H%M%S", time.localtime(os.lstat(path).st_mtime))
    root, ext = os.path.splitext(path)
    kept, n = f"{root}-{when}{ext}", 1
    while os.path.lexists(kept):
        n += 1
        kept = f"{root}-{when}-{n}{ext}"
    os.rename(path, kept)
    return kept
