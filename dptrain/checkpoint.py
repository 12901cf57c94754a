"""Checkpoints that are either complete or absent, loadable without unpickling code.

``save`` writes through a temporary file in the target's directory, flushes and fsyncs it,
renames it over the target and fsyncs the directory: a crash (kill -9, power loss) at any
moment leaves either the previous file or the new one, never a torn mix. ``load`` always
uses ``torch.load(weights_only=True)``, so a checkpoint can only hold tensors and plain
containers of primitives (``save`` checks that up front and names the offending entry).

Model weights are stored with plain-model keys (no ``module.`` prefix); every loader here
accepts both forms, so a checkpoint from a DDP run loads into a bare model and back.

[Note: sharded optimizer state]
For a model wrapped in :class:`dptrain.FullyShardedDataParallel` the Trainer stores the
*full* weights in the checkpoint (gathered to rank 0 with ``full_state_dict(rank0_only=True)``,
so the file loads into a plain model like any other), and each rank's optimizer shard in a
file of its own next to it, ``rank<r>-of-<N>.<checkpoint name>``, written by that rank: no rank
ever holds another rank's shard. The shard files are written first and the checkpoint
itself last, so the checkpoint's (atomic) appearance is what makes the set complete;
shard files without their checkpoint are leftovers of an interrupted save and are removed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import pickle
import re
import shutil
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
    "shard_path",
    "remove_stale_temporaries",
    "describe_mismatch",
]

#: Prefixes that wrappers add to state-dict keys: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

_TMP_MARK = ".tmp-"
_NAME_RE = re.compile(r"^ckpt-e(\d+)-s(\d+)\.pt$")
_SHARD_RE = re.compile(r"^rank(\d+)-of-(\d+)\.(ckpt-e\d+-s\d+\.pt)$")


class CheckpointError(RuntimeError):
    """A checkpoint file is truncated, corrupt, holds something it must not, or cannot be written."""


class CheckpointSpaceError(CheckpointError, OSError):
    """The disk is full: the checkpoint was not written (the previous files are intact)."""


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


def _nbytes(obj: Any) -> int:
    """The bytes of the tensors inside ``obj`` (what a torch.save of it writes, near enough)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _mb(n: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _no_space(path: str, needed: int, free: int) -> CheckpointSpaceError:
    err = CheckpointSpaceError(
        f"no space left on device: writing {path!r} needs about {_mb(needed)} but "
        f"{os.path.dirname(os.path.abspath(path))!r} has {_mb(free)} free; nothing was written and the files "
        f"already there are kept. Free some space, or write checkpoints elsewhere"
    )
    err.errno = errno.ENOSPC
    return err


def _looks_like_full_disk(exc: BaseException, directory: str, needed: int) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.save reports a short write as a RuntimeError ("file write failed",
    # "iostream error"); ask the filesystem whether it is full.
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < max(needed, 1) + 2**20
    return False


def _atomic_write(path: str, write, nbytes: int = 0) -> str:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(directory).free
    if free is not None and nbytes > free:
        raise _no_space(path, nbytes, free)  # fail before writing a single byte
    tmp = os.path.join(directory, f".{os.path.basename(path)}{_TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError) and _looks_like_full_disk(exc, directory, nbytes):
            free = 0
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(directory).free
            raise _no_space(path, nbytes, free) from exc
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
        CheckpointSpaceError: the disk is full (also an ``OSError`` with errno ENOSPC); the
            message names the file, the bytes needed and the space free. Nothing is written.
        OSError: the write failed; the previous file at ``path`` is intact.

    Example:
        >>> checkpoint.save({"model": model.state_dict(), "epoch": 3}, "ckpt/last.pt")
    """
    _check_loadable(obj)
    return _atomic_write(path, lambda tmp: torch.save(obj, tmp), nbytes=_nbytes(obj))


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
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds (zip, struct, EOF, unicode) on bad bytes
        # Said in our words, whole: torch's texts name its internals and run on for lines.
        shape = _damage(path, size)
        if shape is None and isinstance(exc, pickle.UnpicklingError):
            raise CheckpointError(_unpickling_problem(path, size, exc)) from None
        what = shape or f"is corrupt: part of its content does not decode (torch.load raised {type(exc).__name__})"
        raise CheckpointError(
            f"checkpoint {path!r} ({size} bytes) {what}, so it cannot be read. "
            f"Resume from an earlier checkpoint (see dptrain.checkpoint.list_checkpoints)"
        ) from None


_ZIP_START, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"  # a zip's first record; its end-of-directory record
_ZIP_END_SPAN = 22 + 65535  # the end record and the longest comment that may follow it


def _damage(path: str, size: int) -> str | None:
    """What is visibly wrong with a checkpoint file that torch cannot read, or None."""
    with open(path, "rb") as fh:
        head = fh.read(len(_ZIP_START))
        if head != _ZIP_START:
            # torch.save writes a zip archive (since torch 1.6); this one starts otherwise.
            return "does not begin as a PyTorch checkpoint does (a zip archive): it is another kind of file, or its start is damaged"
        fh.seek(max(0, size - _ZIP_END_SPAN))
        if _ZIP_END not in fh.read():
            return "is truncated: its end is missing (a write or a copy that was interrupted)"
    return None


def _unpickling_problem(path: str, size: int, exc: BaseException) -> str:
    # torch's own text advises weights_only=False, which would run whatever code the file
    # holds; say what is wrong instead.
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return (
            f"checkpoint {path!r} ({size} bytes) holds a pickled {found.group(1)} object; dptrain loads checkpoints "
            f"with weights_only=True, which refuses objects other than tensors and plain containers (they could run "
            f"code). Save tensors, numbers, strings and lists/dicts of them"
        )
    return (
        f"checkpoint {path!r} ({size} bytes) is not a PyTorch checkpoint, or it is corrupt: its content cannot be "
        f"unpickled under weights_only=True. Resume from an earlier checkpoint (see dptrain.checkpoint.list_checkpoints)"
    )


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
    # The FSDP wrapper marks its class; asked this one way everywhere (see parallel/fsdp/_plan.py).
    return getattr(type(model), "_dptrain_fsdp", False) is True


def load_model_state(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, source: str = "the state dict"):
    """Load weights into ``model`` whether or not either side carries the ``module.`` prefix.

    ``model`` may be a plain module, our or torch's DDP, DataParallel, or our FSDP (then it
    must be called on every rank with the full state dict).

    Args:
        model: where the weights go.
        state_dict: the weights, with or without wrapper prefixes.
        strict: keys must match exactly (as ``nn.Module.load_state_dict``). Default True.
        source: how to name the weights in an error, e.g. the checkpoint's path.

    Returns:
        ``load_state_dict``'s result (missing and unexpected keys), or None for FSDP.

    Raises:
        CheckpointError (a ``RuntimeError``): the keys (with ``strict``) or the shapes do not
            match; the message names ``source`` and the first missing, unexpected and
            mis-shaped entries with their shapes.

    Example:
        >>> load_model_state(plain_model, checkpoint.load("ckpt.pt")["model"], source="ckpt.pt")
    """
    clean = strip_prefix(state_dict)
    target = unwrap_model(model)
    if _is_fsdp(target):
        try:
            target.load_full_state_dict(clean)
        except ValueError as exc:
            raise CheckpointError(f"{source} does not fit this model: {exc}") from None
        return None
    problem = describe_mismatch(target.state_dict(), clean, strict=strict)
    if problem:
        raise CheckpointError(
            f"{source} does not fit this model ({type(target).__name__}): {problem}. Was it written for another "
            f"model, or the same model built with other arguments?"
        )
    return target.load_state_dict(clean, strict=strict)


def _shape(v: Any) -> str:
    return str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__


def describe_mismatch(expected: Mapping[str, Any], given: Mapping[str, Any], strict: bool = True, limit: int = 3) -> str:
    """What differs between a model's state dict and one to load into it ('' when it fits).

    Example:
        >>> describe_mismatch({"w": torch.zeros(2)}, {"w": torch.zeros(3)})
        "size mismatch for 1 key(s) ('w': given (3,), model (2,))"
    """
    parts = []
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    mis_shaped = [
        k for k in expected
        if k in given and isinstance(given[k], torch.Tensor) and isinstance(expected[k], torch.Tensor)
        and given[k].shape != expected[k].shape
    ]  # fmt: skip
    if strict and missing:
        listed = ", ".join(f"'{k}' {_shape(expected[k])}" for k in missing[:limit])
        parts.append(f"Missing key(s): {len(missing)} (first: {listed})")
    if strict and unexpected:
        listed = ", ".join(f"'{k}' {_shape(given[k])}" for k in unexpected[:limit])
        parts.append(f"Unexpected key(s): {len(unexpected)} (first: {listed})")
    if mis_shaped:
        listed = ", ".join(f"'{k}': given {_shape(given[k])}, model {_shape(expected[k])}" for k in mis_shaped[:limit])
        parts.append(f"size mismatch for {len(mis_shaped)} key(s) ({listed})")
    return "; ".join(parts)


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


def shard_path(path: str | os.PathLike, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its part of checkpoint ``path`` (see [Note: sharded optimizer state])."""
    path = os.fspath(path)
    return os.path.join(os.path.dirname(path), f"rank{rank}-of-{world_size}.{os.path.basename(path)}")


def _shards_of(directory: str, name: str) -> list[str]:
    return [os.path.join(directory, n) for n in os.listdir(directory) if (m := _SHARD_RE.match(n)) and m.group(3) == name]


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints (and their shard files); return what was removed.

    ``keep_last <= 0`` keeps everything.
    """
    directory = os.fspath(directory)
    removed = []
    found = list_checkpoints(directory)
    if keep_last > 0:
        for p in found[:-keep_last]:
            for part in _shards_of(directory, os.path.basename(p)) + [p]:  # the checkpoint itself last
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)
                    removed.append(part)
    return removed


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Delete what an interrupted save left behind; return the names removed.

    That is temporary files of a writer killed mid-save, and shard files whose checkpoint
    was never completed. Only call it when no save is in progress (the Trainer does at
    start, on rank 0).
    """
    directory = os.fspath(directory)
    removed = []
    if os.path.isdir(directory):
        names = set(os.listdir(directory))
        for name in sorted(names):
            m = _SHARD_RE.match(name)
            if (name.startswith(".") and _TMP_MARK in name) or (m and m.group(3) not in names):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))
                    removed.append(name)
    return removed
