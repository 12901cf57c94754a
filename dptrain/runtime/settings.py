"""Every ``DPTRAIN_*`` environment variable: what it means, its default, the values it takes.

[Note: one place for the settings]
The launcher and the ranks read the same variables, so each is declared once, here
(:data:`SETTINGS`), and read through :func:`get` at the moment it is used -- never at
import, so that no value can make ``import dptrain`` fail. A value a variable cannot take
is refused with one line that names it and shows a good one::

    DPTRAIN_HEARTBEAT_S='abc' is not a number of seconds, above 0 and at most 1000000; unset it (default: 2) or set e.g. DPTRAIN_HEARTBEAT_S=5

``dptrain run`` checks them all (:func:`check_all`) before it starts a rank, so that line is
printed once, by the launcher, with exit code 2, instead of a traceback from every rank.
A rank started another way (torchrun, srun) raises :class:`SettingError` where it reads
the value; the first one raised installs an exception hook that prints an uncaught one as
its one line (the traceback stays available under ``DPTRAIN_DEBUG=1``). ``dptrain env``
lists the variables that are set and what is wrong with each (:func:`problem`).

An empty value counts as unset. Variables are read afresh at each use: cheap (a dict
lookup and a comparison), and a test or a notebook that changes ``os.environ`` is heard.

[Note: opening a file dptrain did not make]
Opening some files waits before their type can be known: a FIFO opened to read waits for a
writer (a FIFO given as ``--secret-file`` hung the launcher for good), one opened to write waits
for a reader, and a serial or tape device may wait for its line. So a file whose type dptrain has
not checked is opened through :func:`open_regular`: with ``O_NONBLOCK``, where that open never
waits, and ``O_NOCTTY``, so that a terminal never becomes the process's controlling one; the type
is then read with ``fstat`` from the descriptor the open returned (no window between a check and
the open for the path to change), anything but a regular file is refused as
:class:`NotRegularFile`, naming what it is, and ``O_NONBLOCK`` is cleared so that reads and writes
behave as usual. A file the user names is followed through links (a Kubernetes secret volume is
a tree of links); a file dptrain names itself inside a folder is not (``follow=False``): a link
planted there would send what dptrain writes to somewhere else.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import sys
from typing import Any, Callable, Mapping

__all__ = ["SETTINGS", "Setting", "SettingError", "get", "default", "problem", "shown", "check_all",
           "NotRegularFile", "open_regular", "file_kind"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A ``DPTRAIN_*`` variable holds a value it cannot take; the message is one line naming it."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``DPTRAIN_*`` variable.

    ``kind`` is ``"seconds"`` or ``"number"`` (a float in ``low``..``high``; ``low`` itself
    only with ``low_ok``), ``"count"`` (a whole number in ``low``..``high``, read as an int),
    ``"switch"`` (a bool: 1/true/yes/on or 0/false/no/off), ``"choice"`` (one of ``choices``,
    any case), ``"file"`` (the path of a file that exists, ``~`` expanded), ``"directory"``
    (the path of a directory that exists) or ``"secret"`` (text of at least ``low``
    characters, never shown in a message). ``default`` is what :func:`get` returns when the variable is unset;
    ``default_text`` says it in words where it is None.
    """

    name: str
    kind: str
    default: Any
    meaning: str
    example: str  # a good value, shown in the error
    low: float = 0.0
    high: float = 1e6
    low_ok: bool = False
    choices: tuple[str, ...] = ()
    default_text: str = ""
    unit: str = "seconds"

    def what(self) -> str:
        """The values this variable takes, in words."""
        if self.kind == "switch":
            return "a switch (1, true, yes, on or 0, false, no, off)"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "file":
            return "a file that exists"
        if self.kind == "directory":
            return "a directory that exists"
        if self.kind == "count":
            return f"a whole number from {self.low:.0f} to {self.high:.0f}"
        if self.kind == "secret":
            return f"a secret of at least {self.low:.0f} characters"
        above = f"{self.low:g} or more" if self.low_ok else f"above {self.low:g}"
        return f"a number of {self.unit}, {above} and at most {self.high:.0f}"

    def parse(self, raw: str) -> Any:
        """The value of ``raw`` (not empty); ValueError when this variable cannot take it."""
        if self.kind == "switch":
            if raw.lower() in _ON + _OFF:
                return raw.lower() in _ON
            raise ValueError(raw)
        if self.kind == "choice":
            if raw.lower() in self.choices:
                return raw.lower()
            raise ValueError(raw)
        if self.kind == "file":
            if os.path.isfile(os.path.expanduser(raw)):
                return raw
            raise ValueError(raw)
        if self.kind == "directory":
            if os.path.isdir(os.path.expanduser(raw)):
                return raw
            raise ValueError(raw)
        if self.kind == "count":
            count = int(raw)  # ValueError for 'abc' and for '1.5'
            if not self.low <= count <= self.high:
                raise ValueError(raw)
            return count
        if self.kind == "secret":
            if len(raw.encode()) >= self.low:
                return raw
            raise ValueError("(not shown)")
        value = float(raw)  # ValueError for 'abc'; 'nan' and 'inf' fail the range below
        if not ((value >= self.low if self.low_ok else value > self.low) and value <= self.high):
            raise ValueError(raw)
        return value


def _seconds(name: str, default: float | None, meaning: str, example: str, **kw: Any) -> Setting:
    return Setting(name, "seconds", default, meaning, example, **kw)


def _switch(name: str, default: bool, meaning: str) -> Setting:
    return Setting(name, "switch", default, meaning, "0" if default else "1")


#: The shortest secret taken (``DPTRAIN_SECRET``, or the file's), in characters.
MIN_SECRET_CHARS = 16

#: Every variable dptrain reads, by name. The launcher's flags set some of them for the ranks
#: (``--timeout``, ``--debug``, ``--profile``); ``DPTRAIN_PROGRESS`` is the launcher's message
#: to its ranks, and a user rarely sets it.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    _seconds("DPTRAIN_TIMEOUT", 600.0, "seconds a collective (and dptrain.init) may wait before the job fails; "
             "dptrain run --timeout sets it", "600", high=1e9),
    _seconds("DPTRAIN_HEARTBEAT_S", 2.0, "seconds between two heartbeats of a rank (its progress, in the store)", "5"),
    _seconds("DPTRAIN_WAIT_REPORT_S", 30.0, "seconds dptrain.init and dptrain run wait silently before they say "
             "what they wait for, then again every as many", "30"),
    _seconds("DPTRAIN_STALL_REPORT_S", 60.0, "seconds without progress after which dptrain run reports a rank as "
             "stalled", "60"),
    _seconds("DPTRAIN_PROGRESS_EVERY_S", 5.0, "seconds between two progress lines of a rank that dptrain run "
             "relays when no terminal watches (0: every update)", "5", low_ok=True),
    _switch("DPTRAIN_DEBUG", False, "cross-check every collective across ranks and show tracebacks of user "
            "errors; dptrain run --debug sets it"),
    _switch("DPTRAIN_PROFILE", False, "the Trainer's per-rank step report; dptrain run --profile sets it"),
    _switch("DPTRAIN_SHM", True, "shared memory among the CPU ranks of a node (0: gloo only)"),
    _switch("DPTRAIN_SHM_NODES", True, "across nodes: one shared-memory segment per node, gloo between nodes "
            "(0: gloo for everything)"),
    Setting("DPTRAIN_STORE", "choice", None, "which server hosts the rendezvous store in dptrain run",
            "python", choices=("python", "torch"), default_text="python, or torch with a torch newer than dptrain "
            "was tested with"),
    Setting("DPTRAIN_STORE_MAX_MB", "number", 512, "MiB of keys and values one job may keep in dptrain's "
            "rendezvous store", "512", high=1e7, unit="MiB"),
    Setting("DPTRAIN_SECRET_FILE", "file", None, "dptrain run across nodes: the file that holds the job's "
            "secret, the same on every node, readable by its owner only (--secret-file sets it too)",
            "~/.dptrain/job.secret", default_text="none"),
    Setting("DPTRAIN_SECRET", "secret", None, "dptrain run across nodes: the job's secret itself, the same on "
            "every node (DPTRAIN_SECRET_FILE or --secret-file are read first)",
            "$(python -c 'import secrets; print(secrets.token_hex(32))')", low=MIN_SECRET_CHARS, default_text="none"),
    Setting("DPTRAIN_PROGRESS", "choice", None, "how a rank shows the Trainer's progress: a live bar (tty), "
            "lines now and then (lines), or not at all (off); set by dptrain run", "lines",
            choices=("tty", "lines", "off"), default_text="a bar when stderr is a terminal, else lines"),
    # In-place recovery (dptrain run --recovery in-place): the launcher's message to its ranks.
    Setting("DPTRAIN_RECOVERY", "choice", "restart", "what the ranks of dptrain run do when one fails: restart "
            "(the launcher restarts them all) or in-place (the others keep running and a replacement joins them); "
            "set by dptrain run --recovery", "in-place", choices=("restart", "in-place"), default_text="restart"),
    Setting("DPTRAIN_RECOVERY_DIR", "directory", None, "with in-place recovery: the job's private folder (under "
            "/dev/shm where there is one) where each rank keeps its in-memory snapshot; made, set and removed by "
            "dptrain run", "/tmp", default_text="none"),
    _switch("DPTRAIN_RECOVERY_ADMIT", False, "with in-place recovery of a job of --nnodes MIN:MAX: a node that "
            "arrives while the job runs is let in at a step boundary (the ranks check for it after each optimizer "
            "step); set by dptrain run"),
    _switch("DPTRAIN_WARM_TEMPLATE", True, "dptrain run: keep one process per node that "
            "has imported torch and dptrain (no rank, no device memory) and fork the node's ranks, a failed rank's "
            "replacement and the hot spares from it, in milliseconds instead of an interpreter start and seconds of "
            "imports (not for a script that imports only the standard library); 0: ranks and a replacement without "
            "a hot spare start as new interpreters"),
    Setting("DPTRAIN_TEMPLATE_SERVERS", "directory", None, "dptrain run: share warm templates among the jobs "
            "of this machine, in a private folder of yours made inside this one: one server per Python, import-time "
            "environment imports torch once and forks each job's template in milliseconds (for "
            "a test suite or a notebook that starts many short jobs; a server ends after 2 idle minutes)", "/tmp",
            default_text="none: each job's template imports for itself"),
    Setting("DPTRAIN_GENERATION", "count", 0, "with in-place recovery: 0 for a rank started with the job, g for a "
            "replacement started for generation g of the process group; set by dptrain run", "1", high=1e9),
)}


#: Variables only the launcher reads: ``dptrain run`` starts its ranks without them, so that the
#: job's secret is never in a rank's environment (see [Note: only the job gets in] in
#: ``dptrain.launcher.auth``).
LAUNCHER_ONLY = ("DPTRAIN_SECRET_FILE", "DPTRAIN_SECRET")


def _default_text(setting: Setting) -> str:
    if setting.default_text:
        return setting.default_text
    if setting.kind == "switch":
        return "1" if setting.default else "0"
    return f"{setting.default:g}"


def problem(name: str, raw: str) -> str | None:
    """What is wrong with ``name=raw``, as the one line :class:`SettingError` carries; None if nothing.

    Example:
        >>> problem("DPTRAIN_SHM", "maybe")  # doctest: +ELLIPSIS
        "DPTRAIN_SHM='maybe' is not a switch (...); unset it (default: 1) or set e.g. DPTRAIN_SHM=0"
    """
    setting = SETTINGS[name]
    if not raw.strip():
        return None
    try:
        setting.parse(raw.strip())
    except ValueError:
        shown = f"{name} ({len(raw.strip())} characters, not shown)" if setting.kind == "secret" else f"{name}={raw!r}"
        wrong = f"is not {setting.what()}"
        if setting.kind == "file":  # there, but not a file (a FIFO, a directory): say what it is
            kind = _kind_at(os.path.expanduser(raw.strip()), follow=True)
            wrong = f"is {kind}, not a regular file" if kind is not None else wrong
        return f"{shown} {wrong}; unset it (default: {_default_text(setting)}) or set e.g. {name}={setting.example}"
    return None


def shown(name: str, raw: str) -> str:
    """``raw``, the value of ``name``, as it may be shown: a secret's as its length only."""
    setting = SETTINGS.get(name)
    return f"({len(raw.strip())} characters, not shown)" if setting is not None and setting.kind == "secret" else raw


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the ``DPTRAIN_*`` variable ``name`` (its default when unset or empty).

    Args:
        name: a key of :data:`SETTINGS`.
        environ: where to read it; default ``os.environ``.

    Raises:
        SettingError: the variable holds a value it cannot take (one line: see
            [Note: one place for the settings]).

    Example:
        >>> get("DPTRAIN_HEARTBEAT_S", {"DPTRAIN_HEARTBEAT_S": "0.5"})
        0.5
    """
    setting = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError:
        pass
    _install_hook()
    raise SettingError(problem(name, raw)) from None


def default(name: str) -> Any:
    """What ``name`` is when it is not set (for the modules that name the default)."""
    return SETTINGS[name].default


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Read every variable of :data:`SETTINGS` once; raise :class:`SettingError` for the first bad one.

    The message is that variable's one line, followed by the names of any other bad ones.
    """
    environ = os.environ if environ is None else environ
    bad = [text for name in SETTINGS if (text := problem(name, environ.get(name, ""))) is not None]
    if not bad:
        return
    more = "" if len(bad) == 1 else f" (also wrong: {', '.join(t.split('=', 1)[0] for t in bad[1:])})"
    _install_hook()
    raise SettingError(bad[0] + more)


# -- files dptrain did not make: opened without waiting, refused unless regular ----------------
#: What a file is, in words, by the first test of its mode that holds.
_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISLNK, "a symbolic link"))
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # 0 where there is none (Windows), and no FIFO to wait on either


class NotRegularFile(OSError):
    """The path of a file dptrain was to open names something else; ``kind`` says what ("a FIFO
    (named pipe)", "a directory", "a symbolic link to a FIFO (named pipe)", ...). An ``OSError``,
    as the open's own errors are."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.filename} is {self.kind}, not a regular file"


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words: "a regular file", "a FIFO (named pipe)", ..."""
    return next((words for test, words in _KINDS if test(mode)), f"a file of type {stat.S_IFMT(mode):o}")


def _kind_at(path: str, follow: bool) -> str | None:
    """What ``path`` is, in words ("a symbolic link to a directory" for a followed link); None where it is not there."""
    try:
        kind = file_kind((os.stat if follow else os.lstat)(path).st_mode)
        if follow and os.path.islink(path):
            kind = f"a symbolic link to {kind}"
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return kind


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o666, follow: bool = True) -> int:
    """Open ``path`` as ``os.open`` does, refusing anything but a regular file, without ever waiting
    on what it turns out to be (see [Note: opening a file dptrain did not make]).

    Args:
        path: the file.
        flags: ``os.open``'s flags (default ``O_RDONLY``); ``O_NONBLOCK``, ``O_NOCTTY`` and
            ``O_CLOEXEC`` are added, and ``O_NONBLOCK`` is cleared again once the file is known to be regular.
        mode: the permissions of a file ``O_CREAT`` makes (default 0o666, less the umask).
        follow: follow a link at ``path`` itself (default True: a file the user names); False for a
            file dptrain names inside a folder, where a link is refused as "a symbolic link".

    Returns:
        The file descriptor (the caller closes it).

    Raises:
        NotRegularFile: ``path`` is a FIFO, a directory, a device, a socket, or (``follow=False``) a link.
        OSError: the open's own errors (the file is missing, permission denied, ...).

    Example:
        >>> open_regular("/dev/null")
        Traceback (most recent call last):
        dptrain.runtime.settings.NotRegularFile: /dev/null is a character device, not a regular file
    """
    extra = _NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        extra |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as exc:
        # Not opened, and for want of its type: a FIFO to write without a reader (ENXIO), a
        # directory to write (EISDIR), a socket (ENXIO), a link under O_NOFOLLOW (ELOOP).
        kind = _kind_at(path, follow)
        if kind is not None and kind != "a regular file" and exc.errno != errno.ENOENT:
            raise NotRegularFile(path, kind) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = file_kind(info.st_mode)
            raise NotRegularFile(path, f"a symbolic link to {kind}" if follow and os.path.islink(path) else kind)
        if _NONBLOCK:
            import fcntl  # POSIX only, as O_NONBLOCK is

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- an uncaught SettingError as its one line ------------------------------------------------
_previous_hook: Callable[..., Any] | None = None  # the hook ours replaced (set once: never a loop of two)


def _debugging() -> bool:
    try:
        return bool(get("DPTRAIN_DEBUG"))
    except SettingError:  # DPTRAIN_DEBUG itself is what is wrong
        return False


def _hook(etype: type, exc: BaseException, tb: Any) -> None:
    if not isinstance(exc, SettingError) or _debugging():
        (_previous_hook or sys.__excepthook__)(etype, exc, tb)
        return
    rank = os.environ.get("RANK")  # the launcher's word, for the message only
    print(f"dptrain{f' (rank {rank})' if rank else ''}: error: {exc}", file=sys.stderr)
    sys.stderr.flush()


def _install_hook() -> None:
    """Print an uncaught :class:`SettingError` as its one line (installed at the first one raised)."""
    global _previous_hook
    if _previous_hook is None and sys.excepthook is not _hook:
        _previous_hook = sys.excepthook
        sys.excepthook = _hook
