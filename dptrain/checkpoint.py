"""Checkpoints that are either complete or absent, loadable without unpickling code.

``save`` writes through a temporary file in the target's directory, flushes and fsyncs it,
renames it over the target and fsyncs the directory: a crash (kill -9, power loss) at any
moment leaves either the previous file or the new one, never a torn mix. ``load`` always
uses ``torch.load(weights_only=True)``, so a checkpoint can only hold tensors and plain
containers of primitives (``save`` checks that up front and names the offending entry).

Model weights are stored with plain-model keys (no ``module.`` prefix); every loader here
accepts both forms, so a checkpoint from a DDP run loads into a bare model and back.

[Note: FSDP checkpoints]
For a model wrapped in :class:`dptrain.FullyShardedDataParallel` the Trainer stores the
*full* weights (gathered with ``full_state_dict(rank0_only=True)``, so the file loads into a
plain model like any other) and every rank's optimizer shard, gathered to rank 0 into one
list ``optimizer_per_rank``. One file keeps the complete-or-absent guarantee of a single
rename; resuming the optimizer then needs the same world size (the weights load anywhere).
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import re
from typing import Any, Iterable, Mapping

import torch
from torch import nn

__all__ = [
    "CheckpointError",
    "save",
    "load",
    "strip_prefix",
    "unwrap_model",
    "load_model_state",
    "save_safetensors",
    "load_safetensors",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "prune_checkpoints",
]

#: Prefixes that wrappers add to state-dict keys: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

_TMP_MARK = ".tmp-"
_NAME_RE = re.compile(r"^ckpt-e(\d+)-s(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file is truncated, corrupt, or holds something it must not."""


# ---------------------------------------------------------------------------------------
# atomic save / safe load
# ---------------------------------------------------------------------------------------

_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def _check_loadable(obj: Any, where: str = "checkpoint") -> None:
    """Raise ValueError naming the first entry that weights_only loading would refuse."""
    if isinstance(obj, _SAFE_LEAVES):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise ValueError(f"{where} has a key {k!r} of type {type(k).__name__}; use str or int keys")
            _check_loadable(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise ValueError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which torch.load(weights_only=True) "
        f"refuses; store tensors, numbers, strings and lists/dicts of them (e.g. convert arrays with torch.as_tensor)"
    )


def _fsync_dir(directory: str) -> None:
    # The rename is only durable once the directory entry is on disk.
    with contextlib.suppress(OSError):  # some filesystems (and Windows) cannot open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: str, write) -> str:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}{_TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)
    return path


def save(obj: Any, path: str | os.PathLike) -> str:
    """Write ``obj`` with ``torch.save`` so that ``path`` is always complete or untouched.

    The bytes go to a temporary file next to ``path`` (same filesystem, so the rename is
    atomic), which is flushed and fsynced, renamed over ``path``, and the directory is
    fsynced. Call it from one rank (the Trainer uses rank 0).

    Args:
        obj: tensors and (nested) dicts/lists/tuples of tensors, numbers, strings, None.
        path: the destination; its directory is created if needed.

    Returns:
        ``path`` as a string.

    Raises:
        ValueError: ``obj`` holds something ``load`` could not read back with
            ``weights_only=True`` (the message names the entry); nothing is written.
        OSError: the write failed; the previous file at ``path`` is intact.

    Example:
        >>> checkpoint.save({"model": model.state_dict(), "epoch": 3}, "ckpt/last.pt")
    """
    _check_loadable(obj)
    return _atomic_write(path, lambda tmp: torch.save(obj, tmp))


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """Read a file written by :func:`save` (or any ``torch.save`` of tensors and primitives).

    Always ``weights_only=True``: a checkpoint can never run code on load.

    Args:
        path: the file.
        map_location: where tensors go, as in ``torch.load`` (e.g. ``dptrain.device()`` or
            ``"cpu"``). Default None: where they were saved.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is truncated, corrupt, not a torch checkpoint, or holds
            objects other than tensors and primitives; the message names the file.

    Example:
        >>> state = checkpoint.load("ckpt/last.pt", map_location=dptrain.device())
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; check the path (or the checkpoint directory)")
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a directory; pass a checkpoint file (e.g. ckpt-e0003-s000000120.pt)")
    size = os.path.getsize(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path!r} ({size} bytes) cannot be loaded with weights_only=True: it is corrupt or holds "
            f"pickled objects other than tensors and primitives ({exc})"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds (zip, struct, EOF, unicode) on bad bytes
        raise CheckpointError(
            f"checkpoint {path!r} ({size} bytes) is truncated or corrupt and cannot be read: {exc}. "
            f"Resume from an earlier checkpoint (see dptrain.checkpoint.list_checkpoints)"
        ) from exc


# ---------------------------------------------------------------------------------------
# model weights without wrapper prefixes
# ---------------------------------------------------------------------------------------


def strip_prefix(state_dict: Mapping[str, Any], prefixes: Iterable[str] = _WRAPPER_PREFIXES) -> dict[str, Any]:
    """Return the state dict with wrapper prefixes (``module.``, ``_orig_mod.``) removed from the keys.

    Keys without a prefix are kept as they are, so it is safe on plain state dicts.

    Example:
        >>> strip_prefix({"module.fc.weight": w})
        {'fc.weight': w}
    """
    prefixes = tuple(prefixes)
    out = collections.OrderedDict()
    for key, value in state_dict.items():
        key = _strip_key(key, prefixes)
        if key in out:
            raise ValueError(f"state dict has key {key!r} both with and without a wrapper prefix")
        out[key] = value
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:  # module versions that load_state_dict uses to upgrade old formats
        out._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
            (_strip_key(k + ".", prefixes)[:-1] if k else k, v) for k, v in meta.items()
        )
    return out


def _strip_key(key: str, prefixes: tuple[str, ...]) -> str:
    changed = True
    while changed:
        changed = False
        for p in prefixes:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / torch DDP / DataParallel / ``torch.compile`` wrappers.

    FSDP is not unwrapped: its parameters are sharded, use its ``full_state_dict``.
    """
    while True:
        if _is_fsdp(model):
            return model
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model


def _is_fsdp(model: Any) -> bool:
    return hasattr(model, "full_state_dict") and hasattr(model, "load_full_state_dict")


def load_model_state(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Load weights into ``model`` whether or not either side carries the ``module.`` prefix.

    ``model`` may be a plain module, our or torch's DDP, DataParallel, or our FSDP (then it
    must be called on every rank with the full state dict).

    Returns:
        ``load_state_dict``'s result (missing and unexpected keys), or None for FSDP.

    Raises:
        RuntimeError: ``strict`` and the keys or shapes do not match (torch's message).

    Example:
        >>> load_model_state(plain_model, checkpoint.load("ckpt.pt")["model"])
    """
    clean = strip_prefix(state_dict)
    target = unwrap_model(model)
    if _is_fsdp(target):
        target.load_full_state_dict(clean)
        return None
    return target.load_state_dict(clean, strict=strict)


# ---------------------------------------------------------------------------------------
# safetensors export
# ---------------------------------------------------------------------------------------


def save_safetensors(state: nn.Module | Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> str:
    """Export weights as a ``.safetensors`` file (atomically), with plain-model keys.

    Args:
        state: a model (wrapped or not; not FSDP -- pass its ``full_state_dict()``) or a
            state dict. Tensors are copied to CPU and made contiguous; tied weights are
            stored once per key.
        path: destination file.
        metadata: optional string-to-string metadata stored in the header.

    Raises:
        ImportError: the ``safetensors`` package is missing (``pip install safetensors``).

    Example:
        >>> checkpoint.save_safetensors(trainer.model, "model.safetensors")
    """
    from safetensors.torch import save_file

    sd = unwrap_model(state).state_dict() if isinstance(state, nn.Module) else state
    # safetensors refuses tensors that share memory; independent contiguous copies are exact.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in strip_prefix(sd).items() if isinstance(v, torch.Tensor)}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta or None))


def load_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file into a state dict on ``device``.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is truncated or corrupt (names the file).
    """
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"safetensors file {path!r} does not exist")
    try:
        return load_file(path, device=str(device))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise CheckpointError(f"safetensors file {path!r} is truncated or corrupt: {exc}") from exc


# ---------------------------------------------------------------------------------------
# the Trainer's checkpoint directory: ckpt-e<epoch>-s<step>.pt, newest by step
# ---------------------------------------------------------------------------------------


def checkpoint_path(directory: str | os.PathLike, epoch: int, step: int) -> str:
    """Path of the checkpoint taken at ``step`` (optimizer steps) with ``epoch`` to run next/in progress."""
    return os.path.join(os.fspath(directory), f"ckpt-e{epoch:04d}-s{step:09d}.pt")


def list_checkpoints(directory: str | os.PathLike) -> list[str]:
    """Complete checkpoints in ``directory``, oldest first (temporary files are ignored).

    Every listed file is complete: files only get their final name by an atomic rename.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME_RE.match(name)
        if m:
            found.append(((int(m.group(2)), int(m.group(1))), os.path.join(directory, name)))
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints and leftover temporary files; return what was removed.

    ``keep_last <= 0`` keeps everything.
    """
    directory = os.fspath(directory)
    removed = []
    found = list_checkpoints(directory)
    if keep_last > 0:
        for p in found[:-keep_last]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
                removed.append(p)
    return removed


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Delete temporary files that a writer killed mid-save left behind; return them.

    Only call it when no save is in progress (the Trainer does at start, on rank 0).
    """
    directory = os.fspath(directory)
    removed = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(".") and _TMP_MARK in name:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))
                    removed.append(name)
    return removed
