"""The DPTRAIN_* variables (dptrain.runtime.settings) and what dptrain run refuses before a rank starts
(dptrain.launcher.preflight): issue 31, point 8.

A bad value is one line that names the variable -- from ``dptrain run`` with exit code 2
before any rank starts, from a rank started another way through the exception hook -- and no
value makes an import fail. A number of ranks this machine cannot start is refused with the
limit that stops it.
"""

import ast
import os
import re
import subprocess
import sys
import types

import pytest

from dptrain.runtime import settings as _settings
from dptrain.cli import main
from dptrain.launcher import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "dptrain")
# What a bad value of each variable looks like: one word that no kind of setting takes.
BAD = "abc"
# Variables dptrain run sets for every rank whatever the environment says (see preflight.SET_BY_FLAGS).
ALWAYS_SET = [name for name, flag in preflight.SET_BY_FLAGS.items() if flag is None]


@pytest.fixture(autouse=True)
def _own_excepthook(monkeypatch):
    """A SettingError installs an exception hook (see dptrain.runtime.settings); keep it to each test."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(_settings, "_previous_hook", None)


def _one_line(text: str, name: str) -> None:
    assert "\n" not in text.strip() and "Traceback" not in text, text
    if _settings.SETTINGS[name].kind == "secret":  # a secret is never shown, not even a bad one
        assert f"{name} ({len(BAD)} characters, not shown) is not " in text and f"'{BAD}'" not in text, text
    else:
        assert f"{name}='{BAD}' is not " in text, text
    assert f"or set e.g. {name}=" in text, text


# -- each variable, read in-process -------------------------------------------------------------
@pytest.mark.parametrize("name", list(_settings.SETTINGS))
def test_a_bad_value_is_one_line_that_names_the_variable(name, tmp_path):
    setting = _settings.SETTINGS[name]
    with pytest.raises(_settings.SettingError) as caught:
        _settings.get(name, {name: BAD})
    _one_line(str(caught.value), name)
    assert isinstance(caught.value, ValueError)
    # Unset or empty: the default; the example the message shows is a value it takes (a file: once it exists).
    assert _settings.get(name, {}) == _settings.get(name, {name: " "}) == setting.default
    example = setting.example
    if setting.kind == "file":
        example = str(tmp_path / os.path.basename(example))
        open(example, "w").close()
    assert _settings.get(name, {name: example}) is not None


@pytest.mark.parametrize("name, raw", [("DPTRAIN_TIMEOUT", "0"), ("DPTRAIN_TIMEOUT", "-5"), ("DPTRAIN_TIMEOUT", "inf"),
                                       ("DPTRAIN_HEARTBEAT_S", "nan"), ("DPTRAIN_WAIT_REPORT_S", "1e300"),
                                       ("DPTRAIN_STORE_MAX_MB", "0"), ("DPTRAIN_SHM", "2"), ("DPTRAIN_STORE", "redis")])
def test_values_out_of_range_are_refused_too(name, raw):
    assert _settings.problem(name, raw).startswith(f"{name}={raw!r} is not ")


def test_good_values_read_as_their_kind():
    environ = {"DPTRAIN_TIMEOUT": " 30 ", "DPTRAIN_PROGRESS_EVERY_S": "0", "DPTRAIN_SHM": "Off",
               "DPTRAIN_DEBUG": "yes", "DPTRAIN_STORE": "Torch", "DPTRAIN_PROGRESS": "tty"}
    assert [_settings.get(name, environ) for name in environ] == [30.0, 0.0, False, True, "torch", "tty"]
    _settings.check_all(environ)


def test_check_all_names_the_first_bad_variable_and_the_others():
    with pytest.raises(_settings.SettingError, match=r"^DPTRAIN_TIMEOUT='x' .*\(also wrong: DPTRAIN_SHM, DPTRAIN_STORE\)$"):
        _settings.check_all({"DPTRAIN_TIMEOUT": "x", "DPTRAIN_SHM": "x", "DPTRAIN_STORE": "x", "OTHER": "x"})


def _code_of(path: str) -> ast.Module:
    with open(path) as fh:
        return ast.parse(fh.read())


def _package_files():
    for folder, _, files in os.walk(PACKAGE):
        yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_every_variable_the_package_names_is_declared_and_read_only_through_settings():
    named, reads = set(), []
    for path in _package_files():
        for node in ast.walk(_code_of(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(re.findall(r"\bDPTRAIN_[A-Z][A-Z_]*[A-Z]\b", node.value))
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if node.func.attr in ("get", "getenv", "pop", "setdefault") and not (
                        isinstance(node.func.value, ast.Name) and node.func.value.id == "_settings"):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice
            if isinstance(key, ast.Constant) and str(key.value).startswith("DPTRAIN_"):
                reads.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} reads {key.value}")
    assert not reads, f"read DPTRAIN_* variables through dptrain.runtime.settings.get: {reads}"
    assert named - set(_settings.SETTINGS) == set(), "declare these in dptrain.runtime.settings.SETTINGS"


# -- dptrain run: refused before any rank starts, one line, exit code 2 --------------------------
@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


@pytest.mark.parametrize("name", [n for n in _settings.SETTINGS if n not in ALWAYS_SET])
def test_dptrain_run_refuses_a_bad_value_before_any_rank_starts(name, script, monkeypatch, capsys):
    monkeypatch.setenv(name, BAD)
    assert main(["run", "--nproc-per-node", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dptrain run: error: ")
    _one_line(err, name)
    assert not (script.parent / "ran").exists()


def test_what_a_flag_or_dptrain_run_sets_for_the_ranks_is_not_refused(monkeypatch):
    for name in preflight.SET_BY_FLAGS:
        monkeypatch.setenv(name, BAD)
    flags = types.SimpleNamespace(timeout=30.0, debug=True, profile=True)
    preflight.check_settings(flags)  # --timeout, --debug and --profile replace them; DPTRAIN_PROGRESS always
    with pytest.raises(ValueError, match="DPTRAIN_TIMEOUT='abc'"):
        preflight.check_settings(types.SimpleNamespace(timeout=None, debug=True, profile=True))


def test_dptrain_run_and_a_rank_say_a_bad_value_in_one_line(script):
    """The real commands: dptrain run (no torch), and a rank started by another launcher."""
    bad = dict(os.environ, **{name: BAD for name in _settings.SETTINGS})
    out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=bad)
    assert out.returncode == 2, out
    _one_line(out.stderr, "DPTRAIN_TIMEOUT")
    assert "(also wrong: DPTRAIN_HEARTBEAT_S, DPTRAIN_WAIT_REPORT_S" in out.stderr
    assert not (script.parent / "ran").exists()
    # torchrun's environment, no dptrain run: every module imports; init says it in one line.
    code = ("import dptrain, dptrain.runtime.join, dptrain.runtime.env, dptrain.train, dptrain.launcher.job, "
            "dptrain.launcher.relay\n"
            "print('imported', flush=True)\n"
            "dptrain.init()\n")
    torchrun = dict(bad, RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=torchrun)
    assert out.returncode == 1 and out.stdout == "imported\n", out
    assert out.stderr.startswith("dptrain (rank 3): error: DPTRAIN_TIMEOUT='abc' is not "), out.stderr
    _one_line(out.stderr, "DPTRAIN_TIMEOUT")


def test_spawn_refuses_a_bad_value_once_in_the_caller(monkeypatch):
    import dptrain

    with pytest.raises(ValueError, match="^DPTRAIN_HEARTBEAT_S='abc' is not "):
        dptrain.spawn(print, 2, env={"DPTRAIN_HEARTBEAT_S": BAD})


# -- more ranks than this machine can start ---------------------------------------------------------
def _machine(monkeypatch, tasks=(), files=1 << 20, memory=(), open_now=10):
    monkeypatch.setattr(preflight, "_task_room", lambda: list(tasks))
    monkeypatch.setattr(preflight, "raise_open_files_limit", lambda: files)
    monkeypatch.setattr(preflight, "_memory_room", lambda: list(memory))
    monkeypatch.setattr(preflight, "_open_files", lambda: open_now)


def test_too_many_ranks_are_refused_with_the_limit_that_stops_them(monkeypatch):
    _machine(monkeypatch, tasks=[(32000, "the kernel's pid_max is 32768 and 768 tasks run already")])
    with pytest.raises(ValueError) as caught:
        preflight.check_capacity(100000)
    assert str(caught.value) == (
        "--nproc-per-node 100000: this machine cannot start 100000 ranks: they need at least 300000 tasks (3 per "
        "rank: its process, and 2 threads of dptrain run relaying its output), but the kernel's pid_max is 32768 "
        "and 768 tasks run already; at most 10666 fit on this node")
    preflight.check_capacity(10666)
    # Open files: 2 pipes per rank, and on node 0 a store connection per rank of every node.
    _machine(monkeypatch, files=1024)
    with pytest.raises(ValueError, match=r"^--nproc-per-node 400 --nnodes 2: .* needs at least 1644 open files "
                                         r"\(4 per rank: the 2 pipes of its output and 2 store connection\(s\); "
                                         r"44 more of its own\), but `ulimit -n` allows 1024 .*; at most 245 fit"):
        preflight.check_capacity(400, nnodes=2)
    preflight.check_capacity(400, nnodes=2, hosts_store=False)  # another node: its pipes only
    preflight.check_capacity(245, nnodes=2)
    # Memory: the tightest limit is the one named.
    _machine(monkeypatch, memory=[(64 << 30, "this machine has"), (8 << 30, "/sys/fs/cgroup/memory.max allows")])
    with pytest.raises(ValueError, match=r"at least 15.6 GiB of memory .* but /sys/fs/cgroup/memory.max allows "
                                         r"8.0 GiB with swap; at most 2048 fit"):
        preflight.check_capacity(4000)


def test_what_this_machine_can_start_is_not_refused():
    preflight.check_capacity(64)  # the real limits of this machine
    preflight.check_capacity(256, hosts_store=False)
    if sys.platform == "linux":
        assert preflight._task_room() and preflight._memory_room()


def test_dptrain_run_refuses_what_cannot_start_before_starting_it(script):
    """A hard limit of 256 open files: 1000 ranks are refused in one line, and nothing starts."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
            "from dptrain.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "run", "--nproc-per-node", "1000", str(script)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2, out
    assert out.stderr.startswith("dptrain run: error: --nproc-per-node 1000: this machine cannot start 1000 ranks: ")
    assert "\n" not in out.stderr.strip() and "Traceback" not in out.stderr
    assert "`ulimit -n` allows 256" in out.stderr or "at most" in out.stderr
    assert not (script.parent / "ran").exists()
