"""Every rank built the same model: one check for DDP and FSDP.

Before a wrapper starts communicating, every rank describes its module -- each parameter
and buffer by name, shape, dtype and ``requires_grad``, plus the wrapper settings that shape
the collectives -- and the descriptions are gathered. If any rank differs from rank 0, every
rank raises the same error naming the first difference and the ranks, instead of hanging in
mismatched collectives or silently averaging unrelated tensors.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

from torch import nn

from dptrain import comm
from dptrain.runtime.errors import ModelMismatchError

__all__ = ["verify_same_model", "describe_module", "first_mismatch"]


def describe_module(module: nn.Module, ignore: Collection[str] = ()) -> list[tuple]:
    """What must be identical on every rank: parameters and buffers (but ``ignore``d names), by name, shape and dtype."""
    desc = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
            for n, p in module.named_parameters() if n not in ignore]
    desc += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers() if n not in ignore]
    return desc


def first_mismatch(descs: list[list[tuple]]) -> str | None:
    """A message naming the first difference between rank 0 and the lowest differing rank."""
    ref = descs[0]
    for r, desc in enumerate(descs[1:], start=1):
        if desc == ref:
            continue
        for a, b in zip(desc, ref):
            if a == b:
                continue
            if a[0] == "setting" and b[0] == "setting":
                return f"rank {r} passed {a[1]}={a[2]!r} but rank 0 passed {b[1]}={b[2]!r}"
            if (a[0], a[1]) != (b[0], b[1]):
                return (
                    f"rank {r} holds {a[0]} '{a[1]}' where rank 0 holds {b[0]} '{b[1]}' (same position "
                    "in named_parameters()/named_buffers())"
                )
            what = []
            if a[2] != b[2]:
                what.append(f"shape {a[2]} but rank 0 holds {b[2]}")
            if a[3] != b[3]:
                what.append(f"dtype {a[3]} but rank 0 holds {b[3]}")
            if a[4] != b[4]:
                what.append(f"requires_grad={a[4]} but rank 0 has requires_grad={b[4]}")
            return f"rank {r} holds '{a[1]}' of " + "; ".join(what)
        longer, shorter, who = (desc, ref, r) if len(desc) > len(ref) else (ref, desc, 0)
        extra = longer[len(shorter)]
        other = 0 if who == r else r
        return (
            f"rank {r} has {len(desc)} parameters+buffers but rank 0 has {len(ref)}; "
            f"the first extra one is {extra[0]} '{extra[1]}' on rank {who}, missing on rank {other}"
        )
    return None


def verify_same_model(
    module: nn.Module, group: Any, rank: int, wrapper: str, settings: Sequence[tuple[str, Any]] = (),
    ignore: Collection[str] = (), error: type[Exception] = ModelMismatchError,
) -> None:
    """Raise :class:`ModelMismatchError` on every rank if the ranks built different models.

    Args:
        module: this rank's model.
        group: the process group the wrapper communicates over.
        rank: this rank (in ``group``), for the message.
        wrapper: the wrapper's name, for the message (``"DistributedDataParallel"``).
        settings: ``(name, value)`` pairs that must agree too (bucket sizes, flags...).
        ignore: parameter and buffer names left out (DDP's ignored parameters).
        error: the exception type to raise (a wrapper's own set-up error).
    """
    mine = [("setting", k, v) for k, v in settings] + describe_module(module, ignore)
    problem = first_mismatch(comm.all_gather_object(mine, group=group))
    if problem is not None:
        raise error(
            f"rank {rank}: the ranks built different models for {wrapper}: {problem}; build the same model on every "
            f"rank (same code, same arguments) before wrapping it (raised on rank {rank} and on every other rank)"
        )
