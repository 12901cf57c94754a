"""Warm templates shared by the jobs of one machine, the launcher's side: a server per interpreter
and import-time environment imports torch once and forks each job's warm template (the server
is ``template_server``).

[Note: a warm template for many jobs]
Every ``dptrain run`` starts a warm template (see [Note: the warm template] in ``template``),
which imports torch, dptrain and ``torch._dynamo``: about 3 s of CPU on a 2-core machine, once
per job, before its first rank runs. A test suite or a notebook that starts hundreds of short
jobs spends most of its time there. With ``DPTRAIN_TEMPLATE_SERVERS`` naming a folder, a
launcher asks the server listening in this user's private folder inside it (``servers_folder``)
for its *import key* to fork its template instead, in milliseconds: the server did those imports
once, and its fork, given the launcher's working directory, environment, ``sys.path[0]`` and
descriptors, is the template a start of its own would have made.

The import key (``import_key``) names what can change what an import does or finds: the
interpreter, the variables of Python (``PYTHON*``), the loader, the thread libraries, torch,
CUDA and NCCL, the locale, ``HOME`` and the temporary folder, the working directory where
``PYTHONPATH`` holds a relative entry, and the process's PID, user and cgroup namespaces. Its
network, mount, UTS and IPC namespaces are not in the key: a template forked for a launcher
inside ``ip netns exec`` enters the launcher's (``setns``, which needs the rights ``ip netns``
needs), so that its ranks see that network and that view of the files. The rest of the environment
(``DPTRAIN_*``, a script's own variables) is read at use, after the fork, from the launcher's.
A program whose folder (``sys.path[0]``) holds a module of the name of one the server imported
(a ``torch.py`` beside the script) would import that one afresh: the server refuses it, and the
launcher starts its own template.

The first launcher of a key only notes it (a server for a key seen once would cost its imports
for nothing); the second starts the key's server (``<key>.starting`` holds its pid) and its own
template, and the ones after it are served. No launcher waits for a server's imports: it would
keep its rendezvous store, which the other nodes wait for, closed meanwhile. A server ends after
``IDLE_S`` seconds without a template alive, when its folder is gone, or at SIGTERM; the
templates it forked do not depend on it. A launcher in a network or mount namespace its parent
is not in (``ip netns exec``) starts it in its parent's namespaces (the launcher's may last one
job; entering them takes root, as ``ip netns exec`` does), and is served like any other.

What differs from a template the launcher starts itself: the template is the server's child,
so the launcher cannot adopt its children (they get the parent-death signal when it dies, as
where Linux refuses to adopt them), the template watches the launcher by its pid rather than
its parent's, and its exit code comes from the server.

Protocol (``SOCK_SEQPACKET``, one JSON message a packet), over ``<folder>/<key>.sock``:

* launcher -> server: ``{"launcher": PID, "cwd": ..., "env": {...}, "path0": ..., "command": [...]}``
  with two descriptors: the template's end of its socket pair (the template protocol) and the
  write end of its stderr pipe;
* server -> launcher: ``{"pid": PID}`` once forked (or ``{"refused": TEXT}``), then
  ``{"code": CODE}`` when that template ended (as ``Popen.returncode``).

Only the folder's owner may connect (the folder is refused unless it is theirs and closed to
others; the server checks each caller's uid as well). This module imports only the standard
library at its top (the launcher imports it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import socket
import stat
import subprocess
import sys
import time
from typing import Any

__all__ = ["import_key", "request", "ServedProcess", "servers_folder"]

#: Seconds a server waits without a template alive or a request before it ends.
IDLE_S = 120.0

#: Seconds a launcher waits for a server's answer before it starts its own template.
ANSWER_WAIT_S = 5.0

#: Bytes of command line a server starts with: a template and the ranks forked from it show
#: their own there (see [Note: a spare's command line] in ``spare``).
COMMAND_ROOM = 16384

#: An exit code where nobody could say it (the server ended before its template did, or is silent).
UNKNOWN_CODE = 255

#: Seconds after its template ended that a launcher still waits for the server to say its code.
SERVER_SILENCE_S = 1.0

_KEY_PREFIXES = ("PYTHON", "LD_", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO", "NUMEXPR_",
                 "CUDA", "NCCL_", "LC_", "XDG_")
_KEY_NAMES = frozenset({"HOME", "TMPDIR", "TEMP", "TMP", "LANG", "LANGUAGE", "USER", "LOGNAME", "VIRTUAL_ENV",
                        "CONDA_PREFIX"})


def import_key(environ: dict[str, str], cwd: str | None = None, executable: str | None = None) -> str:
    """The key of the server whose imports are the ones a process of ``environ`` would make
    (see [Note: a warm template for many jobs]).

    Example:
        >>> import_key({"OMP_NUM_THREADS": "1", "RANK": "0"}) == import_key({"OMP_NUM_THREADS": "1"})
        True
    """
    relevant = sorted((k, v) for k, v in environ.items() if k.startswith(_KEY_PREFIXES) or k in _KEY_NAMES)
    path = environ.get("PYTHONPATH", "")
    relative = bool(path) and any(not os.path.isabs(entry) for entry in path.split(os.pathsep))
    what = [executable or sys.executable, relevant, (cwd or os.getcwd()) if relative else None, _namespaces()]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


#: The namespaces a served template enters from its launcher, where they are not the server's, with
#: their ``CLONE_*`` flags for ``setns`` (the mount namespace last: it resets the working directory).
ENTERED_NAMESPACES = (("net", 0x40000000), ("uts", 0x04000000), ("ipc", 0x08000000), ("mnt", 0x00020000))


_LIBC = None


def _libc():
    """The C library, loaded once (and before a fork whose child calls ``setns``: no ``dlopen`` there)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def enter_namespaces(pid: int) -> None:
    """Enter the network, UTS, IPC and mount namespaces of process ``pid`` that are not this
    process's; OSError where Linux refuses (``setns`` needs the rights ``ip netns`` needs: root).
    The caller has one thread, as ``setns`` of a mount namespace requires (a child just forked)."""
    for kind, flag in ENTERED_NAMESPACES:
        theirs = f"/proc/{pid}/ns/{kind}"
        there, here = os.stat(theirs), os.stat(f"/proc/self/ns/{kind}")
        if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino):
            continue
        libc = _libc()
        fd = os.open(theirs, os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                import ctypes  # (loaded by _libc)

                err = ctypes.get_errno()
                raise OSError(err, f"cannot enter the {kind} namespace of process {pid}: {os.strerror(err)}")
        finally:
            os.close(fd)


def _namespaces() -> list[int | None]:
    """The inodes of this process's namespaces that a template cannot enter: its PIDs, users, cgroups."""
    found = []
    for kind in ("pid", "user", "cgroup"):
        try:
            found.append(os.stat(f"/proc/self/ns/{kind}").st_ino)
        except OSError:
            found.append(None)
    return found


@contextlib.contextmanager
def short_path(folder: str):
    """A path to ``folder`` short enough for a Unix socket's address (108 bytes at most; a test's
    temporary folder may be longer): ``/proc/self/fd/N`` of a descriptor opened on it."""
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def servers_folder(folder: str) -> str | None:
    """This user's folder of servers inside ``folder`` (``dptrain-templates-<uid>``, made private if
    missing); None where it cannot be made, or is not this user's alone (nobody else may connect)."""
    path = os.path.join(folder, f"dptrain-templates-{os.getuid()}")
    with contextlib.suppress(FileExistsError, OSError):
        os.mkdir(path, 0o700)
    try:
        info = os.lstat(path)
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return path if private else None


# --------------------------------------------------------------------- the launcher's side --


class ServedProcess:
    """A template forked by a server, with what ``template.Template`` uses of ``Popen``: ``pid``,
    ``stderr``, ``poll``, ``wait`` and ``returncode`` (said by the server)."""

    def __init__(self, conn: socket.socket, pid: int, stderr: Any) -> None:
        self.pid = pid
        self.args = ["<forked by a warm template server>"]
        self.stderr = stderr
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn
        self._gone_at: float | None = None  # when the template was first seen ended with no word from the server

    def _read(self, wait_s: float) -> None:
        from dptrain.runtime import proc as _proc

        if self._conn is None:  # the server ended first: look at the process itself
            if not _proc.running(self.pid):
                self.returncode = UNKNOWN_CODE
            return
        if not select.select([self._conn], [], [], wait_s)[0]:
            # A server that does not say (stopped, hung) must not hold the launcher's end: the
            # template itself is looked at, and its code taken as unknown a second after it ended.
            if not _proc.running(self.pid):
                self._gone_at = self._gone_at or time.monotonic()
                if time.monotonic() - self._gone_at > SERVER_SILENCE_S:
                    self.returncode = UNKNOWN_CODE
                    self._conn.close()
                    self._conn = None
            return
        try:
            data = self._conn.recv(4096)
        except OSError:
            data = b""
        if data:
            self.returncode = int(json.loads(data)["code"])
        self._conn.close()
        self._conn = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        from dptrain.runtime import proc as _proc

        return _proc.wait_polled(self, lambda s: time.sleep(s) if self._conn is None else self._read(s), timeout)


def request(folder: str, environ: dict[str, str], path0: str,
            shown: list[str]) -> tuple[socket.socket, ServedProcess] | None:
    """A template forked for this launcher by the server of ``folder`` for ``environ`` (the ranks'
    base environment): our end of its socket pair and the process; None where no such server
    listens (noted, or started for the next launcher), it refused, or it did not answer in time.
    ``path0`` is the template's ``sys.path[0]``, ``shown`` the command line it shows."""
    folder = servers_folder(folder)
    if folder is None:
        return None
    key = import_key(environ)
    conn = _connect(folder, key)
    if conn is None:
        _note(folder, key, environ)
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    err_r, err_w = os.pipe()
    answer: dict = {}
    try:
        said = {"launcher": os.getpid(), "cwd": os.getcwd(), "env": dict(environ), "path0": path0, "command": shown}
        socket.send_fds(conn, [json.dumps(said).encode()], [theirs.fileno(), err_w])
        if select.select([conn], [], [], ANSWER_WAIT_S)[0]:
            answer = json.loads(conn.recv(65536) or b"{}")
    except (OSError, ValueError):
        pass
    finally:
        theirs.close()
        os.close(err_w)
    if not isinstance(answer.get("pid"), int):
        for end in (conn, ours):
            end.close()
        os.close(err_r)
        return None
    return ours, ServedProcess(conn, answer["pid"], os.fdopen(err_r, "rb"))


def _connect(folder: str, key: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with short_path(folder) as there:
            conn.connect(f"{there}/{key}.sock")
        return conn
    except OSError:
        conn.close()
        return None


def _note(folder: str, key: str, environ: dict[str, str]) -> None:
    """A launcher of ``key`` found no server listening: note the key the first time, start its
    server the second (``<key>.starting`` holds its pid). Never waits: a launcher that waited for
    the imports would keep its store, which the other nodes wait for, closed meanwhile. A server
    that died without a word (killed) leaves its files: they are removed here, and the next
    launcher starts another."""
    from dptrain.runtime import proc as _proc

    starting = os.path.join(folder, key + ".starting")
    if os.path.exists(os.path.join(folder, key + ".unusable")):
        return  # its imports load the CUDA driver: a fork of them could not use CUDA (template.UNUSABLE)
    if os.path.exists(starting):
        pid = _read_pid(starting)
        if pid is not None and not _proc.running(pid):
            for stale in (starting, os.path.join(folder, key + ".sock")):
                with contextlib.suppress(OSError):
                    os.unlink(stale)
        return
    # Under `ip netns exec` the launcher's network and mount namespaces may last one job: its
    # server is started in its parent's instead (where its user may enter them), as if that
    # parent had started it.
    outer = None if _may_start_here() else os.getppid()
    if outer is not None and not _may_enter(outer):
        return

    def create(name: str) -> int | None:
        try:
            return os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError:
            return None

    seen = create(key + ".seen")
    if seen is not None:  # the first of its key: a server for a key seen once would cost its imports for nothing
        os.close(seen)
        return
    fd = create(key + ".starting")
    if fd is None:
        return  # another launcher starts it
    pid = _start_server(folder, key, environ, outer)
    if pid is None:
        os.close(fd)
        os.unlink(starting)
        return
    os.write(fd, str(pid).encode())
    os.close(fd)


def _read_pid(path: str) -> int | None:
    """The pid in ``path`` (None until its maker, which has just started the server, writes it)."""
    try:
        with open(path) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def _may_start_here() -> bool:
    """Whether a server started by this process would outlive its job: not in a network or mount
    namespace entered for this launcher alone (``ip netns exec``: its parent's differ), which may
    last one job and end the server with it."""
    parent = os.getppid()
    try:
        return all(os.stat(f"/proc/self/ns/{kind}").st_ino == os.stat(f"/proc/{parent}/ns/{kind}").st_ino
                   for kind in ("net", "mnt"))
    except OSError:
        return True  # its parent's cannot be read (another user's): as where namespaces are not used


def _may_enter(pid: int) -> bool:
    """Whether this process may enter the namespaces of process ``pid`` (``setns`` needs
    CAP_SYS_ADMIN, which ``ip netns exec`` needs too: root)."""
    return os.geteuid() == 0 and all(os.access(f"/proc/{pid}/ns/{kind}", os.R_OK) for kind, _ in ENTERED_NAMESPACES)


def _start_server(folder: str, key: str, environ: dict[str, str], outer: int | None = None) -> int | None:
    """Start ``key``'s server, in a session of its own that outlives this launcher; its pid.
    ``outer``: a process whose network, UTS, IPC and mount namespaces the server starts in."""
    from dptrain.launcher.spare import command

    if outer is not None:
        _libc()  # loaded here, not in the forked child
    try:
        proc = subprocess.Popen(command("dptrain.launcher.template_server", folder, [key],
                                        room_for=["x" * COMMAND_ROOM]),
                                env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, cwd="/",
                                preexec_fn=None if outer is None else lambda: enter_namespaces(outer))
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.pid
