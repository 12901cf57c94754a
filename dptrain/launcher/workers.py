"""One rank as a process of its launcher: the environment torchrun gives a worker, its log
and error files, its output relayed, and how it is stopped.

Both launchers (``dptrain run`` and ``dptrain.spawn``) give a rank torchrun's variables
(``rank_environ``) and stop their ranks the same way (``stop_processes``). ``dptrain run``
adds this node's settings (``job.base_environ``: OpenMP threads, ``DPTRAIN_*`` flags, gloo's
interface) and how the rank's output is watched (``process_environ``), starts it in a process
group of its own that dies with the launcher (``RankProcess``), and reads back the traceback
its ``@record`` handler wrote (``read_error_file``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import deque
from typing import Any, Callable, Sequence

from dptrain.runtime import proc as _proc, settings as _settings, torch_version as _torch_version
from dptrain.environments import usable_cores
from dptrain.launcher.janitor import parent_death_signal
from dptrain.launcher.relay import Console, Relay, open_log

__all__ = ["RankProcess", "finish_output", "stop_processes", "rank_environ", "process_environ",
           "omp_threads", "error_file", "read_error_file", "rank_log_files", "GRACE_S"]

def rank_environ(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    num_nodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int = 0,
    max_restarts: int = 0,
    error_dir: str | None = None,
) -> dict[str, str]:
    """The variables ``torchrun`` sets for a worker, with the same names and meanings."""
    out = {
        "RANK": str(rank),
        "GROUP_RANK": str(node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(num_nodes),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if not _torch_version.older_than((2, 9)):  # torchrun sets it from torch 2.9 on
        out["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    if error_dir is not None:
        # Where torch's @record decorator writes a rank's exception as JSON; we read it back
        # for the failure report, as torchrun does.
        out["TORCHELASTIC_ERROR_FILE"] = error_file(error_dir, restart_count, rank)
    return out


def omp_threads(nproc: int) -> tuple[str | None, str | None]:
    """torchrun's default: one OpenMP thread per core and rank, with the notice to print (or None)."""
    if "OMP_NUM_THREADS" in os.environ or nproc <= 1:
        return None, None
    cores = usable_cores()
    threads = max(1, cores // nproc)
    notice = (
        f"dptrain run: OMP_NUM_THREADS={threads} for each of {nproc} ranks ({cores} cores / {nproc} ranks); "
        f"set OMP_NUM_THREADS yourself to change it"
    )
    return str(threads), notice


def process_environ(base: dict[str, str], console: Console, show: bool, **torchrun: Any) -> dict[str, str]:
    """One rank's whole environment: ``base`` (see ``job.base_environ``), torchrun's variables
    (``rank_environ(**torchrun)``), and whether a terminal shows its output (``show``)."""
    rank = torchrun["rank"]
    environ = dict(base)
    environ.update(rank_environ(**torchrun))
    # Whether a terminal watches this rank's output: a live progress bar, or progress
    # lines now and then ("off": its output is not shown at all).
    watching = "tty" if console.tty[1] else "lines"
    environ["DPTRAIN_PROGRESS"] = watching if show else "off"
    if watching == "tty" and show and "COLUMNS" not in environ:
        # Output sized for the terminal minus the "[rankN] " prefix, for what asks
        # shutil.get_terminal_size (it reads COLUMNS and LINES when stdout is a pipe).
        columns, rows = console.size(1)
        environ["COLUMNS"] = str(max(columns - len(f"[rank{rank}] "), 20))
        environ.setdefault("LINES", str(rows))
    os.makedirs(os.path.dirname(environ["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
    return environ


def error_file(error_dir: str, attempt: int, rank: int) -> str:
    """Where ``rank`` of ``attempt`` writes its exception (``TORCHELASTIC_ERROR_FILE``)."""
    return os.path.join(error_dir, f"attempt_{attempt}", str(rank), "error.json")


def read_error_file(path: str) -> str:
    """The traceback a rank's ``@record`` handler wrote (torchrun's error-file format)."""
    try:
        # The path may come from the rank's own TORCHELASTIC_ERROR_FILE: never waited on (a FIFO
        # there would hold the failure report for good), read only when a regular file.
        with os.fdopen(_settings.open_regular(path)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):  # NotRegularFile is an OSError: no traceback to show
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        return str(message.get("extraInfo", {}).get("py_callstack") or message.get("message", ""))
    return str(message)


def rank_log_files(base: str | None, run_id: str, attempt: int, local_rank: int, redirects, tee) -> list:
    """torchrun's ``--log-dir``/``--redirects``/``--tee``: per stream (stdout, stderr) of one
    rank, its log file (or None) and whether the console still shows it.

    ``redirects`` and ``tee`` are 0-3 (1 stdout, 2 stderr, 3 both) for every local rank, or a
    dict local rank -> 0-3. Files: ``<base>/<run_id>/attempt_<k>/<local_rank>/stdout.log``.
    """
    out = []
    for bit, name in ((1, "stdout"), (2, "stderr")):
        redirected = bool(_for_rank(redirects, local_rank) & bit)
        teed = bool(_for_rank(tee, local_rank) & bit)
        path = None
        if base and (redirected or teed):
            folder = os.path.join(base, run_id, f"attempt_{attempt}", str(local_rank))
            path = os.path.join(folder, f"{name}.log")
            try:  # here, before the rank starts: a rank must never run without its relay
                os.makedirs(folder, exist_ok=True)
                os.close(open_log(path))
            except _settings.NotRegularFile as exc:
                raise ValueError(f"--log-dir: {path} is {exc.kind}, not a regular file; dptrain appends a rank's "
                                 f"output only to a file of its own there: remove it, or give another --log-dir") from None
            except OSError as exc:
                raise ValueError(f"--log-dir: cannot write {path} ({exc.strerror}); give a writable folder") from None
        out.append((path, not redirected))
    return out


def _for_rank(spec, local_rank: int) -> int:
    return spec.get(local_rank, 0) if isinstance(spec, dict) else int(spec or 0)


class RankProcess:
    """One rank as a child process, its output relayed live under a ``[rankN]`` prefix.

    ``proc``: a process already started (a hot spare given this rank, see ``spare``) instead
    of starting ``cmd``; ``cmd``, ``environ``, ``show`` and ``logs`` are kept, so that a
    replacement can be started the same way (see ``inplace``).
    """

    def __init__(self, rank: int, local_rank: int, cmd: list[str], environ: dict[str, str], show: bool,
                 console: Console, logs: Sequence = ((None, True), (None, True)),
                 proc: subprocess.Popen | None = None) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.cmd, self.environ, self.show, self.logs = cmd, environ, show, logs
        self.tail: deque[str] = deque(maxlen=30)  # last stderr lines, for the failure report
        self.proc = proc if proc is not None else subprocess.Popen(
            cmd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: we can stop its DataLoader workers too
            preexec_fn=parent_death_signal(os.getpid()),
        )
        (out_log, out_shown), (err_log, err_shown) = logs  # see rank_log_files
        self._relays = [Relay(self.proc.stdout, rank, 0, console, show and out_shown, log_path=out_log),
                        Relay(self.proc.stderr, rank, 1, console, show and err_shown, self.tail, log_path=err_log)]

    def poll(self) -> int | None:
        return self.proc.poll()

    def dying(self) -> int | None:
        """The exit status of a rank that the kernel is still ending (see [Note: a process that is
        dying] in :mod:`dptrain.runtime.proc`), as :meth:`poll` will give it; None while it runs."""
        return _proc.dying(self.proc.pid)

    def renumber(self, rank: int) -> None:
        """The job went on without a node and this rank's number changed (see ``resize``)."""
        self.rank = rank
        for relay in self._relays:
            relay.renumber(rank)

    # -- what stop_processes asks of a process --
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        """Signal the rank's whole process group (its DataLoader workers too)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join(self, timeout: float | None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def finish_output(self, deadline: float) -> None:
        """Wait until everything the rank wrote is shown (its pipes reach their end), or ``deadline``."""
        for relay in self._relays:
            relay.join(max(0.0, deadline - time.monotonic()))


def finish_output(ranks: Sequence[RankProcess], timeout_s: float = 5.0) -> None:
    """Wait until everything the ranks wrote is shown, at most ``timeout_s``."""
    # A pipe ends once every process holding it has exited; only a child that left the
    # rank's process group (and so was not stopped with it) can hold it longer.
    deadline = time.monotonic() + timeout_s
    for r in ranks:
        r.finish_output(deadline)


#: Seconds between TERM and KILL when stopping ranks.
GRACE_S = 3.0


def stop_processes(procs, grace_s: float = GRACE_S, hurry=lambda: False) -> None:
    """TERM every live process, KILL what is left after ``grace_s`` (or as soon as ``hurry()``), reap all.

    Both launchers stop their ranks this way. Each process offers ``alive()``, ``send(sig)``
    and ``join(timeout)``; KILL is sent to every one, exited or not, since a rank's
    children (DataLoader workers) may outlive it in its process group.
    """
    for p in procs:
        if p.alive():
            p.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.alive() for p in procs) and not hurry():
        time.sleep(0.02)
    for p in procs:
        p.send(signal.SIGKILL)
        p.join(None)
