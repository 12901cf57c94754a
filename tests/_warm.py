"""Run Python scripts in processes forked from a warm parent: torch and dptrain imported once.

A test that runs a script "as written" checks the script, not the interpreter's start: that
start (torch's import, dptrain's, DDP's ``torch._dynamo``) costs 2-4 s of CPU each time,
more than most scripts themselves. :class:`WarmRunner` starts one parent that imports what
``preload`` names, then forks a child per script. The child behaves like ``python script``
run in ``cwd``: ``__main__`` is the script (``multiprocessing`` children find it by its
``__file__``), ``sys.argv`` and ``sys.path[0]`` are the script's, its stdout and stderr go
to the files given, and at its end it does what the interpreter's exit does for what the
script made (non-daemon threads joined, ``atexit`` handlers run, the script's globals dropped,
files and streams flushed), as a rank forked from dptrain's warm template ends
(``dptrain.launcher.spare.end_as_a_script``), so the exit code is what ``python script``
would give. The environment is the parent's: give the runner the one the scripts
need (it is read by torch's import, which the parent has done).

Not for what a fresh interpreter is the subject of (import time, what ``import dptrain``
loads, interpreter start-up): run those with ``subprocess`` as before.

    with WarmRunner(env=env, preload=["torch", "dptrain"]) as warm:
        rc = warm.run("/tmp/x/block.py", cwd="/tmp/x", out="/tmp/x/out.txt", timeout=120)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WarmRunner:
    """A warm parent that forks one child per :meth:`run` (one run at a time; thread-safe)."""

    def __init__(self, env: dict[str, str], preload: list[str]) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, "-u", __file__, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm parent did not start: {ready!r}")

    def run(self, script: str, cwd: str, out: str, timeout: float) -> int:
        """Run ``script`` as ``python script`` in ``cwd``, its stdout and stderr into ``out``; the
        exit code (-1 when it was still running after ``timeout`` seconds and was killed)."""
        with self._lock:
            self._proc.stdin.write(json.dumps({"script": script, "cwd": cwd, "out": out, "timeout": timeout}) + "\n")
            self._proc.stdin.flush()
            answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError("the warm parent ended")
        return int(json.loads(answer)["rc"])

    def close(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> "WarmRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------ the parent and its children
def stop_template_servers(private: str) -> None:
    """SIGTERM every template server of ``private`` (the folder its ``.pid`` files are in, that
    ``dptrain.launcher.served.servers_folder`` gives); one that is gone already is skipped."""
    for name in (os.listdir(private) if os.path.isdir(private) else []):
        if name.endswith(".pid"):
            try:
                with open(os.path.join(private, name)) as fh:
                    os.kill(int(fh.read()), signal.SIGTERM)
            except (OSError, ValueError):
                pass


def _child(request: dict) -> None:
    """In the forked child: become ``python script`` and exit as it would."""
    from dptrain.launcher.spare import _KEPT, _exit_status, end_as_a_script

    code = 0
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills what it started too
        fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        _KEPT.append(runpy.run_path(script, run_name="__main__"))
    except SystemExit as exc:
        _KEPT.append(exc)
        code = _exit_status(exc.code)
    except BaseException as exc:  # noqa: BLE001 - printed as the interpreter prints an uncaught one
        import traceback

        _KEPT.append(exc)
        traceback.print_exc()
        code = 1
    # What the interpreter's exit does for what the script made, without the teardown of the
    # parent's imports: as a rank forked from dptrain's warm template ends.
    end_as_a_script(code)


def _serve(preload: list[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        deadline = time.monotonic() + float(request["timeout"])
        rc = None
        while rc is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                os.waitpid(pid, 0)
                rc = -1
                break
            time.sleep(0.01)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
