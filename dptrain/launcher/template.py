"""The warm template: one process per node that imports torch and dptrain once, from which
the node's ranks, a failed rank's replacement and the hot spares are forked in milliseconds.

[Note: the warm template]
Without it every rank is a new interpreter: starting Python and importing torch, dptrain and
``torch._dynamo`` take seconds of CPU (3-4 s on a 2-core machine) per process. For a
replacement every survivor waits that long -- the whole of what in-place recovery without a
spare lost, about as much as restarting the whole job -- and a node of N ranks pays N imports
at the start and at every restart. ``dptrain run`` therefore starts this process on each node
before its ranks (``WarmStarts``; ``spare.command``, with the arguments ``PATH FD [outlive]``). It imports
what a hot spare imports (see [Note: what a spare imports ahead] in ``spare``) on its main
thread, at the normal scheduling class since the job's first ranks wait for it, and then only
forks: each child is a hot spare that reads its task from its stdin and runs the program as
``__main__`` (``spare.run_task_and_end``). The job's ranks are its first children (one import for the
node, and no second import competing with the training for the CPU later); a fork takes a few
milliseconds where an interpreter takes seconds, so one template serves any number of
replacements, and ``--spares N`` are forked from it too. Turn it off with
``DPTRAIN_WARM_TEMPLATE=0`` (ranks, and a replacement without a spare, then start new
interpreters). A script whose every import names a module of the standard library (a
check of the hosts, a test of the launcher) gets no template: what it imports ahead would
only delay such a script's ranks, by the seconds the imports take (``standard_library_only``).

What makes a forked child the process a fresh start would have made:

* it is forked by the thread that imported, with no other thread of ours alive, so no lock
  held by another thread is copied locked (numpy's OpenBLAS keeps a thread of its own, which
  it stops before a fork; see also [Note: a thread is not gone when its join returns] in
  ``spare``);
* the objects imported are frozen out of the garbage collector before forking
  (``gc.freeze``): a collection in the child does not write to -- and so copy -- every page
  the template's objects live on (0.25 s of page copies per child without it);
* it gets a session and process group of its own (as a rank started by the launcher, whose
  ``killpg`` stops it and its DataLoader workers), its stdin, stdout and stderr from the
  launcher (three pipes passed over the socket with ``SCM_RIGHTS``) and the default SIGCHLD
  handling;
* it outlives the template: the launcher makes itself the children's subreaper
  (``janitor.adopt_orphans``, the ``outlive`` argument), so a template that dies costs the
  forks it would have made, not the ranks forked from it, and their exit codes still reach
  the launcher (``os.waitpid``; see ``ForkedProcess.poll``). Where the launcher cannot adopt
  them, a child gets the parent-death signal (SIGTERM) when the template is gone. Either way
  the janitor stops the children if the launcher dies (see [Note: how ranks die with the
  launcher] in ``janitor``);
* what it leaves behind when it dies (its DataLoader workers, a subprocess) is reaped by the
  template, which is the subreaper of its children's descendants: an orphan is re-parented to
  it, not to the launcher (which would keep it as a zombie until the job ends) or to init;
* it is not forked at all where the imports ahead loaded the CUDA driver (``cuda_driver_loaded``):
  CUDA does not survive a fork. The template then ends with ``UNUSABLE`` and says why, the
  launcher shows that, and ranks and replacements start as new interpreters;
* ``random`` reseeds itself at a fork; numpy's global generator does not, so it is reseeded
  from the OS as at a fresh import. torch's default generator has the same fixed seed as
  in a fresh process. No CUDA context, store connection or process group exists yet;
* its end is the interpreter's exit for what the program made (threads joined, ``atexit``
  handlers, the script's globals dropped, destructors, open files flushed, the exit code), without
  the teardown of what the template imported (see [Note: a rank's exit without the teardown] in
  ``spare``): 0.25 s of CPU per rank that a short job's ranks spent on nothing else.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (one message a packet, JSON):

* launcher -> template: ``{"op": "fork"}`` with three descriptors (stdin's read end, stdout's
  and stderr's write ends);
* template -> launcher: ``{"forked": PID}`` or ``{"error": TEXT}`` for each fork, in the order
  asked, and ``{"exit": PID, "code": CODE}`` when a child ends (``CODE`` as
  ``Popen.returncode``: negative for a signal). The launcher is not the children's parent, so
  their exit codes come this way.

An end of input ends the template. This module imports only the standard library at its top
(the launcher imports it, and never imports torch).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from dptrain.runtime import proc as _proc
from dptrain.launcher.spare import (Spares, _last_line, _read_task, _warm_heap, _warm_up, command,
                                   run_task_and_end, spare_path0)

__all__ = ["Template", "ForkedProcess", "WarmStarts", "supported", "start", "main"]

#: The template's exit code when it must not fork (the CUDA driver is loaded, see
#: ``cuda_driver_loaded``); it says why on stderr.
UNUSABLE = 3

#: Seconds the template, its socket closed, waits to see whether the launcher died (see
#: ``_stop_if_orphaned``).
ORPHAN_WAIT_S = 2.0

#: Seconds a rank or a replacement waits for the template to fork it: it may still be importing
#: (seconds; more where torch is read from a network file system). After that the process
#: starts afresh, as a new interpreter.
FORK_WAIT_S = 60.0


def supported() -> bool:
    """Whether this platform can run a template: Linux (a fork of a process holding torch is safe
    there; macOS's system libraries are not fork-safe), and descriptors passed over a Unix socket."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "send_fds")
            and hasattr(socket, "SOCK_SEQPACKET"))


#: Calls through which a script imports what its source does not name: it may need torch.
_DYNAMIC_IMPORTS = frozenset({"__import__", "import_module", "run_module", "run_path", "exec", "eval"})


def standard_library_only(program: str, module: bool) -> bool:
    """Whether the script ``program`` imports nothing but the standard library: every ``import``
    and ``from ... import`` in its source (at any depth) names a module of it, and it calls none
    of ``__import__``, ``importlib.import_module``, ``runpy``, ``exec`` or ``eval``. False for a
    module (``-m``: finding its source would import its package), a relative import, a file that
    cannot be read or parsed, and a Python without ``sys.stdlib_module_names`` (before 3.10).

    Example:
        >>> standard_library_only("train.py", False)   # doctest: +SKIP
        False
    """
    names = getattr(sys, "stdlib_module_names", None)
    if module or names is None:
        return False
    try:
        import ast

        with open(program, "rb") as fh:
            tree = ast.parse(fh.read(1 << 22), program)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                return False
            imported = [node.module or ""]
        elif isinstance(node, ast.Call):
            func = node.func
            if getattr(func, "id", getattr(func, "attr", None)) in _DYNAMIC_IMPORTS:
                return False
            continue
        else:
            continue
        if any(name.partition(".")[0] not in names for name in imported):
            return False
    return True


def start(program: str, module: bool, environ: dict[str, str], log: Callable[[str], None],
          rank_command: list[str] = ()) -> "Template | None":
    """The launcher's warm template for ``program`` (see ``Template``; its children outlive it);
    None where this platform cannot run one or it could not start (said through ``log``): ranks
    and replacements then start as new interpreters."""
    if not supported():
        return None
    from dptrain.runtime import settings as _settings

    try:
        return Template(program, module, environ, log, adopt=True, rank_command=rank_command,
                        servers=_settings.get("DPTRAIN_TEMPLATE_SERVERS"))
    except OSError as exc:
        log(f"dptrain run: could not start the warm template ({exc}); ranks and replacements start as new "
            f"processes")
        return None


# ---------------------------------------------------------------------- the template's side --


def main(argv: list[str] | None = None) -> int:
    """Run as the template: import ahead, then fork a process per request (see the Note)."""
    args = sys.argv[1:] if argv is None else argv
    launcher = os.getppid()
    path0, fd = args[0], int(args[1])
    outlive = args[2:3] == ["outlive"]  # the launcher adopts our orphans: children need not die with us
    if sys.path:
        sys.path[0] = path0  # as a spare's: the rank's own sys.path[0]
    sock = socket.socket(fileno=fd)
    # On this thread, at the normal class: the job's first ranks wait for these imports (and a
    # fork copies only the forking thread, so no other thread of ours may be on its way out).
    _warm_up()
    driver = cuda_driver_loaded()
    if driver:
        print(f"importing ahead loaded the CUDA driver ({driver}): a process forked after that cannot use CUDA",
              file=sys.stderr, flush=True)
        return UNUSABLE
    gc.freeze()
    return run(sock, path0, outlive, lambda: os.getppid() == launcher)


def run(sock: socket.socket, path0: str, outlive: bool, launcher_alive: Callable[[], bool]) -> int:
    """Be the template, its imports done: fork on the requests that come over ``sock`` until the
    launcher closes its end (exit code 0); in a forked child, become the rank or spare (its exit
    code). ``launcher_alive()``: whether the launcher still runs (see ``_stop_if_orphaned``)."""
    from dptrain.launcher.janitor import adopt_orphans

    adopt_orphans()  # a child's orphans come here and are reaped (see _reap); not inherited by a fork
    template = os.getpid()  # a forked child's parent, known here: once the template dies its getppid() is another's
    fds = _serve(sock, launcher_alive)
    if fds is None:
        return 0
    return _child(fds, path0, outlive, template)


def cuda_driver_loaded(maps: str = "/proc/self/maps") -> str:
    """The CUDA driver library this process has loaded ("" if none): loaded, it was called.

    torch loads ``libcuda`` only when it first talks to the driver (a device count, a
    context). CUDA does not survive a fork: a child of a process that did so fails at its
    first CUDA call, so such a template must not fork ranks.
    """
    try:
        with open(maps) as fh:
            for line in fh:
                name = line.rsplit("/", 1)[-1].strip()
                if name.startswith("libcuda.so"):
                    return name
    except OSError:
        pass
    return ""


class ChildExits:
    """SIGCHLD as a descriptor a ``select`` loop can wait on (``fd``): readable when a child ended.
    Used by a template and by the template server, the two processes that fork and reap."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        for fd in (self.fd, self._w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up descriptor is written
        signal.set_wakeup_fd(self._w)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 512):  # empty it: one SIGCHLD may stand for several children
                pass

    def close(self) -> None:
        """SIGCHLD back to its default (in a forked child, which reaps nobody)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.fd)
        os.close(self._w)


def _serve(sock: socket.socket, launcher_alive: Callable[[], bool]) -> list[int] | None:
    """Fork on request and report children's exits until the launcher's end closes (None);
    in a child, return the three descriptors it was given."""
    children: set[int] = set()

    def on_term(signum: int, _frame) -> None:  # the launcher's death sends it (see janitor.parent_death_signal)
        _stop_if_orphaned(launcher_alive, children, wait_s=ORPHAN_WAIT_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    wake = ChildExits()
    signal.signal(signal.SIGTERM, on_term)
    while True:
        ready, _, _ = select.select([sock, wake.fd], [], [])
        if wake.fd in ready:
            wake.drain()
        _reap(sock, children)
        if sock not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        except OSError:
            msg = b""
        if not msg:  # the launcher closed its end, or is gone
            _stop_if_orphaned(launcher_alive, children, wait_s=ORPHAN_WAIT_S)
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"fork failed: {exc}"})
            continue
        if pid == 0:
            wake.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sock.close()
            return fds
        children.add(pid)
        for fd in fds:
            os.close(fd)
        _send(sock, {"forked": pid})


def _stop_if_orphaned(launcher_alive: Callable[[], bool], children: set[int], wait_s: float = 0.0) -> None:
    """If the launcher is gone (seen within ``wait_s``), stop the processes forked for it
    (SIGTERM to each one's group).

    They outlive the template when the launcher adopts them (``outlive``), so they would not
    get a parent-death signal of their own when the launcher dies: the janitor stops them
    then, and this does too, for a launcher whose janitor is gone as well (as a rank started
    by the launcher has its parent-death signal besides the janitor). A dying launcher closes
    its descriptors, and sends the parent-death signal, a moment before its children are
    re-parented (``getppid`` changes): hence the wait. A launcher that ends in order kills the
    template right after closing its end, within that wait.
    """
    deadline = time.monotonic() + wait_s
    while launcher_alive():
        if time.monotonic() >= deadline:
            return  # the launcher ends in order: its ranks were stopped by then, its spares by it
        time.sleep(0.005)
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report every child that ended (its code as ``Popen.returncode`` gives it); reap, and say
    nothing of, an orphan of theirs that was re-parented to this process (see ``main``)."""
    for pid, code in _proc.ended_children():
        if pid in children:
            children.discard(pid)
            _send(sock, {"exit": pid, "code": code})


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:  # the launcher is gone: the next read ends the template
        pass


def _child(fds: list[int], path0: str, outlive: bool, template: int) -> int:
    """In a forked child: become a process of its own, then a rank or a hot spare (see the Note).
    ``outlive``: the launcher adopts it if the template dies, so it does not die with the template.
    ``template``: the template's pid. The launcher hears of the fork as soon as it is made, and a
    template killed before this child asked for the parent-death signal sends none: the child
    ends with SIGTERM itself then, as the signal would have ended it."""
    from dptrain.launcher.janitor import parent_death_signal

    os.setsid()
    stop_with_parent = None if outlive else parent_death_signal(template, signal.SIGTERM)
    if stop_with_parent is not None:
        stop_with_parent()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()  # from the OS, as a fresh import seeds it
        except Exception:  # noqa: BLE001 - best effort: the script meets a broken numpy itself
            pass
    if not select.select([0], [], [], 0)[0]:  # no task yet: a spare, waiting (see [Note: a spare's memory is warm])
        _warm_heap()
    try:
        task = _read_task()
    except (OSError, ValueError):
        return 0
    if task is None:
        return 0  # the launcher no longer needs this spare
    run_task_and_end(task, path0)


# --------------------------------------------------------------------- the launcher's side --


class ForkedProcess:
    """A child of the template, with what the launcher uses of ``subprocess.Popen``: ``pid``,
    the three pipes, ``poll``, ``wait`` and ``returncode`` (reported by the template)."""

    def __init__(self, template: "Template", pid: int, ends: tuple[int, int, int]) -> None:
        self.template = template
        self.pid = pid
        self.args = ["<forked from the warm template>"]
        self.stdin = os.fdopen(ends[0], "wb")
        self.stdout = os.fdopen(ends[1], "rb")
        self.stderr = os.fdopen(ends[2], "rb")
        self.returncode: int | None = None
        self.on_demand = False  # forked for a replacement that found no spare waiting (see spare.Spares.take)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.template.pump()
            self.returncode = self.template.exit_code(self.pid)
        if self.returncode is None and self.template.gone and self.template.adopts:
            # The template died and we adopted its children (see Template): this one is ours now.
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not re-parented yet, or reaped already: asked again later
                pid = 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        # Once the template is gone nobody will say: exit_code looks at the process itself.
        return _proc.wait_polled(self, lambda s: time.sleep(s) if self.template.gone else self.template.pump(s),
                                 timeout)


class Template:
    """The launcher's end of one warm template (see [Note: the warm template]).

    ``request()`` asks for a fork and returns at once; ``pump()`` reads the template's
    answers: forked children wait in ``ready`` (oldest first), exit codes in ``exit_code``.
    ``environ`` is the base environment of the ranks; ``log`` prints a launcher line.

    ``rank_command``: the command line a rank started afresh would have, which a child shows
    (see [Note: a spare's command line] in ``spare``).

    ``adopt``: make this process the children's subreaper (``janitor.adopt_orphans``), so that
    they outlive the template: a template that dies then costs only the forks it would have
    made, not the ranks forked from it, and their exit codes come from ``os.waitpid`` here.
    Without it (or where Linux refuses), a child gets SIGTERM when the template dies.

    ``servers``: a folder of template servers (``DPTRAIN_TEMPLATE_SERVERS``): the template is
    forked by the one for this launcher's interpreter and environment where it runs (see
    [Note: a warm template for many jobs] in ``served``; ``adopt`` does not hold then),
    else started here as above.
    """

    def __init__(self, program: str, module: bool, environ: dict[str, str], log: Callable[[str], None],
                 adopt: bool = False, rank_command: list[str] = (), servers: str | None = None) -> None:
        from dptrain.launcher.janitor import adopt_orphans, parent_death_signal

        self.log = log
        path0 = spare_path0(program, module)
        served = None
        if servers:
            from dptrain.launcher import served as _served

            served = _served.request(servers, environ, path0, command("dptrain.launcher.template", path0, ["served"]))
        if served is not None:
            self.adopts = False  # the server's child, not ours: its children get the parent-death signal
            self.sock, self.proc = served
        else:
            self.adopts = adopt and adopt_orphans()
            self.sock, self.proc = self._start(path0, environ, rank_command, parent_death_signal)
        self.pending: list[tuple[int, int, int]] = []  # our ends of the pipes of each fork asked, oldest first
        self.ready: list[ForkedProcess] = []
        self._codes: dict[int, int] = {}
        self.gone = False

    def _start(self, path0: str, environ: dict[str, str], rank_command: list[str],
               parent_death_signal: Callable[[int], Any]) -> tuple[socket.socket, subprocess.Popen]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                command("dptrain.launcher.template", path0,
                        [str(theirs.fileno())] + (["outlive"] if self.adopts else []), room_for=rank_command),
                env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=parent_death_signal(os.getpid()),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours, proc

    @property
    def alive(self) -> bool:
        if not self.gone and self.proc.poll() is not None:
            self.pump()  # what it said before it ended still counts
            self._lost()
        return not self.gone

    def request(self) -> bool:
        """Ask for one more forked spare (it arrives in ``ready``); False if the template is gone."""
        if not self.alive:
            return False
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(self.sock, [json.dumps({"op": "fork"}).encode()], [stdin_r, out_w, err_w])
        except OSError:
            for fd in (stdin_w, out_r, err_r):
                os.close(fd)
            self._lost()
            return False
        finally:
            for fd in (stdin_r, out_w, err_w):  # the child's ends: only the child keeps them
                os.close(fd)
        self.pending.append((stdin_w, out_r, err_r))
        return True

    def pump(self, wait_s: float = 0.0, until: Callable[[], bool] | None = None) -> None:
        """Read what the template said; wait up to ``wait_s`` for a message (or for ``until()``)."""
        deadline = time.monotonic() + wait_s
        while not self.gone:
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                return
            try:
                data = self.sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            self._handle(json.loads(data))
            if until is not None and until():
                return
            deadline = time.monotonic() if until is None else deadline  # once a message came, only drain

    def _handle(self, msg: dict) -> None:
        if "exit" in msg:
            self._codes[int(msg["exit"])] = int(msg["code"])
        elif "forked" in msg and self.pending:
            self.ready.append(ForkedProcess(self, int(msg["forked"]), self.pending.pop(0)))
        elif "error" in msg and self.pending:
            for fd in self.pending.pop(0):
                os.close(fd)
            self.log(f"dptrain run: the warm template could not fork a spare ({msg['error']})")

    def take(self, wait_s: float = FORK_WAIT_S, stop: Callable[[], bool] = lambda: False) -> ForkedProcess | None:
        """A forked process: one ready, else one asked for now, waited for up to ``wait_s`` (or
        until ``stop()``, asked every 0.1 s); None when none came."""
        self.pump()
        if not self.ready and not self.pending and not self.request():
            return None
        deadline = time.monotonic() + wait_s
        while not self.ready and self.pending and not stop():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.pump(min(0.1, left), until=lambda: bool(self.ready))
        return self.ready.pop(0) if self.ready else None

    def exit_code(self, pid: int) -> int | None:
        """The exit code of child ``pid`` (a ``ForkedProcess`` of this template) once it ended, else None."""
        code = self._codes.get(pid)
        if code is None and self.gone and not self.adopts and not _proc.running(pid):
            # The template died first: the child got its parent-death signal, and nobody is left to say.
            code = -int(signal.SIGTERM)
        return code

    def _lost(self) -> None:
        if self.gone:
            return
        self.gone = True
        self._drop_pending()
        try:  # its end of the socket closes as it exits: its code follows at once
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        last = _last_line(self.proc) if code is not None else ""
        self.log(f"dptrain run: the warm template (pid {self.proc.pid}) "
                 f"{'closed its end' if code is None else f'exited with code {code}'}{f': {last}' if last else ''}"
                 f"; ranks and replacements start as new processes from now on")

    def _drop_pending(self) -> None:
        """Close our ends of the pipes of the forks asked for and not answered: none will come."""
        for ends in self.pending:
            for fd in ends:
                os.close(fd)
        self.pending.clear()

    def close(self) -> None:
        """End the template (its children were stopped by then: they are ranks or spares)."""
        self.gone = True
        for proc in self.ready:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()
        self.ready.clear()
        self._drop_pending()
        self.sock.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc.stderr.close()


class WarmStarts:
    """Where one launcher's ranks come from: forked from the node's warm template, or a waiting
    hot spare; a new interpreter where neither is there (see [Note: the warm template]).

    Every job has one (``job.warm``): the template saves a node of N ranks N - 1 imports of
    torch at the start and all N at each restart. With ``--recovery in-place`` it also holds the
    hot spares and forks the replacements (``spares``). ``DPTRAIN_WARM_TEMPLATE=0`` turns the
    template off.
    """

    def __init__(self, job: Any) -> None:
        self.job = job
        self.spares: Spares | None = None
        self._forks_late = False  # the template forked no rank of this attempt in time: the others start afresh

    def prepare(self, base_env: dict[str, str], ranks: int) -> None:
        """Before the ranks of an attempt start: start the warm template (once) and ask it for a
        process for each of this node's ``ranks`` (see ``rank_process``)."""
        from dptrain.runtime import settings as _settings

        job, config = self.job, self.job.config
        if self.spares is None:  # once made (at the first attempt), a restart reuses the template and spares
            warm = _settings.get("DPTRAIN_WARM_TEMPLATE") and not standard_library_only(config.program, config.module)
            if config.spares or warm:
                forker = start(config.program, config.module, base_env, job.log, job.cmd) if warm else None
                self.spares = Spares(config.spares, config.program, config.module, base_env,
                                     started=lambda pid: job.janitor.tell("helper", pid),
                                     ended=lambda pid: job.janitor.tell("forget", pid), log=job.log,
                                     template=forker, rank_command=job.cmd)
        self._forks_late = False
        forker = self.spares.template if self.spares is not None else None
        if forker is not None and forker.alive:
            forker.pump()
            for _ in range(ranks - len(self.spares.waiting) - len(forker.ready) - len(forker.pending)):
                forker.request()  # one import for the node's ranks: see [Note: the warm template]

    def rank_process(self, environ: dict[str, str], stop: Callable[[], bool]) -> Any:
        """A process that has imported torch and dptrain, made the rank ``environ`` describes: a
        waiting hot spare, else one forked from the warm template (waited for until ``stop()``);
        None when there is none (the rank then starts as a new interpreter)."""
        if self.spares is None or self._forks_late:
            return None
        asked = time.monotonic()
        proc = self.spares.take(stop=stop)
        if proc is None:
            # The template is gone (it said why), a fork failed (said), or it is too slow: the
            # other ranks of this attempt do not wait for it again.
            self._forks_late = True
            if time.monotonic() - asked >= FORK_WAIT_S and not stop():
                self.job.log(f"dptrain run: the warm template forked no rank in {FORK_WAIT_S:.0f} s; this "
                             f"node's ranks start as new processes")
            return None
        return proc if self.assign(proc, environ) else None

    def assign(self, proc: Any, environ: dict[str, str]) -> bool:
        """Make the waiting ``proc`` (a spare, a fork) this node's rank of ``environ`` (see ``Spares.assign``)."""
        config = self.job.config
        return self.spares.assign(proc, environ, [config.program] + list(config.args))

    def close(self) -> None:
        if self.spares is not None:
            self.spares.close()


if __name__ == "__main__":
    sys.exit(main())
