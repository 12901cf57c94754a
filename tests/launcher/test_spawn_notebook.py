"""dptrain.spawn from a ``__main__`` that has no file: a Jupyter kernel, ``python -``, ``python -c``.

A fresh interpreter cannot find a function defined there, so with no ``start_method`` spawn
forks the ranks (see [Note: how the ranks start when no start method is given] in
``dptrain/launcher/spawn.py``). Issue 30, point 6: ``dptrain.spawn(work, 2)`` in a notebook
failed with "Can't get attribute 'work' on <module '__main__'>".

The two end-to-end tests run a real ``python -`` and a real Jupyter kernel; the others check
the choice of start method in this process, against a stand-in ``__main__``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import types

import pytest
import torch

import dptrain
from dptrain.launcher.spawn import _choose_start_method

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What a user types: everything the ranks use is defined right here, in __main__.
DEFINITIONS = """\
import json
import torch
import dptrain

torch.ones(64, 64) @ torch.ones(64, 64)  # this process has used torch before it forks


class Scale:
    def __init__(self, k):
        self.k = k


def work(rank, scale):
    dptrain.init()
    t = torch.tensor([float(rank)]) * scale.k
    dptrain.comm.all_reduce(t, op="sum")
    return [dptrain.rank(), dptrain.world_size(), t.item()]
"""
CALL = 'print("results:", json.dumps(dptrain.spawn(work, 2, args=(Scale(2.0),), timeout=60)))'
EXPECTED = [[0, 2, 2.0], [1, 2, 2.0]]


def _child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _results(text: str) -> list:
    line = next((l for l in text.splitlines() if l.startswith("results: ")), None)
    assert line is not None, text[-3000:]
    return json.loads(line[len("results: "):])


# ------------------------------------------------------------------- end to end --


def test_spawn_from_python_reading_stdin(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-"], input=DEFINITIONS + CALL + "\n", cwd=str(tmp_path), env=_child_env(),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _results(proc.stdout) == EXPECTED


def test_spawn_in_a_jupyter_kernel(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # A kernel spec of our own, found first through JUPYTER_PATH: the kernel runs this
    # Python (whatever "python3" spec the machine may have), with the ranks' thread count.
    spec = tmp_path / "jupyter" / "kernels" / "dptrain-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dptrain test", "language": "python",
        "env": {k: v for k, v in _child_env().items() if k in ("OMP_NUM_THREADS", "PYTHONPATH")},
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(DEFINITIONS), nbformat.v4.new_code_cell(CALL)]
    client = nbclient.NotebookClient(
        nb, kernel_name="dptrain-test", timeout=90, startup_timeout=60,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # a cell that raises fails the test here, with its traceback
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs if o.get("output_type") == "stream")
    assert _results(text) == EXPECTED


# ------------------------------------------------- which start method, in-process --


def _imported_work(rank):
    return rank


def _main(monkeypatch, **attrs) -> types.ModuleType:
    """Stand in for ``__main__``: no attributes is a notebook (or ``python -c``, the REPL)."""
    main = types.ModuleType("__main__")
    for name, value in attrs.items():
        setattr(main, name, value)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def _define(main: types.ModuleType, source: str):
    exec(source, main.__dict__)  # what a notebook cell does: its functions' __module__ is "__main__"
    return main.__dict__


def test_a_notebook_forks_only_what_needs_its_main(monkeypatch):
    ns = _define(_main(monkeypatch), "def work(rank):\n    return rank\nclass Config:\n    pass\n")
    assert _choose_start_method(ns["work"], (), 2) == "fork"
    assert _choose_start_method(_imported_work, (ns["Config"](),), 2) == "fork"  # an argument needs it
    assert _choose_start_method(lambda rank: rank, (), 2) == "fork"  # no pickle can send a lambda
    # A function imported from a file starts fresh processes; tensor data is not walked through.
    assert _choose_start_method(_imported_work, (torch.zeros(3), {"n": 1}), 2) == "spawn"


def test_a_script_keeps_spawn(monkeypatch):
    ns = _define(_main(monkeypatch, __file__=os.path.abspath(__file__)), "def work(rank):\n    return rank\n")
    assert _choose_start_method(ns["work"], (), 2) == "spawn"  # the new process runs the file again
    ns = _define(_main(monkeypatch, __spec__=types.SimpleNamespace(name="pkg.train")), "def work(rank): pass\n")
    assert _choose_start_method(ns["work"], (), 2) == "spawn"  # python -m pkg.train: imported by name
    # python -m pkg runs pkg/__main__.py, which multiprocessing does not import again.
    ns = _define(_main(monkeypatch, __spec__=types.SimpleNamespace(name="pkg.__main__")), "def work(rank): pass\n")
    assert _choose_start_method(ns["work"], (), 2) == "fork"


def test_python_reading_stdin_always_forks(monkeypatch):
    # Its __main__ names the file "<stdin>", which a spawned process tries to run and dies.
    _main(monkeypatch, __file__="<stdin>")
    assert _choose_start_method(_imported_work, (), 2) == "fork"


def test_forking_after_cuda_was_initialized_is_refused_with_the_fix(monkeypatch):
    ns = _define(_main(monkeypatch), "def work(rank):\n    return rank\n")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as info:
        dptrain.spawn(ns["work"], 2, timeout=10)
    msg = str(info.value)
    assert "cannot start work: work is defined in __main__" in msg
    assert "already initialized CUDA" in msg
    assert "restart the kernel" in msg
    assert "from mywork import work\n        dptrain.spawn(work, 2)" in msg
    # What the message advises works: an imported function gets fresh processes, CUDA or not.
    assert _choose_start_method(_imported_work, (), 2) == "spawn"


def test_a_platform_without_fork_says_so(monkeypatch):
    ns = _define(_main(monkeypatch), "def work(rank):\n    return rank\n")
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(RuntimeError, match=r"cannot fork the ranks from this process instead\. Fix: put work"):
        _choose_start_method(ns["work"], (), 2)
