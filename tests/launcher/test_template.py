"""The warm template (dptrain.launcher.template): what a child forked from it is, told and reports.

One template serves every test here (it imports torch once, seconds of CPU); each test forks
children from it, hands them a task as the launcher does (``Spares.assign``) and reads what
the program printed. Linux only: the template forks and passes descriptors over a socket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dptrain.launcher import template as template_module
from dptrain.launcher.template import Template

pytestmark = pytest.mark.skipif(not template_module.supported(), reason="the warm template needs Linux")

#: Prints what a fresh ``python -u prog.py ARGS`` would have, then ends as its argument says.
PROGRAM = r'''
import gc, json, os, random, signal, sys
THREADS = len(os.listdir("/proc/self/task"))  # before the script starts any
if "SCRIPT_OMP" in os.environ:  # a script that picks its own thread count before importing torch
    os.environ["OMP_NUM_THREADS"] = os.environ["SCRIPT_OMP"]
import numpy
import torch
import dptrain
dptrain.init()  # no launcher variables: one process, no process group
state = {
    "argv": sys.argv, "name": __name__, "file": os.path.basename(__file__), "x": os.environ.get("X"),
    "path0": sys.path[0], "torch": "torch" in sys.modules, "sid": os.getsid(0) == os.getpid(),
    "pgid": os.getpgid(0) == os.getpid(), "sigchld": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler, "stdin": os.read(0, 10).decode(),
    "numpy": int(numpy.random.randint(1 << 30)), "random": random.getrandbits(30),
    "threads": THREADS, "frozen": gc.get_freeze_count() > 0, "collecting": gc.isenabled(),
    "torch_threads": torch.get_num_threads(),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0"),
    "__file__": __file__,
}
print(json.dumps(state), flush=True)
print("to stderr", file=sys.stderr, flush=True)


class Held:
    pass


import atexit, weakref
HELD = Held()  # held by the script's globals only
# Made with globals of its own: a function of the script would hold the script's globals itself.
report = eval('lambda ref: print(f"AT EXIT globals held {ref() is not None}", flush=True)', {})
atexit.register(report, weakref.ref(HELD))
how = sys.argv[1]
if how == "raise":
    raise ValueError("the script's own error")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "orphan":  # a process of its own (a DataLoader worker, say) that outlives it
    import subprocess
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    print(json.dumps({"worker": worker.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if how != "end":
    sys.exit(int(how))
'''


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prog")
    program = folder / "prog.py"
    program.write_text(PROGRAM)
    lines = []
    # Room for the longest command line a child shows here (see spare.set_command_line).
    tpl = Template(str(program), False, dict(os.environ, OMP_NUM_THREADS="1"), lines.append,
                   rank_command=[sys.executable, "-u", str(program), "x" * 40])
    tpl.program, tpl.folder, tpl.lines = str(program), str(folder), lines
    yield tpl
    tpl.close()
    assert tpl.proc.returncode is not None


def _run(tpl, *args, env=None, lines_out=None, program=None):
    """Fork a child, give it the task (run ``program``, default the template's), and return (exit
    code, its state, its stderr); ``lines_out`` gets every line it printed."""
    child = tpl.take(wait_s=120)
    if child is None and any("CUDA driver" in line for line in tpl.lines):
        pytest.skip(f"this torch loads the CUDA driver as it is imported: no forks ({tpl.lines})")
    assert child is not None, tpl.lines
    program = program or tpl.program
    task = {"env": dict(os.environ, X="rank", **(env or {})), "argv": [program, *args],
            "program": program, "module": False}
    child.stdin.write(json.dumps(task).encode() + b"\n")
    child.stdin.close()
    out, err = child.stdout.read(), child.stderr.read()
    code = child.wait(timeout=60)
    child.stdout.close()
    child.stderr.close()
    lines = out.decode().splitlines()
    if lines_out is not None:
        lines_out.extend(lines)
    return code, (json.loads(lines[0]) if lines and lines[0].startswith("{") else None), err.decode()


def test_a_forked_child_runs_the_program_as_a_fresh_interpreter_would(template):
    code, state, err = _run(template, "3")
    assert code == 3  # the exit code comes back through the template
    assert state["argv"] == [template.program, "3"] and state["name"] == "__main__" and state["file"] == "prog.py"
    assert state["__file__"] == os.path.abspath(template.program)  # as the interpreter makes a script's
    # Its command line is the rank's, as `ps` and `pgrep -f prog.py` show it (NULs may pad its end).
    cmdline = state["cmdline"]
    while cmdline and cmdline[-1] == "":
        cmdline.pop()
    assert cmdline == [sys.executable, "-u", template.program, "3"], state["cmdline"]
    assert state["x"] == "rank" and state["path0"] == template.folder
    assert state["torch"]  # imported ahead: what the fork saves
    assert state["sid"] and state["pgid"]  # a session and process group of its own, as a rank's
    assert state["sigchld"] and state["sigint"]  # the template's SIGCHLD handler is not inherited
    assert state["stdin"] == ""  # /dev/null once the task is read, as a rank's
    assert state["threads"] == 1  # forked from the only thread: no import was half done in another
    assert state["frozen"]  # the template's objects stay out of the collector: no page copied for them
    assert state["collecting"]  # the collector, off while the template imported, is on for the script
    assert err == "to stderr\n"


def test_a_scripts_own_thread_count_holds_as_in_a_fresh_process(template):
    # The template imported torch with OMP_NUM_THREADS=1; a script that sets 2 before its own
    # import gets 2 threads in a fresh process, and so in a forked one (dptrain.init sets it).
    env = dict(os.environ, OMP_NUM_THREADS="1", SCRIPT_OMP="2", X="rank")
    fresh = subprocess.run([sys.executable, template.program, "0"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=template.folder)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout.splitlines()[0])["torch_threads"] == 2
    _, state, _ = _run(template, "0", env={"OMP_NUM_THREADS": "1", "SCRIPT_OMP": "2"})
    assert state["torch_threads"] == 2
    _, state, _ = _run(template, "0", env={"OMP_NUM_THREADS": "1"})
    assert state["torch_threads"] == 1


def test_each_child_draws_its_own_random_numbers(template):
    (_, a, _), (_, b, _) = _run(template, "0"), _run(template, "0")
    assert a["numpy"] != b["numpy"] and a["random"] != b["random"]


def test_a_childs_exception_and_signal_are_reported_as_a_scripts(template):
    code, _, err = _run(template, "raise")
    assert code == 1
    assert err.startswith("to stderr\nTraceback (most recent call last):\n"), err
    assert 'prog.py", line' in err and "ValueError: the script's own error" in err
    assert "runpy" not in err and "template.py" not in err and "spare.py" not in err  # none of our frames
    code, _, _ = _run(template, "kill")
    assert code == -signal.SIGKILL


@pytest.mark.parametrize("how", ["end", "0", "raise"])
def test_a_scripts_globals_are_dropped_after_the_atexit_handlers_as_in_a_fresh_interpreter(template, how):
    # In that order the exit waits for the gloo workers (dptrain.runtime.exit) before the objects
    # that hold the process group go; dropped first, a rank could hang after its script ended.
    fresh = subprocess.run([sys.executable, template.program, how], env=dict(os.environ, X="rank"),
                           capture_output=True, text=True, timeout=120, cwd=template.folder)
    lines = []
    _run(template, how, lines_out=lines)
    for seen in (fresh.stdout.splitlines()[1:], lines[1:]):
        assert seen == ["AT EXIT globals held True"], (seen, fresh.stdout, lines)


#: A script whose end leaves work to the interpreter's exit: a thread still running, an
#: ``atexit`` handler, a global with a destructor, and a file that a module it imported opened
#: and wrote to without a flush or a close.
ENDING = r'''
import atexit, sys, threading, time
import torch
import ending_helper

ending_helper.LOG.write("written through a module's file, never flushed\n")


class Noisy:
    def __del__(self):
        print("a global's destructor ran", flush=True)


KEEP = Noisy()
threading.Thread(target=lambda: (time.sleep(0.3), print("the thread ended", flush=True))).start()
atexit.register(lambda: print("the atexit handler ran", flush=True))
how = sys.argv[1]
if how == "message":
    sys.exit("the script says why it stops")
if how == "raise":
    raise ValueError("the script's own error")
if how != "end":
    sys.exit(None if how == "none" else int(how))
'''
ENDING_HELPER = '''
import os
LOG = open(os.environ["ENDING_LOG"], "w")
'''


@pytest.mark.parametrize("how", ["end", "none", "4", "message", "raise"])
def test_a_childs_end_does_what_a_fresh_interpreters_exit_does(template, how, tmp_path):
    # A forked rank ends without the teardown of what the template imported (spare.end_as_a_script):
    # what the script left to the exit still happens, in the interpreter's order, with its exit code.
    program = os.path.join(template.folder, "ending.py")
    with open(program, "w") as fh:
        fh.write(ENDING)
    with open(os.path.join(template.folder, "ending_helper.py"), "w") as fh:
        fh.write(ENDING_HELPER)
    fresh_log, forked_log = tmp_path / "fresh.log", tmp_path / "forked.log"
    fresh = subprocess.run([sys.executable, "-u", program, how], capture_output=True, text=True, timeout=120,
                           cwd=template.folder, env=dict(os.environ, ENDING_LOG=str(fresh_log)))
    lines = []
    code, _, err = _run(template, how, lines_out=lines, program=program, env={"ENDING_LOG": str(forked_log)})
    expected = ["the thread ended", "the atexit handler ran", "a global's destructor ran"]
    assert fresh.stdout.splitlines() == expected, fresh.stdout  # what a fresh interpreter does, here
    assert lines == expected, (lines, err)
    assert code == fresh.returncode == {"end": 0, "none": 0, "4": 4, "message": 1, "raise": 1}[how]
    assert err.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], (err, fresh.stderr)
    assert forked_log.read_text() == fresh_log.read_text() == "written through a module's file, never flushed\n"


def _parent_and_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None  # gone: reaped
    return int(fields[1]), fields[0]


def test_what_a_dead_child_leaves_behind_is_reaped_by_the_template(template):
    # A child killed with a process of its own still running (a DataLoader worker, say): the orphan
    # is re-parented to the template, which reaps it when it ends; it does not stay a zombie of the
    # launcher's until the job ends, nor go to init.
    printed = []
    code, _, _ = _run(template, "orphan", lines_out=printed)
    assert code == -signal.SIGKILL
    worker = json.loads(printed[1])["worker"]
    assert _parent_and_state(worker)[0] == template.proc.pid  # still running (or just ended)
    deadline = time.monotonic() + 30
    while _parent_and_state(worker) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _parent_and_state(worker) is None  # ended and reaped, not a zombie
    code, _, _ = _run(template, "5")  # the template still reports its own children
    assert code == 5


def test_a_spare_no_longer_needed_ends_with_code_0(template):
    child = template.take(wait_s=120)
    child.stdin.close()  # the launcher's end of input without a task
    assert child.wait(timeout=30) == 0
    assert child.stdout.read() == b"" and child.stderr.read() == b""
    for pipe in (child.stdout, child.stderr):
        pipe.close()


def test_the_template_ends_with_its_launchers_end_of_input(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("")
    tpl = Template(str(program), False, dict(os.environ), print)
    tpl.sock.close()
    assert tpl.proc.wait(timeout=60) == 0
    tpl.proc.stderr.close()


def test_a_template_that_cannot_fork_says_why_and_replacements_start_afresh(tmp_path):
    # Its interpreter ends before serving (here a sitecustomize that exits; on a machine whose
    # torch loads the CUDA driver at import, the template's own check): the launcher's one
    # line has its code and last words, and a fork asked for is refused at once.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.write(2, b'cannot fork here\\n')\nos._exit(3)\n")
    program = tmp_path / "prog.py"
    program.write_text("")
    lines = []
    tpl = Template(str(program), False, dict(os.environ, PYTHONPATH=str(site)), lines.append)
    tpl.proc.wait(timeout=60)
    assert tpl.take(wait_s=30) is None
    assert lines == [f"dptrain run: the warm template (pid {tpl.proc.pid}) exited with code 3: cannot fork here; "
                     f"ranks and replacements start as new processes from now on"], lines
    tpl.close()


def test_a_thread_joined_to_the_end_has_exited():
    # Thread.join returns once the thread's Python code is done; the OS thread then still runs
    # its way out (C++ thread_local destructors, pthread key destructors), and a fork in that
    # window copies what it holds locked: replacements forked right after the template's imports
    # hung. Here the way out is made long: a pthread key destructor that is libc's usleep.
    import ctypes
    import threading

    from dptrain.launcher.spare import join_to_the_end

    libc = ctypes.CDLL(None, use_errno=True)
    key = ctypes.c_uint()
    assert libc.pthread_key_create(ctypes.byref(key), ctypes.cast(libc.usleep, ctypes.c_void_p)) == 0

    def lingering() -> threading.Thread:
        thread = threading.Thread(target=lambda: libc.pthread_setspecific(key, ctypes.c_void_p(300_000)))
        thread.start()
        return thread

    try:
        thread = lingering()
        thread.join()
        assert os.path.exists(f"/proc/self/task/{thread.native_id}")  # joined, and still there
        thread = lingering()
        assert join_to_the_end(thread)
        assert not os.path.exists(f"/proc/self/task/{thread.native_id}")
        thread = lingering()
        assert not join_to_the_end(thread, wait_s=0.01)  # not gone in time: said
        assert join_to_the_end(thread)
    finally:
        libc.pthread_key_delete(key)


def test_the_cuda_driver_loaded_is_seen_in_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f20-7f30 r-xp 00000000 08:01 456 /opt/torch/lib/libtorch_cuda.so\n")
    assert template_module.cuda_driver_loaded(str(maps)) == ""
    with open(maps, "a") as fh:
        fh.write("7f40-7f50 r-xp 00000000 08:01 789 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert template_module.cuda_driver_loaded(str(maps)) == "libcuda.so.550.54.15"
    assert template_module.cuda_driver_loaded(str(tmp_path / "missing")) == ""


def test_the_launcher_and_a_fork_request_wait_for_nothing_but_the_template(tmp_path):
    # A template gone before it answered: the request is refused at once, the launcher says so once.
    program = tmp_path / "prog.py"
    program.write_text("")
    lines = []
    tpl = Template(str(program), False, dict(os.environ), lines.append)
    os.kill(tpl.proc.pid, signal.SIGKILL)
    tpl.proc.wait()
    assert tpl.take(wait_s=30) is None
    assert tpl.take(wait_s=30) is None
    assert len(lines) == 1 and "exited with code -9" in lines[0], lines
    tpl.close()


def test_children_of_a_template_that_died_end_with_it_and_are_seen_to(tmp_path):
    # A spare forked and waiting when its template is killed: the parent-death signal ends it,
    # and the launcher, told by nobody, sees it gone (SIGTERM) without spinning.
    program = tmp_path / "prog.py"
    program.write_text("")
    lines = []
    tpl = Template(str(program), False, dict(os.environ), lines.append)
    child = tpl.take(wait_s=120)
    if child is None and any("CUDA driver" in line for line in lines):
        pytest.skip(f"this torch loads the CUDA driver as it is imported: no forks ({lines})")
    os.kill(tpl.proc.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert not tpl.alive and len(lines) == 1 and "exited with code -9" in lines[0], lines
    for pipe in (child.stdin, child.stdout, child.stderr):
        pipe.close()
    tpl.close()


def test_children_of_an_adopting_launcher_outlive_the_template_and_report_their_code(tmp_path):
    # The launcher adopts the template's orphans (a child subreaper): a rank forked from it keeps
    # running when the template dies, and its own exit code still reaches the launcher. Run in
    # a process of its own, which becomes the subreaper (pytest's process stays as it is).
    program = tmp_path / "prog.py"
    program.write_text("import sys, time\nsys.stdin.read()\nprint('still here', flush=True)\nsys.exit(7)\n")
    launcher = f"""
import json, os, signal, sys, time
from dptrain.launcher.spare import Spares
from dptrain.launcher.template import Template
lines = []
tpl = Template({str(program)!r}, False, dict(os.environ), lines.append, adopt=True)
child = tpl.take(wait_s=120)
if child is None:
    print(json.dumps({{"skip": lines}}))
    sys.exit(0)
spares = Spares(0, {str(program)!r}, False, dict(os.environ), lambda pid: None, lambda pid: None, lines.append)
os.kill(tpl.proc.pid, signal.SIGKILL)
tpl.proc.wait()
while tpl.alive:
    time.sleep(0.05)
time.sleep(0.3)
running = child.poll() is None
ppid = int(open(f"/proc/{{child.pid}}/stat").read().rsplit(")", 1)[1].split()[1])
spares.assign(child, dict(os.environ), [{str(program)!r}])
code = child.wait(timeout=60)
print(json.dumps({{"adopts": tpl.adopts, "running": running, "ppid": ppid, "me": os.getpid(), "code": code,
                  "out": child.stdout.read().decode(), "lines": lines}}))
"""
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout.splitlines()[-1])
    if "skip" in state:
        pytest.skip(f"no fork here: {state['skip']}")
    assert state["adopts"] and state["running"] and state["ppid"] == state["me"], state
    assert state["code"] == 7 and state["out"] == "still here\n", state
    assert len(state["lines"]) == 1 and "exited with code -9" in state["lines"][0], state


@pytest.mark.skipif(not hasattr(sys, "stdlib_module_names"), reason="needs Python >= 3.10")
@pytest.mark.parametrize("source, alone", [
    ("import os, sys\nprint(os.environ['RANK'])\n", True),
    ("import json\nfrom collections import abc\ndef f():\n    import socket.x\n", True),
    ("import torch\n", False),
    ("import os\ndef main():\n    import dptrain\n", False),  # at any depth
    ("from numpy import random\n", False),
    ("from . import helpers\n", False),  # its own package
    ("import importlib\nimportlib.import_module('torch')\n", False),  # named at run time only
    ("__import__('torch')\n", False),
    ("import runpy\nrunpy.run_path('train.py')\n", False),
    ("exec(open('train.py').read())\n", False),
    ("def broken(:\n", False),  # the interpreter says so under the rank's name
])
def test_a_script_of_the_standard_library_alone_is_seen_as_such(tmp_path, source, alone):
    script = tmp_path / "job.py"
    script.write_text(source)
    assert template_module.standard_library_only(str(script), False) is alone
    assert template_module.standard_library_only("pkg.train", True) is False  # -m: its source is not read
    assert template_module.standard_library_only(str(tmp_path / "missing.py"), False) is False


#: A child whose parent dies before it asks for the parent-death signal (the template killed
#: right after a fork): asking then sends nothing, so it must end itself. Its grandparent (this
#: script, made their subreaper) reads how it ended.
ORPHANED_AT_BIRTH = r'''
import os, signal, sys, time
from dptrain.launcher.janitor import adopt_orphans, parent_death_signal

assert adopt_orphans()
parent = os.fork()
if parent == 0:
    me = os.getpid()  # what the template knows of itself before it forks
    child = os.fork()
    if child == 0:
        while os.getppid() == me:  # the parent dies first
            time.sleep(0.005)
        parent_death_signal(me, signal.SIGTERM)()
        os._exit(0)  # not reached: the parent is gone, no signal will come
    os._exit(0)
os.waitpid(parent, 0)
pid, status = os.wait()  # the orphan, re-parented to this process
print(os.waitstatus_to_exitcode(status))
'''


def test_a_child_whose_template_died_before_it_asked_for_the_signal_ends_itself():
    out = subprocess.run([sys.executable, "-c", ORPHANED_AT_BIRTH], capture_output=True, text=True, timeout=60,
                         cwd=template_module.__file__.rsplit("/dptrain/", 1)[0])
    if "AssertionError" in out.stderr:
        pytest.skip("this kernel gives no child subreaper")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(-signal.SIGTERM), out.stdout
