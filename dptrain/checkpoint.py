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
itself last, so the checkpoint's (atomic) appearance is what makes the set complete. A
shard file without its checkpoint is an interrupted save's leftover -- or another job's save
in progress: the clean-up at start removes only those that name its own job (see [Note: what
the clean-up at start may delete]).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import io
import os
import pickle
import re
import secrets
import shutil
import socket
import stat
import zipfile
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from dptrain.runtime import proc as _proc, torch_version as _torch_version, env

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
#: A temporary file as _open_temp names it: .<name>.tmp-<pid>-<start>-<machine>[-<random>].
_TEMP_RE = re.compile(r"^\.(.+)\.tmp-(\d+)-(\d+)-([0-9a-f]{8})(?:-[0-9a-f]{8})?$")
#: One as dptrain named them before they said their writer's start and machine: .<name>.tmp-<pid>[-<random>].
_OLD_TEMP_RE = re.compile(r"^\..+\.tmp-\d+(?:-[0-9a-f]{8})?$")


class CheckpointError(RuntimeError):
    """A checkpoint file is truncated, corrupt, holds something it must not, or cannot be written."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (the file already at its path, if any, is intact); ``errno`` says why when known."""


class CheckpointSpaceError(CheckpointWriteError):
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


def _no_space(path: str, needed: int, free: int, code: int = errno.ENOSPC) -> CheckpointSpaceError:
    what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on device"
    err = CheckpointSpaceError(
        f"{what}: writing {path!r} needs about {_mb(needed)} but "
        f"{os.path.dirname(os.path.abspath(path))!r} has {_mb(free)} free; nothing was written and the files "
        f"already there are kept. Free some space{' under your quota' if code == errno.EDQUOT else ''}, or write "
        f"checkpoints elsewhere"
    )
    err.errno = code
    return err


def _looks_like_full_disk(directory: str, needed: int) -> bool:
    # torch.save reports a short write as a RuntimeError ("unexpected pos", "file write
    # failed") without the OS's reason; ask the filesystem whether it is full.
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < max(needed, 1) + 2**20
    return False


# [Note: the temporary file]
# The temporary's name is predictable, ``.<name>.tmp-<pid>-<start>-<machine>``: the writer's
# pid, when it started (clock ticks after boot, as ``/proc/<pid>/stat`` says) and 8 hex digits
# of its host name and PID namespace, so that the clean-up at start can tell whether the
# process that wrote it is gone (see [Note: what the clean-up at start may delete]). In a
# directory that others can write, someone could plant a symlink under that name, pointing at
# a file of the writer's (root's), and have the checkpoint written through it. So the
# temporary is created by the open itself (O_CREAT | O_EXCL | O_NOFOLLOW, as the shared-memory
# segments are): an entry already of that name -- a link, a leftover -- makes the open fail
# rather than be followed or reused, and the writer takes a random name beside it. The bytes
# then go through that descriptor (torch.save takes the file object), never through the name
# again; the rename moves the directory entry itself, which follows no link.

_NEW_FILE = os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class _TempFile(io.FileIO):
    """The file a checkpoint is written through: it counts the bytes that reached it and keeps
    the first OSError, which torch.save reports only as "unexpected pos 704 vs 598"."""

    written = 0
    failure: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):  # a short write (a disk filling up) is finished or fails here
                done += os.write(self.fileno(), view[done:])
        except OSError as exc:
            self.failure = self.failure or exc
            raise
        finally:
            self.written += done
        return done


def _open_new(path: str, flags: int) -> int:
    return os.open(path, flags | _NEW_FILE, 0o666)


def _machine() -> str:
    """This host and PID namespace as 8 hex digits: a pid means one process only within them."""
    pidns = _proc.identity()[0]
    return hashlib.blake2s(f"{socket.gethostname()}\0{pidns}".encode(), digest_size=4).hexdigest()


_WRITER: tuple[int, str] | None = None  # (pid, "<pid>-<start>-<machine>") of this process, once known


def _temp_name(name: str, pid: int | None = None, started: int | None = None) -> str:
    """The temporary file's name for ``name`` (see [Note: the temporary file]); ``pid`` and
    ``started`` name another process than this one."""
    global _WRITER
    if pid is None:
        if _WRITER is None or _WRITER[0] != os.getpid():  # a forked child is another writer
            me = os.getpid()
            _WRITER = (me, f"{me}-{_proc.start_time(me) or 0}-{_machine()}")
        writer = _WRITER[1]
    else:
        writer = f"{pid}-{started or 0}-{_machine()}"
    return f".{name}{_TMP_MARK}{writer}"


def _open_temp(directory: str, name: str) -> _TempFile:
    """A file that this call creates next to ``name`` (see [Note: the temporary file])."""
    base = os.path.join(directory, _temp_name(name))
    candidate = base
    for _ in range(8):
        try:
            return _TempFile(candidate, "xb", opener=_open_new)
        except FileExistsError:
            candidate = f"{base}-{secrets.token_hex(4)}"
    raise FileExistsError(errno.EEXIST, "every temporary name tried already exists", base)


_WRITABLE = "Make the directory writable for this user (ls -ld shows owner and mode), or write checkpoints elsewhere"
#: What an OSError of a write means, and what to do about it.
_WRITE_FAILURES = {
    errno.EACCES: ("permission denied", _WRITABLE),
    errno.EPERM: ("the operation is not permitted", _WRITABLE),
    errno.EROFS: ("the filesystem is read-only", "Write checkpoints to a writable filesystem"),
    errno.EIO: ("an I/O error: the disk or the network filesystem failed", "Check the disk and the mount, then retry"),
    errno.EFBIG: ("the file would be larger than this process may write (ulimit -f) or the filesystem allows",
                  "Raise the limit, or write checkpoints to another filesystem"),
}


def _write_failed(path: str, existed: bool, exc: BaseException, fh: _TempFile | None, nbytes: int
                  ) -> CheckpointWriteError:
    """The error for a write of ``path`` that failed: which file, why, and that nothing was replaced."""
    directory = os.path.dirname(os.path.abspath(path))
    cause = (fh.failure if fh is not None else None) or (exc if isinstance(exc, OSError) else None)
    code = getattr(cause, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or (cause is None and _looks_like_full_disk(directory, nbytes)):
        free = 0
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(directory).free
        return _no_space(path, nbytes, free, code or errno.ENOSPC)
    if code in _WRITE_FAILURES:
        why, fix = _WRITE_FAILURES[code]
        why = f"{why} ({errno.errorcode[code]})"
    else:
        first = str(cause or exc).strip().splitlines()
        why = f"{type(cause or exc).__name__}: {first[0] if first else ''}"
        fix = "Check the directory and the disk, or write checkpoints elsewhere"
    got = fh.written if fh is not None else 0
    where = (f" after {_mb(got)}" + (f" of about {_mb(nbytes)}" if nbytes > got else "")) if got else ""
    kept = f"the file already at {path!r} is intact" if existed else f"no file was created at {path!r}"
    err = CheckpointWriteError(
        f"writing {path!r} failed{where}: {why}. Nothing was replaced: {kept}, and the other files in "
        f"{directory!r} are untouched. {fix}"
    )
    err.errno = code
    return err


def _atomic_write(path: str, write, nbytes: int = 0) -> str:
    """Write ``path`` through ``write(file)`` so that it is always complete or untouched."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(directory).free
    if free is not None and nbytes > free:
        raise _no_space(path, nbytes, free)  # fail before writing a single byte
    existed = os.path.lexists(path)
    try:
        fh = _open_temp(directory, os.path.basename(path))
    except OSError as exc:
        raise _write_failed(path, existed, exc, None, nbytes) from exc
    try:
        with fh:
            write(fh)
            os.fsync(fh.fileno())
        os.replace(fh.name, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(fh.name)
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, CheckpointError):
            raise _write_failed(path, existed, exc, fh, nbytes) from exc
        raise
    _fsync_dir(directory)
    return path


def save(obj: Any, path: str | os.PathLike) -> str:
    """Write ``obj`` with ``torch.save`` so that ``path`` is always complete or untouched.

    The bytes go to a new temporary file next to ``path`` (same filesystem, so the rename is
    atomic; created so that it follows no link, see [Note: the temporary file]), which is
    fsynced, renamed over ``path``, and the directory is fsynced. Call it from one rank (the
    Trainer uses rank 0).

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
        CheckpointWriteError: the write failed, before or midway (also an ``OSError`` with
            the OS's errno); the message names the file and why (permission, a read-only
            filesystem, an I/O error, ...). The file already at ``path`` is intact.

    Example:
        >>> checkpoint.save({"model": model.state_dict(), "epoch": 3}, "ckpt/last.pt")
    """
    _check_loadable(obj)
    return _atomic_write(path, lambda fh: torch.save(obj, fh), nbytes=_nbytes(obj))


# [Note: weights_only on older torch]
# ``torch.load(weights_only=True)`` is meant to build only tensors and plain containers, but
# torch releases before 2.10 have known ways around it through which a crafted file runs
# code: CVE-2025-32434 (GHSA-53q9-r3pm-6pq6, torch < 2.6.0) and CVE-2026-24747
# (GHSA-63cw-57p8-fm3p, memory corruption in the weights_only unpickler, torch < 2.10.0;
# sources: the CVE records and PyTorch's advisories). dptrain supports torch 2.4 and newer,
# so on those releases a load says once that a checkpoint from someone else is not safe.
_WEIGHTS_ONLY_FIXED = (2, 10)
_WEIGHTS_ONLY_BYPASSED = (
    "torch {} is older than 2.10: its torch.load(weights_only=True), which dptrain loads checkpoints with, has "
    "known bypasses through which a crafted file runs code (CVE-2025-32434 before torch 2.6, CVE-2026-24747 before "
    "2.10). Load only checkpoints that you or people you trust wrote, or upgrade torch (pip install 'torch>=2.10')"
)


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """Read a file written by :func:`save` (or any ``torch.save`` of tensors and primitives).

    Always ``weights_only=True``: a checkpoint can only hold tensors and plain containers.
    On torch older than 2.10 that is not a guarantee against a crafted file (see [Note:
    weights_only on older torch]); the first load says so once. Only a regular file is
    read: a FIFO or a device under a checkpoint's name would block or never end.

    Args:
        path: the file.
        map_location: where tensors go, as in ``torch.load`` (e.g. ``dptrain.device()`` or
            ``"cpu"``). Default None: where they were saved.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is not a regular file, is truncated, corrupt, not a torch
            checkpoint, or holds objects other than tensors and primitives; the message
            names the file.

    Example:
        >>> state = checkpoint.load("ckpt/last.pt", map_location=dptrain.device())
    """
    path = os.fspath(path)
    with _open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if _torch_version.older_than(_WEIGHTS_ONLY_FIXED):  # once per process, from rank 0, at the caller's line
            env._warn_once_main(_WEIGHTS_ONLY_BYPASSED.format(torch.__version__))
        try:
            return torch.load(fh, map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds (zip, struct, EOF, unicode) on bad bytes
            # Said in our words, whole: torch's texts name its internals and run on for lines.
            shape = _damage(fh, size)
            if shape is None and isinstance(exc, pickle.UnpicklingError):
                raise CheckpointError(_unpickling_problem(path, size, exc)) from None
            what = shape or f"is corrupt: part of its content does not decode (torch.load raised {type(exc).__name__})"
            raise CheckpointError(
                f"checkpoint {path!r} ({size} bytes) {what}, so it cannot be read. "
                f"Resume from an earlier checkpoint (see dptrain.checkpoint.list_checkpoints)"
            ) from None


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file (None when it is one)."""
    if stat.S_ISREG(mode):
        return None
    return next((f"is {name}, not a regular file" for test, name in _KINDS if test(mode)), "is not a regular file")


#: Open for reading without waiting: a FIFO's open waits for a writer, which never comes.
_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)


def _open_regular(path: str) -> io.BufferedReader:
    """``path`` open for reading, refused unless it is a regular file (checked on the open
    descriptor, so what is read is what was checked): a FIFO or a device would wait forever
    or never end."""
    try:
        fd = os.open(path, _READ)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; check the path (or the checkpoint directory)") from None
    try:
        other = _not_regular(os.fstat(fd).st_mode)
        if other:
            raise CheckpointError(f"checkpoint {path!r} {other}, so it is not read; pass a checkpoint file "
                                  f"(e.g. ckpt-e0003-s000000120.pt)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _unusable(path: str) -> str | None:
    """Why ``path`` cannot be a complete checkpoint, seen without unpickling it (a few kB read,
    whatever its size); None when it may be one. For deciding what counts, never for loading."""
    try:
        fd = os.open(path, _READ)
    except OSError as exc:
        return f"cannot be opened ({exc.strerror or exc})"
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        return _not_regular(st.st_mode) or _damage(fh, st.st_size)


# [Note: whose checkpoint a file is, read without loading it]
# Whether pruning may delete a file under a checkpoint's name depends on whose it is: its
# ``job`` entry. A file that another job, or anyone else, put into the directory must not be
# unpickled by torch.load for that (on torch < 2.10 a crafted file can run code that way, see
# [Note: weights_only on older torch]), nor read whole (gigabytes of weights). torch.save
# writes a zip archive whose ``<name>/data.pkl`` record holds the structure -- dicts, lists,
# numbers, strings, and a reference per tensor whose bytes lie in records of their own.
# ``_peek`` reads only that record, stored uncompressed, with an unpickler that imports
# nothing: every class or function it names is an inert ``_Opaque``, every tensor reference
# None. It returns the plain top-level entries; nothing of the file runs, and no tensor is read.

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _Opaque:
    """What a peek builds in place of any object it was asked to import: it takes anything and does nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass

    def __setitem__(self, key, value) -> None:
        pass

    def append(self, value) -> None:
        pass

    def extend(self, values) -> None:
        pass


class _Peeker(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return _Opaque  # nothing is imported, so nothing of the file runs

    def persistent_load(self, pid) -> None:
        return None  # a tensor's bytes: not read


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (str, int, float, bool, type(None))) for v in value)
    return isinstance(value, (str, int, float, bool, type(None)))


def _peek(path: str) -> tuple[dict[str, Any], str | None]:
    """The plain top-level entries of checkpoint ``path`` (``format``, ``job``, ``world_size``, ...)
    and None; or ``({}, why)`` when it cannot be a checkpoint (see [Note: whose checkpoint a file is,
    read without loading it]). Follows no link: a link under a checkpoint's name is not one of ours."""
    try:
        fd = os.open(path, _READ | _NOFOLLOW)
    except OSError as exc:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return {}, f"is a symbolic link (to {os.readlink(path)!r}), which dptrain does not follow"
        return {}, f"cannot be opened ({exc.strerror or exc})"
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        problem = _not_regular(st.st_mode) or _damage(fh, st.st_size)
        if problem:
            return {}, problem
        try:
            fh.seek(0)
            with zipfile.ZipFile(fh) as archive:
                index = next((i for i in archive.infolist() if i.filename.count("/") == 1
                              and i.filename.endswith("/data.pkl")), None)
                if index is None or index.compress_type != zipfile.ZIP_STORED:
                    return {}, "is a zip archive but not a PyTorch checkpoint (it has no uncompressed data.pkl)"
                with archive.open(index) as record:
                    top = _Peeker(record).load()
        except Exception as exc:  # noqa: BLE001 - any bytes may be there: zip, pickle, recursion errors
            return {}, f"is corrupt: its index (data.pkl) does not decode ({type(exc).__name__})"
    if not isinstance(top, dict):
        return {}, "is not a dptrain checkpoint: what it holds is not a plain dict"
    return {k: v for k, v in top.items() if isinstance(k, str) and _plain(v)}, None


_ZIP_START, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"  # a zip's first record; its end-of-directory record
_ZIP_END_SPAN = 22 + 65535  # the end record and the longest comment that may follow it


def _damage(fh, size: int) -> str | None:
    """What is visibly wrong with an open checkpoint file that torch cannot read, or None."""
    fh.seek(0)
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
    from safetensors.torch import save

    sd = unwrap_model(state).state_dict() if isinstance(state, nn.Module) else state
    # safetensors refuses tensors that share memory; independent contiguous copies are exact.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in strip_prefix(sd).items() if isinstance(v, torch.Tensor)}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()} or None
    # Built in memory and written through the file this process created (see [Note: the
    # temporary file]): safetensors' own writer takes a name, which a link could redirect.
    return _atomic_write(path, lambda fh: fh.write(save(tensors, metadata=meta)))


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

    ``keep_last <= 0`` keeps everything. Every ``ckpt-*`` file of ``directory`` counts, whichever
    job wrote it: the Trainer's own pruning (``TrainerConfig(keep_last=...)``) deletes only its
    run's checkpoints instead.
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


# [Note: what the clean-up at start may delete]
# A checkpoint directory is not only dptrain's: a user keeps files there, and another job may
# be writing into it at this very moment, from this machine or, over a network filesystem,
# from another. The clean-up that a run does at start therefore deletes only what is certainly
# a leftover of a save that cannot finish any more:
#
# * a temporary file named exactly as ``_temp_name`` names them, whose machine is this one,
#   and whose writer is gone: no process has its pid, or that process is a zombie, or it
#   started at another time than the writer did (the pid was reused). A regular file only.
# * a shard file whose checkpoint is missing and whose ``job`` entry names the job that
#   cleans up (that job's save was interrupted: none of its saves runs while it starts).
#
# Everything else is left where it is, and named (see ``_sweep``): a user's file that merely
# looks like ours (``.notes.tmp-keep`` is not one of ``_TEMP_RE``'s names, and is not even
# named), a temporary whose writer runs -- another job's save in flight, which would fail at
# its rename -- one from another machine or container (whose processes cannot be seen from
# here: the Checkpointer has the first rank there sweep its own machine's), one named as
# dptrain named temporaries before, which says neither machine nor start, a shard file of
# another job or of one that nothing names.


def _writer_gone(pid: int, started: int) -> bool:
    """Whether process ``pid`` of this machine, which started at ``started`` (clock ticks after
    boot; 0: unknown), has ended. False where that cannot be told."""
    if pid <= 0:
        return False  # 0 and below name process groups, not one process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it exists
    except (OSError, OverflowError):
        return False
    now = _proc.start_time(pid)
    if now is None:  # no /proc, or it hides other users' processes
        return False
    return not _proc.running(pid) or (started != 0 and now != started)


def _kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is: "a symbolic link", "a FIFO (named pipe)", ..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return next((name for test, name in _KINDS if test(mode)), "something other than a regular file")


def _temp_machine(name: str) -> str | None:
    """The machine (see ``_machine``) that wrote temporary file ``name``; None for another name."""
    m = _TEMP_RE.match(name)
    return m.group(4) if m else None


def _sweep(directory: str, job: str | None, everything: bool = True) -> tuple[list[str], list[tuple[str, str]]]:
    """What the clean-up at start removes from ``directory``, and what it leaves that looks like
    dptrain's, as ``(removed names, [(name, why it is left)])`` (see [Note: what the clean-up at
    start may delete]). ``job``: the job that cleans up (None: no shard file is removed).
    ``everything=False``: only this machine's temporary files (another rank sweeps the rest)."""
    removed: list[str] = []
    left: list[tuple[str, str]] = []
    if not os.path.isdir(directory):
        return removed, left
    names = set(os.listdir(directory))
    here = _machine()
    for name in sorted(names):
        path = os.path.join(directory, name)
        temp, shard = _TEMP_RE.match(name), _SHARD_RE.match(name)
        if temp:
            pid, started, machine = int(temp.group(2)), int(temp.group(3)), temp.group(4)
            if machine != here:
                if everything:
                    left.append((name, f"was written by process {pid} on another machine or container, "
                                       f"whose processes cannot be seen from here"))
                continue
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # its writer renamed or removed it meanwhile
            if not stat.S_ISREG(mode):
                left.append((name, f"is {_kind(mode)}, not a file that dptrain writes"))
            elif not _writer_gone(pid, started):
                left.append((name, f"is being written by process {pid}, which is running (a save in progress)"))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed.append(name)
        elif not everything:
            continue
        elif _OLD_TEMP_RE.match(name):
            left.append((name, "is named as earlier dptrain versions named their temporary files, which say "
                               "neither the machine nor the start of their writer"))
        elif shard and shard.group(3) not in names:
            entries, problem = _peek(path)
            if problem is None and job is not None and entries.get("job") == job:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed.append(name)
                continue
            if problem:
                whose = f"that cannot be read (it {problem})"
            elif "job" not in entries:
                whose = "that names no job (written by an earlier dptrain)"
            elif entries["job"] is None:
                whose = "of a job that nothing names (a plain python run, dptrain.spawn), maybe another one"
            else:
                whose = f"of job {entries['job']}"
            left.append((name, f"is a shard file {whose} without its checkpoint: a save in progress, or an "
                               f"interrupted one"))
    return removed, left


def remove_stale_temporaries(directory: str | os.PathLike, job: str | None = None) -> list[str]:
    """Delete what interrupted saves left in ``directory`` and nothing else; return the names removed.

    That is the temporary files that dptrain's writers on this machine left when they were
    killed mid-save (named ``.<name>.tmp-<pid>-<start>-<machine>``; removed only once that
    process is gone), and the shard files of job ``job`` whose checkpoint was never written.
    A file that merely looks like one of those, a temporary that a running process (another
    job) is still writing, one of another machine, and another job's shard files are left
    where they are. Call it when no save of ``job`` is in progress (the Trainer does at start,
    and names what it removed and what it left).

    Args:
        directory: the checkpoint directory; a missing one holds nothing.
        job: what names the job that cleans up (``dptrain.train.checkpointer.job_identity()``),
            whose orphan shard files are removed. Default None: no shard file is removed.

    Returns:
        The names removed, sorted.

    Raises:
        OSError: the directory cannot be listed.

    Example:
        >>> checkpoint.remove_stale_temporaries("ckpt")
        ['.ckpt-e0003-s000000120.pt.tmp-4242-1718-1f2e3d4c']
    """
    return _sweep(os.fspath(directory), job)[0]
