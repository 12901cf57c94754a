"""Hot spares: processes that have imported torch and dptrain and wait to become a rank.

``dptrain run --recovery in-place --spares N`` keeps N of them on each node (``Spares``). When
a rank fails, its replacement is a spare (see ``inplace``): what a fresh process would spend
before the script's first line -- starting Python, importing torch -- was spent ahead, while
the job ran, and is off the path from the failure to the replacement joining the job. Where
the node's warm template runs (see [Note: the warm template] in ``template``), the spares are
its forked children and this module's ``run_task`` runs them; otherwise each spare is an
interpreter of its own, started as below.

Protocol: the launcher writes one line of JSON to the spare's stdin and closes it::

    {"env": {...the rank's whole environment...}, "argv": ["train.py", "--lr", "0.1"],
     "program": "train.py", "module": false}

The spare makes ``env`` its environment (``os.environ``, replaced whole), ``argv`` its
``sys.argv``, reads /dev/null on stdin from then on, as a rank does, and runs the program as
``__main__`` with ``runpy``, as ``python -u train.py ...`` (``python -u -m pkg.train ...`` with
``"module": true``) would. An end of input without a line (the launcher ended, or no longer
needs it) ends the spare with code 0.

[Note: what a spare imports ahead]
torch, ``torch.distributed``, the Trainer (``dptrain.train``, which brings ``dptrain``,
``env``, ``comm`` and the sampler), the DDP wrapper and ``torch._dynamo``, which its forward
needs (its import alone is most of a second): what every dptrain rank imports. It cannot
do more before it knows which rank it becomes: no CUDA context (the device is the rank's local
rank, and a context made on the wrong GPU holds its memory there), no store connection, no
process group. A variable torch reads as it is imported (``OMP_NUM_THREADS``) is the same in
the spare's environment as in the rank's: both start from the launcher's base environment
(``job.base_environ``); what differs (``RANK``, ``LOCAL_RANK``, ...) is read only at use. A
script that sets ``OMP_NUM_THREADS`` itself before its ``import torch`` is the exception:
``dptrain.init`` then sets the thread count that a fresh import would have given
(``OMP_AT_IMPORT``), so that a replacement computes with the threads of the rank it replaces.
The imports are best effort: one that fails is left for the script to meet, under its rank's
name.

The spare runs this module as ``__main__`` with the argument PATH (see ``command``), where PATH
is what ``sys.path[0]`` is for the program run the usual way (its folder, or the working
directory with ``-m``) and is ``sys.path[0]`` from the spare's first import on, so that the
imports ahead resolve as the rank's own would. This module imports only
the standard library at its top (the launcher imports it too, and never imports torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable

__all__ = ["Spares", "main"]


# ------------------------------------------------------------------------ the spare's side --


#: In a process that imported torch ahead (a spare, the warm template and its children): the
#: OpenMP thread count its environment gave as torch was imported, ``(value or None,)``; None
#: elsewhere. ``dptrain.init`` reads it (see ``dptrain.runtime.env._threads_as_if_fresh``).
OMP_AT_IMPORT: tuple[str | None] | None = None


@contextlib.contextmanager
def _collector_off():
    """The garbage collector off inside the block (back on after it, if it was on): for imports of
    torch's size, a million-odd objects whose growth sets off dozens of collections, a fifth of
    their CPU (0.5 s of a template's 2.4 s on a 2-core machine), while nothing they make is garbage
    worth collecting before they are done."""
    import gc

    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _warm_up() -> None:
    """Import what every dptrain rank imports (see [Note: what a spare imports ahead]), with the
    collector off meanwhile (``_collector_off``)."""
    with _collector_off():
        _import_ahead()


def _import_ahead() -> None:
    global OMP_AT_IMPORT
    OMP_AT_IMPORT = (os.environ.get("OMP_NUM_THREADS"),)  # OpenMP reads it as torch's libraries load
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

        import dptrain.train  # noqa: F401
        import dptrain.train.trainer  # noqa: F401
        import dptrain.parallel.ddp  # noqa: F401
        import torch._dynamo  # noqa: F401 - DDP's forward needs it: 0.8 s of a 2-core machine's time
    except Exception:  # noqa: BLE001 - the script meets the same error under its rank's name
        return
    # What a replacement meets on its way to the first step, 25 ms of imports there (the
    # Trainer's strategy module, torch.load's, and the profiler module an optimizer's first
    # step imports through record_function); none of it starts a thread.
    # And the module _become takes PR_SET_MM's prctl from (2.5 ms, on the path from the task to the script).
    for name in ("dptrain.parallel.zero", "torch.utils.serialization", "dptrain.launcher.janitor"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a torch without it: imported where needed, or not at all
            pass
    try:
        with torch.autograd.profiler.record_function("dptrain warm-up"):
            pass
    except Exception:  # noqa: BLE001 - as above
        pass


# [Note: a spare's memory is warm]
# A process that has trained a while allocates a tensor from memory its C library already holds:
# glibc serves allocations below its mmap threshold from the heap, and keeps up to its trim
# threshold of freed space at the heap's top. A fresh process has neither: its threshold starts
# at 128 kB, so every tensor of a new model, of the received optimizer state and of the first
# step's gradients is new memory that the kernel zero-fills page by page at its first touch
# (14 MiB: about 12 ms here, against 1.5 ms for memory touched before). That lies on the path
# from a failure to the replacement's first step. So a spare, while it waits, does on its main
# thread (whose heap the script's allocations use) what the first steps of a rank would: frees
# a block large enough that glibc raises its thresholds (to 30 MiB and twice that), then fills
# and frees smaller blocks that stay at the heap's top. It holds that memory (``WARM_HEAP_MIB``)
# while it waits, as a rank holds its own free space; another C library keeps what it keeps.
WARM_HEAP_MIB = 56


def _warm_heap(mib: int = WARM_HEAP_MIB) -> None:
    """Leave ``mib`` MiB of touched, free memory at the main thread's heap (see the Note above)."""
    if mib <= 0:
        return
    raise_to = bytearray(30 << 20)  # above the mmap threshold: mapped, and its release raises the threshold
    del raise_to
    pieces = [bytearray(8 << 20) for _ in range(mib // 8)]  # below it now: from the heap, zero-filled (touched)
    del pieces


def _read_task(fd: int = 0) -> dict | None:
    """The launcher's one line of JSON on ``fd``, or None at the end of input without one."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)  # not sys.stdin: nothing may stay buffered past the line
        if not chunk:
            break
        data += chunk
    return json.loads(data) if data.strip() else None


def _become(task: dict, path0: str) -> None:
    """Take on the rank's environment, arguments, command line and stdin (see the module's docstring)."""
    os.environ.clear()
    os.environ.update(task["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.argv = list(task["argv"])
    if sys.path and sys.path[0] != path0:
        sys.path[0] = path0
    set_command_line([sys.executable, "-u"] + (["-m"] if task.get("module") else []) + sys.argv)


def set_command_line(args: list[str], stat: str = "/proc/self/stat") -> bool:
    """Show ``args`` as this process's command line (``/proc/self/cmdline``: ``ps``, ``pgrep -f``,
    psutil), as a rank started as ``python -u train.py ...`` shows it; whether it could (Linux).

    [Note: a spare's command line]
    A hot spare or a process forked from the warm template was started with the command line
    of ``spare``/``template``, not the rank's; tools that find a job's ranks by their script
    (``pgrep -f train.py``) would miss it. The kernel reads a process's command line from the
    memory its arguments were given in (``arg_start``-``arg_end`` in ``/proc/self/stat``),
    which the process may overwrite (the interpreter keeps its own copies): the new line is
    written there, ending in NULs. It fits because the launcher started the spare or template
    with arguments at least as long as the rank's (``command``'s ``room_for``); a longer one
    is cut. Where the kernel lets this process move ``arg_end`` (``CAP_SYS_RESOURCE``), the
    line ends exactly; otherwise the NULs after it show as trailing empty arguments.
    """
    try:
        import ctypes

        with open(stat) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
        if not 0 < start < end:
            return False
        data = b"\0".join(os.fsencode(a) for a in args)[:end - start - 1] + b"\0"
        ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
        from dptrain.launcher.janitor import prctl_function

        prctl = prctl_function()
        if prctl is not None:  # PR_SET_MM, PR_SET_MM_ARG_END: where this process is allowed to
            prctl(35, 9, ctypes.c_ulong(start + len(data)), 0, 0)
        return True
    except (OSError, ValueError, IndexError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Run as a hot spare: import ahead, wait for the launcher's assignment, run the program as ``__main__``."""
    args = sys.argv[1:] if argv is None else argv
    path0 = args[0] if args else os.getcwd()
    if sys.path:
        sys.path[0] = path0  # what the rank's own sys.path[0] is (see the module's docstring)
    import threading

    warming = threading.Thread(target=_warm_up_idle, name="dptrain-spare-warm-up", daemon=True)
    warming.start()
    _warm_heap()
    try:
        task = _read_task()
    except (OSError, ValueError):  # the launcher's end is gone or wrote no assignment
        return 0
    if task is None:
        return 0
    # The job waits now, so the imports have the machine (and finish fast if not done); the
    # script may fork (a DataLoader's workers), so the thread must be gone, not only its code.
    join_to_the_end(warming)
    run_task_and_end(task, path0)


#: What a script run by :func:`run_task` leaves: its globals (or the exception that ended it,
#: whose traceback holds them), kept until the interpreter ends.
#:
#: [Note: a script's globals outlive the atexit handlers]
#: In a fresh interpreter the script's module stays in ``sys.modules`` until finalization, so
#: its objects (a model, an optimizer, PyTorch's DDP, each holding the process group) are
#: dropped after the ``atexit`` handlers have run, among them
#: :func:`dptrain.runtime.exit.settle_gloo_workers`. ``runpy`` instead returns (or raises out
#: of) a module of its own that nothing holds: dropping it right there ran the process group's
#: destructor while a gloo worker might still be letting go of the job's last collective. The
#: destructor joins that worker holding the GIL, the worker waits for the GIL: the rank hung
#: after its script ended (a two-node job of ``tests/test_shm_nodes.py``, about one exit in
#: ten on a busy machine). Kept here, they go in the interpreter's order.
_KEPT: list[Any] = []


def run_task(task: dict, path0: str) -> int:
    """Become the rank ``task`` describes and run its program as ``__main__``; the exit code.

    An exception of the program is shown as the interpreter shows a script's, without our
    frames; ``SystemExit`` goes through, as from a script run the usual way.
    """
    import runpy

    _become(task, path0)
    try:
        if task.get("module"):
            _KEPT.append(runpy.run_module(task["program"], run_name="__main__", alter_sys=True))
        else:
            # Absolute, as the interpreter makes a script's __file__ (Python >= 3.9).
            _KEPT.append(runpy.run_path(os.path.abspath(task["program"]), run_name="__main__"))
    except SystemExit as ended:
        _KEPT.append(ended)  # its traceback holds the script's frames, and they its globals
        raise
    except Exception:  # noqa: BLE001 - shown as the interpreter shows a script's, without our frames
        etype, exc, tb = sys.exc_info()
        _KEPT.append(exc)
        ours = (os.path.abspath(__file__), runpy.__file__)
        while tb is not None and (tb.tb_frame.f_code.co_filename in ours
                                  or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
            tb = tb.tb_next
        sys.excepthook(etype, exc.with_traceback(tb), tb)  # it prints the exception's own traceback
        return 1
    return 0


def run_task_and_end(task: dict, path0: str):
    """:func:`run_task`, then end this process as the interpreter ends a script's, less the
    teardown of what was imported ahead (:func:`end_as_a_script`). Never returns; a
    ``KeyboardInterrupt`` (or another ``BaseException`` that is not ``SystemExit``) goes up to the
    interpreter, which ends with it as it ends a script."""
    try:
        code = run_task(task, path0)
    except SystemExit as ended:
        code = _exit_status(ended.code)
    end_as_a_script(code)


def _exit_status(code: Any) -> int:
    """The exit status the interpreter makes of ``SystemExit(code)``: None is 0, an integer is
    itself, anything else is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - as the interpreter, which ignores a failed print there
        pass
    return 1


def end_as_a_script(code: int):
    """End a process whose program has ended with ``code`` as the interpreter's exit would, but
    without tearing down what the process imported ahead of the program.

    [Note: a rank's exit without the teardown]
    The interpreter's exit ends the non-daemon threads, runs the ``atexit`` handlers, drops the
    script's globals, collects, flushes the streams -- and then tears down every module: each of
    torch's objects is dropped one by one and the C++ libraries' static destructors unregister
    torch's thousands of operators. In a rank forked from the warm template that teardown cost
    0.25 s of CPU (each page it writes is first copied: copy-on-write), in a fresh interpreter
    0.7 s (2 cores, torch 2.13): more than the rest of a short job's rank. It frees what the
    program never made, and what the kernel frees anyway at the process's end.

    So here the exit does, in the interpreter's order, what concerns the program: the
    non-daemon threads are joined (``threading._shutdown``), the ``atexit`` handlers run (among
    them ``dptrain.shutdown`` and the wait for gloo's workers, ``dptrain.runtime.exit``), the
    script's globals are dropped as a module's are (names with one leading underscore first, then
    the rest; ``__builtins__`` stays for the destructors), then a collection runs the
    destructors of whatever that freed, every file object still open is flushed (one held by a
    module the script imported, whose teardown is skipped), and the standard streams (a failed
    flush of stdout turns exit status 0 into 120, as the interpreter's). Then ``os._exit``. Not
    done: destructors of objects that only a module still holds (they would run at the
    teardown); C-level ``atexit`` handlers. Daemon threads end with the process, as they do at
    the interpreter's exit. An interpreter without ``threading._shutdown`` or
    ``atexit._run_exitfuncs`` ends the usual way.
    """
    import atexit
    import gc
    import io
    import threading

    join_threads = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_exitfuncs is None:
        sys.exit(code)
    join_threads()
    run_exitfuncs()
    for scope in _script_globals():
        for leading_underscore in (True, False):
            for name in list(scope):
                if name != "__builtins__" and name.startswith("_") == leading_underscore:
                    scope[name] = None
    _KEPT.clear()
    gc.collect()
    for obj in gc.get_objects():  # what was made after the imports ahead (those are frozen)
        # By its type (a proxy's __class__ may raise), and never the standard streams (below).
        with contextlib.suppress(Exception):
            if issubclass(type(obj), io.IOBase) and obj is not sys.stdout and obj is not sys.stderr:
                if not obj.closed:
                    obj.flush()
    # Also the original streams where the script replaced sys.stdout or sys.stderr: they were
    # made before the fork, frozen, so not among the objects above.
    streams = [sys.stdout, sys.stderr]
    streams += [s for s in (sys.__stdout__, sys.__stderr__) if all(s is not t for t in streams)]
    for stream in streams:
        if stream is None:  # no stream at all (the interpreter then flushes nothing either)
            continue
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - as the interpreter: a failed flush of stdout is status 120
            if stream is sys.stdout and code == 0:
                code = 120
    os._exit(code)


def _script_globals() -> list[dict]:
    """The globals of the script :func:`run_task` ran: those of its frames in the traceback of
    the exception that ended it, or the copy ``runpy`` returned and the dict itself, which the
    script's functions hold (``__globals__``)."""
    import types

    # A module's own globals are not the script's, also where its name is "__main__" (this
    # module or the template's, run as the process's main module: their frames are in the
    # traceback too, and their globals still in use).
    modules = {id(vars(m)) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    found: list[dict] = []

    def add(scope: Any) -> None:
        if (isinstance(scope, dict) and scope.get("__name__") == "__main__" and id(scope) not in modules
                and all(scope is not f for f in found)):
            found.append(scope)

    for kept in _KEPT:
        if isinstance(kept, dict):
            add(kept)
            for value in list(kept.values()):
                if isinstance(value, types.FunctionType):
                    add(value.__globals__)
            continue
        tb = getattr(kept, "__traceback__", None)
        while tb is not None:
            add(tb.tb_frame.f_globals)
            tb = tb.tb_next
    return found


#: Seconds :func:`join_to_the_end` waits for a thread's exit after its Python code ended: the
#: exit takes microseconds of CPU, but an idle-class thread gets the CPU only when no one else
#: wants it, and a node training on every core may leave it little.
THREAD_EXIT_WAIT_S = 30.0


def join_to_the_end(thread: Any, wait_s: float = THREAD_EXIT_WAIT_S) -> bool:
    """Join ``thread``, then wait until its operating-system thread has exited; False if it
    is still there after ``wait_s`` seconds (on Linux; elsewhere the join is all).

    [Note: a thread is not gone when its join returns]
    ``Thread.join`` returns as soon as the thread's Python code has finished. The thread then
    still runs its way out: the interpreter frees its state, then the C++ ``thread_local`` and
    pthread-key destructors of the libraries it used and glibc's clean-up run, and any of them
    may take a lock of its library. A fork in that window copies such a lock held by a thread
    that does not exist in the child, and the child hangs the first time it needs the lock: a
    replacement forked from the warm template right after its imports stopped before its first
    step (seen in about one of three forks made in that window under load, never after the
    thread had gone). A thread that has exited is no longer listed in ``/proc/self/task``.
    """
    import time

    thread.join()
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + wait_s
    while os.path.exists(task):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
    return True


def _warm_up_idle() -> None:
    """:func:`_warm_up` at the idle scheduling class, on a thread of its own.

    A spare imports while the job trains, and on a machine whose cores the ranks use (CPU
    training) its second of imports would be taken from them: SCHED_IDLE gives it only the
    time nobody else wants. The class is the thread's own (Linux schedules threads), so the
    script later runs on the main thread at the normal class -- which an unprivileged
    process could not return to.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (AttributeError, OSError):  # not Linux: imports at the normal class
        pass
    _warm_up()


# --------------------------------------------------------------------- the launcher's side --


def spare_path0(program: str, module: bool) -> str:
    """``sys.path[0]`` of ``program`` run as ``python program`` (its real folder) or ``python -m program``."""
    return os.getcwd() if module else os.path.dirname(os.path.realpath(program))


def command(module: str, path0: str, extra: list[str] = (), room_for: list[str] = ()) -> list[str]:
    """The command line that runs dptrain's ``module`` (the spare's, the template's) as ``__main__``
    with ``path0`` as ``sys.path[0]`` from its first import, as the rank's own (``spare_path0``),
    and arguments ``extra``; padded with spaces to take at least as many bytes as the rank's
    command line ``room_for`` (see [Note: a spare's command line]).

    Not ``python -m module``: that puts the working directory first while ``module`` and what it
    imports are found, so a ``dptrain`` folder (or a ``json.py``) there would be imported in
    place of the one the rank would import.
    """
    code = ("import sys; sys.path[0] = sys.argv[1]; import runpy; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    cmd = [sys.executable, "-u", "-c", code, path0, *extra]
    missing = _argv_bytes(room_for) - _argv_bytes(cmd)
    if missing > 0:
        cmd.append(" " * (missing - 1))  # an argument of n bytes takes n + 1 (its NUL)
    return cmd


def _argv_bytes(args: list[str]) -> int:
    return sum(len(os.fsencode(a)) + 1 for a in args)


class Spares:
    """The hot spares of one launcher: ``count`` processes started ahead, each handed to the
    next rank of this node that needs a replacement.

    With a ``template`` (a ``template.Template``, see [Note: the warm template] there) the
    spares are forked from that one warm process, and a replacement needed when none waits is
    forked on demand; without it (or where it is gone) each spare is an interpreter of its own.

    ``environ`` is the base environment of the ranks (``job.base_environ``); ``started(pid)``
    and ``ended(pid)`` tell the janitor (a spare dies with the launcher, as a rank does);
    ``log`` prints a launcher line.
    """

    def __init__(self, count: int, program: str, module: bool, environ: dict[str, str],
                 started: Callable[[int], None], ended: Callable[[int], None], log: Callable[[str], None],
                 template: Any = None, rank_command: list[str] = ()) -> None:
        from dptrain.launcher.janitor import parent_death_signal

        self.count = count
        self.program = program
        self.module = module
        self.rank_command = list(rank_command)  # a spare's command line makes room for it (see set_command_line)
        self.environ = environ
        self._started, self._ended, self.log = started, ended, log
        self._preexec = parent_death_signal
        self.waiting: list = []  # subprocess.Popen or template.ForkedProcess, oldest first: the one most likely warm
        self.template = template
        if template is not None:
            started(template.proc.pid)

    def fill(self) -> None:
        """Start spares until ``count`` are waiting (those that died are said once and dropped)."""
        self._collect()
        for proc in [p for p in self.waiting if p.poll() is not None]:
            self.waiting.remove(proc)
            self._discard(proc, gone=True)
        if self.template is not None and self.template.alive:
            for _ in range(self.count - len(self.waiting) - len(self.template.pending)):
                self.template.request()  # forked once the template is warm; see _collect
            if self.template.alive:
                return
        while len(self.waiting) < self.count:
            try:
                proc = subprocess.Popen(
                    command("dptrain.launcher.spare", spare_path0(self.program, self.module),
                            room_for=self.rank_command),
                    env=self.environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group, as a rank's (see workers.RankProcess)
                    preexec_fn=self._preexec(os.getpid()),
                )
            except OSError as exc:  # no process to spare: a replacement starts afresh instead
                self.log(f"dptrain run: could not start a hot spare ({exc}); a failed rank's replacement starts afresh")
                return
            self._started(proc.pid)
            self.waiting.append(proc)

    def _collect(self) -> None:
        """Spares the template forked since last asked join ``waiting``."""
        if self.template is None:
            return
        self.template.pump()
        for proc in self.template.ready:
            self._started(proc.pid)
            self.waiting.append(proc)
        self.template.ready.clear()

    def take(self, stop: Callable[[], bool] = lambda: False):
        """A waiting spare, no longer in ``waiting``; else one forked now from the warm template
        (its ``on_demand`` is True; waited for until ``stop()``, see ``Template.take``); None
        when neither is left."""
        self._collect()
        while self.waiting:
            proc = self.waiting.pop(0)
            if proc.poll() is None:
                return proc
            self._discard(proc, gone=True)
        if self.template is not None:
            asked_ahead = bool(self.template.pending)  # a spare asked for by fill, not forked yet
            proc = self.template.take(stop=stop)
            if proc is not None:
                proc.on_demand = not asked_ahead  # forked for this replacement: no spare was there
                self._started(proc.pid)
                return proc
        return None

    def assign(self, proc: subprocess.Popen, environ: dict[str, str], argv: list[str]) -> bool:
        """Make ``proc`` (from ``take``) the rank that ``environ`` describes; False if it is gone."""
        task = {"env": environ, "argv": argv, "program": self.program, "module": self.module}
        try:
            proc.stdin.write(json.dumps(task).encode() + b"\n")
            proc.stdin.close()  # the spare reads one line; from now on its stdin is /dev/null
            return True
        except (OSError, ValueError):
            self._discard(proc, gone=True)
            return False

    def _discard(self, proc: subprocess.Popen, gone: bool = False) -> None:
        """Stop ``proc`` (with its process group), reap it and close its pipes; say why a spare that died did."""
        if gone and proc.poll() is not None:
            last = _last_line(proc)
            self.log(f"dptrain run: a hot spare (pid {proc.pid}) exited with code {proc.returncode} before it was "
                     f"needed{f': {last}' if last else ''}")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            try:
                pipe.close()
            except (OSError, ValueError, AttributeError):
                pass
        self._ended(proc.pid)

    def close(self) -> None:
        """Stop every waiting spare (they hold no work, so SIGKILL at once), then the template."""
        self._collect()
        while self.waiting:
            self._discard(self.waiting.pop())
        if self.template is not None:
            self.template.close()
            self._ended(self.template.proc.pid)


def _last_line(proc: subprocess.Popen) -> str:
    """The last line a dead spare wrote on stderr (what there is to read now; nobody relays it)."""
    from dptrain.launcher.store_values import clean

    try:
        os.set_blocking(proc.stderr.fileno(), False)
        data = proc.stderr.read(1 << 16) or b""
    except (OSError, ValueError, TypeError):
        return ""
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return clean(lines[-1], 300) if lines else ""


if __name__ == "__main__":
    sys.exit(main())
