"""Reading integers from launcher variables, with errors that name the variable, its value and the fix."""

from __future__ import annotations

from typing import Mapping

__all__ = ["int_var", "optional_int"]


def int_var(env: Mapping[str, str], name: str, *, minimum: int = 0, hint: str) -> int:
    """``env[name]`` as an integer >= ``minimum``; ValueError naming the variable otherwise."""
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"environment variable {name} is not set; {hint}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; {hint}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}; {hint}")
    return value


def optional_int(env: Mapping[str, str], name: str, default: int = 0) -> int:
    """``env[name]`` when it is a plain non-negative integer, else ``default`` (for informational variables)."""
    raw = env.get(name, "")
    return int(raw) if raw.isdigit() else default
