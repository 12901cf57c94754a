"""DistributedDataParallel's constructor takes the installed PyTorch's arguments, no more.

dptrain's DDP implements the arguments of the newest PyTorch it knows (2.13). A script
written for an older torch never passes the newer ones; one that passes an argument the
installed torch lacks (``forward_sync_buffers`` on torch 2.11) must fail here as it fails
with PyTorch's class: ``TypeError: ... got an unexpected keyword argument ...``. So the
arguments are bound against ``inspect.signature(torch.nn.parallel.DistributedDataParallel
.__init__)`` of the installed torch, plus dptrain's own keyword-only extensions, and only
what the caller passed is handed on (defaults stay dptrain's, which equal torch's).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["EXTENSIONS", "bind_arguments", "check_bucket_cap_mb", "installed_signature", "torch_ddp", "torch_has"]

EXTENSIONS = ("shm", "compression", "overlap_optimizer")  # ours, keyword only, not in PyTorch's DDP

_cache: dict[Any, inspect.Signature] = {}


def _is_torchs(cls: Any) -> bool:
    return (
        isinstance(cls, type)
        and cls.__module__ == "torch.nn.parallel.distributed"
        and cls.__qualname__ == "DistributedDataParallel"
    )


@functools.cache
def torch_ddp() -> type:
    """PyTorch's own ``DistributedDataParallel`` class, also where torch's names were rebound to ours.

    Rebinding ``torch.nn.parallel.DistributedDataParallel`` (and the same name in
    ``torch.nn.parallel.distributed``) to dptrain's class is how code one cannot edit is put on
    dptrain. Reading torch's signature through those names would then read our own, so the
    genuine class is found by where it was defined: the names first, then among ``nn.Module``'s
    direct subclasses, where the class stays whatever its module attribute now holds.
    """
    candidates = [
        getattr(nn.parallel.distributed, "DistributedDataParallel", None),
        getattr(nn.parallel, "DistributedDataParallel", None),
        *nn.Module.__subclasses__(),
    ]
    for cls in candidates:
        if _is_torchs(cls):
            return cls
    raise RuntimeError(  # only a torch whose DDP moved, which dptrain's supported range excludes
        f"dptrain could not find torch.nn.parallel.distributed.DistributedDataParallel in torch {torch.__version__}"
    )


def _torch_parameters() -> list[inspect.Parameter]:
    return list(inspect.signature(torch_ddp().__init__).parameters.values())


def installed_signature() -> inspect.Signature:
    """``__init__``'s signature: the installed torch's DDP constructor, then our keyword-only extensions."""
    key = torch_ddp().__init__
    sig = _cache.get(key)
    if sig is None:
        params = _torch_parameters()
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in EXTENSIONS]
        sig = _cache[key] = inspect.Signature(params)
    return sig


def torch_has(name: str) -> bool:
    """Whether the installed torch's DDP constructor has the argument ``name``."""
    return name in installed_signature().parameters and name not in EXTENSIONS


def bind_arguments(ddp: Any, args: tuple, kwargs: dict, newer: Any = ()) -> dict[str, Any]:
    """The arguments the caller passed, by name; TypeError where PyTorch's constructor raises it.

    ``newer``: the names dptrain implements (those of the newest torch it knows), for the hint
    that an argument the installed torch lacks comes with a later torch.
    """
    try:
        bound = installed_signature().bind(ddp, *args, **kwargs)
    except TypeError as exc:
        unknown = sorted(set(kwargs) - set(installed_signature().parameters))
        hint = ""
        if unknown and unknown[0] in newer:
            hint = (
                f" (a later torch's argument: the installed torch {torch.__version__}'s DistributedDataParallel "
                "lacks it, and dptrain's DDP takes the installed torch's arguments; leave it out, or upgrade torch)"
            )
        elif unknown:
            names = ", ".join(p for p in installed_signature().parameters if p != "self")
            hint = f" (check the spelling; the arguments are: {names})"
        raise TypeError(f"DistributedDataParallel.__init__() {exc}{hint}") from None
    out = dict(bound.arguments)
    out.pop("self", None)
    unknown = sorted(set(out) - set(newer)) if newer else []
    if unknown:  # a torch newer than dptrain: an argument we do not implement yet
        raise NotImplementedError(
            f"DistributedDataParallel: the installed torch {torch.__version__} has the argument(s) {unknown}, which "
            "dptrain's DDP does not implement yet; leave them out, or use torch.nn.parallel.DistributedDataParallel"
        )
    return out


def check_bucket_cap_mb(bucket_cap_mb: Any) -> Any:
    """One size in MiB; a list raises TypeError (PyTorch's DDP raises one too), saying where lists go."""
    if isinstance(bucket_cap_mb, (list, tuple)):
        where = (
            f"pass bucket_cap_mb_list={list(bucket_cap_mb)} for one size per bucket"
            if torch_has("bucket_cap_mb_list")
            else f"the installed torch {torch.__version__} has no per-bucket sizes (bucket_cap_mb_list came in a "
            "later torch); pass one size"
        )
        raise TypeError(f"bucket_cap_mb takes one size in MiB, got {bucket_cap_mb!r}: {where}")
    return bucket_cap_mb
