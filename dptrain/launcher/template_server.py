"""The template server: imports what a warm template imports once, then forks a template for each
launcher that asks (see [Note: a warm template for many jobs] in ``served``, which starts it as
``__main__`` with its folder as ``sys.path[0]`` and its key as argument).

This module imports only the standard library at its top.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import socket
import struct
import sys
import time

from dptrain.launcher.served import ANSWER_WAIT_S, IDLE_S, enter_namespaces, short_path
from dptrain.launcher.template import ChildExits

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run as the server of ``FOLDER KEY`` (its folder is its ``sys.path[0]``, see ``_start_server``):
    import ahead, then fork a template per request."""
    folder, key = (sys.argv[1:] if argv is None else argv)[:2]
    from dptrain.launcher import template as _template
    from dptrain.launcher.spare import _warm_up

    _warm_up()
    if _template.cuda_driver_loaded():
        with open(os.path.join(folder, key + ".unusable"), "w"):
            pass  # no launcher starts another for this key (see served._note)
        return _template.UNUSABLE
    gc.freeze()
    path = os.path.join(folder, key + ".sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    part = f"{path}.{os.getpid()}"
    old = os.umask(0o077)
    try:
        with short_path(folder) as there:
            listener.bind(f"{there}/{os.path.basename(part)}")
        listener.listen(64)
        os.rename(part, path)  # whole: a launcher finds it only once it accepts
    except OSError:
        return 1
    finally:
        os.umask(old)
    mine = os.stat(path).st_ino
    with open(os.path.join(folder, f"{key}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    imported = {name.partition(".")[0] for name in sys.modules}
    forked = _serve(listener, folder, imported)
    if forked is None:
        _remove_own_files(folder, key, mine)
        return 0
    return _be_template(*forked)


def _remove_own_files(folder: str, key: str, sock_inode: int) -> None:
    """Remove the socket and the notes of this server, not those of another server of ``key``
    (started after a launcher took this one for dead)."""
    def ours(name: str) -> bool:
        path = os.path.join(folder, key + name)
        try:
            if name == ".sock":
                return os.stat(path).st_ino == sock_inode
            with open(path) as fh:
                return fh.read().strip() == str(os.getpid())
        except OSError:
            return False

    for name in (".sock", ".starting", ".pid"):
        if ours(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, key + name))


def _serve(listener: socket.socket, folder: str, imported: set[str]) -> tuple[dict, list[int]] | None:
    """Fork a template per request until idle (None); in a child, return its request and descriptors."""
    conns: dict[int, socket.socket] = {}  # a live template's pid -> its launcher's connection
    wake = ChildExits()
    last = time.monotonic()
    while True:
        ready = select.select([listener, wake.fd], [], [], 1.0)[0]
        if wake.fd in ready:
            wake.drain()
        _reap(conns)
        if listener in ready:
            last = time.monotonic()
            forked = _fork_one(listener, conns, imported)
            if forked is not None:
                wake.close()
                for conn in conns.values():
                    conn.close()
                listener.close()
                return forked
        elif not os.path.isdir(folder) or (not conns and time.monotonic() - last > IDLE_S):
            return None


def _fork_one(listener: socket.socket, conns: dict[int, socket.socket],
              imported: set[str]) -> tuple[dict, list[int]] | None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    fds: list[int] = []
    try:
        conn.settimeout(ANSWER_WAIT_S)
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            raise PermissionError(f"uid {uid} is not this server's")
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 2)
        req = json.loads(msg)
        if len(fds) != 2:
            raise ValueError("two descriptors expected")
        shadow = _shadowed(req["path0"], imported)
        if shadow:
            conn.send(json.dumps({"refused": f"{shadow} in {req['path0']} would be imported afresh"}).encode())
            raise ValueError(shadow)
        pid = os.fork()
    except (OSError, ValueError, KeyError, TypeError):
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    if pid == 0:
        conn.close()
        return req, fds
    for fd in fds:
        os.close(fd)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:
        pass  # the launcher is gone: so is the template soon (its end of the pair closed)
    conns[pid] = conn
    return None


def _shadowed(path0: str, imported: set[str]) -> str:
    """The entry of ``path0`` that a module imported here would be found as first ("" if none)."""
    try:
        names = os.listdir(path0)
    except OSError:
        return ""
    for name in names:
        base = name.partition(".")[0]
        if base in imported and (name == base or name.endswith((".py", ".pyc", ".so", ".pyd", ".pth"))):
            return name
    return ""


def _reap(conns: dict[int, socket.socket]) -> None:
    """Tell each ended template's launcher its exit code."""
    from dptrain.runtime.proc import ended_children

    for pid, code in ended_children():
        conn = conns.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"code": code}).encode())
            conn.close()


def _be_template(req: dict, fds: list[int]) -> int:
    """In the forked child: take on the launcher's session, descriptors, directory, environment
    and ``sys.path[0]``, then be its template (``template.run``)."""
    from dptrain.launcher import template as _template
    from dptrain.launcher.spare import set_command_line
    from dptrain.runtime import proc as _proc

    os.setsid()  # as a template started with start_new_session: the launcher's killpg ends it
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1):
        os.dup2(null, target)
    os.close(null)
    os.dup2(fds[1], 2)
    os.close(fds[1])
    launcher = int(req["launcher"])
    try:
        enter_namespaces(launcher)
        os.chdir(req["cwd"])
    except OSError as exc:  # the launcher sees the template gone (this line its last), and starts its ranks afresh
        print(f"the template server could not make this the launcher's template: {exc}", file=sys.stderr, flush=True)
        return 1
    os.environ.clear()
    os.environ.update(req["env"])
    if sys.path:
        sys.path[0] = req["path0"]
    set_command_line(list(req["command"]))
    return _template.run(socket.socket(fileno=fds[0]), req["path0"], False, lambda: _proc.running(launcher))


if __name__ == "__main__":
    sys.exit(main())
